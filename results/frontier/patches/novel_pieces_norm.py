"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit 4e8c7ae and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: balanced()'s pieces ranked with a robust normalisation of each head's key novelty. The library min-max
normalises each (layer, head)'s novelty before the mean over layers and heads, so one extreme key (the first token,
a newline) squeezes every other position of that head toward 0. NORM=clip99: min-max after clipping at the head's
99th percentile; NORM=rank: each position's rank within its head, in [0, 1]. A piece is still scored by its top
position. (A diagnostic on the RULER-style contexts, 1024 tokens, 8 per task: the quarter's pieces hold 66% of the
answer tokens with min-max, 5% of qa's; 82% / 79% with clip99, 80% / 82% with rank.)
"""

import os
import sys

import torch

import kvcompress.presses as pr
import kvcompress.reference as ref
from kvcompress.cli import main as cli_main

NORM = os.environ.get("NORM", "clip99")


def _normalised(layer):
    if NORM == "rank":
        return layer.argsort(-1).argsort(-1).float() / max(1, layer.shape[-1] - 1)
    high = layer.quantile(0.99, dim=-1, keepdim=True)
    layer = torch.minimum(layer, high)
    low = layer.amin(-1, keepdim=True)
    return (layer - low) / (high - low).clamp_min(1e-12)


def novel_pieces(novelty, fraction, span, device="cpu"):
    if fraction >= 1:
        return None
    score = torch.stack([_normalised(layer.reshape(-1, layer.shape[-1]).float()).mean(0) for layer in novelty])
    score = score.mean(0).to(device)
    n = score.shape[0]
    pieces = -(-n // span)
    score = torch.nn.functional.pad(score, (0, pieces * span - n), value=-1.0).view(pieces, span).amax(-1)
    return ref._piece_positions(score.topk(max(1, round(fraction * pieces))).indices.sort().values, span, n)


ref.novel_pieces = novel_pieces
pr.novel_pieces = novel_pieces
if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")
    from eval.fidelity import main as fid

    sys.exit(fid(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
