"""Where one continuation-study context loses to SnapKV (docs/BENCHMARKS.md, "The worst continuation context").

A diagnostic, not part of the library. From the repository root:

    python results/frontier/diagnosis/worst_context.py tokens SEED CONTEXT PRESS [PRESS ...]
    python results/frontier/diagnosis/worst_context.py layers SEED CONTEXT PRESS_A PRESS_B

``tokens``: each press's KL(exact || press) per continuation token (the study's mean is their mean) and the 20 tokens
with the largest summed KL, with the text before each. ``layers``: PRESS_A's cache with one layer at a time replaced by
PRESS_B's (a compressed layer as it is; an exact one's rows wrapped with weight 1 and no clip range), the continuation's
KL of each. Contexts as ``python -m eval.fidelity --seed SEED`` builds them (the default kinds and depths; the default
lengths and seeds per kind and length unless ``LENGTHS="1024"`` and ``SEEDS=8`` say, as ``--lengths`` and ``--seeds``
do), the embedded model in float32, 25% kept, one thread.
"""

import copy
import os
import sys

import kvpress  # noqa: F401  (registers the kv-press-text-generation pipeline)
import torch
from transformers import pipeline

from kvcompress.cache import WeightedLayer
from kvcompress.fidelity.contexts import build_contexts
from kvcompress.fidelity.measure import continuation_logprobs, prefill
from kvcompress.fidelity.specs import make_press, parse_spec
from kvcompress.models import load_model

KEPT = 0.25


def token_kl(model, ref, cache, ctx) -> torch.Tensor:
    logp = continuation_logprobs(model, copy.deepcopy(cache), ctx.ids.shape[1], ctx.continuation)
    return torch.sum(ref.exp() * (ref - logp), -1)


def as_weighted(layer, tokens: int) -> WeightedLayer:
    b, h, r, d = layer.values.shape
    inf = torch.full((b, h, d), torch.inf)
    return WeightedLayer(layer.keys, layer.values, torch.ones(b, h, r), -inf, inf, tokens)


def with_layers(cache, replacements: dict):
    """A shallow copy of ``cache`` with ``replacements`` (layer index -> layer) swapped in; ``cache`` unchanged."""
    mixed = copy.copy(cache)
    mixed.layers = list(cache.layers)
    for layer, replacement in replacements.items():
        mixed.layers[layer] = replacement
    return mixed


def main(mode: str, seed: str, name: str, *specs: str) -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_model(None, dtype=torch.float32, device="cpu")
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    lengths = [int(x) for x in os.environ.get("LENGTHS", "2048 4096").split()]
    per_kind = int(os.environ.get("SEEDS", "2"))
    contexts = build_contexts(pipe, ["prose", "code", "mix"], lengths, per_kind, 128, seed=int(seed))
    index = [c.name for c in contexts].index(name)
    ctx = contexts[index]
    exact, _ = prefill(model, None, ctx.ids)
    ref = continuation_logprobs(model, copy.deepcopy(exact), ctx.ids.shape[1], ctx.continuation)
    caches = {s: prefill(model, make_press(parse_spec(s), KEPT, seed=int(seed) + index), ctx.ids)[0] for s in specs}
    kls = {s: token_kl(model, ref, c, ctx) for s, c in caches.items()}
    for s, kl in kls.items():
        print(f"{s}: KL {kl.mean():.4f}")
    if mode == "tokens":
        ids = ctx.continuation[0].tolist()
        print("token  text before -> token  " + "  ".join(specs))
        for t in torch.argsort(sum(kls.values()), descending=True)[:20].tolist():
            before, token = tokenizer.decode(ids[max(0, t - 6) : t]), tokenizer.decode([ids[t]])
            print(f"{t:3d} {before!r} -> {token!r}  " + "  ".join(f"{kls[s][t]:.3f}" for s in specs))
        print("continuation:", repr(tokenizer.decode(ids)))
        return
    a, b = caches[specs[0]], caches[specs[1]]
    for layer in range(len(a.layers)):
        donor = b.layers[layer]  # a compressed layer as it is (its weights and clip range), an exact one wrapped
        donor = donor if isinstance(donor, WeightedLayer) else as_weighted(donor, ctx.ids.shape[1])
        mixed = with_layers(a, {layer: donor})
        print(f"layer {layer:2d} from {specs[1]}: KL {token_kl(model, ref, mixed, ctx).mean():.4f}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
