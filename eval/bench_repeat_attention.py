"""One repeat-pass chunk's attention at one layer, as it ran before and as it runs now: seconds and memory.

The repeat pass feeds the context again in chunks of ``--chunk`` tokens after the n cached ones; each chunk's
queries see every cached key and their own chunk causally. ``masked``: transformers' sdpa with the explicit mask
it builds for such a call (it then copies the keys and values once per query head); ``lower-right``: the
kvcompress attention inside ``new_tokens_see_all_cached()`` (``kvcompress.hf_attention``; on CUDA the flash
kernel with grouped-query heads where flash takes the call, the stock path otherwise; the row says which ran).
Default shape: Qwen2.5-7B-Instruct's attention (28 query heads, 4 KV heads, head dim 128), bf16, batch 1,
contexts 8k and 32k. Each row: median and min over ``--repeats`` calls after ``--warmup`` (CUDA events on CUDA),
that median times ``--layers`` and the chunks of the context (the repeat pass's attention in one prefill), the
peak memory of one call above its inputs (CUDA: the allocator's; CPU: resident, Linux, a lower bound), and the
largest difference from the masked output. The mask's own construction (once per chunk) is not timed.

Run from the repository root: ``python -m eval.bench_repeat_attention [--device cuda] [--output results/...json]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
from types import SimpleNamespace
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from eval.speed.clock import Clock, release
from kvcompress import hf_attention
from kvcompress.hf_attention import kvcompress_attention, new_tokens_see_all_cached

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_case(context: int, chunk: int, heads_q: int, heads_kv: int, dim: int, dtype, device) -> dict[str, Any]:
    """A chunk's queries ``[1, heads_q, chunk, dim]``, the keys/values of the context and the chunk
    ``[1, heads_kv, context + chunk, dim]``, and the explicit mask transformers builds for it."""
    gen = torch.Generator().manual_seed(context + chunk)
    keys_len = context + chunk

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    mask = torch.ones(chunk, keys_len, dtype=torch.bool, device=device).tril(context)[None, None]
    module = SimpleNamespace(num_key_value_groups=heads_q // heads_kv, is_causal=True, sliding_window=None)
    query, key, value = (
        randn(1, heads_q, chunk, dim),
        randn(1, heads_kv, keys_len, dim),
        randn(1, heads_kv, keys_len, dim),
    )
    return dict(module=module, query=query, key=key, value=value, mask=mask, scaling=dim**-0.5)


def masked(case: dict[str, Any]) -> torch.Tensor:
    c = case
    return sdpa_attention_forward(c["module"], c["query"], c["key"], c["value"], c["mask"], scaling=c["scaling"])[0]


def lower_right(case: dict[str, Any]) -> torch.Tensor:
    c = case
    with new_tokens_see_all_cached():
        return kvcompress_attention(c["module"], c["query"], c["key"], c["value"], c["mask"], scaling=c["scaling"])[0]


def path_taken(case: dict[str, Any]) -> str:
    """Which attention the lower-right variant runs on this case."""
    c = case
    out = hf_attention._lower_right_causal_sdpa(c["module"], c["query"], c["key"], c["value"], c["scaling"], {})
    if out is None:
        return "stock (masked)"
    return "lower-right flash" if c["query"].is_cuda else "lower-right (mask materialised: CPU)"


def peak_mib(fn, clock: Clock) -> float | None:
    """Peak memory (MiB) of one call of ``fn`` above what was held before it."""
    clock.sync()
    release(clock.device)
    base = torch.cuda.memory_allocated(clock.device) / 2**30 if clock.cuda else None
    clock.memory_reset()
    if not clock.cuda:
        base = clock.memory_peak_gib()  # right after the reset: what the process holds now
    fn()
    peak = clock.memory_peak_gib()
    return None if peak is None or base is None else (peak - base) * 2**10


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.bench_repeat_attention", description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768], help="cached tokens (default 8k 32k)")
    p.add_argument("--chunk", type=int, default=2048, help="repeat chunk tokens (the press's repeat_chunk)")
    p.add_argument("--heads", type=int, nargs=2, default=[28, 4], metavar=("Q", "KV"), help="query and KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=28, help="layers of the model the per-call median is scaled to")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--output", default=None, help="JSON file for the rows and the environment")
    args = p.parse_args(argv)
    if args.heads[0] % args.heads[1]:
        p.error(f"--heads: query heads must be a multiple of KV heads, got {args.heads}")
    for name in ("chunk", "head_dim", "layers", "repeats"):
        if getattr(args, name) < (2 if name == "chunk" else 1):
            p.error(f"--{name.replace('_', '-')}: must be >= {2 if name == 'chunk' else 1}, got {getattr(args, name)}")
    if min(args.contexts) < 1:
        p.error(f"--contexts: every value must be >= 1, got {args.contexts}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock = Clock(device)
    rows = []
    print(
        f"{'context':>8} {'variant':>12} {'median ms':>10} {'min ms':>8} {'pass s':>8} {'peak MiB':>8} max diff  path"
    )
    for context in args.contexts:
        case = make_case(context, args.chunk, *args.heads, args.head_dim, DTYPES[args.dtype], device)
        reference = masked(case).float()
        chunks = -(-context // args.chunk)
        for name, fn in (("masked", masked), ("lower-right", lower_right)):
            call = functools.partial(fn, case)
            peak = peak_mib(call, clock)
            seconds = clock.times(call, args.warmup, args.repeats)
            median = statistics.median(seconds)
            path = "transformers sdpa, explicit mask" if name == "masked" else path_taken(case)
            row = dict(
                context=context, chunk=args.chunk, variant=name, path=path, median_ms=1e3 * median,
                min_ms=1e3 * min(seconds), pass_s=median * args.layers * chunks, peak_mib=peak, samples=len(seconds),
                max_abs_diff=float((call().float() - reference).abs().max()),
            )  # fmt: skip
            rows.append(row)
            print(
                f"{context:>8} {name:>12} {row['median_ms']:>10.2f} {row['min_ms']:>8.2f} {row['pass_s']:>8.3f} "
                f"{'-' if peak is None else f'{peak:.0f}':>8} {row['max_abs_diff']:.1e}  {path}"
            )
        release(device)
    if args.output:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        environment = dict(
            device=str(device), name=name, torch=torch.__version__, python=platform.python_version(),
            threads=torch.get_num_threads(),
        )  # fmt: skip
        command = " ".join(["python -m eval.bench_repeat_attention", *(sys.argv[1:] if argv is None else argv)])
        with open(args.output, "w") as f:
            json.dump(dict(rows=rows, settings=vars(args), environment=environment, command=command), f, indent=2)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
