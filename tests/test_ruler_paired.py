"""eval.ruler_paired and kvcompress.ruler.scoring.paired_difference: the paired RULER-style comparison."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eval import ruler_paired
from kvcompress.ruler.scoring import paired_difference


def test_paired_difference_against_its_definition():
    rng = np.random.default_rng(5)
    first = {"a": rng.uniform(0, 100, 6), "b": rng.uniform(0, 100, 9)}
    second = {"a": rng.uniform(0, 100, 6), "b": rng.uniform(0, 100, 9)}
    got = paired_difference(first, second, resamples=3000, seed=2)
    assert got["first"] == pytest.approx((first["a"].mean() + first["b"].mean()) / 2)
    assert got["difference"] == pytest.approx(got["first"] - got["second"])
    # The interval by its definition: per task, contexts drawn with replacement (both settings the same draw).
    draws = []
    for index, task in enumerate(sorted(first)):
        n = len(first[task])
        picks = np.random.default_rng(2 + index).integers(0, n, size=(3000, n))
        draws.append(np.array([(first[task][p] - second[task][p]).mean() for p in picks]))
    low, high = np.percentile(np.mean(draws, axis=0), [2.5, 97.5])
    assert (got["low"], got["high"]) == pytest.approx((low, high))
    assert got["low"] < got["difference"] < got["high"]
    shifted = paired_difference({t: v + 12.5 for t, v in second.items()}, second)  # the same contexts, +12.5 each
    assert shifted["difference"] == pytest.approx(12.5) and shifted["low"] == pytest.approx(12.5)
    assert shifted["high"] == pytest.approx(12.5)
    with pytest.raises(ValueError, match="tasks: both settings need the same tasks"):
        paired_difference({"a": [1.0]}, {"b": [1.0]})
    with pytest.raises(ValueError, match="a: both settings need the same contexts"):
        paired_difference({"a": [1.0, 2.0]}, {"a": [1.0]})


class Example:
    def __init__(self, key, expected):
        self.key, self.expected = key, expected


def write_run(run, method: str, seed: int, limit: int, contexts: dict[str, list[Example]], right: int) -> str:
    """A run directory as `kvcompress eval --benchmark ruler` writes it: the first ``right`` of each task's first
    ``limit`` contexts answered with their expected string, the others wrongly."""
    (run / "predictions" / method).mkdir(parents=True)
    settings = dict(length=1024, seed=seed, tasks=list(contexts), model=None, limit=limit)
    (run / "run.json").write_text(json.dumps({"settings": settings}))
    for task, examples in contexts.items():
        rows = []
        for i, example in enumerate(examples[:limit]):
            answer = example.expected[0][0] if i < right else "no idea"
            rows.append(json.dumps({"key": example.key, "prediction": [f" {answer}."]}))
        (run / "predictions" / method / f"{task}.jsonl").write_text("\n".join(rows) + "\n")
    return str(run)


def test_two_runs_pair_on_their_shared_contexts(tmp_path, monkeypatch):
    contexts = {"niah_single": [Example(f"s{i}", [[str(1000 + i)]]) for i in range(4)]}
    contexts["qa"] = [Example(f"q{i}", [["paris", "Paris, France"]]) for i in range(4)]
    monkeypatch.setattr(ruler_paired, "load_task", lambda task, cfg: contexts[task])
    monkeypatch.setattr(ruler_paired, "select", lambda examples, cfg: examples[: cfg.limit])

    a = ruler_paired.example_scores(write_run(tmp_path / "a", "compresskv", 0, 4, contexts, right=3), "compresskv")
    b = ruler_paired.example_scores(write_run(tmp_path / "b", "snapkv", 0, 2, contexts, right=0), "snapkv")
    assert a["niah_single"] == {"s0": 100, "s1": 100, "s2": 100, "s3": 0}
    assert a["qa"] == {"q0": 100, "q1": 100, "q2": 100, "q3": 0}
    result = ruler_paired.compare(a, b)  # only the 2 contexts per task both runs have
    assert result["contexts"] == {"niah_single": 2, "qa": 2}
    assert result["first"] == 100 and result["second"] == 0 and result["low"] == result["high"] == 100
    assert result["per_task"]["qa"]["difference"] == result["per_task"]["niah_single"]["difference"] == 100
    with pytest.raises(ValueError, match="no predictions of 'exact'"):
        ruler_paired.example_scores(str(tmp_path / "b"), "exact")


def test_runs_of_several_seeds_pool_per_task(tmp_path, monkeypatch, capsys):
    def contexts(seed):  # each seed makes its own contexts, as the RULER-style generator does
        return {"niah_single": [Example(f"niah_single-{seed}-{i}", [[str(100 * seed + i)]]) for i in range(3)]}

    monkeypatch.setattr(ruler_paired, "load_task", lambda task, cfg: contexts(cfg.seed)[task])
    monkeypatch.setattr(ruler_paired, "select", lambda examples, cfg: examples[: cfg.limit])

    a = [write_run(tmp_path / "a0", "compresskv", 0, 3, contexts(0), right=3),
         write_run(tmp_path / "a1", "compresskv", 1, 3, contexts(1), right=1)]
    b = [write_run(tmp_path / "b0", "snapkv", 0, 3, contexts(0), right=0),
         write_run(tmp_path / "b1", "snapkv", 1, 3, contexts(1), right=1)]
    pooled = ruler_paired.pooled_scores(a, "compresskv")
    assert pooled == {"niah_single": {"niah_single-0-0": 100, "niah_single-0-1": 100, "niah_single-0-2": 100,
                                      "niah_single-1-0": 100, "niah_single-1-1": 0, "niah_single-1-2": 0}}
    result = ruler_paired.compare(pooled, ruler_paired.pooled_scores(b, "snapkv"))
    assert result["contexts"] == {"niah_single": 6}
    assert result["first"] == pytest.approx(400 / 6) and result["second"] == pytest.approx(100 / 6)
    with pytest.raises(ValueError, match="runs: .*a0 scores 3 niah_single context"):
        ruler_paired.pooled_scores([a[0], a[0]], "compresskv")
    assert ruler_paired.main([",".join(a), "compresskv", ",".join(b), "snapkv"]) == 0  # the CLI's comma-separated runs
    printed = capsys.readouterr().out
    assert "66.67 - snapkv" in printed and "16.67 = +50.00" in printed and "contexts: niah_single 6" in printed
    assert "  niah_single: 66.67 - 16.67 = +50.00 [" in printed  # each task's own line


def test_a_run_with_the_harness_defaults_and_a_later_smaller_limit(tmp_path, monkeypatch):
    """README's first command leaves --tasks and --length at their defaults (run.json holds None), and a later run
    into the same directory with a smaller --limit rewrites run.json: the run's contexts are still rebuilt, every
    default task's, as many as were predicted (this crashed on None and then on the keys past the new limit). A
    cut last line is skipped and a repeated key keeps its first row, as the harness does."""
    from kvcompress.longbench.cli import parse_config
    from kvcompress.longbench.config import task_list

    tasks = task_list(parse_config(["--benchmark", "ruler", "--methods", "exact"]))
    contexts = {task: [Example(f"{task}-{i}", [[f"v{i}"]]) for i in range(3)] for task in tasks}
    seen = []

    def load_task(task, cfg):
        seen.append((task, cfg.length, cfg.limit))
        return contexts[task]

    monkeypatch.setattr(ruler_paired, "load_task", load_task)
    monkeypatch.setattr(ruler_paired, "select", lambda examples, cfg: examples[: cfg.limit])
    run = tmp_path / "run"
    write_run(run, "exact", 0, 3, contexts, right=2)
    settings = dict(length=None, seed=0, tasks=None, model=None, limit=1)  # the later run's --limit 1
    (run / "run.json").write_text(json.dumps({"settings": settings}))
    first = run / "predictions" / "exact" / f"{tasks[0]}.jsonl"
    first.write_text(first.read_text() + json.dumps({"key": f"{tasks[0]}-0", "prediction": ["no idea"]}) + "\n{cut")
    scores = ruler_paired.example_scores(str(run), "exact")
    assert sorted(scores) == sorted(tasks)
    assert all(s == {f"{task}-0": 100, f"{task}-1": 100, f"{task}-2": 0} for task, s in scores.items())
    default_length = parse_config(["--benchmark", "ruler", "--methods", "exact"]).length
    assert {(length, limit) for _, length, limit in seen} == {(default_length, 3)}
    extra = run / "predictions" / "exact" / f"{tasks[1]}.jsonl"
    extra.write_text(extra.read_text() + json.dumps({"key": "elsewhere-9", "prediction": ["x"]}) + "\n")
    with pytest.raises(ValueError, match=f"{tasks[1]} predictions of contexts its settings do not make"):
        ruler_paired.example_scores(str(run), "exact")
