"""Per-layer statistics of the default's reference scores on one continuation-study context (docs/BENCHMARKS.md,
"The worst continuation context"): the mean of the top 2% induction scores, the fraction of them above 0.9, and the
share of the window's attention mass on its top 2% keys. A diagnostic, not part of the library. From the repository
root: ``python results/frontier/diagnosis/layer_stats.py SEED CONTEXT``."""

import sys

import kvpress  # noqa: F401  (registers the kv-press-text-generation pipeline)
import torch
from transformers import pipeline

import kvcompress.presses as presses
from kvcompress.fidelity.contexts import build_contexts
from kvcompress.fidelity.measure import prefill
from kvcompress.models import load_model
from kvcompress.registry import make_press

STATS: dict[int, tuple[float, float, float]] = {}
record_reference = presses.CompressKVPress.record_reference


def recording(self, module, kwargs, keys, values):
    reference = record_reference(self, module, kwargs, keys, values)
    induction, window = reference.mass["induction"][0], reference.mass["window"][0]  # [h_kv, n]
    top = max(1, induction.shape[-1] // 50)
    share = (window / window.sum(-1, keepdim=True)).topk(top, -1).values.sum(-1).mean().item()
    STATS[module.layer_idx] = (induction.topk(top, -1).values.mean().item(), (induction > 0.9).float().mean().item(),
                               share)  # fmt: skip
    return reference


def main(seed: str, name: str) -> None:
    torch.set_num_threads(1)
    presses.CompressKVPress.record_reference = recording
    model, tokenizer = load_model(None, dtype=torch.float32, device="cpu")
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    contexts = build_contexts(pipe, ["prose", "code", "mix"], [2048, 4096], 2, 128, seed=int(seed))
    ctx = next(c for c in contexts if c.name == name)
    prefill(model, make_press("compresskv", 0.75, 0), ctx.ids)
    for layer, (top_induction, above, window_share) in sorted(STATS.items()):
        print(f"layer {layer:2d}: induction top 2% mean {top_induction:.3f}, above 0.9 {above:.4f}; "
              f"window's top-2% keys hold {window_share:.3f} of its mass")  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])
