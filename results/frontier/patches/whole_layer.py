"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "What the full layer 7 brings back");
it patches the press as of commit e568401 and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its
arguments.

Experiment: the layers listed in WHOLE (comma-separated, default "7") keep their whole middle (nothing dropped),
besides the library's retrieval layers (`retrieval_layers`, widened `retrieval_rows` times); every other
full-attention layer gives up an equal share of the rows they all gain (the cache's total unchanged up to
rounding). Why: at 2048 tokens the full cache's layer 7 alone brings back most of the answers the default loses on
niah_multikey and qa at 50% kept, where `retrieval_layers=[18, 7]` keeps nearly all of it (1912 of its 1980 middle
rows at 2048 tokens, fitted); at 25% kept that rule gives it only half its rows and lost 3.5 points. Superseded by the
library's `CompressKVPress(full_layers=...)` (the thirty-second session), which keeps such a layer exactly, unfitted."""
import os
import sys

from _pilot import run

import kvcompress.presses as pr
from kvcompress.weighted_press import RowPlan

WHOLE = {int(x) for x in os.environ.get("WHOLE", "7").split(",") if x}
layer_plan = pr.CompressKVPress.layer_plan


def patched_layer_plan(self, plan, layer_idx):
    if plan is None:
        return plan
    span = plan.tokens - plan.sink - plan.window
    if layer_idx in WHOLE:
        return RowPlan(plan.tokens, plan.sink, plan.window, span)
    planned = layer_plan(self, plan, layer_idx)
    if layer_idx in self._retrieval:
        return planned
    others = sum(window is None for window in self._windows) - len(self._retrieval) - len(WHOLE)
    extra = (span - plan.middle) * len(WHOLE)
    return RowPlan(plan.tokens, plan.sink, plan.window, max(1, planned.middle - round(extra / others)))


pr.CompressKVPress.layer_plan = patched_layer_plan
sys.exit(run(sys.argv[1:]))
