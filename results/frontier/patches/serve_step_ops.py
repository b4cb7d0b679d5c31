"""Operators a serve decode step dispatches, and its time, on CPU (docs/BENCHMARKS.md, serving section, "No
host-device sync inside a decode step"): ``python results/frontier/patches/serve_step_ops.py``.

A 2-layer tiny Llama (tests/tiny_models.py, float32, kvcompress attention), 4 sessions compressed by
``CompressKVPress.paper()`` at 25% kept from 260-330-token contexts, in one decode batch of 400 rows: after 3
warm-up steps, the aten operators of one ``decode_step`` (counted by a dispatch mode) and the median over 5 rounds of
20 steps, one thread. Run it against another commit's ``kvcompress/serve/batch.py`` to compare.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kvcompress.hf_attention import use_weighted_attention  # noqa: E402
from kvcompress.registry import make_press  # noqa: E402
from kvcompress.serve.batch import build, session_rows  # noqa: E402
from kvcompress.serve.step import decode_step  # noqa: E402
from tests.test_serve_batch import _sessions  # noqa: E402
from tests.tiny_models import tiny_model  # noqa: E402


class CountOperators(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(1)
    press = make_press("compresskv_paper", 0.75, 0)  # kvpress imported before the attention is registered
    model = tiny_model("llama", dtype=torch.float32, seed=2)
    use_weighted_attention(model)
    specs = [(260, 4, True), (330, 4, True), (300, 4, True), (280, 4, True)]
    batch = build(None, [], [session_rows(cache) for _, _, cache in _sessions(model, press, specs, seed=5)], 400)
    tokens, positions = [5, 7, 9, 11], [264, 334, 304, 284]

    def step() -> None:
        nonlocal positions
        decode_step(model, batch, tokens, positions)
        positions = [p + 1 for p in positions]

    for _ in range(3):
        step()
    counter = CountOperators()
    with counter:
        step()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(20):
            step()
        rounds.append((time.perf_counter() - start) / 20 * 1e3)
    print(f"{len(batch.layers)} layers, batch {len(tokens)}: {counter.count} aten operators a step, "
          f"{statistics.median(rounds):.2f} ms a step (median of 5 x 20)")  # fmt: skip


if __name__ == "__main__":
    main()
