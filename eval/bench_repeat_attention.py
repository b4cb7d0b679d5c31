"""One repeat-pass chunk's attention at one layer, as it ran before and as it runs now: seconds and memory.

The repeat pass feeds the context again in chunks of ``--chunk`` tokens after the n cached ones; each chunk's
queries see every cached key and their own chunk causally. ``masked``: transformers' sdpa with the explicit mask
it builds for such a call (it then copies the keys and values once per query head); ``lower-right``: the
kvcompress attention inside ``new_tokens_see_all_cached()`` (``kvcompress.hf_attention``; on CUDA the flash
kernel with grouped-query heads where flash takes the call, the stock path otherwise; the row says which ran);
``split``: the same inside ``handing_over_context_rows()`` as the repeat pass runs it (on CUDA two flash calls,
over the context and over the chunk, merged by their log-sum-exps, the context one handed to the mass).
Default shape: Qwen2.5-7B-Instruct's attention (28 query heads, 4 KV heads, head dim 128), bf16, batch 1,
contexts 8k and 32k. Each row: median and min over ``--repeats`` calls after ``--warmup`` (device-synchronised
host clock), that median times ``--layers`` and the chunks of the context (the repeat pass's attention in one
prefill), the peak memory of one call above its inputs (CUDA: the allocator's; CPU: resident, Linux, a lower
bound), and the largest difference from the masked output. The mask's own construction (once per chunk) is not timed.

Run from the repository root: ``python -m eval.bench_repeat_attention [--device cuda] [--output results/...json]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from types import SimpleNamespace
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from eval.microbench import DTYPES, add_run_arguments, check_run_arguments, peak_mib, run_device, time_calls, write_json
from eval.speed.clock import release
from kvcompress import hf_attention
from kvcompress.hf_attention import kvcompress_attention, new_tokens_see_all_cached


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


def split(case: dict[str, Any]) -> torch.Tensor:
    with hf_attention.handing_over_context_rows():
        return lower_right(case)


def path_taken(case: dict[str, Any]) -> str:
    """Which attention the lower-right variant runs on this case."""
    c = case
    out = hf_attention._lower_right_causal_sdpa(c["module"], c["query"], c["key"], c["value"], c["scaling"], {})
    if out is None:
        return "stock (masked)"
    return "lower-right flash" if c["query"].is_cuda else "lower-right (mask materialised: CPU)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.bench_repeat_attention", description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768], help="cached tokens (default 8k 32k)")
    p.add_argument("--chunk", type=int, default=2048, help="repeat chunk tokens (the press's repeat_chunk)")
    add_run_arguments(p)
    args = p.parse_args(argv)
    check_run_arguments(p, args)
    if args.chunk < 2:
        p.error(f"--chunk: must be >= 2, got {args.chunk}")
    if min(args.contexts) < 1:
        p.error(f"--contexts: every value must be >= 1, got {args.contexts}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = run_device(args)
    rows = []
    print(
        f"{'context':>8} {'variant':>12} {'median ms':>10} {'min ms':>8} {'pass s':>8} {'peak MiB':>8} max diff  path"
    )
    for context in args.contexts:
        case = make_case(context, args.chunk, *args.heads, args.head_dim, DTYPES[args.dtype], device)
        reference = masked(case).float()
        chunks = -(-context // args.chunk)
        for name, fn in (("masked", masked), ("lower-right", lower_right), ("split", split)):
            call = functools.partial(fn, case)
            peak = peak_mib(call, device)
            seconds = time_calls(call, args.warmup, args.repeats, device)[0]
            median = statistics.median(seconds)
            path = "transformers sdpa, explicit mask" if name == "masked" else path_taken(case)
            if name == "split":
                path = "split at the context (flash x2)" if hf_attention._split_wanted(case["query"]) else path
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
        write_json(args.output, "eval.bench_repeat_attention", argv, rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
