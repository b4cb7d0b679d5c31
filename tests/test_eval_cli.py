"""The harness command lines end to end at tiny sizes: files, columns and sane numbers (fidelity: test_fidelity.py)."""

from __future__ import annotations

import csv

import pytest

from eval import approx_error


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_approx_error_cli_writes_csv_and_plot(tmp_path):
    argv = ["--n", "256", "--m", "32", "--ranks", "8", "32", "--trials", "2", "--output-dir", str(tmp_path)]
    assert approx_error.main(argv) in (0, None)
    rows = read_csv(tmp_path / "approx_error.csv")
    assert len(rows) == 2 * 5 * 2  # families x methods x ranks
    assert set(rows[0]) == set(approx_error.CSV_COLUMNS)
    assert all(float(r["max_err"]) >= 0 and float(r["rel_fro"]) >= 0 for r in rows)
    assert (tmp_path / "approx_error.png").stat().st_size > 10_000


def test_approx_error_rejects_unknown_method(tmp_path):
    with pytest.raises(SystemExit):
        approx_error.main(["--methods", "nope", "--output-dir", str(tmp_path)])


@pytest.mark.parametrize(
    "tool, argv, message",
    [
        ("approx_error", ["--n", "0"], "approx_error: n: must be an int >= 1, got 0"),
        ("approx_error", ["--trials", "-1"], "approx_error: trials: must be an int >= 1, got -1"),
        ("approx_error", ["--logit-std", "nan"], "approx_error: logit_std: must be a finite number > 0, got nan"),
        ("approx_error", ["--ranks", "8", "5000", "--n", "4096"], "approx_error: ranks: must be an int in [1, 4096]"),
        ("prefill_time", ["--threads", "-1"], "argument --threads: must be an int >= 1, got '-1'"),
        ("prefill_time", ["--tokens", "0"], "argument --tokens: must be an int >= 64, got '0'"),
        ("prefill_time", ["--kept", "0"], "argument --kept: must be a finite number in (0, 1], got '0'"),
        ("prefill_time", ["--question-tokens", "0"], "argument --question-tokens: must be an int >= 1, got '0'"),
        ("serve_load", ["--time-limit", "nan"], "argument --time-limit: must be a finite number in (0, inf)"),
        ("fidelity", ["--resamples", "0"], "fidelity: resamples: must be an int >= 1, got 0"),
        ("fidelity", ["--threads", "-1"], "fidelity: threads: must be an int >= 1, got -1"),
        # each of these was a traceback, or a run that wrote a report of nothing
        ("fidelity", ["--config", "/nonexistent.yaml"], "fidelity: --config: /nonexistent.yaml does not exist"),
        ("fidelity", ["--config", "{list}"], "fidelity: --config: {list}: expected a mapping of settings, got list"),
        ("fidelity", ["--config", "{broken}"], "fidelity: --config: {broken} is not a readable YAML file"),
        ("fidelity", ["--config", "{kept}"], "fidelity: kept: expected a list, got 'abc'"),
        ("fidelity", ["--dtype", "int64"], "fidelity: dtype: float32, bfloat16 or float16, got 'int64'"),
        ("fidelity", ["--device", "nodevice"], "fidelity: device: a torch device such as cpu"),
        ("fidelity", ["--model", "./no/such/model"], "fidelity: model: ./no/such/model does not exist"),
        ("fidelity", ["--report-only", "--output-dir", "{empty}"], "fidelity: report_only: no runs.jsonl in"),
        ("speed", ["--config", "/nonexistent.yaml"], "speed: --config: /nonexistent.yaml does not exist"),
        ("speed", ["--config", "{broken}"], "speed: --config: {broken} is not a readable YAML file"),
        ("speed", ["--config", "{kept}", "--smoke", "--device", "cpu"], "speed: kept: must be a number, got 'abc'"),
        ("speed", ["--model-layers", "0", "--smoke", "--device", "cpu"], "speed: --model-layers: must be an integer"),
        ("speed", ["--attn-implementations", "nope", "--smoke", "--device", "cpu"], "speed: attn_implementations:"),
        ("speed", ["--compile-backend", "nope", "--smoke", "--device", "cpu"], "speed: compile_backend: one of"),
        ("speed", ["--output", "{empty}", "--smoke", "--device", "cpu"], "is a folder; name the JSON file"),
        ("speed", ["--device", "nodevice"], "speed: --device: use cuda, cuda:N or cpu, got 'nodevice'"),
        ("frontier", ["--points", "/nonexistent.yaml"], "frontier: --points: /nonexistent.yaml does not exist"),
        ("frontier", ["--points", "{broken}"], "frontier: --points: {broken} is not a readable YAML file"),
        ("ruler_paired", ["{empty}", "exact", "{empty}", "snapkv"], "not a run directory (no run.json)"),
        ("fidelity_paired", ["--pair", "/nonexistent", "a", "b"], "is neither a fidelity run directory nor"),
    ],
)
def test_eval_tools_refuse_bad_flags_in_one_line_naming_them(tool, argv, message, capsys, tmp_path):
    """Before any model or data work: one line naming the flag (or its config key) and its range, no traceback
    (these raised from torch.set_num_threads, numpy or a kernel's check, or ran an empty study)."""
    import importlib

    files = {"{list}": "- a\n", "{broken}": "a: [\n", "{kept}": "kept: abc\n"}
    for name, text in files.items():
        (tmp_path / f"{name[1:-1]}.yaml").write_text(text)
    (tmp_path / "empty").mkdir()
    paths = {**{name: str(tmp_path / f"{name[1:-1]}.yaml") for name in files}, "{empty}": str(tmp_path / "empty")}
    argv = [paths.get(arg, arg) for arg in argv]
    for name, path in paths.items():
        message = message.replace(name, path)
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"eval.{tool}").main(argv)
    text = str(exit_.value.code) if isinstance(exit_.value.code, str) else capsys.readouterr().err
    assert message in text and "Traceback" not in text
