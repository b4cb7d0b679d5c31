"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit c645dcb and runs `kvcompress eval ...` (or `fidelity ...`) with its arguments.

Experiment: the novelty prior weighted by each value's distance from its head's mean value, ``||v_j - mean v||``,
instead of its norm ``||v_j||`` (the default since the tenth session). Attention's output is a convex combination of
the values, so moving probability onto row j moves the output by about ``v_j - mean``: a row whose value is the
head's average value changes little when dropped, however large its norm. Score: KeyDiff's ``1 - cos(k_j, mean k)``
times ``||v_j - mean v|| / mean_j ||v_j - mean v||`` per head."""

import sys

import torch
import torch.nn.functional as F

from kvcompress import reference
from kvcompress.cli import main as cli_main


def key_novelty(keys: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    keys = keys.float()
    anchor = F.normalize(keys.mean(dim=2, keepdim=True), dim=-1)
    novelty = 1.0 - (F.normalize(keys, dim=-1) * anchor).sum(-1)
    if values is None:
        return novelty
    values = values.float()
    spread = (values - values.mean(dim=2, keepdim=True)).norm(dim=-1)
    return novelty * spread / spread.mean(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


reference.key_novelty = key_novelty
if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")
    from eval.fidelity import main as fidelity_main

    sys.exit(fidelity_main(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
