"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "The induction prior"); it patches
the press as of commit 14578a9 and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: the default's two priors' reserved rows interleaved instead of taken in turn. The library gives
novelty its ``novelty_share`` of the middle rows first, then induction its ``induction_share`` of what is left.
Here the same total R = novelty + induction rows goes to the two priors' top keys in turn, in proportion to their
shares (2 : 1 at the default's 0.5 / 0.25): a key's priority is min(rank_novelty * R / novelty, (rank_induction +
0.5) * R / induction), the R best priorities reserved. A key both priors rank high is taken once, so each goes
deeper into its own list than "in turn" lets the second one. The screen that found induction measured this form
(+3.1 [0.8, 6.2] over the library's, on the contexts the shares were chosen on); this checks fresh ones.
"""

import sys

import torch

import kvcompress.methods as methods
import kvcompress.presses as presses
from kvcompress.cli import main as cli_main
from kvcompress.selection import normalise, pool_scores, top_rows

orig = methods.mixed_scores


def rank_of(x):
    """0 for each head's highest score, 1 for the next, ... (ties: the earlier position first)."""
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices
    return order.argsort(-1).float()


def interleaved_scores(reference, start, end, weights, pool, reserved=None):
    reserved = reserved or {}
    novelty, induction = reserved.get("novelty", 0), reserved.get("induction", 0)
    if not ("novelty" in reference.mass and "induction" in reference.mass and novelty > 0 and induction > 0):
        return orig(reference, start, end, weights, pool, reserved)
    total = None
    for source, mass in reference.mass.items():
        if source in ("novelty", "induction"):
            continue
        part = normalise(pool_scores(mass[:, :, start:end], pool.get(source, 1))) * weights.get(source, 1.0)
        total = part if total is None else total + part
    both = novelty + induction
    priority = torch.minimum(
        rank_of(reference.mass["novelty"][:, :, start:end]) * (both / novelty),
        (rank_of(reference.mass["induction"][:, :, start:end]) + 0.5) * (both / induction),
    )
    count = min(both, priority.shape[-1])
    chosen = torch.zeros_like(priority, dtype=torch.bool).scatter_(-1, top_rows(-priority, count), True)
    if total is None:  # no query source: the interleaved order itself
        return -priority
    return torch.where(chosen, total + (1.0 + total.amax(-1, keepdim=True)), total)


methods.mixed_scores = presses.mixed_scores = interleaved_scores
if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")
    from eval.fidelity import main as fid

    sys.exit(fid(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
