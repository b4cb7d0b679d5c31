"""LongBench's official metrics and LongBench-E scoring, re-implemented with the same behaviour.

Reference: THUDM/LongBench `LongBench/metrics.py` and `LongBench/eval.py` (also vendored by NVIDIA kvpress
as `evaluation/benchmarks/longbench/calculate_metrics.py`, the protocol of the paper's Table 4).

Faithfulness notes (each one matches the reference unless it says otherwise):

- `rouge_score` calls the same package as LongBench (`rouge` 1.0.1, `Rouge().get_scores(...)["rouge-l"]["f"]`,
  a summary-level, case- and punctuation-sensitive ROUGE-L over "."-split sentences) and returns 0.0 where it
  raises: an empty hypothesis or reference ("" or only dots). The package rebuilds each LCS recursively, so a
  hypothesis sentence plus a reference sentence longer than about 1000 words raises RecursionError; LongBench's
  bare `except` turns that into 0.0 and so do we.
- `code_sim_score`: LongBench calls `fuzzywuzzy.fuzz.ratio`; fuzzywuzzy (GPL-2.0) is not a dependency here. We
  compute what it computes when python-Levenshtein is absent, as in LongBench's requirements.txt:
  `int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))`, 100 for equal strings, 0 if either is empty.
  With python-Levenshtein installed fuzzywuzzy switches to the Indel ratio (as rapidfuzz does), which can differ
  by a few points on a line.
- `classification_score` keeps LongBench's removal of matched class names that are substrings of the ground
  truth, including its side effect: it removes items from the list it is iterating over, so the item after each
  removed one is not checked.
- The first-line rule (trec, triviaqa, samsum, lsht) cuts `prediction.lstrip("\\n")` at its first "\\n", as
  LongBench's eval.py does (kvpress's non-E scorer strips all leading whitespace instead).
- `score_task` rounds like LongBench: `round(100 * mean, 2)`; an empty length bucket is NaN (np.mean of nothing).
  Unlike the reference, mismatched input lengths, an empty task and an unknown task raise ValueError.
"""

from __future__ import annotations

import difflib
import math
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "FIRST_LINE_TASKS",
    "LENGTH_BUCKETS",
    "MAX_NEW_TOKENS",
    "METRIC_FUNCTIONS",
    "TASK_METRICS",
    "classification_score",
    "code_sim_score",
    "count_score",
    "first_line",
    "length_bucket",
    "normalize_answer",
    "qa_f1_score",
    "retrieval_score",
    "rouge_score",
    "score_example",
    "score_task",
]

# The 13 LongBench-E tasks of the paper's Table 4 -> LongBench metric name.
TASK_METRICS: dict[str, str] = {
    "qasper": "qa_f1",
    "multifieldqa_en": "qa_f1",
    "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1",
    "triviaqa": "qa_f1",
    "gov_report": "rouge",
    "multi_news": "rouge",
    "samsum": "rouge",
    "trec": "classification",
    "passage_count": "count",
    "passage_retrieval_en": "retrieval",
    "lcc": "code_sim",
    "repobench-p": "code_sim",
}

# LongBench's config/dataset2maxlen.json for those tasks (the harness generates this + 20 tokens).
MAX_NEW_TOKENS: dict[str, int] = {
    "qasper": 128,
    "multifieldqa_en": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "triviaqa": 32,
    "gov_report": 512,
    "multi_news": 512,
    "samsum": 128,
    "trec": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "lcc": 64,
    "repobench-p": 64,
}

# Tasks whose prediction is cut to its first line before scoring (lsht is LongBench's, not scored here).
FIRST_LINE_TASKS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht"})

# LongBench-E buckets over the dataset's `length` field (words): < 4000, [4000, 8000), >= 8000.
LENGTH_BUCKETS: tuple[str, ...] = ("0-4k", "4-8k", "8k+")

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)
_NUMBER = re.compile(r"\d+")
_PARAGRAPH = re.compile(r"Paragraph (\d+)")


def normalize_answer(text: str) -> str:
    """Lowercase, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace (SQuAD style)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _token_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """F1 of two token multisets (0 when nothing is shared)."""
    shared = sum((Counter(prediction) & Counter(ground_truth)).values())
    if shared == 0:
        return 0.0
    precision = shared / len(prediction)
    recall = shared / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    """Token-level F1 between the normalized prediction and ground truth."""
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


_ROUGE: Any = None


def rouge_score(prediction: str, ground_truth: str) -> float:
    """ROUGE-L F of the `rouge` package (as LongBench); 0.0 where the package raises (e.g. empty prediction)."""
    global _ROUGE
    if _ROUGE is None:
        try:
            from rouge import Rouge
        except ImportError as err:  # pragma: no cover - the eval extra installs it
            raise ImportError("rouge_score needs the `rouge` package: pip install 'kvcompress[eval]'") from err
        _ROUGE = Rouge(metrics=["rouge-l"], stats=["f"])  # rouge-l alone: same value, no rouge-1/2 work
    try:
        scores = _ROUGE.get_scores([prediction], [ground_truth], avg=True)
    except (ValueError, RecursionError):
        return 0.0
    return float(scores["rouge-l"]["f"])


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str]) -> float:
    """trec: 1 / (number of class names found in the prediction) if the ground truth is among them, else 0.

    Class names that are substrings of the ground truth (but not equal to it) are dropped from the matches, with
    LongBench's in-place removal during iteration (the entry right after a removed one escapes the check).
    """
    matched = [name for name in all_classes if name in prediction]
    i = 0
    while i < len(matched):  # same visiting order as `for term in matched: matched.remove(...)`
        term = matched[i]
        if term in ground_truth and term != ground_truth:
            matched.remove(term)
        i += 1
    return 1.0 / len(matched) if ground_truth in matched else 0.0


def _fraction_equal(prediction: str, target: str) -> float:
    """Fraction of the digit runs in the prediction equal to `target` (0 when it has none)."""
    numbers = _NUMBER.findall(prediction)
    if not numbers:
        return 0.0
    return sum(number == target for number in numbers) / len(numbers)


def retrieval_score(prediction: str, ground_truth: str) -> float:
    """passage_retrieval_en: fraction of the numbers in the prediction equal to N of the ground truth "Paragraph N"."""
    match = _PARAGRAPH.search(ground_truth)
    if match is None:
        raise ValueError(f"retrieval ground truth must contain 'Paragraph N', got {ground_truth!r}")
    return _fraction_equal(prediction, match.group(1))


def count_score(prediction: str, ground_truth: str) -> float:
    """passage_count: fraction of the numbers in the prediction equal to the ground-truth count."""
    return _fraction_equal(prediction, str(ground_truth))


def _fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy 0.18 `fuzz.ratio` on its pure-Python (difflib) path: an integer in [0, 100]."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


SKIPPED_LINE_MARKS = ("`", "#", "//")  # code_sim_score reads no prediction line holding one of these


def code_sim_score(prediction: str, ground_truth: str) -> float:
    """lcc / repobench-p: fuzzy ratio / 100 between the ground truth and the prediction's first code line.

    That line is the first one (after leading newlines) without a backtick, "#" or "//"; "" if there is none.
    """
    lines = prediction.lstrip("\n").split("\n")
    line = next((ln for ln in lines if not any(mark in ln for mark in SKIPPED_LINE_MARKS)), "")
    return _fuzz_ratio(line, ground_truth) / 100


# Metric name -> function(prediction, ground_truth) (classification also takes all_classes).
METRIC_FUNCTIONS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1_score,
    "rouge": rouge_score,
    "classification": classification_score,
    "count": count_score,
    "retrieval": retrieval_score,
    "code_sim": code_sim_score,
}


def first_line(prediction: str) -> str:
    """The prediction's first line after stripping leading newlines (LongBench's rule for trec/triviaqa/samsum)."""
    return prediction.lstrip("\n").split("\n")[0]


def _metric_name(task: str) -> str:
    """The metric of a LongBench-E task, or ValueError naming the task."""
    try:
        return TASK_METRICS[task]
    except KeyError:
        raise ValueError(f"unknown LongBench-E task {task!r}; expected one of {sorted(TASK_METRICS)}") from None


def score_example(
    task: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """One example's score in [0, 1]: the task's metric, maximised over the ground-truth answers (0 if none)."""
    metric = _metric_name(task)
    if task in FIRST_LINE_TASKS:
        prediction = first_line(prediction)
    if isinstance(answers, str):
        raise TypeError("answers must be a sequence of strings, not a single string")
    if metric == "classification":
        if all_classes is None:
            raise ValueError(f"task {task!r} needs all_classes")
        classes = list(all_classes)
        return max((classification_score(prediction, gt, classes) for gt in answers), default=0.0)
    fn = METRIC_FUNCTIONS[metric]
    return max((float(fn(prediction, gt)) for gt in answers), default=0.0)


def length_bucket(length: int | float) -> str:
    """LongBench-E bucket of a `length` (words): "0-4k" (< 4000), "4-8k" (< 8000) or "8k+"."""
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"


def score_task(
    task: str,
    predictions: Sequence[str],
    answers_list: Sequence[Sequence[str]],
    all_classes_list: Sequence[Sequence[str] | None] | None = None,
    lengths: Sequence[int | float] | None = None,
) -> dict[str, Any]:
    """Score one task the LongBench way.

    Returns {"score": round(100 * mean, 2), "n": number of examples, "scores": per-example scores in [0, 1]}
    and, when `lengths` are given, the LongBench-E buckets "0-4k", "4-8k", "8k+" (each round(100 * mean, 2),
    NaN when empty) with their sizes under "n_0-4k", "n_4-8k", "n_8k+".
    """
    _metric_name(task)
    n = len(predictions)
    if n == 0:
        raise ValueError(f"task {task!r}: no predictions to score")
    if len(answers_list) != n:
        raise ValueError(f"task {task!r}: {n} predictions but {len(answers_list)} answer lists")
    if all_classes_list is None:
        all_classes_list = [None] * n
    elif len(all_classes_list) != n:
        raise ValueError(f"task {task!r}: {n} predictions but {len(all_classes_list)} all_classes entries")
    if lengths is not None and len(lengths) != n:
        raise ValueError(f"task {task!r}: {n} predictions but {len(lengths)} lengths")

    scores = [
        score_example(task, pred, answers, classes)
        for pred, answers, classes in zip(predictions, answers_list, all_classes_list, strict=True)
    ]
    total = 0.0
    for s in scores:  # LongBench's scorer: a running sum divided by the count
        total += s
    result: dict[str, Any] = {"score": round(100 * total / n, 2), "n": n, "scores": scores}
    if lengths is not None:
        buckets: dict[str, list[float]] = {key: [] for key in LENGTH_BUCKETS}
        for s, length in zip(scores, lengths, strict=True):
            buckets[length_bucket(length)].append(s)
        for key, values in buckets.items():
            result[key] = round(100 * float(np.mean(values)), 2) if values else math.nan
            result[f"n_{key}"] = len(values)
    return result
