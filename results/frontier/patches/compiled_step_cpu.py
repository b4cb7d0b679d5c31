"""The server's decode step on CPU, eager against compiled (docs/BENCHMARKS.md, "Compiled decode steps in the server"):
``python results/frontier/patches/compiled_step_cpu.py [--backend inductor] [--sessions 4] [--rounds 3]``.

The embedded SmolLM2-135M-Instruct (float32, 1 thread), ``--sessions`` contexts of 300-450 random tokens compressed
by the default press at 25% kept, one decode batch of them three ways: eager (what ``--compile-decode off`` runs),
static eager (the whole capacity attended, visibility on the device) and static under ``compiled_forward`` (after
``warm_up``, whose time is reported). Rounds of 20 steps alternate between the three on the same tokens; reported:
each one's median step and the paired ratios to eager, and the largest logit difference from eager.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvcompress.hf_attention import use_weighted_attention  # noqa: E402
from kvcompress.models import load_model  # noqa: E402
from kvcompress.registry import make_press  # noqa: E402
from kvcompress.serve.batch import build, session_rows  # noqa: E402
from kvcompress.serve.step import compiled_forward, decode_step, warm_up  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="inductor")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, _ = load_model(None, dtype=torch.float32, device="cpu")
    use_weighted_attention(model)
    press = make_press("compresskv", 0.75, 0)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        forward = compiled_forward(model, args.backend)
        start = time.perf_counter()
        warm_up(model, forward)
        print(f"warm-up ({args.backend}): {time.perf_counter() - start:.1f} s")
        sources, lengths = [], []
        for i in range(args.sessions):
            n = 300 + 50 * i
            cache = DynamicCache(config=model.config)
            with press(model):
                model.model(input_ids=torch.randint(0, 10000, (1, n), generator=gen), past_key_values=cache)
            sources.append(session_rows(cache))
            lengths.append(n)
        steps = 20 * args.rounds + 2
        capacity = max(s[0].keys.shape[-2] for s in sources) + steps + 1
        variants = {"eager": (build(None, [], sources, capacity), None),
                    "static eager": (build(None, [], sources, capacity, static=True), None),
                    f"compiled {args.backend}": (build(None, [], sources, capacity, static=True), forward)}
        times = {name: [] for name in variants}
        largest = {name: 0.0 for name in variants}
        for index in range(steps):
            tokens = torch.randint(0, 10000, (args.sessions,), generator=gen).tolist()
            positions = [n + index for n in lengths]
            logits = {}
            names = list(variants) if index % 2 == 0 else list(reversed(variants))
            for name in names:
                batch, fwd = variants[name]
                tic = time.perf_counter()
                logits[name] = decode_step(model, batch, tokens, positions, fwd)
                if index >= 2:  # two warm-up steps
                    times[name].append((time.perf_counter() - tic) * 1e3)
            for name in variants:
                largest[name] = max(largest[name], (logits[name] - logits["eager"]).abs().max().item())
    for name in variants:
        ratios = [a / b for a, b in zip(times[name], times["eager"], strict=True)]
        median = statistics.median(times[name])
        print(f"{name}: median step {median:.1f} ms, over eager {statistics.median(ratios):.3f} [{min(ratios):.3f}, "
              f"{max(ratios):.3f}] ({len(ratios)} steps), largest logit difference {largest[name]:.2e}")


if __name__ == "__main__":
    main()
