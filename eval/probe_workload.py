"""What the GPU probes over prefill settings share (:mod:`eval.probe_syncs`, :mod:`eval.probe_overlap`): their flags
(``--settings`` of ``eval.speed``'s prefill breakdown, ``--layers``, ``--tokens``, ``--output``) and their workload,
a random-weight Qwen2.5-7B-Instruct-shaped model cut to ``--layers`` layers, bf16, one ``--tokens``-token prefill
per setting after a warm-up prefill (Triton compiles and first allocations outside what is probed)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

import torch

from eval.speed.config import resolve_config
from eval.speed.e2e import build_model, prefill
from eval.speed.prefill import SETTINGS, make_setting


def probe_args(
    prog: str, description: str, argv: list[str] | None, *, settings: list[str], tokens: int, output: str,
    needs_cuda: str,
) -> argparse.Namespace:  # fmt: skip
    """The probe's flags, checked; ``needs_cuda``: why the probe refuses to run without CUDA."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--settings", nargs="+", default=settings)
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the random-weight model (default 4)")
    p.add_argument("--tokens", type=int, default=tokens, help=f"prefill length (default {tokens})")
    p.add_argument("--output", default=None, help=output)
    args = p.parse_args(argv)
    unknown = [name for name in args.settings if name not in SETTINGS]
    if unknown:
        p.error(f"--settings: choose from {', '.join(SETTINGS)}, got {unknown}")
    if args.layers < 1 or args.tokens < 1:
        p.error(f"--layers and --tokens: must be >= 1, got {args.layers} and {args.tokens}")
    if not torch.cuda.is_available():
        p.error(f"CUDA is not available: {needs_cuda} (run this on a GPU machine)")
    return args


def warmed_prefills(
    args: argparse.Namespace, device: torch.device | None = None, smoke: bool = False
) -> Iterator[tuple[str, Callable[[], object]]]:
    """``(setting, one prefill of it)`` for each of ``args.settings``, each prefilled once already (on CUDA;
    ``device`` and ``smoke``, ``eval.speed``'s tiny model in float32, are for a CPU test of the workload)."""
    cfg = resolve_config(["--model-layers", str(args.layers), *(["--smoke"] if smoke else [])])
    device = torch.device("cuda") if device is None else device
    model = build_model(cfg, device, torch.float32 if smoke else torch.bfloat16)
    ids = torch.randint(0, cfg.model["vocab_size"], (1, args.tokens), device=device)
    for name in args.settings:
        press = make_setting(name, cfg)

        def run(press=press) -> object:
            return prefill(model, press, ids)

        run()
        yield name, run
