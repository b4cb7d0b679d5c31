"""Diagnosis for issue 20 (not part of the library): which needle tokens does a press keep, layer by layer?

Per context of TASK (default niah_multikey), one prefill under the default (or ``--press-option``-style overrides
given as KEY=VALUE, read as YAML), and per layer the fraction of each part of the needles'
tokens its cache holds, averaged over KV heads and needles: the key (``for {key}``; qa: the project's name), the
value (the number's digits; qa: the maintainer and the city) and the needle's other tokens ("One of the special magic
numbers ... is:"), with the haystack's for scale. A kept row
is found by its key vector, which the press copies unchanged (the fit changes values only): the diagnostics'
``held_rows``.

    python results/frontier/diagnosis/needle_coverage.py [TASK] [CONTEXTS] [SEED] [KEPT] [LENGTH] [KEY=VALUE ...]
"""
import os
import re
import sys

import kvpress  # noqa: F401
import torch
import yaml
from transformers import pipeline

from kvcompress.fidelity.measure import prefill
from kvcompress.models import load_model
from kvcompress.presses import CompressKVPress
from kvcompress.ruler.generator import generate

PARTS = ("key", "value", "rest", "haystack")
# A planted line per task family: group 1 is its key, the later groups its values.
LINES = {
    "niah": re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\."),
    "qa": re.compile(r"The (\w+) project is maintained by ([^,]+), who works in ([^.]+)\."),
}


def token_parts(tokenizer, ids: torch.Tensor, task: str) -> torch.Tensor:
    """``[n]`` part index per context token (PARTS), from each token's character span in the decoded context."""
    ends = [len(tokenizer.decode(ids[:i])) for i in range(1, len(ids) + 1)]
    starts = [0] + ends[:-1]
    part = torch.full((len(ids),), PARTS.index("haystack"))
    lines = list(LINES["qa" if task == "qa" else "niah"].finditer(tokenizer.decode(ids)))
    assert lines, task
    for line in lines:
        spans = [(line.start(), line.end(), "rest"), (line.start(1), line.end(1), "key")]
        spans += [(line.start(g), line.end(g), "value") for g in range(2, len(line.groups()) + 1)]
        for lo, hi, name in spans:
            for i, (s, e) in enumerate(zip(starts, ends, strict=True)):
                if e > lo and s < hi:
                    part[i] = PARTS.index(name)
    return part


def held_rows(full_layer, kept_layer, chunk: int = 256) -> torch.Tensor:
    """``[h, n]`` bool: which of the full layer's rows (batch row 0) each KV head of the compressed layer holds,
    matched by exact key vector (a projection as a fingerprint is not exact: the same row's dot product can round
    differently in matrices of different sizes)."""
    full, kept = full_layer.keys[0], kept_layer.keys[0]  # [h, n, d], [h, r, d]
    return torch.cat([(full[:, i : i + chunk, None] == kept[:, None]).all(-1).any(-1)
                      for i in range(0, full.shape[1], chunk)], dim=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from swap_answers import arguments  # this directory's diagnostic

    task, contexts, seed, kept, length, rest = arguments(sys.argv[1:])
    overrides = {k: yaml.safe_load(v) for k, v in (a.split("=", 1) for a in rest)}
    torch.set_num_threads(1)
    model, tokenizer = load_model(None)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    press = CompressKVPress(compression_ratio=1 - kept, seed=seed, **overrides)
    layers = model.config.num_hidden_layers
    totals = torch.zeros(layers, len(PARTS))
    with torch.no_grad():
        for example in generate(task, tokenizer, length, contexts, seed):
            inputs = pipe.preprocess(example.context, list(example.questions), example.answer_prefix, 1 << 30)
            ids = inputs["context_ids"]
            part = token_parts(tokenizer, ids[0], task)
            full, _ = prefill(model, None, ids)
            cache, _ = prefill(model, press, ids)
            for layer in range(layers):
                held = held_rows(full.layers[layer], cache.layers[layer]).double()
                for p in range(len(PARTS)):
                    mask = part == p
                    totals[layer, p] += held[:, mask].mean() if mask.any() else 0.0
            print(f"context {example.index + 1}/{contexts}", file=sys.stderr, flush=True)
    print(f"{task}, {contexts} contexts, seed {seed}, kept {kept}, {length} tokens, overrides {overrides}: "
          "fraction of each part's tokens held, mean over KV heads")
    print("layer " + " ".join(f"{p:>9}" for p in PARTS))
    for layer in range(layers):
        print(f"{layer:5d} " + " ".join(f"{v:9.3f}" for v in (totals[layer] / contexts).tolist()))
