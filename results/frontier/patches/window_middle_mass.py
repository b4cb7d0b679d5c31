"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit aec6bce and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: each head's split between the window source and the two priors set by how much the window's queries
read the middle at all. f = the window queries' mean softmax mass on the middle rows (summed over the GQA group's
queries, divided by their count: in [0, 1]); the window source then takes round(SCALE * f * rows) of the head's
middle rows, at least the library's 25% and at most MAXWIN of them, and the priors share the rest 2 : 1. Why: on the
continuation study's worst context (mix-4096-s0) the window alone matches SnapKV and the default's priors triple its
KL, while on the RULER-style contexts the window's queries (the end of an unrelated haystack) should hardly read
the middle. DIAG=path appends, per layer, the context length and the quartiles of f over the layer's heads."""
import os
import sys

import torch
from _pilot import run, split_by_window, window_queries

import kvcompress.presses as pr
from kvcompress.selection import attention_mass

SCALE = float(os.environ.get("SCALE", "1.0"))
MAXWIN = float(os.environ.get("MAXWIN", "0.75"))
DIAG = os.environ.get("DIAG")
record_reference = pr.CompressKVPress.record_reference


def patched_record_reference(self, module, kwargs, keys, values):
    reference = record_reference(self, module, kwargs, keys, values)
    n = keys.shape[-2]
    plan = self.plan(n)
    if plan is None or "window" not in reference.mass:
        return reference
    index = torch.arange(max(0, n - self.observation_window), n, device=keys.device)
    mass = attention_mass(window_queries(reference), keys, module.scaling, query_positions=index, reduce="sum")
    per_query = mass.sum(-1, keepdim=True)  # group size x window queries
    reference.middle_share = (mass[:, :, plan.sink : n - plan.window].sum(-1, keepdim=True) / per_query)[..., 0]
    if DIAG:
        quartiles = torch.quantile(reference.middle_share.flatten().float(), torch.tensor([0.25, 0.5, 0.75]))
        with open(DIAG, "a") as f:
            f.write(f"{n} {module.layer_idx} " + " ".join(f"{x:.3f}" for x in quartiles.tolist()) + "\n")
    return reference


def middle_share_rows(total, reference, start, end, rows, base):
    share = getattr(reference, "middle_share", None)
    if share is None:
        return None
    return torch.round(SCALE * share * rows).long().clamp(min=base, max=max(base, round(MAXWIN * rows)))


pr.CompressKVPress.record_reference = patched_record_reference
split_by_window(middle_share_rows)

sys.exit(run(sys.argv[1:]))
