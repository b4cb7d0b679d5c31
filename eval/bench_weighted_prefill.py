"""Multi-token weighted attention over a compressed cache: Triton kernel vs PyTorch reference vs FlexAttention.

One ``kvcompress.weighted_attention`` call per (context length, new tokens, backend): ``m`` new tokens
(question prefill, speculative or batched decode) attend, causally among themselves, to a cache holding
``kept`` of a context plus the new tokens. Default shape: Qwen2.5-7B-Instruct's attention (28 query heads,
4 KV heads, head dim 128), bf16, batch 1, contexts 2k / 8k / 32k at 25% kept, m = 64 ... 512. The weights are
positive (fitted masses), so FlexAttention applies; the clip range is on.

Backends (``--backends``): ``triton`` (the split-K kernel through ``kvcompress.kernels.weighted_prefill``),
``torch`` (the reference, which builds the whole logits tensor), ``sdpa`` (the weight as one more value column of
torch's fused sdpa: what ``auto`` runs on CPU from ``kvcompress.attention.SDPA_MIN_QUERIES`` queries on; not in the
default list) and ``flex`` (torch FlexAttention with a ``log w`` score bias; compiled on CUDA, so its first calls
compile). ``--tiles RxN[xW] ...`` adds one Triton row per
tile (``triton RxNxW``: ``R`` rows and ``N`` keys a program, ``W`` warps, else the launcher's), the kernel's launcher
called with them, to A/B tile choices (register spills: ``python -m eval.compile_kernels``). Each row: median and
min over ``--repeats`` calls after ``--warmup`` calls, timed with CUDA events; a buffer larger than L2 is zeroed
before every timed call so K/V never come from cache. Also per row: the relative error against the
reference (``||out - ref|| / ||ref||``), the visible-pair FLOPs (QK^T and PV) per second and the floor
bytes (K, V, w read once, q and out) per second. ``--device cpu`` times with a host clock: at tiny sizes with
Triton's interpreter a smoke test, and ``--backends torch sdpa`` the two CPU paths against each other.

Run from the repository root: ``python -m eval.bench_weighted_prefill [--output results/...json]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvcompress import weighted_attention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FLUSH_BYTES = 256 * 2**20  # > L2 of an H100 (50 MiB) or H200


def make_case(
    batch: int, heads_q: int, heads_kv: int, dim: int, context: int, kept: float, m: int, dtype, device, seed: int = 0
) -> dict[str, Any]:
    """Random compressed cache of ``int(context * kept)`` rows plus ``m`` new tokens, and their queries."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = int(context * kept) + m

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    weights = 0.2 + 2 * torch.rand(batch, heads_kv, rows, generator=gen, device=device)
    weights[..., -m:] = 1.0  # the new tokens' own rows
    return dict(
        queries=randn(batch, heads_q, m, dim),
        keys=randn(batch, heads_kv, rows, dim),
        values=randn(batch, heads_kv, rows, dim),
        weights=weights,
        v_min=-2.5 - torch.rand(batch, heads_kv, dim, generator=gen, device=device),
        v_max=2.5 + torch.rand(batch, heads_kv, dim, generator=gen, device=device),
        causal_offset=rows - m,
    )


def work(case: dict[str, Any]) -> tuple[float, float]:
    """(FLOPs over the visible (query, key) pairs, floor bytes: K, V, w, clip range read once, q and out)."""
    batch, heads_q, m, dim = case["queries"].shape
    rows = case["keys"].shape[2]
    pairs = m * (rows - m) + m * (m + 1) / 2
    flops = 4.0 * batch * heads_q * pairs * dim
    tensors = ("queries", "keys", "values", "weights", "v_min", "v_max")
    moved = sum(case[name].numel() * case[name].element_size() for name in tensors)
    moved += case["queries"].numel() * case["queries"].element_size()  # out, same shape and dtype as q here
    return flops, moved


def time_call(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int, flush) -> list[float]:
    """Seconds per call: CUDA events around each call on CUDA (after zeroing ``flush``), a host clock elsewhere."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return samples
    torch.cuda.synchronize(device)
    events = []
    for _ in range(repeats):
        flush.zero_()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        events.append((begin, end))
    torch.cuda.synchronize(device)
    return [begin.elapsed_time(end) / 1e3 for begin, end in events]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _call(case: dict[str, Any], backend: str) -> Callable[[], torch.Tensor]:
    return lambda: weighted_attention(**case, backend=backend, check_finite=False)


def _tiled_call(case: dict[str, Any], backend: str) -> Callable[[], torch.Tensor]:
    """The Triton launcher ``weighted_attention`` would pick for ``case`` (decode up to ``MAX_NEW_TOKENS`` new
    tokens, multi-token above), called with the tile of ``backend`` (``"triton RxN"`` or ``"triton RxNxW"``)."""
    from kvcompress.kernels import weighted_decode, weighted_prefill

    block_r, block_n, *warps = (int(part) for part in backend.split()[1].split("x"))
    decode = case["queries"].shape[2] <= weighted_decode.MAX_NEW_TOKENS
    launcher = weighted_decode.weighted_decode_attention if decode else weighted_prefill.weighted_prefill_attention
    scaling = case["queries"].shape[-1] ** -0.5
    tile = dict(block_r=block_r, block_n=block_n, num_warps=warps[0] if warps else None)
    return lambda: launcher(**case, scaling=scaling, **tile)


def measure(case: dict[str, Any], args: argparse.Namespace, device: torch.device, flush) -> list[dict[str, Any]]:
    """One row per backend for one case (an error row where a backend fails, e.g. out of memory)."""
    flops, moved = work(case)
    ref = weighted_attention(**case, backend="torch", check_finite=False)
    rows = []
    for backend in [*args.backends, *(f"triton {tile}" for tile in args.tiles)]:
        call = _tiled_call(case, backend) if backend.startswith("triton ") else _call(case, backend)
        row: dict[str, Any] = dict(
            cache_rows=case["keys"].shape[2], new_tokens=case["queries"].shape[2], backend=backend
        )
        try:
            row["rel_error"] = relative_error(call(), ref)
            samples = time_call(call, device, args.warmup, args.repeats, flush)
        except (RuntimeError, ValueError) as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        else:
            median = statistics.median(samples)
            row.update(median_ms=median * 1e3, min_ms=min(samples) * 1e3, samples=len(samples))
            row.update(tflops=flops / median / 1e12, floor_gbps=moved / median / 1e9)
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    heads_q, heads_kv = args.heads
    rows = []
    for context in args.contexts:
        for m in args.new_tokens:
            case = make_case(args.batch, heads_q, heads_kv, args.head_dim, context, args.kept, m, dtype, device)
            rows += [{"context": context, **row} for row in measure(case, args, device, flush)]
    return dict(rows=rows, environment=environment(device), settings=vars(args))


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'context':>8} {'rows':>6} {'m':>4} {'backend':>7} {'median ms':>10} {'min ms':>9} "
          f"{'TFLOP/s':>8} {'floor GB/s':>10} {'rel err':>8}")  # fmt: skip
    for r in rows:
        head = f"{r['context']:>8} {r['cache_rows']:>6} {r['new_tokens']:>4} {r['backend']:>7}"
        if "error" in r:
            print(f"{head} {r['error']}")
            continue
        print(f"{head} {r['median_ms']:>10.3f} {r['min_ms']:>9.3f} {r['tflops']:>8.2f} {r['floor_gbps']:>10.1f} "
              f"{r['rel_error']:>8.1e}")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768], help="context tokens")
    p.add_argument("--kept", type=float, default=0.25, help="fraction of the context the cache holds (0, 1]")
    p.add_argument("--new-tokens", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--heads", type=int, nargs=2, default=[28, 4], metavar=("H_Q", "H_KV"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    backends = ("triton", "torch", "sdpa", "flex")
    p.add_argument("--backends", nargs="+", choices=backends, default=["triton", "torch", "flex"])
    p.add_argument("--tiles", nargs="+", default=[], metavar="RxN[xW]",
                   help="extra Triton rows with these tiles: rows and keys a program (powers of two >= 16), warps")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first (flex compiles here on CUDA)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--output", help="JSON path (default results/bench/weighted_prefill_<device>.json)")
    args = p.parse_args(argv)
    if not 0 < args.kept <= 1:
        p.error(f"--kept: must be in (0, 1], got {args.kept}")
    if args.heads[1] < 1 or args.heads[0] % args.heads[1]:
        p.error(f"--heads: H_Q must be a multiple of H_KV >= 1, got {args.heads}")
    for tile in args.tiles:
        sizes = [int(part) if part.isdigit() else 0 for part in tile.split("x")]
        powers = all(size > 0 and size & (size - 1) == 0 for size in sizes)
        if len(sizes) not in (2, 3) or not powers or min(sizes[:2]) < 16 or max(sizes[2:], default=1) > 16:
            p.error(f"--tiles: each must be RxN or RxNxW (R, N powers of two >= 16; W one <= 16), got {tile!r}")
    if min(args.contexts + args.new_tokens + [args.batch, args.head_dim, args.repeats]) < 1 or args.warmup < 0:
        p.error("--contexts, --new-tokens, --batch, --head-dim, --repeats: must be >= 1; --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda"):
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)  # a shape per row
    results = run(args)
    print_table(results["rows"])
    output = Path(args.output or f"results/bench/weighted_prefill_{torch.device(args.device).type}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
