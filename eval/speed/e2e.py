"""End to end on a random-weight model: prefill per press, decode tokens/s and memory, one layer's attention."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from eval.speed.clock import Clock, Notes, backend_kwargs, release, stats
from eval.speed.config import Config
from eval.speed.kernels import timed_row
from kvcompress import registry, weighted_attention
from kvcompress.cache import cache_bytes


def build_model(cfg: Config, device: torch.device, dtype: torch.dtype):
    """A random-weight causal LM from ``cfg.model`` (Qwen2Config kwargs), built directly on ``device``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(cfg.seed)
    config = Qwen2Config(**cfg.model)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


class Chunked(NamedTuple):
    """A setting whose context is prefilled in calls of ``chunk`` tokens, or a quarter of it if that is fewer
    (:func:`kvcompress.prefill_in_chunks` under ``press``; without one, the plain calls)."""

    press: Any
    chunk: int = 4096

    def size(self, tokens: int) -> int:
        return min(self.chunk, -(-tokens // 4))


def prefill(model, press, ids: torch.Tensor):
    """Prefill ``ids`` into a fresh DynamicCache (under ``press`` when given), like kvpress's pipeline; a
    :class:`Chunked` press in its chunks."""
    from transformers import DynamicCache

    from kvcompress import prefill_in_chunks

    if isinstance(press, Chunked):
        return prefill_in_chunks(model, press.press, ids, press.size(ids.shape[1]))
    cache = DynamicCache()
    if press is None:
        model.model(input_ids=ids, past_key_values=cache, use_cache=True)
    else:
        with press(model):
            model.model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache


def make_press(name: str, cfg: Config):
    """``none`` / ``full``: no press; ``snapkv`` and ``compresskv`` from :mod:`kvcompress.registry` with this
    run's settings."""
    if name in ("none", "full"):
        return None
    ratio = 1.0 - cfg.kept
    if name == "snapkv":
        return registry.make_press(name, ratio, window_size=cfg.snapkv_window, kernel_size=cfg.snapkv_kernel)
    if name == "compresskv":
        return registry.make_press(name, ratio, cfg.seed, bin_rank=cfg.bin_rank)
    raise ValueError(name)


def set_attention(model, name: str) -> None:
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)


def run_e2e(cfg: Config, device: torch.device, dtype: torch.dtype, clock: Clock, notes: Notes, flush) -> dict[str, Any]:
    """Prefill, decode and attention-only timings on a random-weight model."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    start = time.perf_counter()
    import kvpress  # noqa: F401  (imported before any timing; fails early when missing)

    import kvcompress.presses  # noqa: F401

    import_s = time.perf_counter() - start
    start = time.perf_counter()
    model = build_model(cfg, device, dtype)
    clock.sync()
    conf = model.config
    info = {
        "config": dict(cfg.model),
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights_gib": sum(p.nbytes for p in model.parameters()) / 2**30,
        "build_s": time.perf_counter() - start,
        "import_s": import_s,
        # what every peak below includes besides the run itself: weights and the kernel-timing flush buffer
        "allocated_after_build_gib": torch.cuda.memory_allocated(device) / 2**30 if clock.cuda else None,
    }
    vocab, heads_q = conf.vocab_size, conf.num_attention_heads
    head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // heads_q
    generator = torch.Generator(device="cpu").manual_seed(cfg.seed)

    def tokens(batch: int, n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (batch, n), generator=generator).to(device)

    # Prefill: no press, SnapKV, CompressKV.
    prefill_rows = []
    for n in cfg.prefill_lengths:
        ids = tokens(1, n)
        for name in ("none", "snapkv", "compresskv"):
            press = make_press(name, cfg)
            set_attention(model, "sdpa")  # CompressKVPress switches the model to "kvcompress" and leaves it so
            row: dict[str, Any] = {"n": n, "press": name, "kept": 1.0 if press is None else cfg.kept}
            release(device)
            clock.memory_reset()
            try:
                samples = clock.times(
                    lambda press=press, ids=ids: prefill(model, press, ids), cfg.e2e_warmup, cfg.e2e_repeats
                )
                row.update(stats(samples))
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"
                notes.add(f"prefill n={n} press={name} failed: {row['error']}")
            row["peak_gib"] = clock.memory_peak_gib()
            prefill_rows.append(row)
        release(device)
    for row in prefill_rows:
        base = next((r for r in prefill_rows if r["n"] == row["n"] and r["press"] == "none"), None)
        if base and "median_s" in base and "median_s" in row:
            row["vs_none"] = row["median_s"] / base["median_s"] - 1

    # Decode and attention-only, per cache variant.
    variants = []
    for impl in cfg.attn_implementations:
        if impl == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            notes.add("flash_attention_2 skipped: flash_attn does not import here")
            continue
        variants.append(("full", impl))
    variants += [("snapkv", "sdpa"), ("compresskv", "kvcompress")]
    decode_rows, attention_rows = [], []
    layer_idx = cfg.attention_layer
    batch = cfg.decode_batch
    ids = tokens(batch, cfg.decode_context)
    for press_name, impl in variants:
        press = make_press(press_name, cfg)
        label = f"{press_name}/{impl}"
        row = {"variant": label, "context": cfg.decode_context, "batch": batch}
        row["kept"] = 1.0 if press is None else cfg.kept
        try:
            if impl != "kvcompress":
                set_attention(model, impl)
            release(device)
            clock.memory_reset()
            cache = prefill(model, press, ids)
            row["peak_prefill_gib"] = clock.memory_peak_gib()
            row["cache_rows"] = cache.layers[layer_idx].keys.shape[-2]
            row["cache_gib"] = cache_bytes(cache) / 2**30
            attention_fn = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
            attention_rows += time_attention(cfg, model, cache, label, attention_fn, clock, notes, flush)
            release(device)
            clock.memory_reset()
            step_times = time_decode(cfg, model, cache, ids[:, -1:], clock)
            row["peak_decode_gib"] = clock.memory_peak_gib()
            row.update(stats(step_times))
            row["step_ms"] = row["median_s"] * 1e3
            row["tokens_per_s"] = batch / row["median_s"]
            del cache
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"
            notes.add(f"decode variant {label} failed: {row['error']}")
        decode_rows.append(row)
        release(device)
    set_attention(model, "sdpa")

    for key, name in (("model_speedup", "model"), ("kernel_speedup", "raw")):
        base = next((r for r in attention_rows if r["variant"] == "full/sdpa" and r["call"].startswith(name)), None)
        for r in attention_rows:
            if base and "median_s" in base and "median_s" in r and r["call"].startswith(name):
                r[key] = base["median_s"] / r["median_s"]
    info["head_dim"] = head_dim
    return {"model": info, "prefill": prefill_rows, "decode": decode_rows, "attention": attention_rows}


def time_decode(cfg: Config, model, cache, last: torch.Tensor, clock: Clock) -> list[float]:
    """Seconds per greedy decode step (one token per batch row), after ``decode_warmup`` steps."""
    token = last

    def step() -> None:
        nonlocal token
        out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)

    for _ in range(cfg.decode_warmup):
        step()
    clock.sync()
    marks = [clock.mark()]
    for _ in range(cfg.decode_tokens):
        step()
        marks.append(clock.mark())
    return clock.intervals(marks)


def time_attention(
    cfg: Config, model, cache, label: str, attention_fn: Callable, clock: Clock, notes: Notes, flush
) -> list[dict[str, Any]]:
    """One layer's attention call of a decode step on ``cache``: the model's function and the raw kernels."""
    from kvcompress.cache import layer_of

    module = model.model.layers[cfg.attention_layer].self_attn
    layer = cache.layers[cfg.attention_layer]
    keys, values = layer.keys, layer.values
    batch, _, rows, dim = keys.shape
    query = torch.randn(batch, model.config.num_attention_heads, 1, dim, device=keys.device, dtype=keys.dtype)
    scaling = module.scaling
    calls: list[tuple[str, Callable[[], Any]]] = [
        (
            f"model:{model.config._attn_implementation}",
            lambda: attention_fn(module, query, keys, values, None, dropout=0.0, scaling=scaling),
        )
    ]
    weighted = layer_of(keys)
    if weighted is None:
        calls.append(
            (
                "raw:sdpa",
                lambda: F.scaled_dot_product_attention(query, keys, values, scale=scaling, enable_gqa=True),
            )
        )
    else:
        row_weights = weighted.weights_for(rows)
        v_min, v_max = weighted.value_range(values)
        for backend in cfg.backends:
            kwargs, note = backend_kwargs(weighted_attention, backend, keys.device)
            notes.add(note)
            if kwargs is None:
                continue

            def call(kwargs: dict = kwargs) -> Any:
                return weighted_attention(
                    query,
                    keys,
                    values,
                    row_weights,
                    scaling=scaling,
                    v_min=v_min,
                    v_max=v_max,
                    causal_offset=rows - 1,
                    **kwargs,
                )

            calls.append((f"raw:weighted_attention[{backend}]", call))
    out = []
    for name, call in calls:
        row = {"variant": label, "call": name, "layer": cfg.attention_layer, "rows": rows, "batch": batch}
        out.append(timed_row(row, call, cfg, clock, flush, notes, f"attention {label} {name}"))
    return out

