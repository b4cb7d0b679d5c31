"""The host-device synchronisations of one prefill under each setting (CUDA): where the host waits for the GPU.

A sync inside a layer's hooks makes the host wait for that layer's forward and then launch the press's kernels
one by one behind an idle GPU; without one, the host queues them while the GPU still runs the forward. Each setting
(names of ``eval.speed``'s prefill breakdown) prefills once to warm up (Triton compiles), then once under
``torch.cuda.set_sync_debug_mode("warn")``; every sync is counted with the library frames that made it. Default
workload: random-weight Qwen2.5-7B-Instruct shape cut to 4 layers, 8,192 tokens, bf16, 25% kept.

Run from the repository root: ``python -m eval.probe_syncs [--settings none snapkv default] [--output x.json]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import traceback
import warnings
from pathlib import Path

import torch

from eval.probe_workload import probe_args, warmed_prefills


def parse(argv: list[str] | None) -> argparse.Namespace:
    return probe_args(
        "python -m eval.probe_syncs", __doc__.split("\n\n")[0], argv,
        settings=["none", "snapkv", "default", "default_overlap", "thorough", "balanced", "balanced_overlap", "kvzip",
                  "paper"],
        tokens=8192, output="JSON file: setting -> {sync site: count}",
        needs_cuda="a CPU has no host-device syncs to count",
    )  # fmt: skip


def _site(message: object, filename: str, lineno: int) -> str:
    """The warning's text and the innermost library frames (kvcompress / eval) that led to it."""
    frames = [f for f in traceback.extract_stack()[:-3] if "kvcompress" in f.filename or "/eval/" in f.filename]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames[-4:]))
    return f"{str(message)[:60]} @ {where or f'{filename}:{lineno}'}"


def count_syncs(fn) -> collections.Counter:
    """Sync sites of one call of ``fn`` (torch's sync debug mode; its one-off "prototype feature" notice is not a
    sync and is left out)."""
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message) and "prototype" not in str(message):
            sites.update([_site(message, filename, lineno)])

    with warnings.catch_warnings():  # restores the filters and showwarning afterwards
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    found = {}
    for name, run in warmed_prefills(args):
        sites = count_syncs(run)
        found[name] = dict(sites)
        print(f"{name}: {sum(sites.values())} syncs", flush=True)
        for site, count in sites.most_common(12):
            print(f"  {count:4d}  {site}", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
