"""Shared by the server tests: start ``python -m kvcompress.serve`` on 127.0.0.1 and wait until it answers."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(
    args: Sequence[str],
    log_path: Path,
    start_timeout: float = 300,
    command: Sequence[str] = (sys.executable, "-m", "kvcompress.serve"),
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """``command`` (this checkout's server by default; e.g. ``[venv/bin/kvcompress, "serve"]``) with ``--api-key
    API_KEY --threads 1`` plus ``args`` on a free port, run in ``cwd`` with ``env`` (default: this environment with
    the checkout on PYTHONPATH), its stdout and stderr in ``log_path``; yields its base URL. On exit: stopped, and
    its log must hold no traceback."""
    import httpx

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)} if env is None else env
    cmd = [*map(str, command), "--port", str(port), "--threads", "1", "--api-key", API_KEY, *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + start_timeout
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited: {log_path.read_text()[-2000:]}")
            if time.time() > deadline:
                pytest.fail(f"server did not start in {start_timeout:.0f} s")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log_path.read_text(), log_path.read_text()[-3000:]
