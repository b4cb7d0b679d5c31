"""A diagnostic of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"), as of
commit aec6bce: which presses keep the needle rows that the model's question actually reads.

For RULER-style multi-key contexts (1024 tokens, seed 0, the first N of each task), each press's kept middle rows
are recorded per (layer, KV head) during a plain prefill of the context. The full cache then reads the context
followed by one of its questions and an answer prefix; the last token's attention per (layer, KV head), summed over
the GQA group, on the asked needle's sentence is that head's retrieval mass r. The score of a press is the
retrieval-weighted share of the needle's tokens it kept, sum(r * kept) / sum(r) over every head, pooled over
the questions. In brackets: the unweighted share of (layer, KV head) pairs keeping the needle's key tokens / its
digits / the rest of its sentence. Usage: python results/frontier/patches/needle_retention.py N TASK [TASK ...]"""
import sys

import torch
from transformers import AutoModelForCausalLM, DynamicCache

import kvcompress.presses as pr
from kvcompress.models import load_model
from kvcompress.ruler.generator import generate_example
from kvcompress.selection import top_rows

PRESSES = {
    "default": pr.CompressKVPress(compression_ratio=0.75),
    "kvzip": pr.CompressKVPress.kvzip(compression_ratio=0.75),
    "balanced": pr.CompressKVPress.balanced(compression_ratio=0.75),
    "window only": pr.CompressKVPress(compression_ratio=0.75, reference=("window",)),
}
kept: dict[int, torch.Tensor] = {}
compress_by_attention = pr.compress_by_attention


def recording(module, keys, values, start, end, rows, scores, reference, fit):
    kept[module.layer_idx] = (top_rows(scores, rows) + start)[0]  # [h_kv, rows]
    return compress_by_attention(module, keys, values, start, end, rows, scores, reference, fit)


def main(count: int, tasks: list[str]) -> None:
    torch.set_num_threads(2)
    pr.compress_by_attention = recording
    model, tokenizer = load_model(None)
    eager = AutoModelForCausalLM.from_pretrained(model.config._name_or_path, attn_implementation="eager").eval()
    totals = {name: [0.0, 0.0] for name in PRESSES}
    for task in tasks:
        for index in range(count):
            example = generate_example(task, tokenizer, 1024, 0, index)
            encoded = tokenizer(example.context, return_offsets_mapping=True, add_special_tokens=False)
            ids, offsets = torch.tensor([encoded.input_ids]), encoded.offset_mapping
            n = ids.shape[1]

            keeps = {}
            for name, press in PRESSES.items():
                kept.clear()
                with torch.no_grad(), press(model):
                    model.model(input_ids=ids, past_key_values=DynamicCache())
                rows = torch.stack([kept[layer] for layer in sorted(kept)])  # [L, h_kv, rows]
                keeps[name] = torch.zeros(*rows.shape[:2], n, dtype=torch.bool).scatter_(-1, rows, True)  # [L, h_kv, n]
            for question, answers in zip(example.questions, example.answers, strict=True):
                asked = tokenizer(
                    " " + question + " Answer: The special magic number", add_special_tokens=False, return_tensors="pt"
                ).input_ids
                with torch.no_grad():
                    attentions = eager(torch.cat([ids, asked], 1), output_attentions=True).attentions
                last = torch.stack(attentions)[:, 0, :, -1, :n]  # [L, h_q, n]
                layers, heads_q, _ = last.shape
                heads_kv = keeps["default"].shape[1]
                needle, digits, key = set(), set(), set()
                for answer in answers:
                    end = example.context.index(answer) + len(answer)
                    start = example.context.rfind("One of", 0, end)
                    needle.update(i for i, (a, b) in enumerate(offsets) if a < end and b > start)
                    digits.update(i for i, (a, b) in enumerate(offsets) if a < end and b > end - len(answer))
                    words = example.context.index(" for ", start) + 5, example.context.index(" is:", start)
                    key.update(i for i, (a, b) in enumerate(offsets) if a < words[1] and b > words[0])
                needle = sorted(needle)
                parts = {"key": sorted(key), "digits": sorted(digits), "rest": sorted(set(needle) - key - digits)}
                mass = last.reshape(layers, heads_kv, heads_q // heads_kv, n).sum(2)[:, :, needle].sum(-1)  # [L, h_kv]
                line = []
                for name, kept_at in keeps.items():
                    weighted = float((mass * kept_at[:, :, needle].float().mean(-1)).sum())
                    totals[name][0] += weighted
                    totals[name][1] += float(mass.sum())
                    plain = " / ".join(f"{float(kept_at[:, :, part].float().mean()):.2f}" for part in parts.values())
                    line.append(f"{name} {weighted / float(mass.sum()):.2f} ({plain})")
                print(task, index, " ".join(line), flush=True)
    print("retrieval-weighted needle rows kept:", {name: round(a / b, 3) for name, (a, b) in totals.items()})


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
