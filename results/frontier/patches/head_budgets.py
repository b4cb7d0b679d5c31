"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit db600bd and runs `kvcompress eval ...` with its arguments.

Experiment: per-head budgets (AdaKV, Feng et al., arXiv 2407.11550): within a layer, the H x rows middle rows go to
the highest scores over all of the layer's KV heads (each head's scores as the press mixes them: every source
normalised per head, its reserved novelty rows first), with a floor of FLOOR x rows per head; a head that gets
fewer rows than the widest keeps its extra slots at weight 0 (attention over the cache is exactly that of the
ragged selection; memory is that of the widest head: a quality measure only). Without the fit (fit="none")."""

import os
import sys

import torch

import kvcompress.presses as presses
from kvcompress.cli import main as cli_main

FLOOR = float(os.environ.get("FLOOR", "0.2"))
original = presses.compress_by_attention


def compress_by_attention(module, keys, values, start, end, rows, scores, reference, fit):
    if fit is not None:
        raise SystemExit("head_budgets.py: run with --press-option compresskv.fit=none")
    batch, heads, length = scores.shape
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # [b, h, L]
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(length).expand_as(order))
    floor = min(rows, int(FLOOR * rows))
    boosted = torch.where(rank < floor, torch.full_like(scores, float("inf")), scores)
    chosen = torch.zeros(batch, heads * length, dtype=torch.bool)
    chosen.scatter_(1, boosted.reshape(batch, -1).topk(heads * rows, dim=-1).indices, True)
    counts = chosen.reshape(batch, heads, length).sum(-1)  # [b, h]
    width = int(counts.max())
    kept = order[..., :width]  # each head's top rows by its own scores
    live = torch.arange(width)[None, None, :] < counts[..., None]  # the first counts[h] of them are its rows
    positions, resort = kept.sort(-1)
    weights = live.gather(-1, resort).float()
    index = (positions + start)[..., None]
    print(f"head budgets layer {module.layer_idx}: {counts.tolist()} (uniform {rows})", file=sys.stderr)
    return (
        keys.gather(2, index.expand(-1, -1, -1, keys.shape[-1])),
        values.gather(2, index.expand(-1, -1, -1, values.shape[-1])),
        weights,
    )


presses.compress_by_attention = compress_by_attention
sys.exit(cli_main(sys.argv[1:]))
