"""Summaries of a study's rows with bootstrap intervals, and its output files (CSV, JSON, Markdown, plot)."""

from __future__ import annotations

import csv
import json
import math
import os
import platform
from importlib.metadata import version
from pathlib import Path

import torch

from kvcompress.fidelity.stats import bootstrap_mean, bootstrap_ratio, context_ratios

METRICS = ("kl", "top1", "needle", "layer_err", "cache_mib", "peak_cache_mib", "prefill_ratio")
BASELINE = "snapkv"  # the KL ratio's denominator: the press spec labelled exactly this, at the same kept fraction
GOAL_RATIO = 0.7


def summarize(
    rows: list[dict], plan: list[tuple[str, float]], contexts: list[str], resamples: int = 2000, seed: int = 0
) -> list[dict]:
    """One summary per planned ``(press label, kept)``: mean and 95% bootstrap interval over contexts of every
    metric (``needle``: a context carries its two trials), the paired ratio ``mean KL / mean KL of snapkv``,
    ``kept_everything`` (a masking press), ``best_kl`` (lowest KL at its kept fraction among the presses that
    really compressed, on every context) and ``error`` (a press that never ran)."""
    order = {name: i for i, name in enumerate(contexts)}
    groups: dict[tuple[str, float], list[dict]] = {key: [] for key in plan}
    errors: dict[tuple[str, float], str] = {}
    for row in rows:
        key = (row["press"], float(row["kept"]))
        if key not in groups or row["context"] not in order:
            continue
        if "error" in row:
            errors[key] = row["error"]
        else:
            groups[key].append(row)
    for group in groups.values():
        group.sort(key=lambda r: order[r["context"]])
    table = []
    for (label, kept), group in groups.items():
        entry: dict = dict(press=label, kept=kept, contexts=len(group), kept_everything=False, best_kl=False)
        entry["error"] = errors.get((label, kept), "") if not group else ""
        if group:
            for metric in METRICS:
                values = [r["needle_hits"] for r in group] if metric == "needle" else [r[metric] for r in group]
                entry[metric], entry[f"{metric}_lo"], entry[f"{metric}_hi"] = bootstrap_mean(values, resamples, seed)
            entry["kept_everything"] = any(r["kept_everything"] for r in group)
            entry.update(_versus_baseline(label, group, groups.get((BASELINE, kept), []), resamples, seed))
        table.append(entry)
    for kept in {k for _, k in plan}:
        ranked = [e for e in table if e["kept"] == kept and e["contexts"] and e["press"] != "exact"]
        ranked = [e for e in ranked if not e["kept_everything"] and e["contexts"] == len(contexts)]
        if ranked:
            min(ranked, key=lambda e: e["kl"])["best_kl"] = True
    return table


def _versus_baseline(label: str, group: list[dict], baseline: list[dict], resamples: int, seed: int) -> dict:
    """``kl_vs_snapkv`` [lo, hi] (ratio of mean KLs) on the contexts both ran, the per-context ratios' mean, min
    and max (``kl_ratio_mean`` / ``_min`` / ``_max``: a rare large loss shows in the max, not in the ratio of
    means; contexts where SnapKV's KL is 0 are left out of them), and whether KL <= 0.7 x SnapKV's with the two
    KL intervals apart (``kl_goal``)."""
    if label == "exact" or not baseline:
        return {}
    theirs = {r["context"]: r["kl"] for r in baseline}
    common = [r for r in group if r["context"] in theirs]
    if not common:
        return {}
    ours, base = [r["kl"] for r in common], [theirs[r["context"]] for r in common]
    ratio, lo, hi = bootstrap_ratio(ours, base, resamples, seed)
    _, ours_hi = bootstrap_mean(ours, resamples, seed)[1:]
    base_lo = bootstrap_mean(base, resamples, seed)[1]
    goal = ratio <= GOAL_RATIO and ours_hi < base_lo and not any(r["kept_everything"] for r in group)
    result = dict(kl_vs_snapkv=ratio, kl_vs_snapkv_lo=lo, kl_vs_snapkv_hi=hi, kl_goal=goal)
    per_context = context_ratios(ours, base)[0]
    if per_context.size:
        result.update(kl_ratio_mean=float(per_context.mean()), kl_ratio_min=float(per_context.min()),
                      kl_ratio_max=float(per_context.max()))  # fmt: skip
    return result


def environment(model) -> dict:
    """Versions, CPU, threads and device of this process."""
    import transformers

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    return dict(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        kvpress=version("kvpress"),
        cpu=cpu,
        cpu_count=os.cpu_count(),
        threads=torch.get_num_threads(),
        device=str(model.device),
        dtype=str(model.dtype),
    )


def _fmt(value, digits: int = 4) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _interval(entry: dict, metric: str, digits: int = 4) -> str:
    if metric not in entry:
        return "n/a"
    return (
        f"{_fmt(entry[metric], digits)} [{_fmt(entry[metric + '_lo'], digits)}, {_fmt(entry[metric + '_hi'], digits)}]"
    )


def _per_context(entry: dict) -> str:
    if "kl_ratio_mean" not in entry:
        return "n/a"
    return f"{entry['kl_ratio_mean']:.2f} ({entry['kl_ratio_min']:.2f}-{entry['kl_ratio_max']:.2f})"


def markdown(table: list[dict], contexts: int) -> str:
    """The Markdown table of ``summarize``'s rows, with notes on masking presses, failures and partial rows."""
    lines = [
        "| press | kept | KL [95% CI] | top-1 | needle [95% CI] | layer err | cache MiB | peak cache MiB | "
        "prefill ratio | KL / SnapKV [95% CI] | per-context KL / SnapKV: mean (min-max) | masked |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for e in table:
        if not e["contexts"]:
            lines.append(f"| {e['press']} | {e['kept']:g} | failed |" + " |" * 9)
            notes.append(f"- {e['press']} at kept {e['kept']:g} could not run: {e['error']}")
            continue
        kl = _interval(e, "kl")
        if e["best_kl"]:
            kl = f"**{kl}**"
        masked = "yes †" if e["kept_everything"] else ""
        partial = "" if e["contexts"] == contexts else f" ({e['contexts']}/{contexts} contexts)"
        lines.append(
            f"| {e['press']}{partial} | {e['kept']:g} | {kl} | {_fmt(e['top1'], 3)} | {_interval(e, 'needle', 2)} | "
            f"{_fmt(e['layer_err'])} | {_fmt(e['cache_mib'], 2)} | {_fmt(e['peak_cache_mib'], 2)} | "
            f"{_fmt(e['prefill_ratio'], 2)} | {_interval(e, 'kl_vs_snapkv', 3)} | {_per_context(e)} | {masked} |"
        )
    text = "\n".join(lines)
    text += "\n\nBold: the lowest KL at its kept fraction among presses that removed rows and ran on every context."
    if any(e["kept_everything"] for e in table):
        text += (
            "\n\n† masks only: after its `with` block the cache still holds (nearly) every row (>= 99% of the full "
            "cache's bytes), so the press saves no memory here; kvpress 0.5.5's head-wise presses (AdaKV, KVzip) "
            "mask evicted rows in later attention calls instead of removing them. Not ranked as a compressor."
        )
    if notes:
        text += "\n\n" + "\n".join(notes)
    return text + "\n"


def write_csv(path: Path, rows: list[dict]) -> None:
    """``rows`` as CSV, columns in first-seen order across all rows."""
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def layer_rows(rows: list[dict]) -> list[dict]:
    """One row per (context, press, kept, layer) with its relative attention error."""
    return [
        dict(context=r["context"], press=r["press"], kept=r["kept"], layer=i, rel_err=err)
        for r in rows
        if "error" not in r
        for i, err in enumerate(r["layer_errors"])
    ]


def plot_kl(path: Path, table: list[dict]) -> None:
    """KL against kept fraction, one line per press, bootstrap intervals as error bars, log y axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    colours = plt.get_cmap("tab20").colors
    for index, label in enumerate(dict.fromkeys(e["press"] for e in table if e["press"] != "exact")):
        points = sorted((e["kept"], e) for e in table if e["press"] == label and e["contexts"] and e["kl"] > 0)
        if not points:
            continue
        kept = [k for k, _ in points]
        kl = [e["kl"] for _, e in points]
        err = [[e["kl"] - e["kl_lo"] for _, e in points], [e["kl_hi"] - e["kl"] for _, e in points]]
        masked = any(e["kept_everything"] for _, e in points)
        ax.errorbar(kept, kl, yerr=err, marker="os^vD<>"[index % 7], capsize=3, color=colours[index % 20],
                    linestyle="--" if masked else "-", label=f"{label} (masks only)" if masked else label)  # fmt: skip
    ax.set_yscale("log")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_xlabel("kept fraction of the context cache")
    ax.set_ylabel("KL(exact || press), mean over contexts")
    ax.set_title("Next-token KL on the teacher-forced continuation (95% bootstrap CI)")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out: Path, table: list[dict], rows: list[dict], meta: dict, contexts: int) -> str:
    """Write ``summary.csv``, ``summary.json`` (summary + ``meta``), ``layer_errors.csv``, ``fidelity.md`` and
    ``fidelity_kl.png`` into ``out``; returns the Markdown table."""
    write_csv(out / "summary.csv", table)
    (out / "summary.json").write_text(json.dumps(dict(summary=table, **meta), indent=1) + "\n")
    write_csv(out / "layer_errors.csv", layer_rows(rows))
    text = markdown(table, contexts)
    (out / "fidelity.md").write_text(text)
    plot_kl(out / "fidelity_kl.png", table)
    return text
