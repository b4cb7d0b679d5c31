"""Diagnosis for issue 20 (not part of the library): what in the full cache's layer L brings the answers back?

`swap_answers.py` showed that the full cache's layer 7, swapped into the default's cache, brings back the multi-key
answers at 2048 tokens, while `needle_coverage.py` showed that the default already holds most needle tokens there.
Per context of TASK, this scores the default's cache with layer LAYER replaced by (every row with weight 1, no clip
range, as in `swap_answers.py`):

- ``full``: every row of the full cache's layer;
- ``kept, unfitted``: the rows the default kept, with their own values and weight 1 (no fit, no weights);
- ``kept + needles``: those plus every needle token the default dropped;
- ``full - dropped needles``: every row but the needle tokens the default dropped (the haystack whole);
- ``kept, neighbours' mass``: the kept rows with their own values, each with weight 1 + the dropped rows up to the
  next kept row (a query-free guess that a dropped row draws the attention of its kept neighbour on the left).

Prints, per cache, the greedy answers' score x 100 and the expected answers' mean log-prob (nats).

    python results/frontier/diagnosis/layer_variants.py [TASK] [CONTEXTS] [SEED] [KEPT] [LENGTH] [LAYER]
"""
import os
import sys

import kvpress  # noqa: F401
import torch
from transformers import pipeline

from kvcompress.cache import WeightedLayer
from kvcompress.fidelity.measure import prefill
from kvcompress.models import load_model
from kvcompress.presses import CompressKVPress
from kvcompress.ruler.generator import generate
from kvcompress.ruler.tasks import TASKS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from needle_coverage import PARTS, held_rows, token_parts  # noqa: E402  (this directory's diagnostics)
from swap_answers import arguments, ask  # noqa: E402
from worst_context import with_layers  # noqa: E402

task, contexts, seed, kept, length, rest = arguments(sys.argv[1:])
layer = int(rest[0]) if rest else 7


def rows_of(full, index: list[torch.Tensor], tokens: int, mass: list[torch.Tensor] | None = None):
    """The full layer's rows ``index[h]`` per KV head (padded to the longest by repeating a head's first row at
    weight 0), as a weighted layer; weights ``mass[h]`` (default 1)."""
    r = max(len(i) for i in index)
    pad = [torch.cat([i, i[:1].expand(r - len(i))]) for i in index]
    idx = torch.stack(pad)[None, :, :, None]  # [1, h, r, 1]
    keys = full.keys.gather(2, idx.expand(-1, -1, -1, full.keys.shape[-1]))
    values = full.values.gather(2, idx.expand(-1, -1, -1, full.values.shape[-1]))
    weights = torch.ones(1, len(index), r)
    for h, i in enumerate(index):
        weights[0, h, len(i):] = 0.0
        if mass is not None:
            weights[0, h, : len(i)] = mass[h]
    inf = torch.full((1, len(index), values.shape[-1]), torch.inf)
    return WeightedLayer(keys, values, weights, -inf, inf, tokens)


torch.set_num_threads(1)
model, tokenizer = load_model(None)
pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
press = CompressKVPress(compression_ratio=1 - kept, seed=seed)
spec = TASKS[task]
names = ("default", "full", "kept, unfitted", "kept + needles", "full - dropped needles", "kept, neighbours' mass")
scores, logprobs, asked = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0), 0
with torch.no_grad():
    for example in generate(task, tokenizer, length, contexts, seed):
        inputs = pipe.preprocess(example.context, list(example.questions), example.answer_prefix, 1 << 30)
        ids = inputs["context_ids"]
        n = ids.shape[1]
        needle = token_parts(tokenizer, ids[0], task) != PARTS.index("haystack")  # [n]
        default, _ = prefill(model, press, ids)
        full, _ = prefill(model, None, ids)
        held = held_rows(full.layers[layer], default.layers[layer])
        every = torch.ones(n, dtype=torch.bool)
        chosen = {
            "full": [every.nonzero()[:, 0] for _ in held],
            "kept, unfitted": [h.nonzero()[:, 0] for h in held],
            "kept + needles": [(h | needle).nonzero()[:, 0] for h in held],
            "full - dropped needles": [(h | ~needle).nonzero()[:, 0] for h in held],
        }
        kept_rows = chosen["kept, unfitted"]
        chosen["kept, neighbours' mass"] = kept_rows
        mass = [torch.diff(i, append=torch.tensor([n])).float() for i in kept_rows]  # 1 + dropped rows up to the next
        caches = {"default": default}
        for name, index in chosen.items():
            weights = mass if name == "kept, neighbours' mass" else None
            caches[name] = with_layers(default, {layer: rows_of(full.layers[layer], index, n, weights)})
        for question, expected in zip(inputs["questions_ids"], example.answers, strict=True):
            row = ask(model, tokenizer, caches, n, question, expected, spec, scores, logprobs, width=12)
            asked += 1
            print(f"context {example.index} expected {expected}: {row}", flush=True)
print(f"{task}, {contexts} contexts, seed {seed}, kept {kept}, {length} tokens, layer {layer}, {asked} questions:")
for name in names:
    print(f"  {name}: score {100 * scores[name] / asked:.1f}, answer log-prob {logprobs[name] / asked:+.3f} nats")
