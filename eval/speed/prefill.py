"""Prefill cost per press setting, broken down: forward, repeat forward, attention mass, selection, fit, peak.

For each context length and setting, the prefill of a fresh cache (``model.model`` under the press, as in
:mod:`eval.speed.e2e`) is timed twice: plain (``total_s``, the median over repeats, and the peak memory), and
with the library's stages wrapped in timers that synchronise the device around each call (the breakdown,
medians over the same repeats). Stages, all in seconds per prefill:

* ``mass_s``: every :func:`kvcompress.selection.attention_mass` call of the reference sources;
* ``repeat_forward_s``: the repeat pass (:func:`kvcompress.reference.repeat_context`, or streamed layer by layer
  :func:`kvcompress.reference.repeat_through_layer`) less the mass inside it;
* ``compress_s``: every layer's compression after its references are recorded (``_compress_layer``), split
  into ``fit_s`` (:func:`kvcompress.fitting.fit_kept_rows`) and ``selection_s`` (the rest: scores, top rows,
  RPNys for the paper's setting, gathers);
* ``forward_s``: the instrumented total less all of the above (the model's own prefill forward with the
  press's hooks; for kvpress's SnapKV its scoring and pruning are in here).

``total_s_runs``: every plain prefill's seconds (the spread behind the median). ``vs_none``: ``total_s`` over the
no-press prefill at the same length; ``peak_gib`` / ``peak_vs_snapkv``: peak
allocated device memory (CUDA only; None on CPU); ``reserved_gib``: the caching allocator's peak reservation (CUDA
only), which can exceed the allocated peak by what a side stream's blocks keep (``overlap_compression``). A
setting that fails (e.g. out of memory at 64k) gets an ``error`` and the run goes on.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch

from eval.speed.clock import Clock, Notes, release
from eval.speed.config import Config
from eval.speed.e2e import Chunked
from kvcompress import CompressKVPress, UniformPress, registry

# name -> CompressKVPress fields (None: built by make_setting; "preset": a named setting's fields changed);
# "default" is CompressKVPress() whatever it is.
SETTINGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "snapkv": None,
    "uniform": None,
    "paper": None,
    "default": {},
    # the default as a calibrated model runs it: the embedded model's calibrated layers (18 widened, 7 kept whole,
    # of 30) at the same depths of this model; a random-weight model has no calibration, so "default" is the uniform
    # press there, and what this row times is those layers' cost, not their choice
    "calibrated": dict(layers_at_depth=dict(retrieval_layers=18 / 30, full_layers=7 / 30)),
    "thorough": None,  # CompressKVPress.thorough()
    "balanced": None,  # CompressKVPress.balanced(): a repeat pass over the most novel quarter
    "kvzip": None,  # CompressKVPress.kvzip(): KVzip's scoring, repeat pass without window or fit
    "window_repeat_sum": dict(reference=("window", "repeat"), score_pooling="sum"),  # the default before novelty
    "window": dict(reference=("window",)),
    "window_sum": dict(reference=("window",), score_pooling="sum"),  # README's pick when the continuation matters
    "window_nofit": dict(reference=("window",), fit="none"),
    # the default without its fit (w = 1, values kept): its total_s against the default's is the fit's cost in a
    # prefill as it runs (the breakdown's fit_s syncs around each call, so it also counts host time the GPU hides)
    "default_nofit": dict(fit="none"),
    "context": dict(reference=("window", "context")),
    "accumulated": dict(reference=("window", "accumulated")),
    # each layer's selection and fit on a side CUDA stream beside the next layer (overlap_compression, off by default)
    "default_overlap": dict(overlap_compression=True),
    "balanced_overlap": dict(preset="balanced", overlap_compression=True),
    "window_novelty": dict(reference=("window", "novelty")),  # the default before its induction prior (2026-11-26)
    "balanced_window_novelty": dict(preset="balanced", reference=("window", "novelty", "repeat")),  # before it too
    # balanced()'s second reading halved: the most novel eighth in pieces of 8 tokens (KVzip's answers, BENCHMARKS)
    "balanced_eighth": dict(preset="balanced", repeat_fraction=0.125, repeat_span=8),
    "repeat_quarter": dict(reference=("window", "repeat"), repeat_fraction=0.25),
    # the context prefilled in calls of 4096 tokens (a quarter of it if fewer; kvcompress.prefill_in_chunks): the
    # peak without one whole-context forward's activations, but every layer's full rows until the last call
    "none_chunks": dict(chunks_of="none"),
    "default_chunks": dict(chunks_of="default"),
    "balanced_chunks": dict(chunks_of="balanced"),  # its repeat pass layer by layer after the last call
}
TORCH_MASS_MAX = 8192 * 8192  # the chunked torch path is timed on CUDA up to this many query-key pairs (~1 s)
STAGES = ("forward_s", "repeat_forward_s", "mass_s", "selection_s", "fit_s", "peak_gib")


def make_setting(name: str, cfg: Config):
    """The press of one setting at this run's kept fraction and seed (None: no press)."""
    ratio = 1.0 - cfg.kept
    if SETTINGS.get(name) and "chunks_of" in SETTINGS[name]:
        return Chunked(make_setting(SETTINGS[name]["chunks_of"], cfg))
    if name == "none":
        return None
    if name == "snapkv":
        return registry.make_press("snapkv", ratio, window_size=cfg.snapkv_window, kernel_size=cfg.snapkv_kernel)
    if name == "uniform":
        return UniformPress(compression_ratio=ratio, seed=cfg.seed)
    if name == "paper":
        return CompressKVPress.paper(ratio, seed=cfg.seed, bin_rank=cfg.bin_rank)
    if name in registry.PRESETS:  # CompressKVPress's named settings (paper above: with the run's bin_rank)
        return getattr(CompressKVPress, name)(ratio, seed=cfg.seed)
    fields = dict(SETTINGS[name])
    depths, layers = fields.pop("layers_at_depth", {}), cfg.model["num_hidden_layers"]
    if layers < 4:  # the smoke run's 2-layer model: the whole layer alone, or no layer would be left to pay for both
        depths = {key: depth for key, depth in depths.items() if key != "retrieval_layers"}
    fields.update({key: (int(depth * layers),) for key, depth in depths.items()})
    preset = fields.pop("preset", None)
    if preset is not None:
        return getattr(CompressKVPress, preset)(ratio, seed=cfg.seed, **fields)
    return CompressKVPress(compression_ratio=ratio, seed=cfg.seed, **fields)


class StageTimer:
    """Wraps the library's stages with device-synchronised timers while active (see the module docstring)."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.spent: dict[str, float] = {}
        self.in_repeat = False

    def _add(self, key: str, seconds: float) -> None:
        self.spent[key] = self.spent.get(key, 0.0) + seconds

    def _timed(self, key: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            self.clock.sync()
            start = time.perf_counter()
            repeat = key == "repeat"
            if repeat:
                self.in_repeat = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.clock.sync()
                seconds = time.perf_counter() - start
                self._add(key, seconds)
                if key == "mass" and self.in_repeat:
                    self._add("mass_in_repeat", seconds)
                if repeat:
                    self.in_repeat = False

        return wrapper

    @contextmanager
    def active(self):
        from kvcompress import methods, reference, repeat_hooks, weighted_press

        patches = [
            (reference, "attention_mass", "mass"),
            (repeat_hooks, "repeat_context", "repeat"),
            (repeat_hooks, "repeat_through_layer", "repeat"),
            (methods, "fit_kept_rows", "fit"),
            (weighted_press.WeightedSubsetPress, "_compress_layer", "compress"),
        ]
        saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
        for owner, attr, key in patches:
            setattr(owner, attr, self._timed(key, getattr(owner, attr)))
        try:
            yield self
        finally:
            for owner, attr, original in saved:
                setattr(owner, attr, original)

    def breakdown(self, total: float) -> dict[str, float]:
        s = self.spent.get
        mass, repeat, compress, fit = s("mass", 0.0), s("repeat", 0.0), s("compress", 0.0), s("fit", 0.0)
        return {
            "forward_s": total - repeat - (mass - s("mass_in_repeat", 0.0)) - compress,
            "repeat_forward_s": repeat - s("mass_in_repeat", 0.0),
            "mass_s": mass,
            "selection_s": compress - fit,
            "fit_s": fit,
        }


def run_prefill_breakdown(
    cfg: Config, model, device: torch.device, clock: Clock, notes: Notes, tokens: Callable[[int, int], torch.Tensor]
) -> list[dict[str, Any]]:
    """Rows of ``{n, setting, total_s, vs_none, forward_s, ..., peak_gib}`` for every length and setting."""
    from eval.speed.e2e import prefill, set_attention

    rows = []
    for n in cfg.breakdown_lengths:
        ids = tokens(1, n)
        for name in cfg.breakdown_settings or SETTINGS:
            row: dict[str, Any] = {"n": n, "setting": name, "kept": 1.0 if name == "none" else cfg.kept}
            try:
                press = make_setting(name, cfg)
                set_attention(model, "sdpa")  # CompressKVPress switches the model to "kvcompress" and leaves it so
                release(device)
                clock.memory_reset()
                totals = clock.times(lambda p=press, i=ids: prefill(model, p, i), cfg.e2e_warmup, cfg.e2e_repeats)
                row["total_s"], row["total_s_runs"] = statistics.median(totals), totals  # the runs: their spread
                row["peak_gib"], row["reserved_gib"] = clock.memory_peak_gib(), clock.memory_reserved_gib()
                parts = []
                for _ in range(cfg.e2e_repeats):
                    set_attention(model, "sdpa")
                    timer = StageTimer(clock)
                    with timer.active():
                        (seconds,) = clock.times(lambda p=press, i=ids: prefill(model, p, i), 0, 1)
                    parts.append(timer.breakdown(seconds))
                row.update({key: statistics.median(p[key] for p in parts) for key in parts[0]})
            except Exception as err:  # e.g. out of memory at the longest length: the row says so, the run goes on
                row["error"] = f"{type(err).__name__}: {err}"
                notes.add(f"prefill breakdown n={n} setting={name} failed: {row['error']}")
            rows.append(row)
            release(device)
    for row in rows:
        same = {r["setting"]: r for r in rows if r["n"] == row["n"] and "total_s" in r}
        if "total_s" in row and "none" in same:
            row["vs_none"] = row["total_s"] / same["none"]["total_s"]
        if row.get("peak_gib") is not None and same.get("snapkv", {}).get("peak_gib"):
            row["peak_vs_snapkv"] = row["peak_gib"] / same["snapkv"]["peak_gib"]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The breakdown as a markdown table (seconds, peak GiB)."""

    def cell(value: Any) -> str:
        return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)

    head = ["n", "setting", "total_s", "vs_none", *STAGES, "peak_vs_snapkv", "reserved_gib"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        values = [row.get(key) for key in head] if "error" not in row else [row["n"], row["setting"], row["error"]]
        lines.append("| " + " | ".join(cell(v) for v in values) + " |")
    return "\n".join(lines)


def run_mass_kernels(cfg: Config, device: torch.device, dtype: torch.dtype, clock: Clock, notes: Notes) -> list[dict]:
    """One layer's attention mass at the model's head shape: the fused kernel (CUDA) and the chunked PyTorch path,
    for m = n queries non-causal (the "context" source, a repeat chunk of n) and causal ("accumulated"), and the
    64 window queries. Rows ``{n, queries, causal, backend, median_s, tflops}`` (QK^T FLOPs of both passes)."""
    from kvcompress.selection import attention_mass_torch

    conf = cfg.model
    heads_q, heads_kv = conf["num_attention_heads"], conf["num_key_value_heads"]
    d = conf.get("head_dim") or conf["hidden_size"] // heads_q
    backends: dict[str, Callable] = {"torch": attention_mass_torch}
    if device.type == "cuda":
        from kvcompress.kernels.attention_mass import attention_mass_kernel

        backends = {"triton": attention_mass_kernel, **backends}
    else:
        notes.add("attention mass kernel: timed on CUDA only (the CPU runs the chunked PyTorch path)")
    rows = []
    generator = torch.Generator(device="cpu").manual_seed(cfg.seed)
    for n in cfg.breakdown_lengths:
        keys = torch.randn(1, heads_kv, n, d, generator=generator).to(device, dtype)
        for m, causal in ((n, False), (n, True), (min(64, n), True)):
            queries = torch.randn(1, heads_q, m, d, generator=generator).to(device, dtype)
            positions = torch.arange(n - m, n, device=device) if causal else None
            flops = 4 * heads_q * m * n * d * (0.5 if causal and m == n else 1.0)
            for backend, fn in backends.items():
                if backend == "torch" and device.type == "cuda" and m * n > TORCH_MASS_MAX:
                    notes.add(f"attention mass: the torch path is timed up to {TORCH_MASS_MAX} query-key pairs")
                    continue
                row: dict[str, Any] = {"n": n, "queries": m, "causal": causal, "backend": backend}
                try:
                    samples = clock.times(
                        lambda f=fn, q=queries, k=keys, p=positions: f(q, k, d**-0.5, p), 1, cfg.e2e_repeats
                    )
                    row["median_s"] = statistics.median(samples)
                    row["tflops"] = flops / row["median_s"] / 1e12
                except Exception as err:  # out of memory for the torch path's chunks at 64k, say
                    row["error"] = f"{type(err).__name__}: {err}"
                rows.append(row)
                release(device)
    return rows


def run_prefill_section(cfg: Config, device: torch.device, dtype: torch.dtype, clock: Clock, notes: Notes) -> dict:
    """The ``prefill`` section of ``python -m eval.speed``: its own random-weight model, the rows, the table."""
    import kvpress  # noqa: F401  (registers kvpress's presses before any timing)

    from eval.speed.e2e import build_model

    model = build_model(cfg, device, dtype)
    generator = torch.Generator(device="cpu").manual_seed(cfg.seed)
    vocab = model.config.vocab_size

    def tokens(batch: int, n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (batch, n), generator=generator).to(device)

    rows = run_prefill_breakdown(cfg, model, device, clock, notes, tokens)
    print("\n[prefill] breakdown per setting (seconds per prefill; medians)\n" + table(rows))
    del model
    release(device)
    mass = run_mass_kernels(cfg, device, dtype, clock, notes)
    print("\n[prefill] attention mass of one layer (seconds; QK^T TFLOP/s of both passes)")
    for row in mass:
        result = row.get("error") or f"{row['median_s']:.4g} s  {row['tflops']:.3g} TFLOP/s"
        print(f"n={row['n']} queries={row['queries']} causal={row['causal']} {row['backend']}: {result}")
    return {"rows": rows, "mass": mass, "settings": {name: SETTINGS[name] for name in SETTINGS}}
