"""What the thirteenth session's pilot patches share (not part of the library): a per-head top-k with counts that
vary by head, and the command line every patch ends with (`eval ...` through kvcompress's CLI, or `fidelity ...`
through eval.fidelity). A patch run as `python results/frontier/patches/<file>.py` finds this module beside it."""
import sys

import torch


def take_top(scores: torch.Tensor, chosen: torch.Tensor, counts: torch.Tensor) -> None:
    """Mark each head's ``counts [b, h]`` highest ``scores [b, h, n]`` not yet ``chosen`` (bool, in place)."""
    width = int(counts.max())
    if width <= 0:
        return
    order = torch.sort(scores.masked_fill(chosen, -torch.inf), dim=-1, descending=True, stable=True).indices
    order = order[..., :width]
    keep = torch.arange(width, device=scores.device) < counts[..., None]
    chosen.scatter_(-1, order, keep | chosen.gather(-1, order))


def run(argv: list[str]) -> int:
    """``fidelity ARGS`` runs eval.fidelity from the repository root; anything else is `kvcompress ARGS`."""
    if argv[0] == "fidelity":
        sys.path.insert(0, ".")
        from eval.fidelity import main as fidelity

        return fidelity(argv[1:])
    from kvcompress.cli import main as cli_main

    return cli_main(argv)
