"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit 05e8ef2 and runs `kvcompress eval ...` with its arguments.

Experiment: the novelty prior with KeyDiff's own anchor (Park et al., arXiv 2504.15364, as kvpress's KeyDiffPress
computes it): the mean of the unit keys, instead of the unit vector of the mean key (which weights each key by its
norm)."""

import sys

import torch.nn.functional as F

import kvcompress.reference as reference
import kvcompress.selection as selection
from kvcompress.cli import main as cli_main


def key_novelty(keys):
    keys = keys.float()
    anchor = F.normalize(keys, dim=-1).mean(dim=2, keepdim=True)
    return 1.0 - F.cosine_similarity(keys, anchor, dim=-1)


selection.key_novelty = key_novelty
if hasattr(reference, "key_novelty"):
    reference.key_novelty = key_novelty
sys.exit(cli_main(sys.argv[1:]))
