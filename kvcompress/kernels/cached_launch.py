"""Launch a compiled Triton kernel without Triton's per-call argument binding.

``kernel[grid](*args, **options)`` runs, on every call, a generated binder that derives each argument's
specialization (a pointer's dtype and 16-byte alignment; an integer equal to 1, divisible by 16, or past int32)
and turns it into the compiled kernel's cache key: 27 us on the host for the 44 arguments of the decode split kernel
(a 2.5 GHz Xeon, a CUDA sm_90 target's binder; ``results/frontier/patches/launch_host_probe.py``). The decode step
pays it once per layer, where the kernel itself runs 15-50 us.

:class:`CachedLaunch` reads the same facts directly (13 us for those 44 arguments), keeps the compiled kernel Triton
returned for them, and launches it through ``CompiledKernel[grid]``, Triton's launcher for a compiled kernel (the
same stream, launch hooks and argument packing as ``kernel[grid]``). The first call with a new key, and every
call under ``TRITON_INTERPRET=1``, goes through ``kernel[grid]``, which compiles or finds the kernel.
``tests/test_cached_launch.py`` checks the key against Triton's own binder on random arguments.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from triton.runtime.jit import JITFunction

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_CACHE_LIMIT = 256  # keys kept per kernel (a dynamic cache's length changes every step: its residues mod 16 do not)


def specialization_key(args: tuple) -> tuple:
    """What Triton specializes a compiled kernel on, per positional argument: a tensor's dtype and 16-byte alignment;
    an int's class (1, or its width, int32, int64 or uint64, and whether 16 divides it); otherwise the argument's type
    (floats and bools are not specialized; None is a constexpr). At least as fine as Triton's own specialization."""
    key = []
    append = key.append
    for x in args:
        kind = type(x)
        if kind is int:
            if x == 1:
                append(1)
            else:  # 16-21: int32, int64 or wider, times whether 16 divides it
                width = 0 if _INT32_MIN <= x <= _INT32_MAX else 2 if _INT64_MIN <= x <= _INT64_MAX else 4
                append(16 + width + (not x & 15))
        elif kind is torch.Tensor or isinstance(x, torch.Tensor):
            append((x.dtype, not x.data_ptr() & 15))
        else:
            append(kind)
    return tuple(key)


class CachedLaunch:
    """``launch(grid, args, options)`` = ``kernel[grid](*args, **options)`` for a ``@triton.jit`` kernel whose
    non-constexpr parameters are passed positionally (``args``, in order) and its constexprs and launch options
    (``num_warps``, ``num_stages``) by name (``options``)."""

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self._compiled: dict[tuple, tuple[Any, tuple]] = {}  # key -> (compiled kernel, its constexprs' values)
        params = getattr(kernel, "params", None)
        self._positional = sum(not p.is_constexpr for p in params) if params is not None else None
        if params is not None and any(p.is_constexpr for p in params[: self._positional]):
            raise ValueError(f"{kernel}: CachedLaunch needs every constexpr parameter after the others")
        tail = params[self._positional :] if params is not None else ()
        self._constexpr_defaults = {p.name: p.default for p in tail if p.default is not inspect.Parameter.empty}
        self._constexprs = tuple(p.name for p in tail)

    def __call__(self, grid: tuple[int, ...], args: tuple, options: dict[str, Any]) -> None:
        if not isinstance(self.kernel, JITFunction):  # the interpreter: nothing compiled to keep
            self.kernel[grid](*args, **options)
            return
        if len(args) != self._positional:
            raise TypeError(f"{self.kernel}: {self._positional} positional arguments expected, got {len(args)}")
        key = (torch.cuda.current_device(), specialization_key(args), tuple(options.items()))
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **options)
            if len(self._compiled) >= _CACHE_LIMIT:
                self._compiled.clear()
            defaults = self._constexpr_defaults
            constexprs = tuple(options[n] if n in options else defaults[n] for n in self._constexprs)
            self._compiled[key] = (compiled, constexprs)
            return
        compiled, constexprs = entry
        if len(grid) < 3:  # the compiled kernel's launcher reads three axes (kernel[grid] pads them itself)
            grid = (*grid, 1, 1)[:3]
        compiled[grid](*args, *constexprs)


_LAUNCHERS: dict[Any, CachedLaunch] = {}


def launch(kernel: Any, grid: tuple[int, ...], args: tuple, options: dict[str, Any], *, cached: bool) -> None:
    """``kernel[grid](*args, **options)``; ``cached``: through the kernel's :class:`CachedLaunch` instead."""
    if not cached:
        kernel[grid](*args, **options)
        return
    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        launcher = _LAUNCHERS[kernel] = CachedLaunch(kernel)
    launcher(grid, args, options)
