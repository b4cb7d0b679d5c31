"""Host cost of launching the weighted decode kernels, Triton's way and through ``kvcompress.kernels.cached_launch``,
on CPU (docs/BENCHMARKS.md, "Launches without Triton's per-call binding"): ``python
results/frontier/patches/launch_host_probe.py``.

The decode call of Qwen2.5-7B's shape (1 query, 28 query / 4 KV heads of 128, bf16, 8,192 rows, 32 splits) is made
once with both kernels replaced by recorders, which keep each launch's arguments. Then, per kernel, medians of 7 x
2,000 repeats of: Triton's per-call work before its C launcher (the binder that ``JITFunction.run`` runs, built for
a CUDA sm_90 target, and its cache-key lookup), and ``CachedLaunch``'s (its key, its lookup and building the
compiled kernel's argument list) with the compiled launch itself a no-op. Neither includes the C launcher
(argument packing, ``cuLaunchKernel``), which both paths pay.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature  # noqa: E402

from kvcompress.kernels import weighted_decode  # noqa: E402
from kvcompress.kernels.cached_launch import CachedLaunch  # noqa: E402


def median_us(fn, repeats: int = 2000) -> float:
    for _ in range(200):
        fn()
    rounds = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        rounds.append((time.perf_counter() - start) / repeats * 1e6)
    return statistics.median(rounds)


class Recorder:
    def __init__(self, name: str, calls: dict):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **options: self.calls.__setitem__(self.name, (grid, args, options))


class NoOpJIT(JITFunction):
    """Triton's path replaced by a compiled kernel whose launches do nothing."""

    def run(self, *args, grid, warmup, **kwargs):
        class Compiled:
            def __getitem__(self, grid):
                return lambda *args: None

        return Compiled()


def time_kernel(name: str, kernel, grid, args: tuple, options: dict) -> None:
    """Print Triton's per-call work before its C launcher and CachedLaunch's, for one recorded launch."""
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    binder = create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
    extra = dict(debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode,
                 fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts)  # fmt: skip
    key_cache: dict = {}

    def triton_path():
        bound, specialization, opts = binder(*args, **options, **extra)
        compute_cache_key(key_cache, specialization, opts)
        return tuple(bound.values())

    cached = CachedLaunch(NoOpJIT(jit.fn))
    cached(grid, args, options)  # the first call keeps the (no-op) compiled kernel
    print(f"{name}: {len(args)} positional arguments; Triton's binder and key {median_us(triton_path):.1f} us, "
          f"CachedLaunch {median_us(lambda: cached(grid, args, options)):.1f} us")  # fmt: skip


def main() -> None:
    torch.set_num_threads(1)
    q = torch.randn(1, 28, 1, 128).bfloat16()
    k, v = torch.randn(1, 4, 8192, 128).bfloat16(), torch.randn(1, 4, 8192, 128).bfloat16()
    w = torch.rand(1, 4, 8192)
    calls: dict = {}
    kernels = dict(split=weighted_decode._weighted_split_kernel, reduce=weighted_decode._weighted_decode_reduce_kernel)
    recorders = dict(_weighted_split_kernel=Recorder("split", calls),
                     _weighted_decode_reduce_kernel=Recorder("reduce", calls))  # fmt: skip
    with mock.patch.multiple(weighted_decode, **recorders):
        weighted_decode.weighted_decode_attention(q, k, v, w, scaling=128**-0.5, causal_offset=8191, check=False)
    torch.cuda.current_device = lambda: 0  # one GPU (the probe runs without one)
    for name, kernel in kernels.items():
        time_kernel(name, kernel, *calls[name])


if __name__ == "__main__":
    main()
