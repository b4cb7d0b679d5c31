"""Speed of CompressKV: copy bandwidth, kernel rooflines, and end-to-end prefill/decode on a random-weight model.

Sections (``--only`` picks a subset; every timing is a median over repeats after warm-ups):

* ``bandwidth``: a large device-to-device copy; bytes moved (read + write) / time. This is the
  denominator of every roofline fraction below.
* ``kernels``: achieved bytes/s over the copy bandwidth for ``compress_kv`` (bins = rank / 12 at
  the kept fraction; bytes = K and V read once + K_S, V_S, w written) and for ``weighted_attention``
  decode (one query per head, GQA; bytes = K, V, w read once + q and out), per ``backend``. A stock
  ``scaled_dot_product_attention`` on the same K, V is timed beside it for reference.
* ``e2e``: a random-weight model built from a config (default: Qwen2.5-7B-Instruct's shape; no
  weights are downloaded). Prefill time with no press, kvpress SnapKVPress and CompressKVPress; decode
  tokens/s and peak memory for the full cache (sdpa, flash_attention_2 when flash_attn imports) and
  the compressed caches; and the attention part of a decode step alone: one layer's attention call on
  each cache (the model's attention function, and the raw kernels).

On CUDA the timings use CUDA events; kernel timings zero an L2-sized buffer before each sample so that
no cache stays warm between calls. On CPU (``--device cpu --smoke``) the same code paths run at tiny
sizes with ``time.perf_counter``: a smoke test, not a performance measurement.

Run from the repository root: ``python -m eval.speed`` (defaults in ``configs/speed.yaml``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from eval.config import load_yaml
from kvcompress import compress_kv, registry, weighted_attention
from kvcompress._checks import BACKENDS

DEFAULT_CONFIG = Path("configs/speed.yaml")
SECTIONS = ("bandwidth", "kernels", "e2e")
DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}

# Qwen2.5-7B-Instruct's shape (random weights; nothing is downloaded).
QWEN25_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
SMOKE_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# --smoke: tiny sizes for every code path (applied over the YAML, under explicit flags).
SMOKE = {
    "threads": 1,  # a shared 2-core machine: one thread avoids OpenMP spin contention (10-100x slower steps)
    "warmup": 1,
    "repeats": 3,
    "flush_mib": 4,
    "bandwidth_mib": 16,
    "compress_n": 512,
    "compress_heads": [2],
    "decode_lengths": [256, 512],
    "decode_batches": [1, 2],
    "decode_heads": [[2, 2], [1, 3]],
    "model": SMOKE_MODEL,
    "prefill_lengths": [384, 512],
    "e2e_warmup": 1,
    "e2e_repeats": 2,
    "decode_context": 512,
    "decode_tokens": 4,
    "decode_warmup": 1,
}
GOALS = {
    "prefill_overhead_max": 0.02,  # CompressKV prefill / no-press prefill - 1, longest prefill length
    "decode_roofline_min": 0.70,  # weighted decode bytes/s over copy bandwidth, compressed lengths >= 4k
    "decode_roofline_from": 4096,
    "attention_speedup_min": 3.0,  # full-cache attention time / compressed-cache attention time
}


@dataclass
class Config:
    only: list[str] = field(default_factory=lambda: list(SECTIONS))
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str = "bfloat16"
    output: str | None = None  # None: results/speed/speed.json (speed_smoke.json with --smoke)
    smoke: bool = False
    seed: int = 0
    threads: int | None = None  # torch CPU threads for this run (None: leave as is); --smoke uses 1
    warmup: int = 3
    repeats: int = 20
    flush_mib: int = 256  # zeroed before each kernel sample (> L2 of H100/H200); 0 = no flush
    bandwidth_mib: int = 2048
    backends: list[str] = field(default_factory=lambda: ["triton", "torch"])
    kept: float = 0.25  # kept fraction of the cache (kvpress compression_ratio = 1 - kept)
    bin_rank: int = 12  # pivots per bin
    compress_n: int = 32768
    compress_d: int = 128
    compress_heads: list[int] = field(default_factory=lambda: [4, 8])
    compress_batch: int = 1
    decode_d: int = 128
    decode_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768])
    decode_batches: list[int] = field(default_factory=lambda: [1, 4, 16])
    decode_heads: list[list[int]] = field(default_factory=lambda: [[8, 4], [4, 7]])  # [kv_heads, group]
    sdpa_reference: bool = True
    model: dict[str, Any] = field(default_factory=lambda: dict(QWEN25_7B))
    prefill_lengths: list[int] = field(default_factory=lambda: [8192, 32768])
    e2e_warmup: int = 1
    e2e_repeats: int = 3
    decode_context: int = 32768
    decode_batch: int = 1
    decode_tokens: int = 64
    decode_warmup: int = 8
    attention_layer: int = 0
    attn_implementations: list[str] = field(default_factory=lambda: ["sdpa", "flash_attention_2"])
    snapkv_window: int = 64
    snapkv_kernel: int = 5


# ----------------------------------------------------------------------------------------------- timing


class Clock:
    """CUDA events on CUDA devices, ``time.perf_counter`` elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self) -> Any:
        """A point in time on the device's stream (an event on CUDA, a float on CPU)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def intervals(self, marks: list[Any]) -> list[float]:
        """Seconds between consecutive marks (synchronises first)."""
        self.sync()
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:], strict=False)]
        return [b - a for a, b in zip(marks, marks[1:], strict=False)]

    def times(self, fn: Callable[[], Any], warmup: int, repeats: int, flush: torch.Tensor | None = None) -> list[float]:
        """Seconds per call of ``fn`` for ``repeats`` calls after ``warmup`` calls."""
        for _ in range(warmup):
            fn()
        self.sync()
        spans = []
        for _ in range(repeats):
            if flush is not None:
                flush.zero_()  # queued ahead of the timed call: the launch overhead hides behind it
            start = self.mark()
            fn()
            spans.append((start, self.mark()))
        self.sync()
        return [self.intervals([a, b])[0] for a, b in spans]

    def memory_reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def memory_peak_gib(self) -> float | None:
        """Peak allocated device memory since the last reset (None on CPU)."""
        if not self.cuda:
            return None
        self.sync()
        return torch.cuda.max_memory_allocated(self.device) / 2**30


def stats(samples: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "samples": len(samples)}


def release(device: torch.device) -> None:
    """Free what the last measurement left (CUDA only: a full gc pass costs ~0.4 s with transformers loaded)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------- backends


def has_backend_keyword(fn: Callable) -> bool:
    try:
        return "backend" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def backend_kwargs(fn: Callable, backend: str, device: torch.device) -> tuple[dict | None, str | None]:
    """``(kwargs, note)`` to run ``fn`` on ``backend``; kwargs None means the backend cannot be measured."""
    name = fn.__name__
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None, (
            f"{name}: backend 'triton' skipped on {device.type} (the Triton kernels take CUDA tensors; "
            "TRITON_INTERPRET=1 runs them in the interpreter, as a code-path check only)"
        )
    if has_backend_keyword(fn):
        return {"backend": backend}, None
    if backend == "triton":
        return None, f"{name}: no backend keyword in this kvcompress yet; no Triton path to measure"
    return {}, f"{name}: no backend keyword in this kvcompress yet; '{backend}' rows ran its default (PyTorch)"


class Notes(list):
    """Printed once each, kept in the JSON."""

    def add(self, note: str | None) -> None:
        if note and note not in self:
            self.append(note)
            print(f"note: {note}")


# ----------------------------------------------------------------------------------------------- sections


def run_bandwidth(cfg: Config, device: torch.device, clock: Clock) -> dict[str, Any]:
    """Device-to-device copy of a ``bandwidth_mib`` buffer: (read + write bytes) / time."""
    numel = cfg.bandwidth_mib * 2**20 // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    samples = clock.times(lambda: dst.copy_(src), cfg.warmup, cfg.repeats)
    moved = 2 * src.nbytes
    result = {"buffer_bytes": src.nbytes, "bytes_moved": moved, **stats(samples)}
    result["gbps"] = moved / result["median_s"] / 1e9
    result["best_gbps"] = moved / result["min_s"] / 1e9
    return result


def coreset_size(n: int, kept: float, bin_rank: int) -> tuple[int, int]:
    """``(rank, bins)``: ``int(n * kept)`` rows rounded down to whole bins of ``bin_rank`` pivots."""
    bins = max(1, int(n * kept) // bin_rank)
    return bins * bin_rank, bins


def run_compress_kernels(
    cfg: Config, device: torch.device, dtype: torch.dtype, clock: Clock, bandwidth: float, notes: Notes, flush
) -> list[dict[str, Any]]:
    """``compress_kv`` on ``[batch, heads, n, d]`` keys/values, per backend."""
    rows = []
    for heads in cfg.compress_heads:
        rows += _compress_case(cfg, heads, device, dtype, clock, bandwidth, notes, flush)
        release(device)
    return rows


def _compress_case(
    cfg: Config, heads: int, device: torch.device, dtype: torch.dtype, clock: Clock, bandwidth: float, notes, flush
) -> list[dict[str, Any]]:
    n, d, batch = cfg.compress_n, cfg.compress_d, cfg.compress_batch
    rank, bins = coreset_size(n, cfg.kept, cfg.bin_rank)
    elt = torch.empty((), dtype=dtype).element_size()
    keys = torch.randn(batch, heads, n, d, device=device, dtype=dtype)
    values = torch.randn(batch, heads, n, d, device=device, dtype=dtype)
    moved = 2 * batch * heads * n * d * elt + batch * heads * rank * (2 * d * elt + 4)
    rows = []
    for backend in cfg.backends:
        kwargs, note = backend_kwargs(compress_kv, backend, device)
        notes.add(note)
        if kwargs is None:
            continue
        row = {"heads": heads, "batch": batch, "n": n, "d": d, "rank": rank, "bins": bins, "backend": backend}
        row["backend_keyword"] = "backend" in kwargs
        row["bytes"] = moved

        def call(kwargs: dict = kwargs) -> Any:
            return compress_kv(keys, values, rank, bins=bins, scaling=d**-0.5, seed=cfg.seed, **kwargs)

        rows.append(timed_row(row, call, cfg, clock, flush, notes, f"compress_kv heads={heads} backend={backend}"))
        if "median_s" in row:
            row["gbps"] = moved / row["median_s"] / 1e9
            row["roofline"] = row["gbps"] / bandwidth
    return rows


def timed_row(
    row: dict[str, Any], call: Callable[[], Any], cfg: Config, clock: Clock, flush, notes: Notes, what: str
) -> dict[str, Any]:
    """``row`` with the kernel timing of ``call`` (or the error, noted: one failure must not end the run)."""
    try:
        row.update(stats(clock.times(call, cfg.warmup, cfg.repeats, flush)))
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {err}"
        notes.add(f"{what} failed: {row['error']}")
    return row


def run_decode_kernels(
    cfg: Config, device: torch.device, dtype: torch.dtype, clock: Clock, bandwidth: float, notes: Notes, flush
) -> list[dict[str, Any]]:
    """``weighted_attention`` with one query per head over n compressed rows, per backend (+ sdpa)."""
    rows = []
    for heads_kv, group in cfg.decode_heads:
        for batch in cfg.decode_batches:
            for n in cfg.decode_lengths:
                rows += _decode_case(cfg, heads_kv, group, batch, n, device, dtype, clock, bandwidth, notes, flush)
        release(device)
    return rows


def _decode_case(
    cfg: Config,
    heads_kv: int,
    group: int,
    batch: int,
    n: int,
    device: torch.device,
    dtype: torch.dtype,
    clock: Clock,
    bandwidth: float,
    notes: Notes,
    flush,
) -> list[dict[str, Any]]:
    d, heads_q = cfg.decode_d, heads_kv * group
    q = torch.randn(batch, heads_q, 1, d, device=device, dtype=dtype)
    k = torch.randn(batch, heads_kv, n, d, device=device, dtype=dtype)
    v = torch.randn(batch, heads_kv, n, d, device=device, dtype=dtype)
    w = torch.rand(batch, heads_kv, n, device=device, dtype=torch.float32) + 0.5
    v_min, v_max = v.amin(2).float(), v.amax(2).float()  # float32, as a compressed cache layer stores them
    kv_bytes = k.nbytes + v.nbytes
    q_out_bytes = 2 * q.nbytes
    calls: list[tuple[str, Callable[[], Any], int]] = []
    for backend in cfg.backends:
        kwargs, note = backend_kwargs(weighted_attention, backend, device)
        notes.add(note)
        if kwargs is None:
            continue

        def call(kwargs: dict = kwargs) -> Any:
            return weighted_attention(q, k, v, w, scaling=d**-0.5, v_min=v_min, v_max=v_max, **kwargs)

        calls.append((backend, call, kv_bytes + w.nbytes + q_out_bytes + v_min.nbytes + v_max.nbytes))
    if cfg.sdpa_reference:

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, scale=d**-0.5, enable_gqa=True)

        calls.append(("sdpa", sdpa, kv_bytes + q_out_bytes))
    rows = []
    for label, call, moved in calls:
        row = {"kv_heads": heads_kv, "group": group, "batch": batch, "n": n, "d": d, "backend": label, "bytes": moved}
        what = f"decode kernel {heads_kv}x{group} batch={batch} n={n} backend={label}"
        rows.append(timed_row(row, call, cfg, clock, flush, notes, what))
        if "median_s" in row:
            row["gbps"] = moved / row["median_s"] / 1e9
            row["roofline"] = row["gbps"] / bandwidth
    return rows


def build_model(cfg: Config, device: torch.device, dtype: torch.dtype):
    """A random-weight causal LM from ``cfg.model`` (Qwen2Config kwargs), built directly on ``device``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(cfg.seed)
    config = Qwen2Config(**cfg.model)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def prefill(model, press, ids: torch.Tensor):
    """Prefill ``ids`` into a fresh DynamicCache (under ``press`` when given), like kvpress's pipeline."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if press is None:
        model.model(input_ids=ids, past_key_values=cache, use_cache=True)
    else:
        with press(model):
            model.model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache


def cache_bytes(cache) -> int:
    """Bytes held by a cache: keys, values and, on compressed layers, weights and value ranges."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "row_weights", "value_min", "value_max"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.nbytes
    return total


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


# ----------------------------------------------------------------------------------------------- goals


def check_goals(results: dict[str, Any]) -> dict[str, Any]:
    """The three speed goals, from whatever sections ran (missing inputs give ``met: None``)."""
    goals: dict[str, Any] = {}
    e2e = results.get("e2e")
    if e2e and e2e["prefill"]:
        longest = max(r["n"] for r in e2e["prefill"])
        times = {r["press"]: r.get("median_s") for r in e2e["prefill"] if r["n"] == longest}
        entry = {"n": longest, "target_max": GOALS["prefill_overhead_max"], "met": None}
        if times.get("none") and times.get("compresskv"):
            entry["vs_none"] = times["compresskv"] / times["none"] - 1
            entry["met"] = entry["vs_none"] <= GOALS["prefill_overhead_max"]
        if times.get("snapkv") and times.get("compresskv"):
            entry["vs_snapkv"] = times["compresskv"] / times["snapkv"] - 1
        goals["prefill_overhead"] = entry
    kernels = results.get("kernels")
    if kernels:
        measured = [r for r in kernels["weighted_attention"] if "roofline" in r and r["backend"] != "sdpa"]
        backends = [r["backend"] for r in measured]
        preferred = "triton" if "triton" in backends else (backends[0] if backends else None)
        long_rows = [r for r in measured if r["backend"] == preferred and r["n"] >= GOALS["decode_roofline_from"]]
        entry = {"backend": preferred, "from_n": GOALS["decode_roofline_from"], "met": None}
        entry["target_min"] = GOALS["decode_roofline_min"]
        if long_rows:
            worst = min(long_rows, key=lambda r: r["roofline"])
            entry.update(
                min=worst["roofline"],
                worst={k: worst[k] for k in ("kv_heads", "group", "batch", "n")},
                median=statistics.median(r["roofline"] for r in long_rows),
                met=worst["roofline"] >= GOALS["decode_roofline_min"],
            )
        goals["decode_roofline"] = entry
    if e2e and e2e["attention"]:
        entry = {"target_min": GOALS["attention_speedup_min"], "met": None}
        compressed = [r for r in e2e["attention"] if r["variant"].startswith("compresskv")]
        model_row = next((r for r in compressed if "model_speedup" in r), None)
        raw_rows = [r for r in compressed if "kernel_speedup" in r]
        if model_row:
            entry["model_path"] = model_row["model_speedup"]
            entry["met"] = model_row["model_speedup"] >= GOALS["attention_speedup_min"]
        if raw_rows:
            entry["raw_kernel"] = {r["call"]: r["kernel_speedup"] for r in raw_rows}
        goals["attention_speedup"] = entry
    return goals


# ----------------------------------------------------------------------------------------------- output


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.4g}"
        return f"{value:.3e}"
    return str(value)


def table(title: str, headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def us(row: dict, key: str = "median_s") -> float | None:
    return row[key] * 1e6 if key in row else None


def ms(row: dict, key: str = "median_s") -> float | None:
    return row[key] * 1e3 if key in row else None


def report(results: dict[str, Any]) -> str:
    """The printed tables."""
    parts = [f"device: {results['device']}  dtype: {results['dtype']}  smoke: {results['smoke']}"]
    if "bandwidth" in results:
        b = results["bandwidth"]
        parts.append(
            table(
                "\n[bandwidth] device-to-device copy",
                ["MiB", "median ms", "GB/s (median)", "GB/s (best)"],
                [[b["buffer_bytes"] / 2**20, ms(b), b["gbps"], b["best_gbps"]]],
            )
        )
    if "kernels" in results:
        k = results["kernels"]
        parts.append(
            table(
                "\n[kernels] compress_kv (roofline = achieved bytes/s over copy bandwidth)",
                ["heads", "n", "d", "rank", "bins", "backend", "median ms", "GB/s", "roofline", "error"],
                [
                    [
                        r["heads"],
                        r["n"],
                        r["d"],
                        r["rank"],
                        r["bins"],
                        r["backend"],
                        ms(r),
                        r.get("gbps"),
                        r.get("roofline"),
                        r.get("error"),
                    ]
                    for r in k["compress_kv"]
                ],
            )
        )
        parts.append(
            table(
                "\n[kernels] weighted_attention decode (m = 1; sdpa = stock kernel on the same K, V, no w)",
                ["kv_heads", "group", "batch", "n", "backend", "median us", "GB/s", "roofline", "error"],
                [
                    [
                        r["kv_heads"],
                        r["group"],
                        r["batch"],
                        r["n"],
                        r["backend"],
                        us(r),
                        r.get("gbps"),
                        r.get("roofline"),
                        r.get("error"),
                    ]
                    for r in k["weighted_attention"]
                ],
            )
        )
    if "e2e" in results:
        e = results["e2e"]
        m = e["model"]
        parts.append(
            f"\n[e2e] random-weight model: {m['config'].get('num_hidden_layers')} layers, hidden "
            f"{m['config'].get('hidden_size')}, {m['parameters'] / 1e9:.3g} B parameters, "
            f"{m['weights_gib']:.3g} GiB weights"
        )
        parts.append(
            table(
                "\n[e2e] prefill (model.model on a fresh cache, press applied during it)",
                ["n", "press", "kept", "median s", "vs none", "peak GiB", "error"],
                [
                    [
                        r["n"],
                        r["press"],
                        r["kept"],
                        r.get("median_s"),
                        r.get("vs_none"),
                        r.get("peak_gib"),
                        r.get("error"),
                    ]
                    for r in e["prefill"]
                ],
            )
        )
        parts.append(
            table(
                "\n[e2e] decode (greedy, one token per step; median step)",
                [
                    "variant",
                    "context",
                    "batch",
                    "rows/layer",
                    "cache GiB",
                    "step ms",
                    "tokens/s",
                    "peak prefill GiB",
                    "peak decode GiB",
                    "error",
                ],
                [
                    [
                        r["variant"],
                        r["context"],
                        r["batch"],
                        r.get("cache_rows"),
                        r.get("cache_gib"),
                        r.get("step_ms"),
                        r.get("tokens_per_s"),
                        r.get("peak_prefill_gib"),
                        r.get("peak_decode_gib"),
                        r.get("error"),
                    ]
                    for r in e["decode"]
                ],
            )
        )
        parts.append(
            table(
                "\n[e2e] attention part of a decode step: one layer's attention call "
                "(speedups vs full/sdpa, model path and raw)",
                ["variant", "call", "rows", "median us", "model speedup", "kernel speedup", "error"],
                [
                    [
                        r["variant"],
                        r["call"],
                        r["rows"],
                        us(r),
                        r.get("model_speedup"),
                        r.get("kernel_speedup"),
                        r.get("error"),
                    ]
                    for r in e["attention"]
                ],
            )
        )
    goals = results.get("goals", {})
    if goals:
        rows = []
        if "prefill_overhead" in goals:
            g = goals["prefill_overhead"]
            rows.append(
                [
                    f"CompressKV prefill overhead at n={g['n']} vs no press",
                    g.get("vs_none"),
                    f"<= {g['target_max']}",
                    g["met"],
                ]
            )
            rows.append(["  (vs SnapKV, for reference)", g.get("vs_snapkv"), "-", None])
        if "decode_roofline" in goals:
            g = goals["decode_roofline"]
            rows.append(
                [
                    f"decode roofline min, n >= {g['from_n']} [{g['backend']}]",
                    g.get("min"),
                    f">= {g['target_min']}",
                    g["met"],
                ]
            )
        if "attention_speedup" in goals:
            g = goals["attention_speedup"]
            rows.append(
                ["decode attention speedup (model path)", g.get("model_path"), f">= {g['target_min']}", g["met"]]
            )
            for call, value in g.get("raw_kernel", {}).items():
                rows.append([f"  raw kernel speedup {call}", value, f">= {g['target_min']}", None])
        title = "\n[goals]" + (" (smoke run: NOT performance claims)" if results["smoke"] else "")
        parts.append(table(title, ["goal", "value", "target", "met"], rows))
    return "\n".join(parts)


def environment(device: torch.device) -> dict[str, Any]:
    versions: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "kvpress", "triton", "flash-attn", "kvcompress"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    env: dict[str, Any] = {"versions": versions, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda)
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


# ----------------------------------------------------------------------------------------------- config


def build_parser() -> argparse.ArgumentParser:
    """CLI flags; all default to None so that the YAML config (then the built-in defaults) fill the gaps."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", type=Path, default=None, help=f"YAML with the same keys (default {DEFAULT_CONFIG})")
    p.add_argument("--only", help="comma-separated sections: bandwidth,kernels,e2e (default all)")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default cuda when available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="tensor and model dtype (default bfloat16)")
    p.add_argument("--output", help="JSON path (default results/speed/speed.json; speed_smoke.json with --smoke)")
    p.add_argument("--smoke", action="store_true", default=None, help="tiny sizes for every code path (CPU test)")
    p.add_argument("--seed", type=int)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: unchanged; 1 with --smoke)")
    p.add_argument("--warmup", type=int, help="warm-up calls per kernel timing (default 3)")
    p.add_argument("--repeats", type=int, help="timed calls per kernel timing (default 20)")
    p.add_argument("--flush-mib", type=int, help="buffer zeroed before each kernel sample (default 256; 0 = none)")
    p.add_argument("--bandwidth-mib", type=int, help="copy buffer size (default 2048)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, help="kvcompress backends to time (default triton torch)")
    p.add_argument("--kept", type=float, help="kept fraction of the cache (default 0.25)")
    p.add_argument("--bin-rank", type=int, help="pivots per bin (default 12)")
    p.add_argument("--compress-n", type=int, help="compress_kv context length (default 32768)")
    p.add_argument("--compress-heads", type=int, nargs="+", help="compress_kv KV heads (default 4 8)")
    p.add_argument("--decode-lengths", type=int, nargs="+", help="compressed lengths for the decode kernel")
    p.add_argument("--decode-batches", type=int, nargs="+", help="batch sizes for the decode kernel (default 1 4 16)")
    p.add_argument("--decode-heads", nargs="+", help="KVxGROUP pairs for the decode kernel (default 8x4 4x7)")
    p.add_argument("--prefill-lengths", type=int, nargs="+", help="e2e prefill lengths (default 8192 32768)")
    p.add_argument("--decode-context", type=int, help="e2e context before decoding (default 32768)")
    p.add_argument("--decode-batch", type=int, help="e2e decode batch size (default 1)")
    p.add_argument("--decode-tokens", type=int, help="e2e timed decode steps (default 64)")
    p.add_argument("--model-layers", type=int, help="override the model's num_hidden_layers (shorter e2e runs)")
    p.add_argument("--attn-implementations", nargs="+", help="full-cache attention (default sdpa flash_attention_2)")
    return p


def resolve_config(argv: list[str] | None = None) -> Config:
    """Built-in defaults < YAML config < smoke preset < command-line flags, validated."""
    args = vars(build_parser().parse_args(argv))
    merged = load_yaml(args.pop("config"), DEFAULT_CONFIG, Config)
    model_layers = args.pop("model_layers")
    flags = {k: v for k, v in args.items() if v is not None}
    if "only" in flags:
        flags["only"] = [s.strip() for s in flags["only"].split(",") if s.strip()]
    if "decode_heads" in flags:
        try:
            flags["decode_heads"] = [[int(x) for x in pair.lower().split("x")] for pair in flags["decode_heads"]]
        except ValueError as err:
            raise ValueError("--decode-heads: use KVxGROUP pairs such as 8x4 4x7") from err
    if flags.get("smoke", merged.get("smoke", False)):
        merged.update(SMOKE)
    merged.update(flags)
    cfg = Config(**merged)
    cfg.model = {**cfg.model}
    if model_layers is not None:
        cfg.model["num_hidden_layers"] = model_layers
    bad = set(cfg.only) - set(SECTIONS)
    if bad or not cfg.only:
        raise ValueError(f"only: choose from {','.join(SECTIONS)}, got {cfg.only}")
    if set(cfg.backends) - set(BACKENDS):
        raise ValueError(f"backends: choose from {BACKENDS}, got {cfg.backends}")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype: choose from {sorted(DTYPES)}, got {cfg.dtype!r}")
    if not 0 < cfg.kept < 1:
        raise ValueError(f"kept: must be in (0, 1), got {cfg.kept}")
    if any(len(pair) != 2 or min(pair) < 1 for pair in cfg.decode_heads):
        raise ValueError(f"decode_heads: need [kv_heads, group] pairs >= 1, got {cfg.decode_heads}")
    sizes = [
        cfg.repeats,
        cfg.bandwidth_mib,
        cfg.compress_n,
        cfg.compress_d,
        cfg.decode_d,
        cfg.bin_rank,
        cfg.e2e_repeats,
        cfg.decode_context,
        cfg.decode_batch,
        cfg.decode_tokens,
        *cfg.compress_heads,
        *cfg.decode_lengths,
        *cfg.decode_batches,
        *cfg.prefill_lengths,
    ]
    if min(sizes) < 1 or min(cfg.warmup, cfg.e2e_warmup, cfg.decode_warmup, cfg.flush_mib) < 0:
        raise ValueError("sizes, repeats and token counts must be >= 1; warm-ups and flush_mib >= 0")
    return cfg


def resolve_device(cfg: Config) -> torch.device:
    name = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: CUDA is not available here; use --device cpu --smoke")
        if device.index is not None:
            torch.cuda.set_device(device)
        return device
    if device.type != "cpu":
        raise ValueError(f"--device: use cuda, cuda:N or cpu, got {name!r}")
    if not cfg.smoke:
        raise RuntimeError("--device cpu: the full sizes need a GPU; add --smoke (tiny sizes, a smoke test)")
    return device


def main(argv: list[str] | None = None) -> int:
    """Run the selected sections, print the tables and write the JSON."""
    cfg = resolve_config(argv)
    device = resolve_device(cfg)
    dtype = DTYPES[cfg.dtype]
    output = Path(cfg.output or ("results/speed/speed_smoke.json" if cfg.smoke else "results/speed/speed.json"))
    print(f"config: {asdict(cfg)}")
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return run(cfg, device, dtype, output)
    finally:
        torch.set_num_threads(threads)


def run(cfg: Config, device: torch.device, dtype: torch.dtype, output: Path) -> int:
    """The body of :func:`main`."""
    torch.manual_seed(cfg.seed)
    clock = Clock(device)
    notes = Notes()
    env = environment(device)
    results: dict[str, Any] = {
        "device": env.get("gpu") or f"cpu ({env['cpu']}, {env['cpu_count']} cores)",
        "device_type": device.type,
        "smoke": cfg.smoke,
        "dtype": str(dtype).removeprefix("torch."),
        "environment": env,
        "backend_keyword": {
            "compress_kv": has_backend_keyword(compress_kv),
            "weighted_attention": has_backend_keyword(weighted_attention),
        },
        "config": asdict(cfg),
        "notes": notes,
    }
    if cfg.smoke:
        notes.add("smoke run: tiny sizes; the numbers are NOT performance claims")
    start = time.perf_counter()
    sections: dict[str, float] = {}
    with torch.no_grad():
        if "bandwidth" in cfg.only or "kernels" in cfg.only:
            if "bandwidth" not in cfg.only:
                notes.add("bandwidth measured anyway: it is the denominator of the kernel rooflines")
            tic = time.perf_counter()
            results["bandwidth"] = run_bandwidth(cfg, device, clock)
            sections["bandwidth"] = time.perf_counter() - tic
            print(f"bandwidth: {results['bandwidth']['gbps']:.4g} GB/s")
        flush = torch.empty(cfg.flush_mib * 2**20 // 4, device=device) if cfg.flush_mib else None
        if "kernels" in cfg.only:
            tic = time.perf_counter()
            bandwidth = results["bandwidth"]["gbps"]
            results["kernels"] = {
                "compress_kv": run_compress_kernels(cfg, device, dtype, clock, bandwidth, notes, flush),
                "weighted_attention": run_decode_kernels(cfg, device, dtype, clock, bandwidth, notes, flush),
            }
            sections["kernels"] = time.perf_counter() - tic
        if "e2e" in cfg.only:
            tic = time.perf_counter()
            results["e2e"] = run_e2e(cfg, device, dtype, clock, notes, flush)
            release(device)
            sections["e2e"] = time.perf_counter() - tic
    results["section_s"] = sections
    results["goals"] = check_goals(results)
    if cfg.smoke:
        results["goals"]["note"] = "smoke run at tiny sizes: these values are NOT performance claims"
    results["total_s"] = time.perf_counter() - start
    results["notes"] = list(notes)
    print("\n" + report(results))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nwrote {output}; total {results['total_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
