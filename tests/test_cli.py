"""The ``kvcompress`` command: its subcommands, the pyproject entry point, and the embedded run from an install."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvcompress import cli
from kvcompress.longbench.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run(args: list[str], cwd: Path, pythonpath: Path = REPO, timeout: int = 120) -> subprocess.CompletedProcess:
    """``args`` in a fresh process from ``cwd``, importing kvcompress from ``pythonpath`` (the checkout under test)."""
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_subcommand_on_one_line(tmp_path):
    result = run([sys.executable, "-m", "kvcompress", "--help"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    listed = result.stdout.split("commands:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in listed] == list(cli.COMMANDS)
    assert all(len(line.split()) > 2 for line in listed)  # a name and a summary


def test_eval_help_describes_the_default_run_and_every_flag(tmp_path):
    result = run([sys.executable, "-m", "kvcompress", "eval", "--help"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith("usage: kvcompress eval")
    assert "default run (no --model, no --config)" in text and "SmolLM2-135M-Instruct" in text
    assert "./results/longbench/SmolLM2-135M-Instruct_0.25/ under the current directory" in text
    for action in build_parser()._actions:
        assert action.help, action.option_strings  # every flag says what it does
        assert action.option_strings[-1] in text


def test_serve_subcommand_reaches_the_server_cli(tmp_path):
    result = run([sys.executable, "-m", "kvcompress", "serve", "--help"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--cache-memory" in result.stdout and "--api-key" in result.stdout and "--press-option" in result.stdout


def test_bad_subcommand_or_flag_is_one_error_line(capsys):
    assert cli.main(["nope"]) == 2
    assert capsys.readouterr().err == "error: unknown command 'nope'; choose from eval, calibrate, serve\n"
    assert cli.main([]) == 2 and "commands:" in capsys.readouterr().err
    argv = list(sys.argv)
    assert cli.main(["eval", "--ratio", "0"]) == 2
    assert sys.argv == argv  # restored after the command
    err = capsys.readouterr().err
    assert err.startswith("error: --ratio") and err.count("\n") == 1


def test_pyproject_script_resolves_to_the_dispatcher():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    module, _, function = project["scripts"]["kvcompress"].partition(":")
    assert getattr(importlib.import_module(module), function) is cli.main
    for target, _ in cli.COMMANDS.values():  # every subcommand's entry point exists
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function))


@pytest.mark.slow
def test_installed_wheel_runs_the_embedded_default_from_any_directory(tmp_path, embedded_dir):
    """Build a wheel of the checkout, install it (no dependencies) into a folder, run its console script elsewhere."""
    source, dist, site, work = (tmp_path / name for name in ("src", "dist", "site", "work"))
    shutil.copytree(REPO / "kvcompress", source / "kvcompress", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    build = f"from setuptools import build_meta; print(build_meta.build_wheel({str(dist)!r}))"
    built = run([sys.executable, "-c", build], cwd=source, pythonpath=source)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = dist / built.stdout.split()[-1]
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvcompress/longbench/offline_default.yaml" in names
    assert "kvcompress/longbench/data/offline_suite/py_qa.jsonl" in names
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)]
    assert run(pip, cwd=tmp_path).returncode == 0
    work.mkdir()
    smoke = ["--methods", "exact", "--tasks", "py_qa", "--limit", "1", "--max-new-tokens", "2", "--threads", "1"]
    result = run([str(site / "bin" / "kvcompress"), "eval", *smoke], cwd=work, pythonpath=site, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = work / "results" / "longbench" / "SmolLM2-135M-Instruct_0.25"
    assert (out / "results.md").read_text().startswith("# Offline suite: SmolLM2-135M-Instruct")
    assert (out / "predictions" / "exact" / "py_qa.jsonl").exists()
    assert not (site / "kvcompress" / "longbench" / "results").exists()


NEEDS_PROC = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
FORBIDDEN = "/proc/forbidden/x"  # nothing can be made in /proc, not even by root (for whom os.access says it can)


def no_model(*args, **kwargs):
    raise AssertionError("the model was loaded: the check came too late")


@pytest.mark.parametrize(
    "argv, message",
    [  # each started a server, ran until the press met a prefill, or ended in a traceback
        (["serve", "--method", "snapkv", "--press-option", "window_size=-1"],
         "kvcompress serve: error: --press-option: window_size: must be an int >= 1, got -1"),
        (["serve", "--method", "snapkv", "--press-option", "kernel_size=4"],
         "kvcompress serve: error: --press-option: kernel_size: must be an odd int >= 1, got 4"),
        (["serve", "--method", "streamingllm", "--press-option", "n_sink=1.5"],
         "kvcompress serve: error: --press-option: n_sink: must be an int >= 0, got 1.5"),
        (["serve", "--method", "adakv", "--press-option", "alpha_safeguard=2"],
         "kvcompress serve: error: --press-option: alpha_safeguard: must be a number in [0, 1], got 2"),
        (["serve", "--press-option", "reference=["], "kvcompress serve: error: --press-option: 'reference=[': the "
         "value '[' is not valid YAML (expected the node content, but found '<stream end>')"),
        (["serve", "--served-model-name", ""], "kvcompress serve: error: --served-model-name: must be a non-empty"),
        (["serve", "--served-model-name", "  "], "kvcompress serve: error: --served-model-name: must be a non-empty"),
        (["serve", "--model", "/nonexistent/dir"], "kvcompress serve: error: --model: /nonexistent/dir does not exist"),
        (["eval", "--methods", "snapkv", "--press-option", "snapkv.kernel_size=0"],
         "error: --press-option: snapkv: kernel_size: must be an int >= 1, got 0"),
        (["eval", "--methods", "streamingllm", "--press-option", "streamingllm.n_sink=1.5"],
         "error: --press-option: streamingllm: n_sink: must be an int >= 0, got 1.5"),
        (["eval", "--press-option", "compresskv.reference=["], "error: --press-option: 'compresskv.reference=[': the "
         "value '[' is not valid YAML (expected the node content, but found '<stream end>')"),
        pytest.param(["eval", "--methods", "exact", "--tasks", "py_count", "--limit", "1", "--output-dir", FORBIDDEN],
                     f"error: --output-dir: {FORBIDDEN} cannot be created or written: no folder can be made in /proc",
                     marks=NEEDS_PROC),
    ],
)
def test_bad_press_options_and_paths_are_one_error_line_before_the_model_loads(argv, message, capsys, monkeypatch):
    monkeypatch.setattr("kvcompress.models.load_model", no_model)
    monkeypatch.setattr("kvcompress.longbench.cli.load_pipeline", no_model)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err


@NEEDS_PROC
def test_calibrate_refuses_an_output_that_cannot_be_created_before_the_scan(capsys, monkeypatch):
    """Was found after the scan (minutes to hours): root passed the os.access check, then the file could not be made."""
    monkeypatch.setattr("kvcompress.models.load_model", no_model)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["calibrate", "--output", f"{FORBIDDEN}.json"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"kvcompress calibrate: error: --output: {FORBIDDEN}.json cannot be created: no folder can be made in /proc "
        "(No such file or directory)"
    )
    monkeypatch.setenv("KVCOMPRESS_CALIBRATIONS", FORBIDDEN)  # no --output: the folder calibrations are filed in
    with pytest.raises(SystemExit) as exit_:
        cli.main(["calibrate"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"kvcompress calibrate: error: --output (not given: {FORBIDDEN}, $KVCOMPRESS_CALIBRATIONS): {FORBIDDEN}/"
        "calibration.json cannot be created: no folder can be made in /proc (No such file or directory)"
    )
