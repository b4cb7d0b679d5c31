"""The speed goals, the printed tables and the machine's environment."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
from typing import Any

import torch

from eval.speed.config import GOALS


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

