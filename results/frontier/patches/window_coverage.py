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
from _pilot import run, split_by_window

from kvcompress.selection import normalise

COVER = float(os.environ.get("COVER", "0.5"))
MAXWIN = float(os.environ.get("MAXWIN", "1.0"))
DIAG = os.environ.get("DIAG")


def covering_rows(total, reference, start, end, rows, base):
    cumulative = torch.sort(normalise(total), dim=-1, descending=True).values.cumsum(-1)
    needed = (cumulative < COVER).sum(-1) + 1
    window = needed.clamp(min=base, max=max(base, round(MAXWIN * rows)))
    if DIAG:
        with open(DIAG, "a") as f:
            shares = [((cumulative < c).sum(-1) + 1).float().mean().item() / rows for c in (0.5, 0.8, 0.9)]
            f.write(f"{window.float().mean().item() / rows:.3f} " + " ".join(f"{x:.3f}" for x in shares) + "\n")
    return window


split_by_window(covering_rows)

sys.exit(run(sys.argv[1:]))
