"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit cce5ea8 and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: per-layer budgets for presses that hold every layer (repeat pass): AdaKV-style global top-k over
every layer's normalised middle scores, counts averaged over heads, a floor of FLOOR x the uniform middle."""
import os
import sys

import torch

import kvcompress.weighted_press as wp
from kvcompress.cli import main as cli_main
from kvcompress.methods import mixed_scores
from kvcompress.selection import normalise

FLOOR = float(os.environ.get("FLOOR", "0.2"))
orig_after = wp.WeightedSubsetPress._after_prefill

def layer_budgets(self, pending):
    parts, _sizes, middles = {}, {}, {}
    for idx, st in pending.items():
        plan = st["plans"][0]
        start, end = plan.sink, plan.tokens - plan.window
        ref = st["references"][0]
        sc = mixed_scores(ref, start, end, {"repeat": self.repeat_weight}, {"window": self.pool_kernel},
                          reserved=round(self.novelty_share * plan.middle))
        sc = normalise(sc.clamp_min(0))[0]  # [h, L]
        parts[idx], middles[idx] = sc, plan.middle
    heads = next(iter(parts.values())).shape[0]
    total = sum(middles.values())
    flexible = round((1 - FLOOR) * total)
    allv = torch.cat([p.reshape(-1) for p in parts.values()])
    k = flexible * heads
    thresh = allv.topk(k).values[-1]
    counts = {i: float((p >= thresh).sum()) / heads for i, p in parts.items()}
    scale = flexible / max(1e-9, sum(counts.values()))
    out = {}
    for i in parts:
        length = parts[i].shape[-1]
        out[i] = min(length, max(1, round(FLOOR * middles[i] + counts[i] * scale)))
    # fix rounding so the total does not exceed the uniform total
    excess = sum(out.values()) - total
    order = sorted(out, key=lambda i: -out[i])
    j = 0
    while excess > 0:
        i = order[j % len(order)]
        if out[i] > 1:
            out[i] -= 1
            excess -= 1
        j += 1
    print("layer budgets", [out[i] for i in sorted(out)], "uniform", middles[next(iter(middles))], file=sys.stderr)
    return out

def _after_prefill(self, decoder, args, kwargs, output):
    if self._repeating or not self._pending:
        return orig_after(self, decoder, args, kwargs, output)
    pending = self._pending
    orig = self._compress_layer
    budgets = {}
    def compress(cache, state):
        if not budgets:
            budgets.update(layer_budgets(self, pending))
        idx = state["module"].layer_idx
        plan = state["plans"][0]
        state["plans"] = [wp.RowPlan(plan.tokens, plan.sink, plan.window, budgets[idx])]
        return orig(cache, state)
    self._compress_layer = compress
    try:
        return orig_after(self, decoder, args, kwargs, output)
    finally:
        del self._compress_layer
wp.WeightedSubsetPress._after_prefill = _after_prefill

if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")  # run from the repository root
    from eval.fidelity import main as fid
    sys.exit(fid(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
