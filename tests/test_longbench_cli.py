"""The LongBench-E command line (eval/longbench.py) and the offline suite, at tiny sizes.

Model runs use the embedded SmolLM2-135M-Instruct with short prompts (--max-context-length) and short
answers (--max-new-tokens); nothing is read from the Hub.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcompress import longbench
from kvcompress.longbench import Config, Example, offline_suite

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "eval" / "longbench.py"
SMOKE = ["--max-context-length", "400", "--max-new-tokens", "6", "--threads", "1"]  # 1 thread: cores are shared


@pytest.fixture(autouse=True)
def restore_threads():
    """In-process runs set torch's thread count (--threads); give the rest of the session its own back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def cli(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python eval/longbench.py ARGS`` (the script form) offline, from another directory."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    full_env.pop("PYTHONPATH", None)  # the script must find the repository by itself
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=full_env, timeout=timeout, cwd="/"
    )


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def table_rows(markdown: str) -> list[list[str]]:
    """Cells of the first Markdown table."""
    rows = []
    for line in markdown.splitlines():
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            break
    return rows


# ------------------------------------------------------------------------------------------------ units


class CharTokenizer:
    """One token per character (enough for the truncation arithmetic)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_prompts_split_longbench_templates_into_context_question_and_prefix():
    for task in longbench.LONGBENCH_TASKS:
        question = "Q?" + ("\nType:" if task == "trec" else "\nAnswer:" if task == "triviaqa" else "")
        question = question + "\nSummary:" if task == "samsum" else question
        context, rest, prefix = longbench.split_prompt(task, "CTX {x}", question)
        full = longbench.PROMPTS[task].replace("{context}", "CTX {x}").replace("{input}", question)
        assert context + rest + prefix == full  # nothing lost or added, braces survive
        assert "CTX {x}" in context and "CTX" not in rest
        assert prefix == longbench.ANSWER_PREFIXES[task] and not rest.startswith("\n")
    assert longbench.split_prompt("lcc", "x = 1\n", "") == (
        "Please complete the code given below. \nx = 1\n",
        "",
        "Next line of code:\n",
    )


def test_middle_truncation_keeps_both_ends_and_the_question():
    example = Example("qasper", 0, "#0", "a" * 50 + "b" * 50, "QQQQ", "A:", ["x"], None, 10)
    kept, tokens, truncated = longbench.truncate_middle(CharTokenizer(), example, 40)
    assert truncated and tokens == 40
    assert kept == "a" * 20 + "b" * 14  # first 40 // 2 prompt tokens, last 20 = 14 context + 6 question/prefix
    assert longbench.truncate_middle(CharTokenizer(), example, 1000) == (example.context, 106, False)


def test_fraction_is_seeded_and_limit_takes_the_first():
    examples = [Example("qasper", i, f"#{i}", "", "", "", [], None, 0) for i in range(40)]
    first = longbench.select(examples, Config(fraction=0.25, seed=3))
    assert len(first) == 10 and [e.index for e in first] == sorted(e.index for e in first)
    assert first == longbench.select(examples, Config(fraction=0.25, seed=3))
    assert first != longbench.select(examples, Config(fraction=0.25, seed=4))
    assert [e.index for e in longbench.select(examples, Config(limit=3))] == [0, 1, 2]


def test_markdown_has_table4_layout_partial_marks_and_the_paper_rows():
    plan = {"qasper": [None] * 2, "trec": [None] * 3}
    done = {"n": 2, "n_expected": 2, "complete": True, "overall": 40.0, "0-4k": 40.0, "4-8k": None, "8k+": None}
    half = {"n": 1, "n_expected": 3, "complete": False, "overall": 50.0, "0-4k": 50.0, "4-8k": None, "8k+": None}
    buckets = {"0-4k": 45.0, "4-8k": None, "8k+": None}
    results = {
        "exact": {"tasks": {"qasper": done, "trec": done}, "average": 40.0, "buckets": buckets, "complete": True},
        "compresskv": {"tasks": {"qasper": done, "trec": half}, "average": 45.0, "buckets": buckets, "complete": False},
    }
    text = longbench.markdown(Config(model="Qwen/Qwen2.5-7B-Instruct"), plan, results)
    assert text.splitlines()[0].endswith("(partial)") and "**Partial results**" in text
    rows = table_rows(text)
    assert rows[0] == ["Method", "qasper", "trec", "Average"]
    assert rows[2] == ["Exact", "40.00", "40.00", "40.00"]
    assert rows[3] == ["CompressKV", "40.00", "50.00 (partial 1/3)", "45.00 (partial)"]
    paper = text[text.index("## Paper, Table 4") :]
    assert "| CompressKV | 33.23 | 54.33 | 43.78 |" in paper
    assert "Paper" not in longbench.markdown(Config(), plan, results)  # other models: no reference rows


def test_press_options_from_yaml_and_flags_reach_the_press_and_the_run_identity(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("press_options:\n  compresskv: {window_size: 64, bin_rank: 8}\n  snapkv: {kernel_size: 7}\n")
    cfg = longbench.parse_config(["--config", str(config), "--press-option", "compresskv.window_size=128"])
    assert cfg.press_options == {"compresskv": {"window_size": 128, "bin_rank": 8}, "snapkv": {"kernel_size": 7}}
    press = longbench.make_press("compresskv", cfg.ratio, cfg.seed, cfg.press_options["compresskv"])
    assert (press.window_size, press.bin_rank, press.sink_size, press.compression_ratio) == (128, 8, 4, 0.75)
    assert longbench.make_press("snapkv", 0.5, 0, cfg.press_options["snapkv"]).kernel_size == 7
    assert longbench.prediction_settings(cfg)["press_options"] == cfg.press_options
    cpu = longbench.parse_config(["--model", "some/model", "--device", "cpu"])
    assert longbench.prediction_settings(cpu)["dtype"] == "float32"  # auto on a CPU: float32, as explicitly asked
    assert longbench.prediction_settings(cpu)["device"] == "cpu"
    assert (
        longbench.output_dir(cfg).name
        == "SmolLM2-135M-Instruct_0.25_compresskv.bin_rank=8_compresskv.window_size=128_snapkv.kernel_size=7"
    )
    assert longbench.output_dir(longbench.parse_config([])).name == "SmolLM2-135M-Instruct_0.25"


def test_offline_suite_is_deterministic_and_committed(tmp_path):
    committed = offline_suite.ensure_suite()
    for task, spec in offline_suite.TASKS.items():
        rows = lines(committed[task])
        assert len(rows) >= 2 and len({r["_id"] for r in rows}) == len(rows)
        assert all(r["length"] == len(r["context"].split()) and r["answers"] for r in rows)
        assert [r["length"] for r in rows][0] <= [r["length"] for r in rows][-1]  # shortest first
        assert longbench.split_prompt(task, "C", "Q")[2] == spec.answer_prefix
    again = offline_suite.build_task("py_qa", examples=2, seed=5)
    assert again == offline_suite.build_task("py_qa", examples=2, seed=5)
    # A rebuilt code task's answers all score: a line with "#", "//" or "`" is one code_sim_score skips, so even a
    # perfect prediction of it scored 0 (2 of 120 answers before these were drawn again).
    from kvcompress.longbench.metrics import code_sim_score

    for seed in (0, 1):
        assert all(code_sim_score(r["answers"][0], r["answers"][0]) == 1
                   for r in offline_suite.build_task("py_code", examples=60, seed=seed))  # fmt: skip
    fact = again[0]["answers"][0]
    assert fact in again[0]["context"]
    count = offline_suite.build_task("py_count", examples=1)[0]
    paragraphs = [p.split(": ", 1)[1] for p in count["context"].split("\n\n")]
    assert len(set(paragraphs)) == int(count["answers"][0]) < len(paragraphs)


# -------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "nope"], "--tasks: unknown task 'nope'"),
        (["--methods", "exact", "h2o"], "--methods: unknown method 'h2o'"),
        (["--ratio", "0"], "--ratio"),
        (["--ratio", "1.5"], "--ratio"),
        (["--ratio", "abc"], "--ratio"),
        (["--data-dir", "/nonexistent/longbench"], "--data-dir"),
        (["--config", "/nonexistent/run.yaml"], "--config"),
        (["--press-option", "compresskv.window=3"], "--press-option: compresskv has no setting 'window'"),
        (["--press-option", "snapkv.window_size=-3"], "--press-option: snapkv: window_size: must be an int >= 1"),
        (["--press-option", "exact.window_size=3"], "--press-option: 'exact' has no press"),
        (["--methods", "snapkv", "--press-option", "snapkv.kernel_size=0"],  # failed in the first prefill
         "--press-option: snapkv: kernel_size: must be an int >= 1, got 0"),
        (["--press-option", "compresskv.reference=["], "--press-option: 'compresskv.reference=[': the value '[' is "
         "not valid YAML"),  # a traceback
        (["--methods", "compresskv", "--press-option", "snapkv.window_size=3"],  # was accepted and ignored
         "--press-option: snapkv is not among --methods (compresskv)"),
        (["--tasks", "trec"], "--dataset: cannot load Xnhyacinth/LongBench (trec_e)"),  # the Hub is offline here
        (["--benchmark", "ruler", "--data-dir", "/tmp"], "--data-dir: not with --benchmark ruler"),  # was ignored
        (["--benchmark", "ruler", "--dataset", "x/y"], "--dataset: not with --benchmark ruler"),
        (["--device-map", "auto", "--device", "cpu"], "--device-map: auto spreads the model over the GPUs"),
        (["--methods", "exact", "--tasks", "py_qa", "--score-only"], "--score-only: no predictions in"),  # wrote tables
    ],
)
def test_bad_input_is_one_error_line(tmp_path, args, message):
    out = tmp_path / "out"
    result = cli(*args, "--output-dir", str(out))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and message in result.stderr
    assert not out.exists()


def test_an_output_dir_that_is_a_file_is_one_error_line(tmp_path):
    out = tmp_path / "a_file"
    out.write_text("not a directory")
    result = cli("--tasks", "py_count", "--methods", "exact", "--limit", "1", "--output-dir", str(out))
    assert result.returncode == 2 and result.stderr == f"error: --output-dir: {out} exists and is not a directory\n"


def test_an_output_dir_under_a_file_is_one_error_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = cli("--tasks", "py_count", "--methods", "exact", "--limit", "1", "--output-dir", str(blocker / "out"))
    assert result.returncode == 2 and result.stderr == f"error: --output-dir: {blocker} is a file, not a folder\n"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_output_dir_that_cannot_be_made_is_one_error_line_before_the_model(tmp_path, capsys, monkeypatch):
    """Nothing can be made in /proc, not even by root, for whom os.access says it can: the directory is tried before
    the model loads (was a FileNotFoundError traceback once it had); the try leaves nothing behind."""
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("kvcompress.longbench.cli.load_pipeline", no_model)
    flags = ["--methods", "exact", "--tasks", "py_count", "--limit", "1"]
    assert longbench.main([*flags, "--output-dir", "/proc/forbidden/x"]) == 2
    assert capsys.readouterr().err == ("error: --output-dir: /proc/forbidden/x cannot be created or written: no folder "
                                       "can be made in /proc (No such file or directory)\n")
    assert longbench.main([*flags, "--score-only", "--output-dir", str(tmp_path / "new" / "run")]) == 2
    assert capsys.readouterr().err.startswith("error: --score-only: no predictions in")
    assert list(tmp_path.iterdir()) == []


def test_a_layer_the_model_does_not_have_is_one_error_line(tmp_path):
    """full_layers / retrieval_layers are checked against the loaded model: one line naming the flag (a traceback)."""
    result = cli("--benchmark", "ruler", "--length", "512", "--limit", "1", "--tasks", "niah_single", "--methods",
                 "compresskv", "--press-option", "compresskv.full_layers=[99]", "--output-dir", str(tmp_path / "o"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == ("error: --press-option: compresskv: full_layers: 99 is not a "
                                              "full-attention layer of this 30-layer model; accepted: 0 to 29")


def test_data_dir_without_the_task_file(tmp_path):
    result = cli("--data-dir", str(tmp_path), "--tasks", "qasper", "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 2 and result.stderr.startswith("error: --data-dir: neither qasper.jsonl")
    assert result.stderr.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("model", ["not_a_model", "missing"])
def test_model_path_that_is_not_a_model_is_one_error_line(tmp_path, model):
    (tmp_path / "not_a_model").mkdir()
    out = tmp_path / "out"
    result = cli("--model", str(tmp_path / model), "--output-dir", str(out))
    assert result.returncode == 2 and result.stderr.startswith("error: --model: ") and result.stderr.count("\n") == 1
    assert not out.exists()


@pytest.mark.slow
def test_unloadable_model_is_one_error_line(tmp_path):
    out = tmp_path / "out"
    result = cli("--model", "no-such-org/no-such-model", "--tasks", "py_qa", "--output-dir", str(out))  # Hub offline
    assert result.returncode == 2
    assert result.stderr.startswith("error: --model: cannot load 'no-such-org/no-such-model'"), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert not (out / "results.md").exists() and not (out / "scores.json").exists()


# ---------------------------------------------------------------------------------------------- runs


@pytest.mark.slow
def test_offline_suite_end_to_end_then_resume(tmp_path, embedded_dir):
    out = tmp_path / "run"
    args = ["--methods", "exact", "compresskv", "--limit", "1", "--output-dir", str(out), *SMOKE]
    first = cli(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    tasks = list(offline_suite.TASKS)
    for method in ("exact", "compresskv"):
        for task in tasks:
            (record,) = lines(out / "predictions" / method / f"{task}.jsonl")
            assert record["method"] == method and record["task"] == task and record["truncated"]
    scores = json.loads((out / "scores.json").read_text())
    assert scores["complete"] and scores["ratio"] == 0.25 and scores["tasks"] == tasks
    assert all(0 <= scores["results"][m]["tasks"][t]["overall"] <= 100 for m in ("exact", "compresskv") for t in tasks)
    rows = table_rows((out / "results.md").read_text())
    assert rows[0] == ["Method", *tasks, "Average"]
    assert [r[0] for r in rows[2:]] == ["Exact", "CompressKV"] and "partial" not in (out / "results.md").read_text()
    assert rows[2][-1] == f"{scores['results']['exact']['average']:.2f}"
    assert rows[0] == table_rows(first.stdout)[0]  # the table is printed too
    with open(out / "scores.csv", newline="") as handle:
        csv_rows = list(csv.DictReader(handle))
    assert {(r["method"], r["task"], r["bucket"]) for r in csv_rows} >= {("exact", "average", "overall")}
    assert len(csv_rows) == 2 * (len(tasks) + 1) * 4
    assert (out / "scores.png").read_bytes()[:4] == b"\x89PNG"

    # Resume: everything is there, so no model is loaded and nothing is appended.
    sizes = {p: p.stat().st_size for p in (out / "predictions").rglob("*.jsonl")}
    tick = time.perf_counter()
    again = cli(*args)
    assert again.returncode == 0 and "0 predictions to make" in again.stderr and "loading" not in again.stderr
    assert time.perf_counter() - tick < 30
    assert {p: p.stat().st_size for p in (out / "predictions").rglob("*.jsonl")} == sizes

    # A run killed mid-line: the scores say partial until the rerun completes the missing example.
    path = out / "predictions" / "compresskv" / "py_qa.jsonl"
    path.write_text(path.read_text()[:40])
    partial = cli(*args, "--score-only")
    assert partial.returncode == 1
    assert "(partial 0/1)" in (out / "results.md").read_text() and "(partial)" in (out / "results.md").read_text()
    assert not json.loads((out / "scores.json").read_text())["complete"]
    # Predictions made with another press are not continued: a run.json from before the settings were recorded
    # (and before calibrations: no retrieval layers), and one whose default had another setting (a changed default)
    record = json.loads((out / "run.json").read_text())
    settings = record["presses"]["compresskv"]
    assert settings["active_retrieval_layers"] == [18] and settings["retrieval_prior_share"] == 1.0
    assert record["presses"]["exact"] == {} and settings["compression_ratio"] == 0.75
    (out / "run.json").write_text(json.dumps({k: v for k, v in record.items() if k != "presses"}))
    mixed = cli(*args)
    assert mixed.returncode == 2 and mixed.stderr.count("error:") == 1, mixed.stderr
    assert "holds compresskv predictions made with another press (retrieval layers [] there, [18] now)" in (
        mixed.stderr.splitlines()[-1]
    )
    older = {**record, "presses": {**record["presses"], "compresskv": {**settings, "retrieval_prior_share": 0.0}}}
    (out / "run.json").write_text(json.dumps(older))
    mixed = cli(*args)
    assert mixed.returncode == 2 and "(retrieval_prior_share: 0.0 there, 1.0 now)" in mixed.stderr, mixed.stderr
    (out / "run.json").write_text(json.dumps(record))
    done = cli(*args)
    assert done.returncode == 0 and "1 predictions to make" in done.stderr
    assert len(lines(path)) == 1 and json.loads((out / "scores.json").read_text())["complete"]

    # Other settings cannot be mixed into this directory: the attention implementation is one of them, and the
    # dtype counts as it resolves here (the embedded run's float32, asked for explicitly, is the same).
    clash = cli(*args, "--ratio", "0.5")
    assert clash.returncode == 2 and "ratio=0.25" in clash.stderr and clash.stderr.count("\n") == 1
    clash = cli(*args, "--attn-implementation", "eager")
    assert clash.returncode == 2 and "attn_implementation='sdpa'" in clash.stderr
    assert cli(*args, "--dtype", "float32", "--score-only").returncode == 0
    history = json.loads((out / "run.json").read_text())["history"]  # every run kept, the first one first
    assert len(history) == 5 and history[0]["command"][-len(args) :] == args
    assert history[-1]["command"][-3:] == ["--dtype", "float32", "--score-only"] and "kvcompress" in history[-1]


@pytest.mark.slow
def test_data_dir_and_hub_layout_on_local_files(tmp_path, embedded_dir, monkeypatch):
    """LongBench's raw columns from --data-dir, kvpress's processed columns through datasets.load_dataset."""
    paragraphs = "\n\n".join(
        f"Paragraph {i}: The {w} is the color of item number {i}." for i, w in enumerate(["red", "blue", "green"], 1)
    )
    raw = [
        {
            "input": "The green item.",
            "context": paragraphs,
            "answers": ["Paragraph 3"],
            "length": 40,
            "all_classes": None,
            "_id": "r1",
            "dataset": "passage_retrieval_en_e",
            "language": "en",
        },
        {
            "input": "The red item.",
            "context": paragraphs,
            "answers": ["Paragraph 1"],
            "length": 5000,
            "all_classes": None,
            "_id": "r2",
            "dataset": "passage_retrieval_en_e",
            "language": "en",
        },
    ]
    trec = {
        "input": "Question: Who painted the Mona Lisa?\nType:",
        "context": "Question: Who wrote Hamlet?\nType: Individual\nQuestion: Where is Lyon?\nType: City",
        "answers": ["Individual"],
        "length": 20,
        "all_classes": ["Individual", "City", "Date"],
        "_id": "t1",
    }
    data = tmp_path / "data"
    data.mkdir()
    (data / "passage_retrieval_en.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw))
    (data / "trec_e.jsonl").write_text(json.dumps(trec) + "\n")
    base = ["--model", str(embedded_dir), "--methods", "exact", *SMOKE]
    out = tmp_path / "local"
    status = longbench.main(
        [*base, "--data-dir", str(data), "--tasks", "passage_retrieval_en", "trec_e", "--output-dir", str(out)]
    )
    assert status == 0
    scores = json.loads((out / "scores.json").read_text())["results"]["exact"]
    assert scores["tasks"]["passage_retrieval_en"]["n"] == 2 and scores["tasks"]["trec"]["n"] == 1
    assert (
        scores["tasks"]["passage_retrieval_en"]["n_0-4k"] == 1
        and scores["tasks"]["passage_retrieval_en"]["n_4-8k"] == 1
    )
    assert table_rows((out / "results.md").read_text())[0] == ["Method", "p.ret", "trec", "Average"]

    hub = tmp_path / "hub" / "trec_e"  # laid out like Xnhyacinth/LongBench: <task>_e/test.jsonl
    hub.mkdir(parents=True)
    context, question, prefix = longbench.split_prompt("trec", trec["context"], trec["input"])
    processed = {**trec, "context": context, "question": question, "answer_prefix": prefix, "task": "trec"}
    del processed["input"]
    (hub / "test.jsonl").write_text(json.dumps(processed) + "\n")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
    out2 = tmp_path / "hub_run"
    assert longbench.main([*base, "--dataset", str(hub.parent), "--tasks", "trec", "--output-dir", str(out2)]) == 0
    (mine,) = lines(out2 / "predictions" / "exact" / "trec.jsonl")
    (theirs,) = [r for r in lines(out / "predictions" / "exact" / "trec.jsonl")]
    assert mine["prediction"] == theirs["prediction"] and mine["prompt_tokens"] == theirs["prompt_tokens"]


@pytest.mark.slow
def test_processes_write_shards_and_process_zero_merges(tmp_path, embedded_dir, monkeypatch):
    out = tmp_path / "mp"
    args = [
        "--model",
        str(embedded_dir),
        "--tasks",
        "py_count",
        "--methods",
        "exact",
        "--limit",
        "3",
        "--output-dir",
        str(out),
        *SMOKE,
    ]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert longbench.main(args) == 0
    shard = out / "predictions" / "exact" / "py_count.rank1.jsonl"
    assert [r["index"] for r in lines(shard)] == [1] and not (out / "results.md").exists()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert longbench.main(args) == 0
    merged = out / "predictions" / "exact" / "py_count.jsonl"
    assert [r["index"] for r in lines(merged)] == [0, 1, 2] and not shard.exists()
    assert json.loads((out / "scores.json").read_text())["complete"]


def test_press_options_offer_only_real_settings_and_our_presses_check_their_own():
    """--press-option lists a press's settings, not its private state, and leaves our presses' fields to their own
    checks (a negative seed is a seed; a negative window is refused by the press, naming it)."""
    from kvcompress.longbench.config import UsageError

    with pytest.raises(UsageError, match="has no setting 'foo'") as err:
        longbench.parse_config(["--press-option", "compresskv.foo=1"])
    assert "window_size" in str(err.value) and "_pending" not in str(err.value)
    with pytest.raises(UsageError, match="has no setting '_pending'"):
        longbench.parse_config(["--press-option", "compresskv._pending=1"])
    cfg = longbench.parse_config(["--press-option", "compresskv.seed=-1"])
    assert longbench.make_press("compresskv", cfg.ratio, cfg.seed, cfg.press_options["compresskv"]).seed == -1
    with pytest.raises(UsageError, match="window_size"):
        longbench.parse_config(["--press-option", "compresskv.window_size=-3"])
    with pytest.raises(UsageError, match=r"snapkv: window_size: must be an int >= 1, got -3"):
        longbench.parse_config(["--press-option", "snapkv.window_size=-3"])
