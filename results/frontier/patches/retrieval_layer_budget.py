"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "The worst continuation context");
it patches the press as of commit 8479084 and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its
arguments.

Experiment: more middle rows in the layers listed in BIG (comma-separated, default "18"), FACTOR (default 2) times
the uniform middle (at most the whole middle), every other layer's middle cut by an equal share of those extra rows
(the cache's total rows unchanged up to rounding). The novelty and induction priors keep their uniform row counts in
the BIG layers; the extra rows go to the window's attention. Why: on the embedded model layer 18 is where both the
planted facts (the priors' rows; with no priors there, niah-s drops from 100 to 0) and the continuation's copied
identifiers (the window's rows; SnapKV's layer 18 alone closes half the worst context's KL gap) are read.
The library has this rule since 6449236: `CompressKVPress(retrieval_layers=(18,), retrieval_rows=2.0)`."""
import os
import sys

from _pilot import run

import kvcompress.presses as pr
import kvcompress.weighted_press as wp

BIG = {int(x) for x in os.environ.get("BIG", "18").split(",") if x}
FACTOR = float(os.environ.get("FACTOR", "2"))
compress_rows, reserved_rows = wp.WeightedSubsetPress._compress_rows, pr.CompressKVPress._reserved_rows


def patched_compress_rows(self, module, keys, values, plan, reference):
    layers = module.config.num_hidden_layers
    span = keys.shape[-2] - plan.sink - plan.window
    big = min(span, round(FACTOR * plan.middle))
    extra = (big - plan.middle) * len(BIG)
    middle = big if module.layer_idx in BIG else max(1, plan.middle - round(extra / (layers - len(BIG))))
    self._uniform_middle = plan.middle
    try:
        return compress_rows(self, module, keys, values, wp.RowPlan(plan.tokens, plan.sink, plan.window, middle),
                             reference)
    finally:
        del self._uniform_middle


def patched_reserved_rows(self, rows):
    return reserved_rows(self, min(rows, getattr(self, "_uniform_middle", rows)))


wp.WeightedSubsetPress._compress_rows = patched_compress_rows
pr.CompressKVPress._reserved_rows = patched_reserved_rows

sys.exit(run(sys.argv[1:]))
