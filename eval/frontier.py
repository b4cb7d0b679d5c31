"""The retention / cost frontier of press settings, from results already measured.

Each point (a press setting) takes its numbers from the files other harnesses wrote, nothing is re-run here:

* questions asked after compression: the RULER-style average of ``kvcompress eval --benchmark ruler``
  (``scores.json`` of a run directory and the method's name there), at each kept fraction given; or, for a list of
  run directories (e.g. one per ``--seed``), the average over their pooled contexts with its 95% bootstrap interval
  (each task's contexts resampled, as ``eval.ruler_paired`` pools them);
* the continuation: KL / SnapKV's KL (paired ratio with its 95% interval, and the worst context's ratio) from
  ``python -m eval.fidelity``'s ``summary.json`` and the press's label there; or, for a list of ``[run, label]``
  pairs (fidelity output directories, e.g. one per ``--seed``), paired against ``kl_baseline``'s rows of the same
  runs and pooled as ``eval.fidelity_paired`` pools them, with the count of contexts above ``kl_bound``;
* the prefill's cost: ``python -m eval.prefill_time``'s output lines for the press's label, the median CPU seconds
  over rounds divided by the baseline's (``baseline_prefill``'s label) in the same output (a ratio within one
  run: every log a point reads must time the baseline too), and the median peak resident memory above what the
  process held before the prefill;
* the prefill's cost on a GPU, where measured: ``python -m eval.speed --only prefill``'s JSON, the setting's
  ``vs_none`` (its prefill over the no-press one in the same run) and ``peak_vs_snapkv`` at ``gpu_tokens``.

    python -m eval.frontier --points results/frontier/points.yaml --output-dir results/frontier

Writes ``frontier.md`` (the table, also printed), ``frontier.json`` and ``frontier.png`` (against the prefill
cost: the RULER-style average per kept fraction, and the KL ratio with its interval; then the RULER-style average
at the first kept fraction against the KL ratio; and, where points have GPU numbers, the RULER-style average against
the GPU prefill cost; skipped with a note without matplotlib). Paths in the points
file are relative to the current directory.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from eval.fidelity_paired import paired_kl
from eval.ruler_paired import pooled_scores
from kvcompress.config import load_yaml
from kvcompress.fidelity.stats import bootstrap_ratio, context_ratios
from kvcompress.ruler.scoring import paired_difference

PREFILL_LINE = re.compile(
    r"^(?P<label>\S+) kept=\S+ tokens=\d+ round \d+: prefill [\d.]+ s wall, (?P<cpu>[\d.]+) s CPU"
    r"(?:, peak resident [\d.]+ GiB \(\+(?P<peak>[\d.]+) GiB\))?$"
)


@dataclass
class PointsFile:
    """The points file's keys: ``baseline_prefill`` ``[log, label]`` (the no-press prefill), ``points`` (each with
    ``name`` and optional ``ruler`` ``{kept: [run_dir or [run_dir, ...], method]}``, ``kl`` ``[summary.json, label]``
    or ``[[run, label], ...]``, ``prefill`` ``[log, label]`` and ``gpu`` ``[eval.speed JSON, setting]``), the kept
    fraction of the KL ratios, the pooled KL's baseline label and bound, and the context length and machine of the
    GPU numbers."""

    baseline_prefill: list = field(default_factory=list)
    points: list = field(default_factory=list)
    kl_kept: float = 0.25
    kl_baseline: str = "snapkv"
    kl_bound: float = 1.5
    gpu_tokens: int = 32768
    gpu_machine: str = "GPU"


def ruler_average(run_dir: str, method: str) -> float:
    """The RULER-style average of ``method`` in a run directory's ``scores.json``."""
    scores = json.loads((Path(run_dir) / "scores.json").read_text())
    if method not in scores["results"]:
        raise ValueError(f"ruler: no method {method!r} in {run_dir}/scores.json (has {list(scores['results'])})")
    return scores["results"][method]["average"]


def pooled_ruler(run_dirs: list[str], method: str, answers: dict | None = None) -> dict:
    """The RULER-style average of ``method`` over the pooled contexts of several runs, its 95% bootstrap interval
    (each task's contexts resampled) and the fewest contexts of any task. ``answers``: the expected answers of the
    runs' contexts, remembered across calls (:func:`eval.ruler_paired.example_scores`)."""
    pooled = pooled_scores(list(run_dirs), method, answers)
    scores = {task: list(by_key.values()) for task, by_key in pooled.items()}
    interval = paired_difference(scores, {task: [0.0] * len(values) for task, values in scores.items()})
    contexts = min(len(values) for values in scores.values())
    return dict(average=interval["first"], low=interval["low"], high=interval["high"], contexts=contexts)


def pooled_kl_ratio(pairs: list, baseline: str, kept: float, bound: float) -> dict:
    """KL / ``baseline``'s KL over the contexts of several fidelity runs (``[[run, label], ...]``), each context
    paired within its run: the ratio of means with its 95% paired interval, the worst context's ratio and how many
    contexts are above ``bound``."""
    kl, base, _ = paired_kl([(run, label, baseline) for run, label in pairs], kept)
    ratio, low, high = bootstrap_ratio(kl, base)
    per_context = context_ratios(kl, base)[0]  # contexts where the baseline's KL is 0 have no ratio
    return dict(
        ratio=ratio, low=low, high=high, worst=float(per_context.max()), contexts=len(kl),
        above=int((per_context > bound).sum()),
    )  # fmt: skip


def kl_ratio(summary: str, label: str, kept: float) -> dict:
    """KL / SnapKV's KL of ``label`` at ``kept`` in an eval.fidelity ``summary.json``: mean, interval, worst."""
    for entry in json.loads(Path(summary).read_text())["summary"]:
        if entry["press"] == label and abs(entry["kept"] - kept) < 1e-9:
            return dict(
                ratio=entry["kl_vs_snapkv"],
                low=entry["kl_vs_snapkv_lo"],
                high=entry["kl_vs_snapkv_hi"],
                worst=entry["kl_ratio_max"],
                contexts=entry["contexts"],
            )
    raise ValueError(f"kl: no press {label!r} at kept {kept} in {summary}")


def prefill_cost(log: str, label: str) -> tuple[float, float | None]:
    """Median CPU seconds and median peak resident GiB above the start of ``label``'s prefills in an
    eval.prefill_time output."""
    cpu, peak = [], []
    for line in Path(log).read_text().splitlines():
        match = PREFILL_LINE.match(line.strip())
        if match and match["label"] == label:
            cpu.append(float(match["cpu"]))
            if match["peak"] is not None:
                peak.append(float(match["peak"]))
    if not cpu:
        raise ValueError(f"prefill: no line for {label!r} in {log}")
    return statistics.median(cpu), statistics.median(peak) if peak else None


def gpu_cost(speed_json: str, setting: str, tokens: int) -> dict:
    """``vs_none`` and ``peak_vs_snapkv`` of ``setting`` at ``tokens`` in an eval.speed JSON's prefill breakdown."""
    for row in json.loads(Path(speed_json).read_text())["prefill_breakdown"]["rows"]:
        if row["setting"] == setting and row["n"] == tokens and "vs_none" in row:
            return dict(ratio=row["vs_none"], peak_vs_snapkv=row.get("peak_vs_snapkv"), source=speed_json)
    raise ValueError(f"gpu: no setting {setting!r} at {tokens} tokens in {speed_json}")


def collect(points_file: str) -> dict:
    """Every point's numbers (see the module docstring)."""
    spec = PointsFile(**load_yaml(Path(points_file), Path(points_file), PointsFile, flag="--points"))
    base_log, base_label = spec.baseline_prefill
    base_cpu, base_peak = prefill_cost(base_log, base_label)
    kept_kl = float(spec.kl_kept)
    answers: dict = {}  # one table's runs share a few context settings: each is rebuilt once
    rows = []
    for point in spec.points:
        row = dict(
            name=point["name"], ruler={}, ruler_interval={}, kl=None, prefill_ratio=None, peak_gib=None, gpu=None
        )
        for kept, (runs, method) in (point.get("ruler") or {}).items():
            if isinstance(runs, str):
                row["ruler"][str(kept)] = ruler_average(runs, method)
            else:
                pooled = pooled_ruler(runs, method, answers)
                row["ruler"][str(kept)] = pooled.pop("average")
                row["ruler_interval"][str(kept)] = pooled
        kl = point.get("kl")
        if kl and isinstance(kl[0], str):
            row["kl"] = kl_ratio(*kl, kept_kl)
        elif kl:
            row["kl"] = pooled_kl_ratio(kl, spec.kl_baseline, kept_kl, float(spec.kl_bound))
        if point.get("prefill"):
            log, label = point["prefill"]
            cpu, peak = prefill_cost(log, label)
            row["prefill_ratio"] = cpu / (base_cpu if log == base_log else prefill_cost(log, base_label)[0])
            row["peak_gib"] = peak
        if point.get("gpu"):
            row["gpu"] = gpu_cost(*point["gpu"], int(spec.gpu_tokens))
        rows.append(row)
    fractions = sorted({kept for row in rows for kept in row["ruler"]}, key=float)
    gpu = dict(tokens=int(spec.gpu_tokens), machine=spec.gpu_machine)
    return dict(
        fractions=fractions, kl_kept=kept_kl, kl_bound=float(spec.kl_bound), baseline_peak_gib=base_peak, gpu=gpu,
        points=rows,
    )  # fmt: skip


def markdown(result: dict) -> str:
    """The table: a pooled RULER-style cell shows its interval, and its contexts per task where they differ from
    the table's most common count; a column of contexts above the KL bound where any point has pooled KL rows."""
    fractions = result["fractions"]
    counts = [i["contexts"] for row in result["points"] for i in row.get("ruler_interval", {}).values()]
    usual = max(set(counts), key=counts.count) if counts else None
    above = any(row["kl"] and "above" in row["kl"] for row in result["points"])
    head = ["setting", *[f"RULER-style avg, {float(f):.0%} kept" for f in fractions]]
    head += [f"KL / SnapKV at {result['kl_kept']:.0%} kept [95% CI]", "worst context"]
    head += [f"contexts above {result.get('kl_bound', 1.5)}x"] if above else []
    head += ["CPU prefill / no press", "peak above start, GiB"]
    on_gpu = any(row.get("gpu") for row in result["points"])
    if on_gpu:
        where = f"{result['gpu']['machine']}, {result['gpu']['tokens'] // 1024}k"
        head += [f"GPU prefill / no press ({where})", "GPU peak / SnapKV's"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def fmt(value, pattern: str) -> str:
        return "-" if value is None else pattern.format(value)

    def ruler_cell(row: dict, kept: str) -> str:
        interval = row.get("ruler_interval", {}).get(kept)
        cell = fmt(row["ruler"].get(kept), "{:.1f}")
        if interval:
            cell += f" [{interval['low']:.1f}, {interval['high']:.1f}]"
            cell += f" ({interval['contexts']} per task)" if interval["contexts"] != usual else ""
        return cell

    for row in result["points"]:
        kl = row["kl"]
        cells = [row["name"], *[ruler_cell(row, f) for f in fractions]]
        cells.append("-" if kl is None else f"{kl['ratio']:.2f} [{kl['low']:.2f}, {kl['high']:.2f}]")
        cells.append(fmt(kl and kl["worst"], "{:.2f}"))
        cells += [fmt(kl and kl.get("above"), "{:d}")] if above else []
        cells += [fmt(row["prefill_ratio"], "{:.2f}"), fmt(row["peak_gib"], "{:.3f}")]
        if on_gpu:
            gpu = row.get("gpu") or {}
            cells += [fmt(gpu.get("ratio"), "{:.2f}"), fmt(gpu.get("peak_vs_snapkv"), "{:.3f}")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    on_gpu = [row for row in result["points"] if row.get("gpu")]
    fig, axes = plt.subplots(1, 4 if on_gpu else 3, figsize=(24 if on_gpu else 18, 5.2))
    left, right, both = axes[:3]
    points = [row for row in result["points"] if row["prefill_ratio"] is not None]
    for marker, kept in zip("os^D", result["fractions"], strict=False):
        shown = [row for row in points if kept in row["ruler"]]
        x, y = [r["prefill_ratio"] for r in shown], [r["ruler"][kept] for r in shown]
        left.scatter(x, y, marker=marker, label=f"{float(kept):.0%} kept")
        for row in shown:
            left.annotate(row["name"], (row["prefill_ratio"], row["ruler"][kept]), fontsize=7)
    left.set(xlabel="CPU prefill / no press", ylabel="RULER-style average", title="Questions after compression")
    left.legend()
    shown = [row for row in points if row["kl"] is not None]
    ratios = [row["kl"]["ratio"] for row in shown]
    errors = [[r - row["kl"]["low"] for r, row in zip(ratios, shown, strict=True)]]
    errors.append([row["kl"]["high"] - r for r, row in zip(ratios, shown, strict=True)])
    right.errorbar([row["prefill_ratio"] for row in shown], ratios, yerr=errors, fmt="o", capsize=3)
    for row in shown:
        right.annotate(row["name"], (row["prefill_ratio"], row["kl"]["ratio"]), fontsize=7)
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set(
        xlabel="CPU prefill / no press",
        ylabel=f"KL / SnapKV's KL at {result['kl_kept']:.0%} kept",
        title="Continuation (lower is better)",
    )
    first = result["fractions"][0] if result["fractions"] else None
    shown = [row for row in result["points"] if row["kl"] is not None and first in row["ruler"]]
    both.scatter([row["kl"]["ratio"] for row in shown], [row["ruler"][first] for row in shown])
    for row in shown:
        both.annotate(row["name"], (row["kl"]["ratio"], row["ruler"][first]), fontsize=7)
    both.axvline(1.0, color="grey", linewidth=0.8)
    both.set(
        xlabel=f"KL / SnapKV's KL at {result['kl_kept']:.0%} kept",
        ylabel=f"RULER-style average, {float(first):.0%} kept" if first else "",
        title="Questions against continuation (top left is better)",
    )
    if on_gpu:
        gpu_axis = axes[3]
        for marker, kept in zip("os^D", result["fractions"], strict=False):
            shown = [row for row in on_gpu if kept in row["ruler"]]
            gpu_axis.scatter([r["gpu"]["ratio"] for r in shown], [r["ruler"][kept] for r in shown], marker=marker)
            for row in shown:
                gpu_axis.annotate(row["name"], (row["gpu"]["ratio"], row["ruler"][kept]), fontsize=7)
        where = f"{result['gpu']['machine']}, {result['gpu']['tokens'] // 1024}k tokens"
        gpu_axis.set(xlabel=f"GPU prefill / no press ({where})", ylabel="RULER-style average", title="Against GPU cost")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.frontier", description=__doc__.splitlines()[0])
    parser.add_argument("--points", required=True, help="YAML file of points (see results/frontier/points.yaml)")
    parser.add_argument("--output-dir", default="results/frontier", help="where the table and plot go")
    args = parser.parse_args(argv)
    try:
        result = collect(args.points)
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise SystemExit(f"frontier: {exc}") from None
    out = Path(args.output_dir)
    table = markdown(result)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "frontier.md").write_text(table + "\n")
        (out / "frontier.json").write_text(json.dumps(result, indent=1) + "\n")
    except OSError as exc:
        raise SystemExit(f"frontier: --output-dir: {exc}") from None
    print(table)
    try:
        plot(result, out / "frontier.png")
    except ImportError as exc:
        print(f"frontier.png skipped: the plot needs {exc.name or 'matplotlib'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
