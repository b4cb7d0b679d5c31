"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit 4e8c7ae and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: the default's novelty prior by consensus over heads, in whole pieces. balanced() finds the pieces holding
the facts by a consensus (the mean over layers and heads of each position's min-max normalised key novelty, a piece
scored by its top position); here each layer's novelty rows go to such pieces of SPAN tokens in every KV head alike,
the consensus taken over that layer's heads (CUM=0) or over the heads of every layer prefilled so far (CUM=1: what a
press that compresses each layer right after its prefill can know). A position's score: its piece's score, ties
broken by its own consensus. The query sources choose the other rows as before.
"""

import os
import sys

import torch

import kvcompress.reference as ref
from kvcompress.cli import main as cli_main

SPAN = int(os.environ.get("SPAN", "16"))
CUM = os.environ.get("CUM", "0") == "1"
_state = {"sum": None, "layers": 0}
_orig = ref.record_prefill


def _normalised(novelty):  # [1, h, n] -> [n]: mean over heads of the per-head min-max normalised novelty
    layer = novelty.reshape(-1, novelty.shape[-1]).float()
    low, high = layer.amin(-1, keepdim=True), layer.amax(-1, keepdim=True)
    return ((layer - low) / (high - low).clamp_min(1e-12)).mean(0)


def record_prefill(module, kwargs, keys, sources, observation_window, samples, reduce="sum"):
    reference = _orig(module, kwargs, keys, sources, observation_window, samples, reduce)
    if "novelty" not in reference.mass:
        return reference
    novelty = reference.mass["novelty"]
    here = _normalised(novelty)
    if CUM:
        if module.layer_idx == 0 or _state["sum"] is None or _state["sum"].shape != here.shape:
            _state["sum"], _state["layers"] = torch.zeros_like(here), 0
        _state["sum"] += here
        _state["layers"] += 1
        here = _state["sum"] / _state["layers"]
    n = here.shape[0]
    pieces = -(-n // SPAN)
    padded = torch.nn.functional.pad(here, (0, pieces * SPAN - n), value=-1.0).view(pieces, SPAN)
    piece_score = padded.amax(-1).repeat_interleave(SPAN)[:n]
    score = piece_score + 1e-3 * here
    reference.mass["novelty"] = score.expand_as(novelty).contiguous().to(novelty.dtype)
    return reference


ref.record_prefill = record_prefill
import kvcompress.presses as pr  # noqa: E402

pr.record_prefill = record_prefill
if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")
    from eval.fidelity import main as fid

    sys.exit(fid(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
