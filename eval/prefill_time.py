"""Prefill a real context under one press, ``--repeats`` times: a whole process to time from outside.

``python -m eval.prefill_time --press compresskv --kept 0.25`` against ``--press exact`` gives the CPU
prefill-time ratio of a press (load the model, tokenize, prefill; compare medians and A/B ratios with an
external process timer). ``--press none`` stops after loading, to subtract the fixed cost. Presses are
``kvcompress.fidelity`` specs (``NAME`` or ``NAME[field=value,...]``); the context is the fidelity study's
first prose context of ``--tokens`` tokens. ``--also`` runs more presses in turn in the same process and each
line reports wall and CPU seconds (CPU time is the steadier figure on a shared machine) and, on Linux, the
process's peak resident memory during the prefill, whole and above what was resident before it (the model's
weights, the tokenizer, the interpreter); the compressed cache is still held at the peak's reading. One untimed
prefill without a press runs first, so that no setting's peak holds the process's first-use allocations (a first
prefill of 2k tokens read about 0.4 GiB more than the next ones: the first setting of a run was charged for them).

``--question-tokens Q`` then feeds the source's next ``Q`` tokens over each cache in one forward (a long question or
chat turn after the context: what the compressed cache's weighted attention runs with many queries at once) and
reports its wall and CPU seconds and its own peak above what was resident before it. ``--weighted-reference`` runs
every weighted attention call through the PyTorch reference (the CPU path before sdpa's fused kernel took calls of
``kvcompress.attention.SDPA_MIN_QUERIES`` queries or more), to time the two paths against each other.
"""

from __future__ import annotations

import argparse
import time

import kvpress  # noqa: F401  (registers the kv-press-text-generation pipeline)
import torch
from transformers import pipeline

import kvcompress.attention
from eval.speed.clock import Clock
from kvcompress._checks import int_flag, number_flag
from kvcompress.fidelity.contexts import build_contexts
from kvcompress.fidelity.measure import prefill
from kvcompress.fidelity.specs import make_press, parse_spec
from kvcompress.models import load_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--press", default="exact", help="a press spec of kvcompress.fidelity, 'exact', or 'none'")
    parser.add_argument("--kept", type=number_flag(0, 1, low_open=True), default=0.25,
                        help="kept fraction of the context, in (0, 1] (default 0.25)")  # fmt: skip
    parser.add_argument("--tokens", type=int_flag(64), default=2000, help="context tokens, prose, >= 64 (default 2000)")
    parser.add_argument("--repeats", type=int_flag(1), default=3, help="prefills in one process (default 3)")
    parser.add_argument(
        "--also", nargs="+", default=[], help="more press specs, run in turn after --press in the same process"
    )
    parser.add_argument("--threads", type=int_flag(1), help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--question-tokens", type=int_flag(1), help="after each prefill, one forward of the next Q tokens (>= 1)"
    )
    parser.add_argument(
        "--weighted-reference", action="store_true", help="weighted attention through the PyTorch reference only"
    )
    args = parser.parse_args(argv)
    if args.weighted_reference:
        kvcompress.attention.SDPA_MIN_QUERIES = 2**62  # every call below it: the reference
    spec = None if args.press == "none" else parse_spec(args.press)
    others = [parse_spec(name) for name in args.also]
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    context = build_contexts(pipe, ["prose"], [args.tokens], seeds=1, continuation=args.question_tokens or 1)[0]
    if spec is None:
        return
    clock = Clock(torch.device("cpu"))
    prefill(model, None, context.ids)  # the process's first-use allocations, before any setting's reading
    for i in range(args.repeats):  # the presses in turn, so that a drift of the machine's speed hits them alike
        for press_spec in [spec, *others]:
            press = make_press(press_spec, args.kept, seed=i)
            clock.memory_reset()
            before = clock.memory_peak_gib()
            cpu = time.process_time()
            cache, seconds = prefill(model, press, context.ids)[:2]
            cpu = time.process_time() - cpu
            peak = clock.memory_peak_gib()
            memory = "" if peak is None else f", peak resident {peak:.3f} GiB (+{peak - before:.3f} GiB)"
            question = "" if args.question_tokens is None else _time_question(model, cache, context, clock)
            del cache
            print(
                f"{press_spec.label} kept={args.kept} tokens={context.ids.shape[1]} round {i}: "
                f"prefill {seconds:.3f} s wall, {cpu:.3f} s CPU{memory}{question}",
                flush=True,
            )


@torch.no_grad()
def _time_question(model, cache, context, clock: Clock) -> str:
    """One forward of the context's continuation over ``cache`` (which it extends): its report clause."""
    tokens = context.continuation.to(model.device)
    clock.memory_reset()
    before = clock.memory_peak_gib()
    cpu, start = time.process_time(), time.perf_counter()
    model(input_ids=tokens, past_key_values=cache, logits_to_keep=1)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = clock.memory_peak_gib()
    memory = "" if peak is None else f", peak +{peak - before:.3f} GiB"
    return f"; question of {tokens.shape[1]} tokens {seconds:.3f} s wall, {cpu:.3f} s CPU{memory}"


if __name__ == "__main__":
    main()
