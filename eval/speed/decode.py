"""Decode speed per cache: ms per step, tokens/s and peak memory, and one layer's attention call timed from Python
and replayed in a CUDA graph (``python -m eval.speed --only decode``).

Variants (random-weight model of ``cfg.model``'s shape; each context prefilled once at batch 1, the cache then
repeated to each batch size, so every batch row holds the same rows):

- ``full/eager``: the whole cache, DynamicCache, stock sdpa, eager steps;
- ``full/static+compile``: the whole cache in a transformers StaticCache, ``torch.compile(fullgraph=True)``;
- ``kept/static+compile``: an unweighted StaticCache of the kept size (``int(kept * context)`` rows): the floor
  for a compressed cache's step (no weights, no clip);
- ``snapkv/eager``: kvpress's SnapKV at the kept size, DynamicCache, eager;
- ``ours/eager``: CompressKV's default press at the kept size, the eager weighted path;
- ``ours/compiled``: the same cache as :class:`kvcompress.static_cache.StaticWeightedCache`, compiled.

Compiled variants use ``cfg.compile_mode`` (``reduce-overhead``: CUDA graphs) and ``cfg.compile_backend``; the
compile happens in the warm-up steps, never in the timed ones. Steps pass device-side ``cache_position`` and
``position_ids`` advanced in place, as ``generate`` does.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any
from unittest import mock

import torch

from eval.speed.clock import Clock, Notes, release, stats
from eval.speed.config import Config
from eval.speed.e2e import build_model, make_press, prefill, set_attention
from kvcompress.cache import cache_bytes

VARIANTS = (
    "full/eager",
    "full/static+compile",
    "kept/static+compile",
    "snapkv/eager",
    "ours/eager",
    "ours/compiled",
)
ATTENTION_VARIANTS = ("full/eager", "ours/eager", "ours/compiled")


def repeat_batch(cache, batch: int):
    """The batch-1 ``cache`` repeated to ``batch`` identical rows: a new cache (the decode steps of one variant
    never reach another's), through transformers' ``batch_repeat_interleave`` (compressed layers move their
    weights with their rows)."""
    out = copy.deepcopy(cache)
    out.batch_repeat_interleave(batch)
    return out


def static_copy(model, cache, rows: int, capacity: int):
    """A transformers StaticCache of ``capacity`` rows holding the first ``rows`` rows of every layer of ``cache``."""
    from transformers import StaticCache

    keys = cache.layers[0].keys
    static = StaticCache(config=model.config, max_cache_len=capacity)
    static.early_initialization(keys.shape[0], keys.shape[1], keys.shape[-1], keys.dtype, keys.device)
    for layer, source in zip(static.layers, cache.layers, strict=True):
        layer.keys[:, :, :rows] = source.keys[:, :, :rows]
        layer.values[:, :, :rows] = source.values[:, :, :rows]
    return static


def decode_steps(
    forward: Callable, cache, batch: int, first_row: int, first_position: int, cfg: Config, clock: Clock
) -> list[float]:
    """Seconds per greedy step: ``cfg.decode_step_warmup`` untimed steps (compilation), then ``cfg.decode_steps``."""
    device = cache.layers[0].keys.device
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    cache_position = torch.tensor([first_row], device=device)
    position_ids = torch.full((batch, 1), first_position, device=device)

    def step() -> None:
        nonlocal token
        out = forward(
            input_ids=token,
            past_key_values=cache,
            cache_position=cache_position,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
        )
        token = out.logits[:, -1:].argmax(-1)
        cache_position.add_(1)
        position_ids.add_(1)

    for _ in range(cfg.decode_step_warmup):
        step()
    clock.sync()
    marks = [clock.mark()]
    for _ in range(cfg.decode_steps):
        step()
        marks.append(clock.mark())
    return clock.intervals(marks)


def build_variant(variant: str, model, ids: torch.Tensor, batch: int, cfg: Config, base: dict) -> tuple:
    """``(cache, forward, first_row)`` for ``variant`` at ``batch`` (``base`` memoises the batch-1 prefills)."""
    from kvcompress.static_cache import StaticWeightedCache

    context = ids.shape[1]
    capacity = cfg.decode_step_warmup + cfg.decode_steps
    press_name = {"snapkv": "snapkv", "ours": "compresskv"}.get(variant.split("/")[0], "none")
    if press_name not in base:
        set_attention(model, "sdpa")
        base[press_name] = prefill(model, make_press(press_name, cfg), ids)
    cache = repeat_batch(base[press_name], batch)
    if variant in ("full/eager", "snapkv/eager"):
        set_attention(model, "sdpa")
    elif variant == "ours/eager":
        set_attention(model, "kvcompress")
    if variant == "full/static+compile":
        cache = static_copy(model, cache, context, context + capacity)
    elif variant == "kept/static+compile":
        kept = int(cfg.kept * context)
        cache = static_copy(model, cache, kept, kept + capacity)
        context = kept
    elif variant == "ours/compiled":
        cache = StaticWeightedCache.from_compressed(cache, max_new_tokens=capacity)
    if variant.endswith("compile") or variant.endswith("compiled"):
        set_attention(model, "kvcompress" if variant.startswith("ours") else "sdpa")
        torch._dynamo.reset()  # one graph per variant and batch; never the recompile limit
        options = dict(fullgraph=True, dynamic=False, backend=cfg.compile_backend)
        if cfg.compile_backend == "inductor":
            options["mode"] = cfg.compile_mode
        forward = torch.compile(model.forward, **options)
    else:
        forward = model.forward
    # cache_position as generate passes it: the row index for transformers' caches (a SnapKV cache holds its kept
    # rows), the token count for compressed caches (get_seq_length() of a WeightedDynamicCache; static: the same)
    if variant in ("snapkv/eager", "ours/eager"):
        first_row = cache.get_seq_length()
    elif variant == "ours/compiled":
        first_row = ids.shape[1]
    else:
        first_row = context
    return cache, forward, first_row


class _SkippedLaunch:
    """A Triton kernel stand-in whose launches do nothing."""

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def _weighted_kernels_skipped() -> AbstractContextManager:
    """Inside: the weighted decode kernels' launches do nothing, so a call's host time is ours (Python, the
    dispatcher, the output's allocation) without Triton's launcher. Outputs are then unwritten: timing only."""
    from kvcompress.kernels import weighted_decode

    skipped = dict(_weighted_split_kernel=_SkippedLaunch(), _weighted_decode_reduce_kernel=_SkippedLaunch())
    return mock.patch.multiple(weighted_decode, **skipped)


# ``weighted_decode``'s launch options, off by default until a GPU measures them: name -> module attributes set
LAUNCH_SWITCHES = {
    "fused": dict(FUSED_MERGE=True),
    "cached": dict(CACHED_LAUNCH=True),
    "cached_fused": dict(FUSED_MERGE=True, CACHED_LAUNCH=True),
}
LAUNCH_LABELS = {"fused": "fused merge", "cached": "cached launch", "cached_fused": "both"}  # the table's columns


def _folding_one_row(layer: Any, call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` with the layer's clip range set one row back first (a WeightedLayer's ``_range``: low, high, rows
    covered), so that each call folds one row in, as the first attention call of a decode step does. The range
    already holds that row, so its values do not change."""
    low, high, covered = layer._range

    def step() -> Any:
        layer._range = (low, high, covered - 1)
        return call()

    return step


def _one_row_longer_each_call(layer: Any, call_over: Callable[[Any, Any], Any], count: int) -> Callable[[], Any]:
    """A decode step's attention call as it comes: ``call_over(keys, values)`` over the layer's rows plus one more
    each call (views of the layer after ``count`` rows more were appended, each tagged as the layer's), folding
    that row into the clip range; the row count and causal offset are new every call, as over a dynamic cache,
    where the other host figures repeat one shape. Restore the layer with ``layer.crop(rows before)`` after."""
    from kvcompress.cache import tag_layer

    keys, values = layer.keys, layer.values
    rows = keys.shape[-2]
    more = torch.randn(*keys.shape[:2], count, keys.shape[-1], device=keys.device).to(keys.dtype)
    grown_keys, grown_values = layer.update(more, torch.randn_like(more, dtype=torch.float32).to(values.dtype))
    views = []
    for extra in range(1, count + 1):
        view = grown_keys[:, :, : rows + extra]
        tag_layer(view, layer)
        views.append((view, grown_values[:, :, : rows + extra]))
    low, high, _ = layer.clip_range(rows + count)
    position = [0]

    def step() -> Any:
        k, v = views[position[0] % count]
        position[0] += 1
        layer._range = (low, high, k.shape[-2] - 1)
        return call_over(k, v)

    return step


def time_layer_attention(model, cache, variant: str, cfg: Config, clock: Clock, notes: Notes) -> list[dict[str, Any]]:
    """One layer's attention call of a decode step on ``cache`` (after its decode steps): from Python, and replayed
    in a CUDA graph (CUDA only). ``host_s``: wall time per call issued back to back (the same rows every call, so
    the clip range folds in no new row); for ``ours/eager`` also ``host_step_s``, the same with the clip range
    folding in one row per call as a decode step's does (its 3 launches), and ``host_grow_s``, the calls over a
    cache one row longer each (a dynamic cache's step: new shapes every call, the launch plan's cache misses); on
    CUDA also ``host_python_s``, the same with the Triton launches skipped (the rest of ``host_s`` is Triton's
    launcher), and ``python_NAME_s`` / ``host_NAME_s`` for each of ``LAUNCH_SWITCHES``: the splits merged in the
    split kernel (one launch instead of two), the launches without Triton's per-call binding, and both."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    module = model.model.layers[cfg.attention_layer].self_attn
    layer = cache.layers[cfg.attention_layer]
    keys, values = layer.keys, layer.values
    query = torch.randn(keys.shape[0], model.config.num_attention_heads, 1, keys.shape[-1], device=keys.device)
    query = query.to(keys.dtype)
    attention = ALL_ATTENTION_FUNCTIONS["kvcompress" if variant.startswith("ours") else "sdpa"]

    def call_over(k: torch.Tensor, v: torch.Tensor) -> Any:
        return attention(module, query, k, v, None, dropout=0.0, scaling=module.scaling)[0]

    def call() -> Any:
        return call_over(keys, values)

    def host_seconds(fn: Callable[[], Any] = call) -> float:
        """Seconds per call issued back to back, no sync: the host's cost per call while the GPU queue runs."""
        clock.sync()
        start = time.perf_counter()
        for _ in range(cfg.repeats):
            fn()
        seconds = (time.perf_counter() - start) / cfg.repeats
        clock.sync()
        return seconds

    row: dict[str, Any] = {"variant": variant, "batch": keys.shape[0], "rows": keys.shape[-2]}
    try:
        row["python_s"] = stats(clock.times(call, cfg.warmup, cfg.repeats))["median_s"]
        row["host_s"] = host_seconds()
        if variant == "ours/eager":
            row["host_step_s"] = host_seconds(_folding_one_row(layer, call))
            rows = keys.shape[-2]
            try:
                row["host_grow_s"] = host_seconds(_one_row_longer_each_call(layer, call_over, cfg.repeats))
            finally:
                layer.crop(rows)
        if variant == "ours/eager" and clock.cuda:
            from kvcompress.kernels import weighted_decode

            with _weighted_kernels_skipped():  # the same calls with the Triton launches skipped
                row["host_python_s"] = host_seconds()
            for name, switches in LAUNCH_SWITCHES.items():  # the same calls with each launch option on
                with mock.patch.multiple(weighted_decode, **switches):
                    row[f"python_{name}_s"] = stats(clock.times(call, cfg.warmup, cfg.repeats))["median_s"]
                    row[f"host_{name}_s"] = host_seconds()
        if clock.cuda:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            row["cuda_graph_s"] = stats(clock.times(graph.replay, cfg.warmup, cfg.repeats))["median_s"]
        else:
            row["cuda_graph_s"] = None
            notes.add("attention replayed in a CUDA graph: CUDA only (None on CPU)")
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {err}"
        notes.add(f"attention {variant} failed: {row['error']}")
    return [row]


def run_decode(cfg: Config, device: torch.device, dtype: torch.dtype, clock: Clock, notes: Notes) -> dict[str, Any]:
    """Every variant at every context and batch size (see the module docstring)."""
    import kvcompress.presses  # noqa: F401  (registers the "kvcompress" attention)
    from kvcompress.hf_attention import register

    register()
    model = build_model(cfg, device, dtype)
    generator = torch.Generator().manual_seed(cfg.seed)
    rows, attention = [], []
    for context in cfg.decode_contexts:
        ids = torch.randint(0, model.config.vocab_size, (1, context), generator=generator).to(device)
        base: dict = {}
        for variant in VARIANTS:
            for batch in cfg.decode_batch_sizes:
                row: dict[str, Any] = {"variant": variant, "context": context, "batch": batch, "kept": cfg.kept}
                if variant.startswith("full"):
                    row["kept"] = 1.0
                try:
                    start = time.perf_counter()
                    cache, forward, first_row = build_variant(variant, model, ids, batch, cfg, base)
                    row["build_s"] = time.perf_counter() - start
                    row["cache_rows"] = cache.layers[cfg.attention_layer].keys.shape[-2]
                    row["cache_gib"] = cache_bytes(cache) / 2**30
                    release(device)
                    clock.memory_reset()
                    samples = decode_steps(forward, cache, batch, first_row, context, cfg, clock)
                    row["peak_decode_gib"] = clock.memory_peak_gib()
                    row.update(stats(samples))
                    row["step_ms"] = row["median_s"] * 1e3
                    row["tokens_per_s"] = batch / row["median_s"]
                    if variant in ATTENTION_VARIANTS:
                        attention += [{"context": context, **r} for r in time_layer_attention(
                            model, cache, variant, cfg, clock, notes)]  # fmt: skip
                    del cache, forward
                except Exception as err:
                    row["error"] = f"{type(err).__name__}: {err}"
                    notes.add(f"decode {variant} context={context} batch={batch} failed: {row['error']}")
                rows.append(row)
                release(device)
        del base
    set_attention(model, "sdpa")
    torch._dynamo.reset()
    return {"steps": rows, "attention": attention, "goals": decode_goals(rows, attention)}


def _step(rows: list[dict], variant: str, context: int, batch: int) -> float | None:
    row = next((r for r in rows if (r["variant"], r["context"], r["batch"]) == (variant, context, batch)), None)
    return None if row is None else row.get("step_ms")


def decode_goals(rows: list[dict], attention: list[dict]) -> list[dict[str, Any]]:
    """The issue's goals per (context, batch): ours compiled <= 1.1x the kept-size floor; faster than the full
    cache's fastest path; ours eager within 5% of SnapKV eager; our attention call's host time <= 40 us (the
    slower of eager and compiled caches). ``met`` None where a number is missing."""
    goals = []
    for context, batch in sorted({(r["context"], r["batch"]) for r in rows}):
        ours, floor = _step(rows, "ours/compiled", context, batch), _step(rows, "kept/static+compile", context, batch)
        fulls = [_step(rows, v, context, batch) for v in ("full/eager", "full/static+compile")]
        fastest_full = min((x for x in fulls if x), default=None)
        eager, snap = _step(rows, "ours/eager", context, batch), _step(rows, "snapkv/eager", context, batch)
        entry: dict[str, Any] = {"context": context, "batch": batch}
        entry["compiled_vs_floor"] = ours / floor if ours and floor else None
        entry["speedup_vs_full"] = fastest_full / ours if ours and fastest_full else None
        entry["eager_vs_snapkv"] = eager / snap if eager and snap else None
        entry["met_floor_1.1x"] = None if entry["compiled_vs_floor"] is None else entry["compiled_vs_floor"] <= 1.1
        entry["met_eager_5pct"] = None if entry["eager_vs_snapkv"] is None else entry["eager_vs_snapkv"] <= 1.05
        hosts = [
            r["host_s"] * 1e6
            for r in attention
            if r["variant"].startswith("ours") and (r["context"], r["batch"]) == (context, batch) and "host_s" in r
        ]
        entry["ours_attention_host_us"] = max(hosts) if hosts else None
        entry["met_host_40us"] = None if not hosts else max(hosts) <= 40
        goals.append(entry)
    return goals


def format_decode(section: dict[str, Any]) -> str:
    """The printed tables of the decode section."""
    from eval.speed.report import table

    def us(value: float | None) -> float | None:
        return None if value is None else value * 1e6

    steps = [
        [r["variant"], r["context"], r["batch"], r.get("cache_rows"), r.get("step_ms"), r.get("tokens_per_s"),
         r.get("peak_decode_gib"), r.get("cache_gib"), r.get("error", "")]
        for r in section["steps"]
    ]  # fmt: skip
    calls = [
        [r["variant"], r["context"], r["batch"], r["rows"], us(r.get("python_s")), us(r.get("host_s")),
         us(r.get("host_step_s")), us(r.get("host_grow_s")), us(r.get("host_python_s")),
         *[us(r.get(f"{kind}_{name}_s")) for name in LAUNCH_SWITCHES
                                        for kind in ("python", "host")],
         us(r.get("cuda_graph_s")), r.get("error", "")]
        for r in section["attention"]
    ]  # fmt: skip
    goals = [
        [
            g["context"],
            g["batch"],
            g["compiled_vs_floor"],
            g["speedup_vs_full"],
            g["eager_vs_snapkv"],
            g["ours_attention_host_us"],
        ]
        for g in section["goals"]
    ]
    return "\n".join(
        [
            table(
                "\n[decode] greedy decode step (median), per cache variant",
                ["variant", "context", "batch", "rows", "step ms", "tokens/s", "peak GiB", "cache GiB", "error"],
                steps,
            ),
            table(
                "\n[decode] one layer's attention call (us): from Python (device time per call, and host time per call"
                " issued back to back), and replayed in a CUDA graph",
                ["variant", "context", "batch", "rows", "python us", "host us", "host us folding a row",
                 "host us a row longer each call", "host us without launches",
                 *[f"{kind} us {LAUNCH_LABELS[name]}" for name in LAUNCH_SWITCHES for kind in ("python", "host")],
                 "cuda graph us", "error"],
                calls,
            ),
            table(
                "\n[decode] goals: ours compiled / kept floor (<= 1.1); full fastest / ours compiled; "
                "ours eager / SnapKV (<= 1.05); our attention host us (<= 40)",
                ["context", "batch", "compiled/floor", "speedup vs full", "eager/snapkv", "our host us"],
                goals,
            ),
        ]
    )
