"""Two presses' continuation KL compared on the contexts of one or more fidelity runs: the ratio of their mean KL
with a 95% paired bootstrap interval, and the per-context ratios (worst, how many above a bound, how many below 1).

    python -m eval.fidelity_paired --pair RUN PRESS_A PRESS_B [--pair RUN2 PRESS_A2 PRESS_B2 ...] [--kept 0.25]

A run is an ``eval.fidelity`` output directory (or its ``runs.jsonl``). Each ``--pair`` reads both presses' rows of
one run (their labels as that run wrote them, e.g. ``compresskv`` or ``compresskv[novelty_share=0.375]``); pairs of
several runs (e.g. one per ``--seed``, whose context names repeat) are pooled, each context paired within its run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from kvcompress.fidelity.stats import bootstrap_ratio, context_ratios
from kvcompress.fidelity.study import read_runs


def context_kl(run: str, press: str, kept: float) -> dict[str, float]:
    """context name -> KL of ``press`` at ``kept`` in a fidelity run (directory or runs.jsonl), read as the study
    reads it (the first of any repeated row)."""
    path = Path(run)
    path = path / "runs.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"--pair: {run} is neither a fidelity run directory nor its runs.jsonl")
    rows = read_runs(path, repair=False)  # a study may still be appending to it
    kl = {r["context"]: r["kl"] for r in rows if r["press"] == press and r.get("kept") == kept and "kl" in r}
    if not kl:
        labels = sorted({r["press"] for r in rows if r.get("kept") == kept})
        raise ValueError(f"--pair: {path} has no rows of {press!r} at kept {kept}; it has {labels}")
    return kl


def paired_kl(pairs: list[tuple[str, str, str]], kept: float) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Both presses' KL on the contexts each run scored for both, pooled over the runs in order (contexts sorted by
    name within a run): ``(kl_a [n], kl_b [n], names [n])``, a name ``run:context``."""
    kl_a, kl_b, names = [], [], []
    for run, press_a, press_b in pairs:
        a, b = context_kl(run, press_a, kept), context_kl(run, press_b, kept)
        shared = sorted(set(a) & set(b))
        if not shared:
            raise ValueError(f"--pair: {run}: {press_a!r} and {press_b!r} share no context")
        kl_a += [a[c] for c in shared]
        kl_b += [b[c] for c in shared]
        names += [f"{run}:{c}" for c in shared]
    return np.array(kl_a), np.array(kl_b), names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.fidelity_paired", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", nargs=3, action="append", required=True, metavar=("RUN", "PRESS_A", "PRESS_B"),
                   help="a fidelity run and the two presses' labels in it (repeat to pool runs)")  # fmt: skip
    p.add_argument("--kept", type=float, default=0.25, help="kept fraction of the rows compared (default 0.25)")
    p.add_argument("--bound", type=float, default=1.5, help="count the contexts whose ratio is above this")
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default 2000, as the study)")
    args = p.parse_args(argv)
    try:
        kl_a, kl_b, names = paired_kl([tuple(pair) for pair in args.pair], args.kept)
        ratio, low, high = bootstrap_ratio(kl_a, kl_b, resamples=args.resamples)
    except (ValueError, OSError) as error:
        raise SystemExit(f"error: {error}") from None
    per_context, covered = context_ratios(kl_a, kl_b)  # contexts where B's KL is 0 have no ratio
    names = [name for name, kept in zip(names, covered, strict=True) if kept]
    worst = int(np.argmax(per_context))
    print(
        f"KL A / B on {len(kl_a)} contexts: {ratio:.3f} [95% paired interval {low:.3f}, {high:.3f}];"
        f" per context: worst {per_context[worst]:.2f} ({names[worst]}), median {np.median(per_context):.2f},"
        f" {int((per_context > args.bound).sum())} above {args.bound}, {int((per_context < 1).sum())} below 1"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
