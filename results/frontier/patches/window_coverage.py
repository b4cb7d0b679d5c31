"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit 69c399c and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: the split of each head's middle rows between the window and the two priors set per head by the
window's own scores instead of fixed shares. The library gives novelty 50% and induction 25% of the middle rows
and the window the rest (25%) in every head. Here the window first takes, per head, the fewest of its top rows
that hold COVER of its (pooled, normalised) scores, at least the library's 25% and at most MAXWIN of the rows;
the priors share what is left in their 2 : 1 ratio. Why: the default's continuation KL is 3.1x SnapKV's on one
study context (mix-4096-s0) where the window alone matches SnapKV; a head whose window scores are spread over many
keys loses them to the priors' fixed 75%. DIAG=path appends each call's mean window share, then the shares
covering 0.5 / 0.8 / 0.9, to that file."""
import os
import sys

import torch
from _pilot import run, take_top

import kvcompress.presses as pr
from kvcompress.reference import PRIORS
from kvcompress.selection import normalise, pool_scores

COVER = float(os.environ.get("COVER", "0.5"))
MAXWIN = float(os.environ.get("MAXWIN", "1.0"))
DIAG = os.environ.get("DIAG")
reserved_rows = pr.CompressKVPress._reserved_rows


def patched_reserved_rows(self, rows):
    return {**reserved_rows(self, rows), "_rows": rows}



def patched_mixed_scores(reference, start, end, weights, pool, reserved=None):
    reserved = dict(reserved or {})
    rows = reserved.pop("_rows")
    total = None
    for source, mass in reference.mass.items():
        if source in PRIORS:
            continue
        part = normalise(pool_scores(mass[:, :, start:end], pool.get(source, 1))) * weights.get(source, 1.0)
        total = part if total is None else total + part
    novelty, induction = reserved.get("novelty", 0), reserved.get("induction", 0)
    base = rows - novelty - induction
    cumulative = torch.sort(normalise(total), dim=-1, descending=True).values.cumsum(-1)
    needed = (cumulative < COVER).sum(-1) + 1
    window = needed.clamp(min=base, max=max(base, round(MAXWIN * rows)))
    if DIAG:
        with open(DIAG, "a") as f:
            shares = [((cumulative < c).sum(-1) + 1).float().mean().item() / rows for c in (0.5, 0.8, 0.9)]
            f.write(f"{window.float().mean().item() / rows:.3f} " + " ".join(f"{x:.3f}" for x in shares) + "\n")
    chosen = torch.zeros_like(total, dtype=torch.bool)
    take_top(total, chosen, window)
    left = rows - window
    novelty_rows = torch.round(left * (novelty / max(novelty + induction, 1))).long()
    for source, counts in (("novelty", novelty_rows), ("induction", left - novelty_rows)):
        if source in reference.mass:
            take_top(reference.mass[source][:, :, start:end], chosen, counts)
    return torch.where(chosen, total + (1.0 + total.amax(-1, keepdim=True)), total)


pr.CompressKVPress._reserved_rows = patched_reserved_rows
pr.mixed_scores = patched_mixed_scores

sys.exit(run(sys.argv[1:]))
