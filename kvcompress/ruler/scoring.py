"""RULER's scoring: case-insensitive string matching of the expected strings in a prediction.

RULER (arXiv 2404.06654, ``scripts/eval/synthetic/constants.py`` of NVIDIA/RULER) scores the NIAH variants,
variable tracking and the word-extraction tasks by ``string_match_all`` (the fraction of the expected strings
that occur in the prediction) and QA by ``string_match_part`` (1 if any expected string occurs), both after
lower-casing, on the prediction stripped of control characters; a task's score is the mean x 100. Here an
example (one context) may carry several questions: its score is the mean over its questions, and the task's
interval is a percentile bootstrap over examples (a context is resampled with all its questions).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from kvcompress.fidelity.stats import bootstrap_mean, resample_indices

METRICS = ("all", "part")
_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """The prediction as RULER scores it: stripped, control characters turned into newlines."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, expected: Sequence[str]) -> float:
    """Fraction of ``expected`` strings found in ``prediction`` (case-insensitive substring), in [0, 1]."""
    text = postprocess(prediction).lower()
    return sum(e.lower() in text for e in expected) / len(expected)


def string_match_part(prediction: str, expected: Sequence[str]) -> float:
    """1.0 if any of the ``expected`` strings is found in ``prediction`` (case-insensitive substring), else 0.0."""
    text = postprocess(prediction).lower()
    return float(any(e.lower() in text for e in expected))


def match(metric: str, prediction: str, expected: Sequence[str]) -> float:
    """RULER's ``metric`` (``"all"`` or ``"part"``) of one answer."""
    if metric not in METRICS:
        raise ValueError(f"metric: must be one of {', '.join(METRICS)}, got {metric!r}")
    if not expected:
        raise ValueError("expected: at least one expected string")
    return string_match_all(prediction, expected) if metric == "all" else string_match_part(prediction, expected)


def example_score(metric: str, predictions: Sequence[str], expected: Sequence[Sequence[str]]) -> float:
    """Mean of ``metric`` over one context's questions: ``predictions[i]`` answers the question expecting
    ``expected[i]``."""
    if len(predictions) != len(expected) or not predictions:
        raise ValueError(f"predictions: expected {len(expected)} answers (one per question), got {len(predictions)}")
    return sum(match(metric, p, e) for p, e in zip(predictions, expected, strict=True)) / len(predictions)


def score_task(
    metric: str,
    predictions: Sequence[Sequence[str]],
    expected: Sequence[Sequence[Sequence[str]]],
    resamples: int = 2000,
    seed: int = 0,
) -> dict[str, float | int]:
    """A task's score x 100 over its examples, with a 95% bootstrap interval over examples:
    ``{"overall", "ci_low", "ci_high", "questions"}``."""
    values = [example_score(metric, p, e) for p, e in zip(predictions, expected, strict=True)]
    mean, low, high = bootstrap_mean(values, resamples=resamples, seed=seed)
    return {
        "overall": round(100 * mean, 2),
        "ci_low": round(100 * low, 2),
        "ci_high": round(100 * high, 2),
        "questions": sum(len(e) for e in expected),
    }


def paired_difference(
    first: dict[str, Sequence[float]], second: dict[str, Sequence[float]], resamples: int = 4000, seed: int = 0
) -> dict[str, float]:
    """The RULER-style average (mean over tasks of each task's mean example score) of ``first`` minus ``second``,
    with a 95% paired bootstrap interval: ``{"first", "second", "difference", "low", "high"}``.

    ``first[task][i]`` and ``second[task][i]`` score the same context of ``task``; each task's contexts are
    resampled on their own (stratified) and both settings take the same draw."""
    if set(first) != set(second) or not first:
        raise ValueError(f"tasks: both settings need the same tasks, got {sorted(first)} and {sorted(second)}")
    draws, means = [], {}
    for index, task in enumerate(sorted(first)):
        a, b = np.asarray(first[task], dtype=np.float64), np.asarray(second[task], dtype=np.float64)
        if a.shape != b.shape or a.ndim != 1 or len(a) == 0:
            raise ValueError(f"{task}: both settings need the same contexts, got {len(a)} and {len(b)} scores")
        picks = resample_indices(len(a), resamples, seed + index)
        draws.append((a - b)[picks].mean(axis=1))
        means[task] = (a.mean(), b.mean())
    averaged = np.mean(draws, axis=0)
    low, high = np.percentile(averaged, [2.5, 97.5])
    first_avg = float(np.mean([m[0] for m in means.values()]))
    second_avg = float(np.mean([m[1] for m in means.values()]))
    return dict(
        first=first_avg, second=second_avg, difference=first_avg - second_avg, low=float(low), high=float(high)
    )
