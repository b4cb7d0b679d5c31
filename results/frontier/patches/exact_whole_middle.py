"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Layer 7 kept whole by default"); it
patches the press as of commit 2104a35 and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its
arguments.

Experiment: a layer whose row plan keeps its whole middle (at 50% kept, the calibrated retrieval layer 18 widened two
times) keeps it exactly, weight 1 and no fit, as a layer in `full_layers` does. Why: at 50% kept and 2048 tokens,
layer 7 kept whole exactly answered 2.2 [0.8, 3.7] above the same rows fitted (`retrieval_layers=[18, 7]`)."""
import sys

import torch
from _pilot import run

import kvcompress.presses as pr

compress_middle = pr.CompressKVPress.compress_middle


def patched_compress_middle(self, module, keys, values, start, end, rows, reference):
    if rows >= end - start:
        weights = torch.ones(*keys.shape[:2], end - start, dtype=torch.float32, device=keys.device)
        return keys[:, :, start:end], values[:, :, start:end], weights
    return compress_middle(self, module, keys, values, start, end, rows, reference)


pr.CompressKVPress.compress_middle = patched_compress_middle
sys.exit(run(sys.argv[1:]))
