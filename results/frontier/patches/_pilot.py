"""What the thirteenth session's pilot patches share (not part of the library): a per-head top-k with counts that
vary by head, the split of a head's middle rows that gives the window source its rows first, the window queries the
press already recorded, and the command line every patch ends with (`eval ...` through kvcompress's CLI, or
`fidelity ...` through eval.fidelity). A patch run as `python results/frontier/patches/<file>.py` finds this module
beside it."""
import sys
from collections.abc import Callable

import torch

import kvcompress.presses as pr
from kvcompress.reference import PRIORS, LayerReference


def take_top(scores: torch.Tensor, chosen: torch.Tensor, counts: torch.Tensor) -> None:
    """Mark each head's ``counts [b, h]`` highest ``scores [b, h, n]`` not yet ``chosen`` (bool, in place)."""
    width = int(counts.max())
    if width <= 0:
        return
    order = torch.sort(scores.masked_fill(chosen, -torch.inf), dim=-1, descending=True, stable=True).indices
    order = order[..., :width]
    keep = torch.arange(width, device=scores.device) < counts[..., None]
    chosen.scatter_(-1, order, keep | chosen.gather(-1, order))


def window_queries(reference: LayerReference) -> torch.Tensor:
    """The window source's queries ``[b, h_q, m, d]``: ``record_prefill`` records them first."""
    return reference.queries[0]


def window_first(total, reference, start: int, end: int, rows: int, reserved: dict, window) -> torch.Tensor:
    """Middle scores whose top ``rows`` per head are the window's ``window [b, h]`` best by ``total`` (the query
    sources' mixed scores), then the priors' best, sharing the rest in their ``reserved`` ratio."""
    chosen = torch.zeros_like(total, dtype=torch.bool)
    take_top(total, chosen, window)
    left = rows - window
    novelty, induction = reserved.get("novelty", 0), reserved.get("induction", 0)
    novelty_rows = torch.round(left * (novelty / max(novelty + induction, 1))).long()
    for source, counts in zip(PRIORS, (novelty_rows, left - novelty_rows), strict=True):
        if source in reference.mass:
            take_top(reference.mass[source][:, :, start:end], chosen, counts)
    return torch.where(chosen, total + (1.0 + total.amax(-1, keepdim=True)), total)


def split_by_window(window_rows: Callable) -> None:
    """Patch the press so that each head's window source takes ``window_rows(total, reference, start, end, rows,
    base)`` of its middle rows first (``base``: the library's share; None keeps the library's split) and the priors
    the rest (:func:`window_first`)."""
    reserved_rows, mixed_scores = pr.CompressKVPress._reserved_rows, pr.mixed_scores

    def patched_reserved_rows(self, rows):
        return {**reserved_rows(self, rows), "_rows": rows}

    def patched_mixed_scores(reference, start, end, weights, pool, reserved=None):
        reserved = dict(reserved or {})
        rows = reserved.pop("_rows")
        total = mixed_scores(reference, start, end, weights, pool)  # no reserved rows: the query sources' mix
        window = window_rows(total, reference, start, end, rows, rows - sum(reserved.values()))
        if window is None:
            return mixed_scores(reference, start, end, weights, pool, reserved)
        return window_first(total, reference, start, end, rows, reserved, window)

    pr.CompressKVPress._reserved_rows = patched_reserved_rows
    pr.mixed_scores = patched_mixed_scores


def run(argv: list[str]) -> int:
    """``fidelity ARGS`` runs eval.fidelity from the repository root; anything else is `kvcompress ARGS`."""
    if argv[0] == "fidelity":
        sys.path.insert(0, ".")
        from eval.fidelity import main as fidelity

        return fidelity(argv[1:])
    from kvcompress.cli import main as cli_main

    return cli_main(argv)
