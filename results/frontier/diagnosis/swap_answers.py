"""Diagnosis for issue 20 (not part of the library): does the full cache's layer l, swapped into the default's cache,
bring back the answers (RULER's string match of greedy answers), not only the answers' log-prob?

`repeat_layer_gain.py` with DONOR ``full`` found that at 2048 tokens the full layer 7 alone recovers most of the
log-prob the default loses on niah_multikey, while widening layer 7 (``retrieval_layers=[18, 7]``) did not bring
the answers back. Per context of TASK, this prefills the default and the full cache, builds the default's cache with
LAYERS (comma-separated) swapped in from the full cache (as `repeat_layer_gain.py`: every full row with weight 1,
no clip range), and greedy-decodes every question on the three caches. Prints each question's score and answer (its
first 24 characters) per cache, and per cache the task's mean score x 100 and the expected answers' mean log-prob
(nats).

    python results/frontier/diagnosis/swap_answers.py [TASK] [CONTEXTS] [SEED] [KEPT] [LENGTH] [LAYERS]
"""
import copy
import os
import sys

import kvpress  # noqa: F401
import torch
from transformers import pipeline

from kvcompress.calibration_scan import _answer_logprob
from kvcompress.fidelity.measure import prefill
from kvcompress.models import load_model
from kvcompress.presses import CompressKVPress
from kvcompress.ruler.generator import generate
from kvcompress.ruler.scoring import match
from kvcompress.ruler.tasks import TASKS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worst_context import as_weighted, with_layers  # noqa: E402  (this directory's diagnostic, not an installed module)


def greedy(model, cache, context_len: int, question: torch.Tensor, new_tokens: int, eos: int) -> list[int]:
    """Greedy answer to ``question [1, q]`` on a copy of ``cache``."""
    cache = copy.deepcopy(cache)
    ids, position, out = question, context_len, []
    for _ in range(new_tokens):
        positions = torch.arange(position, position + ids.shape[1])[None]
        logits = model(input_ids=ids, past_key_values=cache, position_ids=positions).logits[0, -1]
        position += ids.shape[1]
        token = int(logits.argmax())
        if token == eos:
            break
        out.append(token)
        ids = torch.tensor([[token]])
    return out


def arguments(argv: list[str]) -> tuple[str, int, int, float, int, list[str]]:
    """TASK CONTEXTS SEED KEPT LENGTH (defaults niah_multikey 4 0 0.5 2048) and the arguments after them."""
    defaults = ("niah_multikey", "4", "0", "0.5", "2048")
    task, contexts, seed, kept, length = (argv[i] if len(argv) > i else d for i, d in enumerate(defaults))
    return task, int(contexts), int(seed), float(kept), int(length), argv[5:]


def ask(model, tokenizer, caches: dict, context_len: int, question, expected, spec, scores, logprobs, width=24) -> str:
    """Answer ``question`` greedily on each of ``caches`` (name -> cache), add each answer's score and the expected
    answers' mean log-prob to ``scores`` / ``logprobs`` (name -> sum); the row of scores and answers to print."""
    row = []
    for name, cache in caches.items():
        answer = greedy(model, cache, context_len, question, spec.max_new_tokens, tokenizer.eos_token_id)
        text = tokenizer.decode(answer)
        score = match(spec.metric, text, expected)
        scores[name] += score
        logprobs[name] += sum(
            _answer_logprob(model, cache, context_len, question,
                            tokenizer.encode(" " + a, return_tensors="pt", add_special_tokens=False))
            for a in expected) / len(expected)
        row.append(f"{score:.2f} {text.strip()[:width]!r}")
    return " | ".join(row)


if __name__ == "__main__":
    task, contexts, seed, kept, length, rest = arguments(sys.argv[1:])
    swapped = [int(x) for x in (rest[0] if rest else "7").split(",")]
    torch.set_num_threads(1)
    model, tokenizer = load_model(None)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    press = CompressKVPress(compression_ratio=1 - kept, seed=seed)
    spec = TASKS[task]
    names = ("default", f"default + full {','.join(map(str, swapped))}", "full")
    scores, logprobs, asked = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0), 0
    with torch.no_grad():
        for example in generate(task, tokenizer, length, contexts, seed):
            inputs = pipe.preprocess(example.context, list(example.questions), example.answer_prefix, 1 << 30)
            ids = inputs["context_ids"]
            default, _ = prefill(model, press, ids)
            full, _ = prefill(model, None, ids)
            mixed = with_layers(default, {layer: as_weighted(full.layers[layer], ids.shape[1]) for layer in swapped})
            caches = dict(zip(names, (default, mixed, full), strict=True))
            for question, expected in zip(inputs["questions_ids"], example.answers, strict=True):
                row = ask(model, tokenizer, caches, ids.shape[1], question, expected, spec, scores, logprobs)
                asked += 1
                print(f"context {example.index} expected {expected}: {row}", flush=True)
    print(f"{task}, {contexts} contexts, seed {seed}, kept {kept}, {length} tokens, {asked} questions:")
    for name in names:
        print(f"  {name}: score {100 * scores[name] / asked:.1f}, answer log-prob {logprobs[name] / asked:+.3f} nats")
