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
time on CUDA, CPU time otherwise): where the time goes. ``--known-rows`` hands the fit its queries' log-sum-exp
and outputs, as the default's prefill call hands over its window queries' (its fit then runs one kernel, not two).
``--kernel-tiles`` times the fused path's two kernels of the
last case alone with the launchers' tiles and with ``ROWS_TILES`` / ``PRODUCTS_TILES`` (TFLOP/s and agreement). On
CPU the seconds are this machine's; ratios within one run are the figures to compare.

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


def known_rows(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's queries' causal log-sum-exp ``[1, h_q, m]`` and attention outputs ``[1, h_q, m, d]`` (float32, one
    query head at a time), what the default press's prefill call hands its fit for the window's queries."""
    keys, values, queries = case["keys"].float(), case["values"].float(), case["queries"].float()
    group = queries.shape[1] // keys.shape[1]
    hidden = torch.arange(keys.shape[2], device=keys.device) > case["query_positions"][:, None]
    lse, outputs = [], []
    for head in range(queries.shape[1]):
        logits = (queries[0, head] @ keys[0, head // group].T * case["scaling"]).masked_fill_(hidden, -torch.inf)
        lse.append(logits.logsumexp(-1))
        outputs.append(logits.sub_(lse[-1][:, None]).exp_() @ values[0, head // group])
    return torch.stack(lse)[None], torch.stack(outputs)[None]


def _call(case: dict[str, Any], backend: str = "auto"):
    return fit_kept_rows(
        case["keys"], case["values"], case["kept"], case["protected"], case["queries"], case["scaling"],
        query_positions=case["query_positions"], backend=backend, known_rows=case.get("known_rows"),
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


# Tiles a sweep times beside the launchers' own (first row): (BLOCK_M, BLOCK_N, warps, stages) of attention_rows,
# (BLOCK_M, warps, stages) of block_sums. Chosen from what compiles for sm_90 in bf16 at head dim 128 without
# spilling (``python -m eval.compile_kernels``), and a few that spill a little, to see what the spills cost.
ROWS_TILES = ((64, 32, 8, 3), (64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2))
PRODUCTS_TILES = ((64, 8, 3), (32, 8, 2), (64, 8, 2), (128, 8, 2), (32, 4, 3))


def capture_kernel_calls(case: dict[str, Any]) -> dict[str, tuple[tuple, dict]]:
    """The arguments of the fused kernels' launches in one fit of ``case`` (backend ``"triton"``)."""
    from kvcompress.kernels import fit_products

    calls: dict[str, tuple[tuple, dict]] = {}
    originals = {name: getattr(fit_products, name) for name in ("attention_rows", "block_sums")}

    def recorder(name: str):
        def record(*args, **kwargs):
            calls[name] = (args, kwargs)
            return originals[name](*args, **kwargs)

        return record

    try:
        for name in originals:
            setattr(fit_products, name, recorder(name))
        _call({**case, "known_rows": None}, "triton")  # every kernel, the first one included
    finally:
        for name, original in originals.items():
            setattr(fit_products, name, original)
    return calls


def kernel_tiles(case: dict[str, Any], device: torch.device, warmup: int, repeats: int) -> list[dict[str, Any]]:
    """Each fused fit kernel of ``case`` launched alone with the launcher's own tiles and with each of
    ``ROWS_TILES`` / ``PRODUCTS_TILES``: median ms, TFLOP/s of the work the rows see (the logits, the outputs or
    the products; causal rows see keys up to their position; the values' products of every block) and the largest
    difference from the launcher's own tiles' result (relative to its largest entry: the same sums in another
    order)."""
    from kvcompress.kernels import fit_products

    calls = capture_kernel_calls(case)
    rows_args, rows_kwargs = calls["attention_rows"]
    sums_args, sums_kwargs = calls["block_sums"]  # the fit's last launch of it (one up to about 50k tokens)

    def seen(queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor | None) -> int:
        """Query-key pairs a launch's rows see: each row the keys up to its position (shifted with the launch's keys;
        negative: none)."""
        n = keys.shape[1]
        return n * queries.shape[1] if positions is None else int((positions.clamp(-1, n - 1) + 1).sum())

    problems, dim, d_v = rows_args[1].shape[0], rows_args[1].shape[-1], rows_args[2].shape[-1]
    span, width = sums_args[10:12]
    sets = -(-sums_args[0].shape[1] // (sums_kwargs.get("set_rows") or sums_args[0].shape[1]))
    values_products = 2 * problems * sets * -(-sums_args[1].shape[1] // span) * span * width * d_v
    rows_pairs, sums_pairs = seen(*rows_args[:2], rows_args[4]), seen(*sums_args[:2], sums_args[4])
    kernels = [
        ("attention_rows", rows_args, rows_kwargs, 2 * problems * rows_pairs * (dim + d_v),
         [dict()] + [dict(block_m=m, block_n=b, num_warps=w, num_stages=st) for m, b, w, st in ROWS_TILES]),
        ("block_sums", sums_args, sums_kwargs, 2 * problems * sums_pairs * (dim + width) + values_products,
         [dict()] + [dict(block_m=m, num_warps=w, num_stages=st) for m, w, st in PRODUCTS_TILES]),
    ]  # fmt: skip
    rows = []
    for name, args, kwargs, flops, tiles in kernels:
        launch = getattr(fit_products, name)
        reference = None
        for tile in tiles:
            row: dict[str, Any] = dict(kernel=name, tiles=tile or "launcher's")
            try:
                call = functools.partial(launch, *args, **{**kwargs, **tile})
                seconds, result = time_calls(call, warmup, repeats, device)
            except Exception as exc:  # noqa: BLE001 - a tile that fails to compile or launch is a row, not the end
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                rows.append(row)
                continue
            out = result[1]  # the attention outputs (the log-sum-exp rides on them), the values' sums
            reference = out if reference is None else reference
            median = statistics.median(seconds)
            scale = reference.abs().amax().clamp_min(1e-30)
            row.update(median_ms=1e3 * median, tflops=flops / median / 1e12,
                       max_rel_diff=float(((out - reference).abs().amax() / scale).item()))  # fmt: skip
            rows.append(row)
    return rows


def print_kernel_tiles(rows: list[dict[str, Any]]) -> None:
    print(f"{'kernel':>14} {'median ms':>10} {'TFLOP/s':>8} {'max rel diff':>12} tiles")
    for row in rows:
        if "error" in row:
            print(f"{row['kernel']:>14} {'-':>10} {'-':>8} {'-':>12} {row['tiles']}  {row['error']}")
            continue
        print(
            f"{row['kernel']:>14} {row['median_ms']:>10.3f} {row['tflops']:>8.1f} {row['max_rel_diff']:>12.1e} "
            f"{row['tiles']}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.bench_fit", description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768], help="context tokens (default 8k 32k)")
    p.add_argument("--queries", type=int, nargs="+", default=[64, 320], help="reference queries per query head")
    p.add_argument("--kept", type=float, default=0.25, help="kept fraction of each context, in (0, 1] (default 0.25)")
    p.add_argument(
        "--backends", nargs="+", choices=BACKENDS, default=["auto"],
        help="fit paths, a row each: torch (probabilities held), triton (fused kernels), auto (default)",
    )  # fmt: skip
    p.add_argument(
        "--known-rows", action="store_true",
        help="give the fit its queries' log-sum-exp and outputs, as the default's prefill gives its window queries' "
        "(cases of at most 64 queries: the window's)",
    )  # fmt: skip
    p.add_argument("--profile", action="store_true", help="print the top operators of the last row's case")
    p.add_argument(
        "--kernel-tiles", action="store_true",
        help="time the fused kernels of the last case alone with other tiles (CUDA; on CPU under TRITON_INTERPRET=1)",
    )  # fmt: skip
    add_run_arguments(p)
    args = p.parse_args(argv)
    if not 0 < args.kept <= 1:
        p.error(f"--kept: must be in (0, 1], got {args.kept}")
    check_run_arguments(p, args)
    for name in ("contexts", "queries"):
        low = SINK + WINDOW + 16 if name == "contexts" else 2
        if min(getattr(args, name)) < low:
            p.error(f"--{name}: every value must be >= {low}, got {getattr(args, name)}")
    if args.known_rows and max(args.queries) > WINDOW:
        p.error(f"--known-rows: the prefill gives only the window's rows, --queries must be <= {WINDOW}")
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
        if args.known_rows:
            case["known_rows"] = known_rows(case)
        for backend in args.backends:  # the same case on every path
            call = functools.partial(_call, case, backend)
            peak = peak_mib(call, device)  # the case's first call: the least freed memory to reuse
            seconds, result = time_calls(call, args.warmup, args.repeats, device)
            accepted = float(result.accepted.float().mean())  # fraction of heads whose fit was accepted
            median = statistics.median(seconds)
            row = dict(
                backend=backend, context=context, queries=m, kept_rows=int(case["kept"].shape[-1]),
                median_ms=1e3 * median, min_ms=1e3 * min(seconds), model_s=median * args.layers, accepted=accepted,
                samples=len(seconds), peak_mib=peak, known_rows=args.known_rows,
            )  # fmt: skip
            rows.append(row)
            print(
                f"{backend:>7} {context:>8} {m:>7} {row['kept_rows']:>9} {row['median_ms']:>10.2f} "
                f"{row['min_ms']:>8.2f} {row['model_s']:>10.3f} {'-' if peak is None else f'{peak:.0f}':>8} "
                f"{accepted:.2f}"
            )
    if args.profile and case is not None:
        print(profile_case(case, device, args.backends[-1]))
    tiles = []
    if args.kernel_tiles and case is not None:
        tiles = kernel_tiles(case, device, args.warmup, args.repeats)
        print_kernel_tiles(tiles)
    if args.output:
        write_json(args.output, "eval.bench_fit", argv, rows + tiles, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
