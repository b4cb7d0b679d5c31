"""The fit of kept rows (``kvcompress.fitting.fit_kept_rows``) alone: seconds per layer, and where they go.

One call fits one layer of a compressed context: ``kept`` of a context's middle rows against ``m`` reference
queries per query head (the default press: the 64 window queries; ``balanced()`` and ``thorough()``: 64 + 256
repeat queries). Default shape: Qwen2.5-7B-Instruct's attention (28 query heads, 4 KV heads, head dim 128),
bf16, batch 1, contexts 8k and 32k at 25% kept, the default's 4 sink and 64 window rows protected. Keys carry a
per-head mean offset, as real keys do. Each row: median and min over ``--repeats`` calls after ``--warmup``,
device-synchronised host clock, and that median times ``--layers`` (the fit's share of one prefill); the peak
memory one call allocates above its inputs (CUDA: the allocator's peak; CPU: the process's peak resident memory,
reset before the call, on Linux).
``--backends torch triton`` times the fit's two paths on the same cases (the fused kernels run on CUDA, or on CPU
under ``TRITON_INTERPRET=1``, far slower there). ``--profile`` prints the top operators of one more call (device
time on CUDA, CPU time otherwise): where the time goes. On CPU the seconds are this machine's; ratios within one
run are the figures to compare.

Run from the repository root: ``python -m eval.bench_fit [--device cuda] [--profile] [--output results/...json]``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
from typing import Any

import torch

from eval.microbench import DTYPES, add_run_arguments, check_run_arguments, peak_mib, run_device, time_calls, write_json
from kvcompress._checks import BACKENDS
from kvcompress.fitting import fit_kept_rows

SINK, WINDOW = 4, 64  # the default press's protected rows


def make_case(
    context: int, kept: float, m: int, heads_q: int, heads_kv: int, dim: int, dtype, device, seed: int = 0
) -> dict[str, Any]:
    """Arguments of one ``fit_kept_rows`` call: a random context, a sorted random subset of its middle, and
    ``m`` queries per query head at the window's positions (the last ``m``, or the window plus positions spread
    over the rest when ``m`` exceeds it, as repeat-pass samples are)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    keys = randn(1, heads_kv, context, dim) + 2 * randn(1, heads_kv, 1, dim)
    middle = context - SINK - WINDOW
    rows = max(1, int(kept * context) - SINK - WINDOW)
    kept_rows = torch.stack([torch.randperm(middle, generator=gen)[:rows].sort().values for _ in range(heads_kv)])
    window = torch.arange(context - min(m, WINDOW), context)
    spread = torch.linspace(0, context - WINDOW - 1, max(0, m - WINDOW)).long()
    position = torch.arange(context)
    return dict(
        keys=keys.to(device, dtype),
        values=randn(1, heads_kv, context, dim).to(device, dtype),
        kept=(kept_rows[None] + SINK).to(device),
        protected=(position < SINK) | (position >= context - WINDOW),  # on the CPU, as the press passes it
        queries=(1.5 * randn(1, heads_q, m, dim)).to(device, dtype),
        scaling=dim**-0.5,
        query_positions=torch.cat([spread, window]).to(device),
    )


def _call(case: dict[str, Any], backend: str = "auto"):
    return fit_kept_rows(
        case["keys"], case["values"], case["kept"], case["protected"], case["queries"], case["scaling"],
        query_positions=case["query_positions"], backend=backend,
    )  # fmt: skip


def profile_case(case: dict[str, Any], device: torch.device, backend: str = "auto", rows: int = 15) -> str:
    """The top operators of one call by self device time (CUDA) or self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        _call(case, backend)
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=rows, max_shapes_column_width=80)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.bench_fit", description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768], help="context tokens (default 8k 32k)")
    p.add_argument("--queries", type=int, nargs="+", default=[64, 320], help="reference queries per query head")
    p.add_argument("--kept", type=float, default=0.25, help="kept fraction of each context, in (0, 1] (default 0.25)")
    p.add_argument(
        "--backends", nargs="+", choices=BACKENDS, default=["auto"],
        help="fit paths, a row each: torch (probabilities held), triton (fused kernels), auto (default)",
    )  # fmt: skip
    p.add_argument("--profile", action="store_true", help="print the top operators of the last row's case")
    add_run_arguments(p)
    args = p.parse_args(argv)
    if not 0 < args.kept <= 1:
        p.error(f"--kept: must be in (0, 1], got {args.kept}")
    check_run_arguments(p, args)
    for name in ("contexts", "queries"):
        low = SINK + WINDOW + 16 if name == "contexts" else 2
        if min(getattr(args, name)) < low:
            p.error(f"--{name}: every value must be >= {low}, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = run_device(args)
    rows, case = [], None
    print(
        f"{'backend':>7} {'context':>8} {'queries':>7} {'kept rows':>9} {'median ms':>10} {'min ms':>8} "
        f"{'x layers s':>10} {'peak MiB':>8} accepted"
    )
    for context, m in itertools.product(args.contexts, args.queries):
        case = make_case(context, args.kept, m, *args.heads, args.head_dim, DTYPES[args.dtype], device)
        for backend in args.backends:  # the same case on every path
            call = functools.partial(_call, case, backend)
            peak = peak_mib(call, device)  # the case's first call: the least freed memory to reuse
            seconds, result = time_calls(call, args.warmup, args.repeats, device)
            accepted = float(result.accepted.float().mean())  # fraction of heads whose fit was accepted
            median = statistics.median(seconds)
            row = dict(
                backend=backend, context=context, queries=m, kept_rows=int(case["kept"].shape[-1]),
                median_ms=1e3 * median, min_ms=1e3 * min(seconds), model_s=median * args.layers, accepted=accepted,
                samples=len(seconds), peak_mib=peak,
            )  # fmt: skip
            rows.append(row)
            print(
                f"{backend:>7} {context:>8} {m:>7} {row['kept_rows']:>9} {row['median_ms']:>10.2f} "
                f"{row['min_ms']:>8.2f} {row['model_s']:>10.3f} {'-' if peak is None else f'{peak:.0f}':>8} "
                f"{accepted:.2f}"
            )
    if args.profile and case is not None:
        print(profile_case(case, device, args.backends[-1]))
    if args.output:
        write_json(args.output, "eval.bench_fit", argv, rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
