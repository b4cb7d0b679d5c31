"""Greedy decode steps of the embedded model on CPU after a 2,048-token prefill, per press (25% kept): the median
step of 25 (after 5 untimed), three rounds of no press / SnapKV / the default, one thread; then one layer's
attention call over the default's rows against stock sdpa over the same rows (medians of 7 x 3,000 calls)
(docs/BENCHMARKS.md, "Decode steps on CPU"): ``python results/frontier/patches/cpu_decode_step.py``."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import pydoc_data.topics  # noqa: E402

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvcompress.models import load_model  # noqa: E402
from kvcompress.registry import make_press  # noqa: E402


@torch.no_grad()
def step_ms(model, ids: torch.Tensor, method: str | None) -> float:
    cache = DynamicCache()
    if method is None:
        model.model(input_ids=ids, past_key_values=cache)
    else:
        with make_press(method, 0.75)(model):
            model.model(input_ids=ids, past_key_values=cache)
    tokens, token, times = cache.get_seq_length(), torch.tensor([[42]]), []
    for step in range(30):
        start = time.perf_counter()
        out = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[tokens + step]]),
                    logits_to_keep=1)  # fmt: skip
        token = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) * 1e3


@torch.no_grad()
def layer_call_us(model, ids: torch.Tensor) -> dict[str, float]:
    """One decode call of layer 5's attention over the default's compressed rows: ours and stock sdpa."""
    from kvcompress import hf_attention

    cache = DynamicCache()
    with make_press("compresskv", 0.75)(model):
        model.model(input_ids=ids, past_key_values=cache)
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    dim = model.config.hidden_size // heads
    keys, values = cache.layers[5].update(torch.randn(1, kv_heads, 1, dim), torch.randn(1, kv_heads, 1, dim))
    module, query = model.model.layers[5].self_attn, torch.randn(1, heads, 1, dim)
    sdpa = hf_attention.ALL_ATTENTION_FUNCTIONS["sdpa"]
    calls = {
        "ours": lambda: hf_attention.kvcompress_attention(module, query, keys, values, None, scaling=module.scaling),
        "sdpa": lambda: sdpa(module, query, keys, values, None, 0.0, scaling=module.scaling),
    }
    result = {"rows": keys.shape[-2]}
    for name, call in calls.items():
        for _ in range(200):
            call()
        rounds = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(3000):
                call()
            rounds.append((time.perf_counter() - start) / 3000 * 1e6)
        result[f"{name} us"] = round(statistics.median(rounds), 1)
    return result


def main() -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    text = " ".join(list(pydoc_data.topics.topics.values())[:40])
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :2048]
    rounds: dict[str, list[float]] = {}
    for _ in range(3):
        for name, method in (("snapkv", "snapkv"), ("default", "compresskv"), ("none", None)):
            rounds.setdefault(name, []).append(step_ms(model, ids, method))
    median = {name: statistics.median(times) for name, times in rounds.items()}
    print({name: round(ms, 1) for name, ms in median.items()}, "default / snapkv",
          round(median["default"] / median["snapkv"], 3), "per round",
          [round(a / b, 3) for a, b in zip(rounds["default"], rounds["snapkv"], strict=True)])  # fmt: skip
    print("one layer's call:", layer_call_us(model, ids))


if __name__ == "__main__":
    main()
