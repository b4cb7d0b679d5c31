"""Timing (CUDA events or perf_counter), the backend keyword of the timed functions, and run notes."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import inspect
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _resident_peak_bytes() -> int | None:
    """This process's peak resident memory since its last reset (Linux ``VmHWM``), or None where unreadable."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_resident_peak() -> bool:
    """Reset ``VmHWM`` to the current resident memory (Linux ``clear_refs`` 5); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def _return_freed_memory() -> None:
    """Serve every allocation of 64 KiB or more by its own mmap (glibc), so a freed tensor leaves the resident
    set at once: else memory freed by one setting stays resident and counts in the next one's peak."""
    path = ctypes.util.find_library("c")
    if path:
        try:
            ctypes.CDLL(path).mallopt(_M_MMAP_THRESHOLD, 1 << 16)
        except (OSError, AttributeError):
            pass


class Clock:
    """CUDA events on CUDA devices, ``time.perf_counter`` elsewhere. Peak memory: allocated device memory on
    CUDA; on CPU the whole process's peak resident memory (Linux; model weights included, as on CUDA)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._resident = False
        if not self.cuda:
            _return_freed_memory()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self) -> Any:
        """A point in time on the device's stream (an event on CUDA, a float on CPU)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def intervals(self, marks: list[Any]) -> list[float]:
        """Seconds between consecutive marks (synchronises first)."""
        self.sync()
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:], strict=False)]
        return [b - a for a, b in zip(marks, marks[1:], strict=False)]

    def times(self, fn: Callable[[], Any], warmup: int, repeats: int, flush: torch.Tensor | None = None) -> list[float]:
        """Seconds per call of ``fn`` for ``repeats`` calls after ``warmup`` calls."""
        for _ in range(warmup):
            fn()
        self.sync()
        spans = []
        for _ in range(repeats):
            if flush is not None:
                flush.zero_()  # queued ahead of the timed call: the launch overhead hides behind it
            start = self.mark()
            fn()
            spans.append((start, self.mark()))
        self.sync()
        return [self.intervals([a, b])[0] for a, b in spans]

    def memory_reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._resident = _reset_resident_peak()

    def memory_peak_gib(self) -> float | None:
        """Peak memory since the last reset, GiB: allocated on CUDA, resident on CPU (None where the CPU's
        peak cannot be reset and read)."""
        if self.cuda:
            self.sync()
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        peak = _resident_peak_bytes() if self._resident else None
        return None if peak is None else peak / 2**30

    def memory_reserved_gib(self) -> float | None:
        """Peak memory the CUDA caching allocator reserved since the last reset, GiB (None off CUDA): above the
        allocated peak where blocks cached for one stream cannot serve another (a side stream's work)."""
        if not self.cuda:
            return None
        self.sync()
        return torch.cuda.max_memory_reserved(self.device) / 2**30


def stats(samples: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "samples": len(samples)}


def release(device: torch.device) -> None:
    """Free what the last measurement left (CUDA only: a full gc pass costs ~0.4 s with transformers loaded)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------- backends


def has_backend_keyword(fn: Callable) -> bool:
    try:
        return "backend" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def backend_kwargs(fn: Callable, backend: str, device: torch.device) -> tuple[dict | None, str | None]:
    """``(kwargs, note)`` to run ``fn`` on ``backend``; kwargs None means the backend cannot be measured."""
    name = fn.__name__
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None, (
            f"{name}: backend 'triton' skipped on {device.type} (the Triton kernels take CUDA tensors; "
            "TRITON_INTERPRET=1 runs them in the interpreter, as a code-path check only)"
        )
    if has_backend_keyword(fn):
        return {"backend": backend}, None
    if backend == "triton":
        return None, f"{name}: no backend keyword in this kvcompress yet; no Triton path to measure"
    return {}, f"{name}: no backend keyword in this kvcompress yet; '{backend}' rows ran its default (PyTorch)"


class Notes(list):
    """Printed once each, kept in the JSON."""

    def add(self, note: str | None) -> None:
        if note and note not in self:
            self.append(note)
            print(f"note: {note}")

