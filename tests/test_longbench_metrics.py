"""LongBench metrics and LongBench-E scoring: hand-computed cases (arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest

from kvcompress.longbench.metrics import (
    FIRST_LINE_TASKS,
    MAX_NEW_TOKENS,
    TASK_METRICS,
    classification_score,
    code_sim_score,
    count_score,
    first_line,
    length_bucket,
    normalize_answer,
    qa_f1_score,
    retrieval_score,
    rouge_score,
    score_example,
    score_task,
)


def test_task_tables():
    assert len(TASK_METRICS) == 13 and set(MAX_NEW_TOKENS) == set(TASK_METRICS)
    assert {t for t, m in TASK_METRICS.items() if m == "qa_f1"} == {
        "qasper",
        "multifieldqa_en",
        "hotpotqa",
        "2wikimqa",
        "triviaqa",
    }
    assert {t for t, m in TASK_METRICS.items() if m == "rouge"} == {"gov_report", "multi_news", "samsum"}
    assert {t for t, m in TASK_METRICS.items() if m == "code_sim"} == {"lcc", "repobench-p"}
    assert (TASK_METRICS["trec"], TASK_METRICS["passage_count"], TASK_METRICS["passage_retrieval_en"]) == (
        "classification",
        "count",
        "retrieval",
    )
    # LongBench's config/dataset2maxlen.json
    assert MAX_NEW_TOKENS == {
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
    assert FIRST_LINE_TASKS == {"trec", "triviaqa", "samsum", "lsht"}


def test_normalize_answer():
    # lower -> "the cat, sat on  a mat!"; no punctuation -> "the cat sat on  a mat"; articles -> " cat sat on   mat"
    assert normalize_answer("The Cat, sat on  a MAT!") == "cat sat on mat"
    # articles only as whole words ("banana", "anthem" survive); "U.S." -> "us"
    assert normalize_answer("Banana and the anthem of an U.S. state") == "banana and anthem of us state"
    assert normalize_answer("?!.") == ""


def test_qa_f1():
    # "cat sat" vs "cat sat down": shared 2, P = 2/2, R = 2/3, F1 = 2 * 1 * 2/3 / (1 + 2/3) = (4/3) / (5/3) = 0.8
    assert qa_f1_score("the cat sat", "a cat sat down") == pytest.approx(0.8)
    # multiset overlap: "cat cat cat" vs "cat dog": shared min(3, 1) = 1, P = 1/3, R = 1/2, F1 = (1/3) / (5/6) = 0.4
    assert qa_f1_score("cat cat cat", "cat dog") == pytest.approx(0.4)
    assert qa_f1_score("Paris.", "paris") == 1.0
    assert qa_f1_score("dog", "cat") == 0.0
    assert qa_f1_score("", "cat") == 0.0
    assert qa_f1_score("...", "cat") == 0.0  # only punctuation -> no tokens


def test_rouge_l():
    # one sentence each; the `rouge` package counts distinct words: ref {the, cat, is, on, mat} m = 5,
    # hyp {the, cat, sat, on, mat} n = 5; LCS "the cat on the mat" as a set {the, cat, on, mat} = 4;
    # R = P = 4/5, F = 2 * 0.64 / (1.6 + 1e-8) = 0.8
    assert rouge_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.8, abs=1e-6)
    # case-sensitive: only "cat" is shared, R = P = 1/2, F = 0.5
    assert rouge_score("The cat", "the cat") == pytest.approx(0.5, abs=1e-6)
    # summary level: "."-split hypothesis sentences "a b" and "c d" cover the reference through the LCS union
    assert rouge_score("a b. c d", "a b c d") == pytest.approx(1.0, abs=1e-6)
    # where the package raises ("Hypothesis is empty" / no sentences) LongBench returns 0
    assert rouge_score("", "the cat") == 0.0
    assert rouge_score("...", "the cat") == 0.0
    assert rouge_score("the cat", "") == 0.0


def test_rouge_recursion_quirk():
    # the package rebuilds the LCS recursively: a 1500-word sentence overflows Python's stack -> LongBench's 0
    long_sentence = " ".join(f"w{i}" for i in range(1500))
    assert rouge_score(long_sentence, "w0 w1") == 0.0
    # the same words as 1500 one-word sentences: m = 2, n = 1500, union LCS {w0, w1} = 2,
    # R = 1, P = 2/1500, F = 2 * (2/1500) / (1 + 2/1500) = 4/1502
    assert rouge_score(". ".join(f"w{i}" for i in range(1500)), "w0 w1") == pytest.approx(4 / 1502, abs=1e-8)


def test_rouge_matches_longbench_call():
    # LongBench calls Rouge() with its default metrics; we ask for rouge-l alone: same value
    from rouge import Rouge

    pairs = [
        ("The report says costs rose. GAO recommends audits.", "GAO found costs rose 10%. It recommends audits."),
        ("Ann will bring the cake . Bob pays", "Bob pays for the cake Ann brings."),
        ("a a b b c", "a b c c a"),
    ]
    for hyp, ref in pairs:
        expected = Rouge().get_scores([hyp], [ref], avg=True)["rouge-l"]["f"]
        assert rouge_score(hyp, ref) == expected


CLASSES = ["Animal", "City", "Country", "Other location", "location"]


def test_classification():
    assert classification_score("Animal", "Animal", CLASSES) == 1.0
    # two class names in the prediction, the ground truth among them: 1/2
    assert classification_score("Animal or City", "City", CLASSES) == 0.5
    assert classification_score("Country", "City", CLASSES) == 0.0
    assert classification_score("no class here", "City", CLASSES) == 0.0


def test_classification_overlapping_names():
    # "location" and "Other location" both match; "location" is a proper substring of the ground truth -> dropped
    assert classification_score("Other location", "Other location", CLASSES) == 1.0
    # ground truth "location": "Other location" is not a substring of it and stays -> 1/2
    assert classification_score("Other location", "location", CLASSES) == 0.5
    # LongBench removes while iterating: matches [loc, location, Other location]; "loc" is removed at index 0,
    # "location" slides into index 0 and is never checked -> [location, Other location] -> 1/2, not 1
    assert classification_score("Other location", "Other location", ["loc", "location", "Other location"]) == 0.5


def test_retrieval():
    assert retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    # numbers [3, 13, 30]: whole digit runs, only "3" equals the id -> 1/3
    assert retrieval_score("Paragraph 3, not Paragraph 13 or 30", "Paragraph 3") == pytest.approx(1 / 3)
    # numbers [3, 3, 7] -> 2/3
    assert retrieval_score("Paragraph 3 (yes, 3), then 7", "Paragraph 3") == pytest.approx(2 / 3)
    assert retrieval_score("I do not know", "Paragraph 3") == 0.0
    with pytest.raises(ValueError, match="Paragraph N"):
        retrieval_score("3", "third paragraph")


def test_count():
    # numbers [4, 4, 12] vs "4" -> 2/3
    assert count_score("There are 4 unique paragraphs; 4 of 12.", "4") == pytest.approx(2 / 3)
    assert count_score("4", "4") == 1.0
    assert count_score("04", "4") == 0.0  # compared as strings
    assert count_score("four", "4") == 0.0  # no numbers -> 0


def test_code_sim():
    # first line without "`", "#" or "//" (after leading newlines) is "x = foo(1)": identical -> 100 / 100
    pred = "\n```python\n# compute x\nx = foo(1)\ny = 2\n```"
    assert code_sim_score(pred, "x = foo(1)") == 1.0
    # "return a+b;" (11 chars) vs "return a + b;" (13): difflib blocks "return a" 8 + "b;" 2 + "+" 1 = 11,
    # ratio = 2 * 11 / 24 = 0.91666 -> fuzz.ratio int(round(91.67)) = 92 -> 0.92
    assert code_sim_score("\n\n// comment\nreturn a+b;", "return a + b;") == 0.92
    # ratio 2 * 1 / 16 = 12.5% -> round-half-even 12 (fuzzywuzzy's int(round(.)))
    assert code_sim_score("abcdefgh", "aXXXXXXX") == 0.12
    # every line is a comment / fence -> "" -> 0; a "#" inside a string also skips the line
    assert code_sim_score("# a\n// b\n```", "x = 1") == 0.0
    assert code_sim_score('s = "#"\nx = 1', "x = 1") == 1.0
    assert code_sim_score("", "") == 1.0  # fuzz.ratio("", "") is 100 (equality is checked first)


def test_code_sim_is_fuzzywuzzy_ratio_without_levenshtein():
    # LongBench installs fuzzywuzzy alone, whose fuzz.ratio is then round(100 * difflib ratio); the 251-char
    # pair crosses difflib's 200-character autojunk threshold.
    import difflib

    pairs = [("return a+b;", "return a + b;"), ("self.x = x", "self.y = y"), ("a" * 250 + "b", "a" * 240 + "bc")]
    for a, b in pairs:
        assert code_sim_score(a, b) == round(100 * difflib.SequenceMatcher(None, a, b).ratio()) / 100


def test_max_over_ground_truths():
    # "paris" vs "paris france": P 1, R 1/2 -> F1 2/3; vs "paris" -> 1
    assert score_example("hotpotqa", "Paris", ["London", "Paris, France"]) == pytest.approx(2 / 3)
    assert score_example("hotpotqa", "Paris", ["London", "Paris, France", "paris"]) == 1.0
    assert score_example("hotpotqa", "Paris", []) == 0.0
    assert score_example("passage_count", "3 or 5", ["3", "5"]) == 0.5  # each answer: 1 of 2 numbers


def test_first_line_rule():
    assert first_line("\n\nParis\nLondon") == "Paris"
    # triviaqa scores "Paris" only -> 1; hotpotqa (no rule): "paris london is wrong" vs "paris" -> P 1/4, R 1 -> 0.4
    pred = "\nParis\nLondon is wrong"
    assert score_example("triviaqa", pred, ["Paris"]) == 1.0
    assert score_example("hotpotqa", pred, ["Paris"]) == pytest.approx(0.4)
    # trec: first line "Animal" -> 1 class matched -> 1; without the cut both classes match -> 1/2
    assert score_example("trec", "\n\nAnimal\nCity", ["Animal"], CLASSES) == 1.0
    assert score_example("trec", "\n\nAnimal\nCity", ["City"], CLASSES) == 0.0
    # samsum: the second line is dropped; gov_report keeps it (m = 3, n = 5, LCS 3 -> R 1, P 3/5 -> F 0.75)
    assert score_example("samsum", "\nAnn meets Bob\nthen they eat", ["Ann meets Bob"]) == pytest.approx(1.0, abs=1e-6)
    assert score_example("gov_report", "\nAnn meets Bob\nthen they", ["Ann meets Bob"]) == pytest.approx(0.75, abs=1e-6)


def test_length_buckets():
    # < 4000 -> "0-4k"; 4000 <= l < 8000 -> "4-8k"; >= 8000 -> "8k+"
    assert [length_bucket(x) for x in (0, 3999, 4000, 7999, 8000, 31000)] == [
        "0-4k",
        "0-4k",
        "4-8k",
        "4-8k",
        "8k+",
        "8k+",
    ]
    # scores [1, 1, 0, 1]: overall 3/4 -> 75.0; 0-4k [1] -> 100, 4-8k [1, 0] -> 50, 8k+ [1] -> 100
    res = score_task("passage_count", ["4", "4", "5", "4"], [["4"]] * 4, lengths=[100, 4000, 7999, 9000])
    assert res["score"] == 75.0 and res["n"] == 4 and res["scores"] == [1.0, 1.0, 0.0, 1.0]
    assert (res["0-4k"], res["4-8k"], res["8k+"]) == (100.0, 50.0, 100.0)
    assert (res["n_0-4k"], res["n_4-8k"], res["n_8k+"]) == (1, 2, 1)
    # empty bucket -> NaN (LongBench: round(100 * np.mean([]), 2)); no lengths -> no buckets
    res = score_task("passage_count", ["4"], [["4"]], lengths=[10])
    assert math.isnan(res["4-8k"]) and math.isnan(res["8k+"]) and res["0-4k"] == 100.0
    assert "0-4k" not in score_task("passage_count", ["4"], [["4"]])


def test_score_task_rounding_and_classes():
    # 1 of 3 right -> 100/3 = 33.333 -> round(., 2) = 33.33
    assert score_task("passage_count", ["1", "2", "2"], [["1"], ["1"], ["1"]])["score"] == 33.33
    res = score_task("trec", ["Animal", "Animal or City"], [["Animal"], ["City"]], [CLASSES, CLASSES])
    assert res["score"] == 75.0  # (1 + 1/2) / 2


def test_errors():
    with pytest.raises(ValueError, match="narrativeqa"):
        score_example("narrativeqa", "x", ["x"])
    with pytest.raises(ValueError, match="qasper_e"):
        score_task("qasper_e", ["x"], [["x"]])
    with pytest.raises(ValueError, match="all_classes"):
        score_example("trec", "Animal", ["Animal"])
    with pytest.raises(ValueError, match="answer lists"):
        score_task("qasper", ["x", "y"], [["x"]])
    with pytest.raises(ValueError, match="lengths"):
        score_task("qasper", ["x"], [["x"]], lengths=[1, 2])
    with pytest.raises(ValueError, match="no predictions"):
        score_task("qasper", [], [])
    with pytest.raises(TypeError):
        score_example("qasper", "x", "x")
