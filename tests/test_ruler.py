"""The RULER-style benchmark: deterministic generation, answers present in the contexts, RULER's scoring, the CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvcompress.ruler import TASKS, generate, generate_example, score_task, string_match_all, string_match_part
from kvcompress.ruler.scoring import example_score, match, postprocess
from kvcompress.ruler.tasks import NEEDLE

REPO = Path(__file__).resolve().parents[1]


class WordTokenizer:
    """One token per whitespace-separated word (the generator only needs ``encode``)."""

    def encode(self, text, add_special_tokens=False):
        return text.split()


def _examples(task: str, count: int = 3, length: int = 600, seed: int = 0):
    return generate(task, WordTokenizer(), length, count, seed)


# ------------------------------------------------------------------------------------------ generation


@pytest.mark.parametrize("task", list(TASKS))
def test_generation_is_deterministic_and_fills_the_length(task):
    first, again = _examples(task), _examples(task)
    assert first == again
    assert len({e.key for e in first}) == 3 and len({e.context for e in first}) == 3  # distinct examples
    assert all(520 <= e.tokens <= 600 for e in first)  # filled to within a haystack unit of the target
    assert _examples(task, seed=1)[0].context != first[0].context
    assert generate_example(task, WordTokenizer(), 600, 0, 2) == first[2]  # example i alone is example i


def test_generation_is_the_same_in_another_process():
    """No set or hash order leaks into the draws: a process with another hash seed draws the same examples."""
    code = (
        "from tests.test_ruler import WordTokenizer; from kvcompress.ruler import TASKS, generate;"
        "print([e.key for t in TASKS for e in generate(t, WordTokenizer(), 400, 2)])"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONHASHSEED": str(seed), "PYTHONPATH": str(REPO)},
            check=True,
        ).stdout
        for seed in (1, 2)
    ]
    assert runs[0] == runs[1] and runs[0].count("-") > 16


def test_real_tokenizer_counts_within_the_length(embedded_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    for task in TASKS:
        (example,) = generate(task, tokenizer, 1024, 1)
        longest = max(len(tokenizer.encode(q, add_special_tokens=False)) for q in example.questions)
        counted = len(tokenizer.encode(example.context, add_special_tokens=False)) + longest
        assert counted == example.tokens and 800 <= counted <= 1024, (task, counted)


def test_too_short_a_length_is_an_error():
    with pytest.raises(ValueError, match="length: 5 tokens cannot hold a niah_single example"):
        generate("niah_single", WordTokenizer(), 5, 1)
    with pytest.raises(ValueError, match="task: unknown RULER task 'nope'"):
        generate("nope", WordTokenizer(), 500, 1)


# ------------------------------------------------------------------------------- answers in the context


def _needles(context: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    pattern = re.escape(NEEDLE).replace(r"\{key\}", r"(\S+)").replace(r"\{value\}", r"(\d+)")
    for key, value in re.findall(pattern, context):
        found.setdefault(key, []).append(value)
    return found


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"])
def test_niah_answers_are_the_planted_values_of_the_asked_keys(task):
    for example in _examples(task):
        needles = _needles(example.context)
        for question, expected in zip(example.questions, example.answers, strict=True):
            asked = [k for k in needles if re.search(rf"(?<![\w-]){re.escape(k)}(?![\w-])", question)]
            assert asked and sorted(v for k in asked for v in needles[k]) == sorted(expected)
        assert len(needles) == {"niah_single": 1, "niah_multivalue": 1}.get(task, 4)


def test_variable_tracking_answer_is_the_chain_from_the_value():
    for example in _examples("vt"):
        ((question,), (expected,)) = example.questions, example.answers
        value = re.search(r"assigned the value (\d+)", question).group(1)
        assignments = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", example.context))
        holding = {v for v, source in assignments.items() if source == value}
        while True:  # follow the chain: every variable assigned from one already holding the value
            more = {v for v, source in assignments.items() if source.removeprefix("VAR ") in holding} - holding
            if not more:
                break
            holding |= more
        assert holding == set(expected) and len(expected) == 5


def test_common_words_answer_is_the_most_frequent_list_entries():
    for example in _examples("cwe"):
        words = re.findall(r"\d+\. ([a-z]+)", example.context)
        counts = Counter(words).most_common()
        top = {w for w, c in counts if c == counts[0][1]}
        assert top == set(example.answers[0]) and counts[len(top)][1] < counts[0][1]


def test_frequent_words_answer_is_the_three_most_frequent_coded_words():
    for example in _examples("fwe"):
        words = example.context.split("coded words. ", 1)[1].split(" ... ")
        counts = Counter(w.strip() for w in words).most_common()
        assert {w for w, _ in counts[:3]} == set(example.answers[0]) and counts[2][1] > counts[3][1]


def test_qa_answers_are_in_the_planted_fact_of_the_asked_project():
    for example in _examples("qa"):
        assert len(example.questions) == 4
        for question, (answer,) in zip(example.questions, example.answers, strict=True):
            project = re.search(r"the (\w+) project", question).group(1)
            (fact,) = re.findall(rf"The {project} project is maintained by [^.]+\.", example.context)
            assert answer in fact


# ------------------------------------------------------------------------------------------------ scoring


def test_string_match_follows_rulers_rules():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all("ALPHA beta", ["alpha", "Beta"]) == 1.0  # case-insensitive
    assert string_match_all("", ["x"]) == 0.0
    assert string_match_all("1234567", ["123"]) == 1.0  # a substring match, as in RULER
    assert string_match_part("Ada Moreau maintains it", ["Boris Novak", "ada moreau"]) == 1.0
    assert string_match_part("nobody", ["Ada Moreau", "Lisbon"]) == 0.0
    assert postprocess("  12\x0034\n") == "12\n34"
    assert string_match_all("12\x0034", ["12\n34"]) == 1.0  # control characters become newlines first
    with pytest.raises(ValueError, match="metric: must be one of all, part"):
        match("exact", "x", ["x"])


def test_task_score_is_the_mean_over_examples_of_the_mean_over_questions():
    predictions = [["111", "nothing"], ["222 333"], ["444"]]
    expected = [[["111"], ["999"]], [["222", "333", "555"]], [["444"]]]
    assert example_score("all", predictions[0], expected[0]) == 0.5
    result = score_task("all", predictions, expected, resamples=500, seed=1)
    assert result["overall"] == pytest.approx(100 * (0.5 + 2 / 3 + 1) / 3, abs=0.01)
    assert 0 <= result["ci_low"] <= result["overall"] <= result["ci_high"] <= 100 and result["questions"] == 4
    same = score_task("part", [["x"]] * 5, [[["x"]]] * 5)
    assert same["overall"] == same["ci_low"] == same["ci_high"] == 100.0
    with pytest.raises(ValueError, match="predictions: expected 2 answers"):
        example_score("all", ["one"], [["a"], ["b"]])


# ---------------------------------------------------------------------------------------------- the CLI


def test_bad_ruler_flags_are_one_error_line():
    from kvcompress.longbench import cli

    for args, message in (
        (["--length", "100"], "--length: only with --benchmark ruler"),
        (["--benchmark", "ruler", "--tasks", "py_qa"], "--tasks: unknown task 'py_qa'; choose from niah_single"),
        (["--benchmark", "ruler", "--length", "0"], "--length: must be an integer >= 1"),
        (["--benchmark", "bogus"], "--benchmark"),
    ):
        with pytest.raises(cli.UsageError, match=re.escape(message)):
            cli.parse_config(args)
    cfg = cli.parse_config(["--benchmark", "ruler"])
    assert cfg.tasks is None and cfg.limit is None  # the offline suite's tasks and limit do not apply


@pytest.mark.slow
def test_ruler_cli_smoke_then_resume(tmp_path, embedded_dir):
    """``kvcompress eval --benchmark ruler`` on the embedded model at a short length: questions answered after the
    press, scored per task with intervals, tables written; a rerun predicts nothing."""
    out = tmp_path / "ruler"
    args = [
        *("--benchmark", "ruler", "--length", "300", "--limit", "2", "--tasks", "niah_single", "qa"),
        *("--methods", "exact", "compresskv_kvzip", "--max-new-tokens", "8", "--threads", "1"),
        *("--output-dir", str(out)),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    script = [sys.executable, str(REPO / "eval" / "longbench.py")]
    first = subprocess.run([*script, *args], capture_output=True, text=True, env=env, cwd="/", timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    for method in ("exact", "compresskv_kvzip"):
        records = [json.loads(line) for line in (out / "predictions" / method / "qa.jsonl").read_text().splitlines()]
        assert len(records) == 2 and all(len(r["prediction"]) == 4 for r in records)  # 4 questions per context
    scores = json.loads((out / "scores.json").read_text())
    assert scores["complete"] and scores["benchmark"] == "ruler"
    for method in ("exact", "compresskv_kvzip"):
        entry = scores["results"][method]["tasks"]["qa"]
        assert entry["questions"] == 8 and 0 <= entry["ci_low"] <= entry["overall"] <= entry["ci_high"] <= 100
    text = (out / "results.md").read_text()
    assert text.startswith("# RULER-style, 300 tokens: SmolLM2-135M-Instruct, cache kept at 0.25")
    assert "| KVzip |" in text and "questions: niah-s 2, qa 8" in text
    assert (out / "scores.png").read_bytes()[:4] == b"\x89PNG"
    again = subprocess.run([*script, *args], capture_output=True, text=True, env=env, cwd="/", timeout=600)
    assert again.returncode == 0 and "0 predictions to make" in again.stderr
