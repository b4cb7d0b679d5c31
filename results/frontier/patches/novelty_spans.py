"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit 439cf76 and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: the novelty prior over spans. NOVPOOL=k (odd), NOVSIDE=both|after|before: a key's novelty becomes the
max of the novelty over its k-neighbourhood (both: centred; after: the k-1 keys before it, so the tokens after a
novel key inherit its score; before: the k-1 keys after it)."""

import os
import sys

import torch.nn.functional as F

import kvcompress.reference as ref
from kvcompress.cli import main as cli_main

K, SIDE = int(os.environ.get("NOVPOOL", "1")), os.environ.get("NOVSIDE", "both")
orig = ref.key_novelty


def pooled_novelty(keys, values=None):
    novelty = orig(keys, values)
    if K <= 1:
        return novelty
    shape = novelty.shape
    x = novelty.reshape(-1, 1, shape[-1])
    if SIDE == "both":
        x = F.max_pool1d(x, K, stride=1, padding=K // 2)
    elif SIDE == "after":
        x = F.max_pool1d(F.pad(x, (K - 1, 0), value=-1.0), K, stride=1)
    else:
        x = F.max_pool1d(F.pad(x, (0, K - 1), value=-1.0), K, stride=1)
    return x.reshape(shape)


ref.key_novelty = pooled_novelty
if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")
    from eval.fidelity import main as fid

    sys.exit(fid(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
