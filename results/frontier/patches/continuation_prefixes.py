"""Pilot (not part of the library): the continuation study with each row's KL also over the first 128 and 256
tokens of its continuation (``kl_128``, ``kl_256``), so that one run with ``--continuation-tokens 512`` pairs each
context's short-continuation KL with its long one, and its mean KL per stretch of ``BIN`` tokens (``kl_bins``).
``kl`` stays the mean over the whole continuation.

    python results/frontier/patches/continuation_prefixes.py fidelity --continuation-tokens 512 ...
"""
import sys

import torch
from _pilot import run

import kvcompress.fidelity.measure as measure

PREFIXES = (128, 256)
BIN = 32
_last: dict = {}
continuation_kl, make_row = measure.continuation_kl, measure._row


def prefix_kl(exact: torch.Tensor, approx: torch.Tensor) -> float:
    per_token = torch.sum(exact.exp() * (exact - approx), dim=-1)
    _last.clear()
    _last.update({f"kl_{c}": per_token[:c].mean().item() for c in PREFIXES})
    _last["kl_bins"] = [part.mean().item() for part in per_token.split(BIN)]
    return continuation_kl(exact, approx)


def row_with_prefixes(ctx, kl, *args, **kwargs) -> dict:
    """The row with the KL parts of its own ``prefix_kl`` call (none: the exact cache's row, which makes none)."""
    prefixes = dict(_last) or {**{f"kl_{c}": 0.0 for c in PREFIXES}, "kl_bins": []}
    _last.clear()
    return {**make_row(ctx, kl, *args, **kwargs), **prefixes}


measure.continuation_kl, measure._row = prefix_kl, row_with_prefixes

if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
