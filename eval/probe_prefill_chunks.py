"""The server's worker when a long question (or a long new context) arrives while sessions decode
(docs/BENCHMARKS.md, "Question prefill in chunks", "Contexts read in chunks"): ``python -m eval.probe_prefill_chunks
[--layers 4] [--sessions 8] [--context 4096] [--question 8192] [--chunks 0 2048 512 128] [--arrives question|context]
[--output F]``.

A random-weight Qwen2.5-7B-shaped model (``eval.speed``'s config, ``--layers`` of its 28 layers, bf16 on CUDA)
behind the server's :class:`~kvcompress.serve.engine.Engine`: no press (the contexts stay whole: what is measured is
the worker's schedule, not the compression), a stub tokenizer (requests are token ids), eager decode steps. With
``--arrives context`` the arriving request's ``--question`` tokens are a new context and a 16-token question comes
after them, under the default press (``--press``: or ``thorough()``/``balanced()``, whose repeat pass runs layer by
layer in those rounds; 25% kept), which reads it in ``--prefill-chunk`` pieces and compresses its layers in the
rounds after the last (``compression_rounds``). Per
``--chunks`` entry (the server's ``--prefill-chunk``; 0: none, the question in one piece), ``--sessions`` requests
of ``--context`` tokens and a 16-token question decode greedily when one request with a ``--question``-token
question arrives. Reported per entry: the median decode step before it arrived, the longest gap between two decode
steps from its arrival until the step after its first token, the decode steps in that time, the chunks it was fed
in, and its time to first token (wall clock; CUDA synchronised after every step and chunk). ``--smoke``: a tiny
model on CPU, to check the script (not a measurement).
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from eval.microbench import print_and_write
from eval.speed.config import random_qwen


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.time() + seconds
    while not condition():
        if time.time() > deadline:
            raise TimeoutError(f"{what} within {seconds} s")
        time.sleep(0.002)


def one_chunk_size(model, args: argparse.Namespace, chunk: int) -> dict:
    """One engine with ``--prefill-chunk`` ``chunk`` (0: the whole question) under the load above."""
    from kvcompress.serve.engine import Engine
    from kvcompress.serve.jobs import Job
    from kvcompress.serve.metrics import ServerMetrics
    from kvcompress.serve.store import ContextStore

    device = model.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    from kvcompress.registry import make_press

    method = "compresskv" if args.press == "default" else f"compresskv_{args.press}"
    press = make_press(method, 0.75) if args.arrives == "context" else None
    engine = Engine(model, SimpleNamespace(eos_token_id=None, decode=lambda ids, skip_special_tokens=True: ""),
                    model_name="m", press=press, press_label=args.press, store=ContextStore(1 << 40),
                    metrics=ServerMetrics(), max_batch=args.sessions + 1, max_queue=args.sessions + 1,
                    compile_decode="off", prefill_chunk=chunk or args.question, memory=1 << 40)
    engine.eos_ids = set()  # random weights: the sessions decode until cancelled
    steps, chunks, first, compressed = [], [], [], [0]
    decode, feed = engine.decode, engine.feed

    def timed_decode(batch, tokens, positions):
        logits = decode(batch, tokens, positions)
        sync()
        steps.append(time.perf_counter())
        return logits

    def timed_feed(opening, tokens=None):
        session = feed(opening, tokens)
        sync()
        if opening.job.rid == "long":
            chunks.append(time.perf_counter())
            compressed[0] = opening.compress_rounds
            if session is not None:
                first.append(chunks[-1])
        return session

    engine.decode, engine.feed = timed_decode, timed_feed
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    rounds = -(-args.question // (chunk or args.question))
    decoding = [Job(ids(args.context), ids(16), max_tokens=2 * rounds + args.warmup + 64, temperature=0,
                    rid=f"s{i}") for i in range(args.sessions)]  # fmt: skip
    try:
        engine.submit(decoding)
        wait_for(lambda: len(engine.scheduler.active) == args.sessions, 600, "the sessions did not all decode")
        steady_from = len(steps)  # every session decoding, no context prefill between two steps any more
        wait_for(lambda: len(steps) >= steady_from + args.warmup, 600, "no warm-up steps")
        arrival, before = time.perf_counter(), len(steps)
        long = ([], ids(args.question)) if args.arrives == "question" else (ids(args.question), ids(16))
        engine.submit([Job(*long, max_tokens=1, temperature=0, rid="long")])
        wait_for(lambda: first and steps[-1] > first[0], 600, "no first token and step after it")
    finally:
        for job in decoding:
            job.cancelled.set()
        engine.shutdown()
    window = [steps[before - 1]] + [t for t in steps[before:] if t <= first[0]]
    window.append(next(t for t in steps[before:] if t > first[0]))
    gaps = [b - a for a, b in zip(window, window[1:], strict=False)]
    steady = [b - a for a, b in zip(steps[steady_from:before - 1], steps[steady_from + 1:before], strict=False)]
    return {
        "prefill_chunk": chunk,
        "median_step_ms_before": statistics.median(steady) * 1e3,
        "longest_gap_ms": max(gaps) * 1e3,
        "steps_until_first_token": len(window) - 2,
        "chunks_fed": len(chunks),  # the engine's feed calls: context chunks, compression rounds, question chunks
        "compression_rounds": compressed[0],
        "ttft_ms": (first[0] - arrival) * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.probe_prefill_chunks", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the 28 (default 4)")
    p.add_argument("--sessions", type=int, default=8, help="sessions decoding when the question arrives")
    p.add_argument("--context", type=int, default=4096, help="context tokens of each decoding session")
    p.add_argument("--question", type=int, default=8192, help="tokens of the question that arrives")
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 2048, 512, 128],
                   help="--prefill-chunk values (0: the question in one piece)")
    p.add_argument("--warmup", type=int, default=8, help="decode steps before the question arrives")
    p.add_argument("--arrives", choices=("question", "context"), default="question",
                   help="what the --question tokens are: a question (no press), or a new context read under the "
                        "default press, with a 16-token question after it")
    p.add_argument("--press", choices=("default", "thorough", "balanced"), default="default",
                   help="with --arrives context: the press it is read under (default: CompressKVPress())")
    p.add_argument("--output", help="JSON file for the numbers")
    p.add_argument("--smoke", action="store_true", help="a tiny model on CPU: checks the script, measures nothing")
    args = p.parse_args(argv)
    if min(args.layers, args.sessions, args.context, args.question) < 1 or min(args.chunks) < 0 or args.warmup < 2:
        p.error("--layers, --sessions, --context and --question must be >= 1, --chunks >= 0, --warmup >= 2")
    from kvcompress.hf_attention import use_weighted_attention

    model = random_qwen(args.layers, args.smoke)
    use_weighted_attention(model)
    result = {
        "device": torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu (smoke: not a measurement)",
        "layers": args.layers, "sessions": args.sessions, "context": args.context, "question": args.question,
        "arrives": args.arrives, "press": args.press if args.arrives == "context" else None,
        "runs": [one_chunk_size(model, args, chunk) for chunk in args.chunks],
    }
    print_and_write(result, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
