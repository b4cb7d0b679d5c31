"""Reports: results.md (Table 4's layout, also printed), scores.json, scores.csv and scores.png."""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvcompress.longbench import offline_suite
from kvcompress.longbench.config import (
    EMBEDDED_LABEL,
    METHODS,
    Config,
    changed_press_options,
    model_label,
    ruler_length,
)
from kvcompress.longbench.data import Example
from kvcompress.longbench.scoring import collect
from kvcompress.longbench.tasks import BUCKETS, COLUMN_NAMES, LONGBENCH_TASKS

log = logging.getLogger("kvcompress.longbench")

# The paper's Table 4 (Qwen2.5-7B-Instruct, cache kept at 25%), in LONGBENCH_TASKS order, then the average.
PAPER_TABLE4: dict[str, list[float]] = {
    "Exact": [43.76, 50.08, 56.43, 43.71, 34.16, 24.32, 64.00, 87.53, 38.56, 14.67, 99.67, 69.96, 62.17, 53.00],
    "StreamingLLM": [23.17, 25.49, 26.45, 20.89, 29.65, 22.25, 52.33, 75.17, 35.79, 12.50, 24.83, 68.48, 56.22, 36.40],
    "PyramidKV": [21.59, 29.96, 39.38, 30.24, 27.12, 21.13, 43.33, 86.77, 38.27, 15.88, 61.06, 67.40, 59.20, 41.64],
    "BalanceKV": [29.50, 36.57, 37.89, 23.71, 30.27, 21.98, 55.00, 73.83, 34.56, 12.67, 71.67, 65.48, 62.57, 42.75],
    "Uniform": [26.91, 37.51, 38.46, 25.93, 30.02, 21.86, 54.33, 81.71, 35.37, 15.33, 63.44, 64.84, 61.34, 42.85],
    "SnapKV": [25.52, 30.13, 44.36, 31.80, 29.70, 22.10, 49.33, 88.32, 37.15, 16.67, 89.06, 69.16, 56.33, 45.36],
    "CompressKV": [33.23, 38.13, 43.43, 33.37, 30.30, 22.26, 54.33, 86.15, 35.38, 14.33, 98.00, 64.85, 60.43, 47.25],
}


def _cell(entry: dict[str, Any], value: float | None) -> str:
    text = "–" if value is None else f"{value:.2f}"
    if value is not None and entry.get("ci_low") is not None:  # RULER: the bootstrap interval over examples
        text += f" [{entry['ci_low']:.0f}, {entry['ci_high']:.0f}]"
    if not entry.get("complete", True):
        text += f" (partial {entry['n']}/{entry['n_expected']})" if "n" in entry else " (partial)"
    return text


def markdown(cfg: Config, plan: dict[str, list[Example]], results: dict[str, Any]) -> str:
    """results.md: Table 4's layout (rows = methods, columns = tasks + Average), then the length buckets."""
    complete = all(r["complete"] for r in results.values())
    ruler = cfg.benchmark == "ruler"
    suite = "Offline suite" if all(t in offline_suite.TASKS for t in plan) else "LongBench-E"
    suite = f"RULER-style, {ruler_length(cfg)} tokens" if ruler else suite
    title = f"# {suite}: {model_label(cfg)}, cache kept at {cfg.ratio:g} (compression_ratio {1 - cfg.ratio:g})"
    lines = [title + ("" if complete else " (partial)"), ""]
    if not complete:
        lines += [
            "**Partial results**: cells marked (partial k/n) hold k of the n requested examples; "
            "rerun the same command to finish.",
            "",
        ]
    columns = [COLUMN_NAMES[t] for t in plan]
    lines += ["| Method | " + " | ".join(columns) + " | Average |", "|---" * (len(columns) + 2) + "|"]
    for method, r in results.items():
        cells = [_cell(r["tasks"][t], r["tasks"][t]["overall"]) for t in plan]
        avg = _cell({"complete": r["complete"]}, r["average"])
        lines.append(f"| {METHODS[method]} | " + " | ".join(cells) + f" | {avg} |")
    sizes = ", ".join(f"{COLUMN_NAMES[t]} {len(e)}" for t, e in plan.items())
    changed = changed_press_options(cfg)
    settings = "; ".join(f"{METHODS[m]} {', '.join(f'{k}={v}' for k, v in o.items())}" for m, o in changed.items())
    if ruler:
        questions = ", ".join(f"{COLUMN_NAMES[t]} {sum(len(e.questions) for e in x)}" for t, x in plan.items())
        lines += [
            "",
            "RULER's string match per task x 100 (fraction of the expected strings in the answer; qa: any of them), "
            "questions asked after the context is compressed; [95% bootstrap interval over contexts]; Average = "
            f"unweighted mean over the tasks. Contexts per task: {sizes}; questions: {questions}.",
            *([f"Press settings other than the defaults: {settings}."] if changed else []),
        ]
        return "\n".join(lines) + "\n"
    lines += [
        "",
        f"LongBench metric per task x 100; Average = unweighted mean over the tasks. Examples per task: {sizes}.",
        *([f"Press settings other than the defaults: {settings}."] if changed else []),
        "",
        "## By length (LongBench-E buckets of the `length` field, words; mean over the tasks with examples there)",
        "",
        "| Method | " + " | ".join(BUCKETS) + " |",
        "|---" * (len(BUCKETS) + 1) + "|",
    ]
    for method, r in results.items():
        cells = [_cell({"complete": r["complete"]}, r["buckets"][b]) for b in BUCKETS]
        lines.append(f"| {METHODS[method]} | " + " | ".join(cells) + " |")
    if "qwen2.5-7b-instruct" in model_label(cfg).lower() and cfg.ratio == 0.25 and set(plan) <= set(LONGBENCH_TASKS):
        order = list(LONGBENCH_TASKS)
        lines += ["", "## Paper, Table 4 (reference; Average over the columns shown)", ""]
        lines += ["| Method | " + " | ".join(columns) + " | Average |", "|---" * (len(columns) + 2) + "|"]
        for name, row in PAPER_TABLE4.items():
            values = [row[order.index(t)] for t in plan]
            average = row[-1] if len(values) == len(order) else sum(values) / len(values)
            lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {average:.2f} |")
    return "\n".join(lines) + "\n"


def write_csv(path: Path, plan: dict[str, list[Example]], results: dict[str, Any]) -> None:
    """scores.csv: one row per method, task (and the average) and bucket ("overall" first), with completeness."""
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "task", "bucket", "score", "n", "n_expected", "complete", "ci_low", "ci_high"])
        for method, r in results.items():
            for task in plan:
                t = r["tasks"][task]
                counts = [t["n"], t["n_expected"], t["complete"], t.get("ci_low"), t.get("ci_high")]  # interval: RULER
                writer.writerow([method, task, "overall", t["overall"], *counts])
                for b in BUCKETS:
                    writer.writerow([method, task, b, t[b], t.get(f"n_{b}"), "", t["complete"]])
            writer.writerow([method, "average", "overall", r["average"], "", "", r["complete"]])
            for b in BUCKETS:
                writer.writerow([method, "average", b, r["buckets"][b], "", "", r["complete"]])


def plot(path: Path, cfg: Config, plan: dict[str, list[Example]], results: dict[str, Any]) -> None:
    """Grouped bars: tasks + Average on x, one bar per method; partial bars hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [*plan, "average"]
    width = 0.8 / max(1, len(results))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 * len(columns) + 2), 4.2))
    for i, (method, r) in enumerate(results.items()):
        xs, heights, hatches = [], [], []
        for j, column in enumerate(columns):
            entry = r if column == "average" else r["tasks"][column]
            value = r["average"] if column == "average" else entry["overall"]
            if value is not None:
                xs.append(j + (i - (len(results) - 1) / 2) * width)
                heights.append(value)
                hatches.append("" if entry["complete"] else "//")
        bars = ax.bar(xs, heights, width, label=METHODS[method])
        for bar, hatch in zip(bars, hatches, strict=True):
            bar.set_hatch(hatch)
    ax.set_xticks(range(len(columns)))
    ax.set_xticklabels([COLUMN_NAMES.get(c, "Average") for c in columns], rotation=30, ha="right")
    ax.set_ylabel("score (RULER string match x 100)" if cfg.benchmark == "ruler" else "score (LongBench metric x 100)")
    complete = all(r["complete"] for r in results.values())
    ax.set_title(f"{model_label(cfg)}, cache kept at {cfg.ratio:g}" + ("" if complete else " (partial: hatched)"))
    ax.legend(fontsize=8, ncol=min(3, len(results)))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_tables(cfg: Config, plan: dict[str, list[Example]], out: Path) -> bool:
    """scores.json, scores.csv, results.md (also printed) and scores.png (skipped with a note without matplotlib);
    returns whether all is complete."""
    results = collect(cfg, plan, out)
    complete = all(r["complete"] for r in results.values())
    payload = {
        "complete": complete,
        "model": cfg.model or EMBEDDED_LABEL,
        "benchmark": cfg.benchmark,
        "ratio": cfg.ratio,
        "compression_ratio": round(1 - cfg.ratio, 6),
        "tasks": list(plan),
        "methods": list(cfg.methods),
        "results": results,
        "settings": asdict(cfg),
    }
    (out / "scores.json").write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    write_csv(out / "scores.csv", plan, results)
    text = markdown(cfg, plan, results)
    (out / "results.md").write_text(text, encoding="utf-8")
    print(text, flush=True)
    try:  # the tables above are written and printed whatever happens to the plot
        plot(out / "scores.png", cfg, plan, results)
    except ImportError as err:
        log.warning(f"scores.png skipped: the plot needs {err.name or 'matplotlib'}: pip install 'kvcompress[eval]'")
    log.info(f"{'complete' if complete else 'PARTIAL'} results in {out}")
    return complete
