"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Layer 7 kept whole by default"); it
patches the press as of commit 2104a35 and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its
arguments.

Experiment: a layer whose row plan keeps its whole middle keeps it exactly, weight 1 and no fit, as a layer in
`full_layers` does. Why: at 50% kept and 2048 tokens, layer 7 kept whole exactly answered 2.2 [0.8, 3.7] above
`retrieval_layers=[18, 7]`, taken for the same rows fitted. Result: it changed no answer, because the two-times rule
does not reach a layer's whole middle at 50% kept (layer 18 keeps 1912 of 1980 middle rows at 2048 tokens), so
`[18, 7]` had dropped 3% of layer 7 as well as fitting it."""
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
