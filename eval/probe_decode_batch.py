"""The server's decode step with each batch row bounded by its own causal offset, against the shared key mask it ran
with before, and compiled (``--compile-decode``) (docs/BENCHMARKS.md, serving, "Each batch row reads its own rows
only", "Compiled decode steps"): ``python -m eval.probe_decode_batch [--rows 16384 2048 ...] [--layers 4] [--steps 16]
[--compile cudagraphs inductor] [--output F]``.

A random-weight Qwen2.5-7B-shaped model (``eval.speed``'s config, ``--layers`` of its 28 layers, bf16 on CUDA) and
two identical decode batches (``kvcompress.serve.batch.build``) of synthetic sessions, one per ``--rows`` entry
(random keys and values, weight 1, no clip range). One batch's layers give the attention each row's causal offset
(what CUDA runs since the twenty-fifth session), the other's the step's shared mask (what it ran before; the
rows past each session's length are then read and masked). Both take the same tokens, in alternating rounds of
``--steps`` decode steps after ``--warmup``; each step is timed with CUDA events (wall time on CPU). Reported: the
median step of each, their ratio, and the largest logit difference between them (the same sums but for rounding).
Each ``--compile`` backend adds a third kind of batch: static (the whole capacity attended, visibility on the
device) and stepped by ``kvcompress.serve.step.compiled_forward`` (on CUDA ``inductor`` runs CUDA graphs): its
median step, its largest logit difference from the per-row batch and its first step's seconds (its compile:
the first ``--warmup`` steps are not timed otherwise).
``--smoke``: a tiny model on CPU, to check the script (not a measurement; ``--compile eager`` there).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from eval.microbench import print_and_write
from eval.speed.clock import Clock
from eval.speed.config import random_qwen
from kvcompress.hf_attention import use_weighted_attention
from kvcompress.serve.batch import RowSource, build
from kvcompress.serve.step import COMPILE_BACKENDS, compiled_forward, decode_step


def synthetic_sessions(model, rows: list[int], dtype: torch.dtype, device: torch.device) -> list[list[RowSource]]:
    """One session per entry of ``rows``: per layer, random keys and values of that many rows, weight 1."""
    config = model.config
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    gen = torch.Generator(device=device).manual_seed(0)
    sessions = []
    for n in rows:
        layers = []
        for _ in range(config.num_hidden_layers):
            keys = torch.randn(1, heads, n, dim, generator=gen, device=device, dtype=dtype)
            values = torch.randn(1, heads, n, dim, generator=gen, device=device, dtype=dtype)
            bound = torch.full((1, heads, dim), math.inf, device=device)
            layers.append(RowSource(keys, values, torch.ones(1, heads, n, device=device), -bound, bound))
        sessions.append(layers)
    return sessions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.probe_decode_batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16384] + [2048] * 7, help="rows held per session")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the 28 (default 4)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per variant and round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of --steps steps each")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", nargs="*", choices=COMPILE_BACKENDS[1:], default=None,
                   help="compiled variants (default: cudagraphs and inductor on CUDA, eager on CPU; none: omit)")
    p.add_argument("--output", help="JSON file for the numbers")
    p.add_argument("--smoke", action="store_true", help="a tiny model on CPU: checks the script, measures nothing")
    args = p.parse_args(argv)
    if min(args.rows) < 1 or min(args.layers, args.steps, args.rounds) < 1 or args.warmup < 0:
        p.error("--rows, --layers, --steps and --rounds must be >= 1, --warmup >= 0")
    model = random_qwen(args.layers, args.smoke)
    device, dtype = model.device, model.dtype
    cuda = device.type == "cuda"
    use_weighted_attention(model)
    sessions = synthetic_sessions(model, args.rows, dtype, device)
    steps = args.warmup + args.rounds * args.steps
    capacity = max(args.rows) + steps + 1
    backends = args.compile if args.compile is not None else (["cudagraphs", "inductor"] if cuda else ["eager"])
    # per-row offsets as on CUDA (also on the smoke run's CPU), the shared mask as before the twenty-fifth session
    batches = {name: build(None, [], sessions, capacity, per_row_offsets=name == "per-row offsets")
               for name in ("per-row offsets", "shared mask")}
    forwards = {f"compiled {b}": compiled_forward(model, b) for b in backends}
    batches.update({name: build(None, [], sessions, capacity, static=True) for name in forwards})
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {name: [] for name in batches}
    largest = {name: 0.0 for name in batches}  # against the per-row batch
    first_ms: dict[str, float] = {}

    clock = Clock(device)  # CUDA events on CUDA, the wall clock elsewhere

    def step(name: str, tokens: list[int], positions: list[int]) -> torch.Tensor:
        start = clock.mark()
        logits = decode_step(model, batches[name], tokens, positions, forwards.get(name))
        times[name].append(clock.intervals([start, clock.mark()])[0] * 1e3)
        return logits

    with torch.no_grad():
        for index in range(steps):
            tokens = torch.randint(0, model.config.vocab_size, (len(args.rows),), generator=gen).tolist()
            positions = [n + 100 + index for n in args.rows]
            order = list(batches) if (index // args.steps) % 2 == 0 else list(reversed(batches))
            logits = {name: step(name, tokens, positions) for name in order}
            for name in batches:
                difference = (logits[name].float() - logits["per-row offsets"].float()).abs().max().item()
                largest[name] = max(largest[name], difference)
            if index < args.warmup:
                for name in batches:
                    first_ms.setdefault(name, times[name][-1])  # a compiled variant's compile is in its first step
                    times[name].pop()
    medians = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke: not a measurement)",
        "rows": args.rows,
        "layers": args.layers,
        "steps_timed": len(times["shared mask"]),
        "median_step_ms": medians,
        "per_row_over_shared": medians["per-row offsets"] / medians["shared mask"],
        "over_per_row": {name: value / medians["per-row offsets"] for name, value in medians.items()},
        "largest_logit_difference": largest["shared mask"],
        "largest_logit_difference_from_per_row": largest,
        "first_step_s": {name: value / 1e3 for name, value in first_ms.items()},  # with --warmup >= 1
    }
    print_and_write(result, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
