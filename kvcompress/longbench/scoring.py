"""Scores: LongBench's metric per task x 100, by length bucket, from the predictions on disk, with completeness."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvcompress.longbench import metrics
from kvcompress.longbench.config import Config, UsageError
from kvcompress.longbench.data import Example
from kvcompress.longbench.predict import read_predictions
from kvcompress.longbench.tasks import BUCKETS, OFFLINE_METRICS


def _nan_to_none(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def check_metric_packages(tasks: list[str]) -> None:
    """UsageError naming what to install when a task's metric needs a package that is missing (checked before
    any prediction, so no work is made that cannot be scored)."""
    import importlib.util

    rouge = [t for t in tasks if metrics.TASK_METRICS.get(t, OFFLINE_METRICS.get(t)) in ("rouge", "rouge_score")]
    if rouge and importlib.util.find_spec("rouge") is None:
        raise UsageError(f"--tasks: {rouge[0]} is scored with ROUGE-L, which needs the rouge package: "
                         "pip install 'kvcompress[eval]'")  # fmt: skip


def score_examples(task: str, examples: list[Example], predictions: list) -> dict[str, Any]:
    """LongBench scores x 100 of one task: "overall", the buckets ("0-4k", "4-8k", "8k+", None if empty), sizes.
    A RULER task (examples with ``expected``; ``predictions``: one list of answers per example): RULER's string
    match x 100 as "overall", its 95% bootstrap interval over examples ("ci_low", "ci_high"), "questions"."""
    if examples and examples[0].expected:  # RULER: string matching, an interval over examples, no length buckets
        from kvcompress.ruler.scoring import score_task
        from kvcompress.ruler.tasks import TASKS as RULER_TASKS

        result = score_task(RULER_TASKS[task].metric, predictions, [e.expected for e in examples])
        return result | {b: None for b in BUCKETS} | {f"n_{b}": None for b in BUCKETS}
    answers = [e.answers for e in examples]
    classes = [e.all_classes for e in examples]
    lengths = [e.length for e in examples]
    if task in metrics.TASK_METRICS:
        result = metrics.score_task(task, predictions, answers, classes, lengths=lengths)
        overall = result.get("overall", result.get("score"))
        scores = {"overall": overall, **{b: result.get(b) for b in BUCKETS}}
        sizes = {f"n_{b}": result.get(f"n_{b}") for b in BUCKETS}
    else:  # offline task: one of LongBench's metric functions, bucketed the LongBench-E way
        metric = getattr(metrics, OFFLINE_METRICS[task])
        values = [max(float(metric(p, gt)) for gt in a) for p, a in zip(predictions, answers, strict=True)]
        per_bucket: dict[str, list[float]] = {b: [] for b in BUCKETS}
        for value, length in zip(values, lengths, strict=True):
            per_bucket["0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"].append(value)
        scores = {"overall": round(100 * sum(values) / len(values), 2)}
        scores |= {b: round(100 * sum(v) / len(v), 2) if v else None for b, v in per_bucket.items()}
        sizes = {f"n_{b}": len(v) for b, v in per_bucket.items()}
    return {k: _nan_to_none(v) for k, v in scores.items()} | sizes


def collect(cfg: Config, plan: dict[str, list[Example]], out: Path) -> dict[str, Any]:
    """Scores of every requested (method, task) from the predictions on disk, with completeness."""
    results: dict[str, Any] = {}
    for method in cfg.methods:
        per_task: dict[str, Any] = {}
        for task, examples in plan.items():
            found = read_predictions(out, method, task)
            done = [e for e in examples if e.key in found]
            entry: dict[str, Any] = {"n": len(done), "n_expected": len(examples)}
            entry["complete"] = len(done) == len(examples)
            if done:
                entry |= score_examples(task, done, [found[e.key]["prediction"] for e in done])
            else:
                entry |= {"overall": None, **{b: None for b in BUCKETS}}
            per_task[task] = entry
        overall = [t["overall"] for t in per_task.values()]
        average = round(sum(overall) / len(overall), 2) if all(v is not None for v in overall) else None
        buckets = {}
        for b in BUCKETS:
            values = [t[b] for t in per_task.values() if t.get(b) is not None]
            buckets[b] = round(sum(values) / len(values), 2) if values else None
        results[method] = {
            "tasks": per_task,
            "average": average,
            "buckets": buckets,
            "complete": all(t["complete"] for t in per_task.values()),
        }
    return results
