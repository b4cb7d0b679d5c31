"""What the one-operation benchmarks (``eval.bench_fit``, ``eval.bench_repeat_attention``) share: the attention
shape and run flags, the timing of a call, its peak memory, and the JSON they write."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Qwen2.5-7B-Instruct's attention shape by default, the device, and how to run and report."""
    p.add_argument("--heads", type=int, nargs=2, default=[28, 4], metavar=("Q", "KV"), help="query and KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=28, help="layers of the model the per-call median is scaled to")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--output", default=None, help="JSON file for the rows and the environment")


def check_run_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a message naming the flag where the flags of :func:`add_run_arguments` are out of range."""
    if args.heads[0] % args.heads[1]:
        p.error(f"--heads: query heads must be a multiple of KV heads, got {args.heads}")
    for name in ("head_dim", "layers", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")


def run_device(args: argparse.Namespace) -> torch.device:
    """Apply the run flags of :func:`add_run_arguments` (torch's CPU threads when given) and return the device."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return torch.device(args.device)


def time_calls(fn: Callable[[], Any], warmup: int, repeats: int, device: torch.device) -> tuple[list[float], Any]:
    """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` (each call device-synchronised), and the last result."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    seconds, result = [], None
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return seconds, result


def _resident_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field)) / 2**10


def peak_mib(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Peak memory (MiB) of one call of ``fn`` above what was held before it. CUDA: the allocator's peak. CPU, on
    Linux: the resident high-water mark, reset first (``/proc/self/clear_refs``), then read (``VmHWM``); memory
    the process freed earlier and reuses is not counted, so a lower bound. None where /proc does not allow it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        before = _resident_mib("VmRSS")
    except OSError:
        return None
    fn()
    return _resident_mib("VmHWM") - before


def write_json(path: str, program: str, argv: list[str] | None, rows: list, args: argparse.Namespace) -> None:
    """``rows``, the settings, the environment and the command line (``python -m program ...``) to ``path``."""
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    environment = dict(
        device=str(device), name=name, torch=torch.__version__, python=platform.python_version(),
        threads=torch.get_num_threads(),
    )  # fmt: skip
    command = " ".join([f"python -m {program}", *(sys.argv[1:] if argv is None else argv)])
    with open(path, "w") as f:
        json.dump(dict(rows=rows, settings=vars(args), environment=environment, command=command), f, indent=2)
    print(f"wrote {path}")


def print_and_write(result: dict, output: str | None) -> None:
    """A probe's result as indented JSON on stdout, and in ``output`` when given."""
    print(json.dumps(result, indent=1))
    if output:
        with open(output, "w") as handle:
            json.dump(result, handle, indent=1)
