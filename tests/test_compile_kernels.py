"""eval/compile_kernels.py: the fit's fused kernels compile for an H100 (sm_90) on this CPU-only machine, with the
launch options their launchers choose, without register spills; bad arguments exit with a message naming the flag.

It runs in a subprocess: this session's conftest sets TRITON_INTERPRET=1, under which the kernels are defined for
the interpreter and cannot be compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed (the kernel tests need it)")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    return subprocess.run(
        [sys.executable, "-m", "eval.compile_kernels", *args], capture_output=True, text=True, env=env, timeout=600
    )


def test_fit_kernels_compile_for_sm90_without_spills():
    done = _run("--dtypes", "bf16", "fp32", "--head-dims", "128", "--bin-rows", "1", "16")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("ok")]
    # Two dtypes x (attention_rows with and without positions + block_products at 2 bin sizes).
    assert len(lines) == 2 * (2 + 2) and done.stdout.rstrip().endswith("0 failed for sm_90")
    assert all("shared" in line for line in lines)


@pytest.mark.parametrize("bad, flag", [(["--head-dims", "300"], "--head-dims"), (["--bin-rows", "65"], "--bin-rows"),
                                       (["--arch", "70"], "--arch")])  # fmt: skip
def test_bad_arguments_exit_with_a_message(bad, flag):
    done = _run(*bad)
    assert done.returncode == 2 and flag in done.stderr


def test_refuses_to_run_under_the_interpreter():
    done = subprocess.run(
        [sys.executable, "-m", "eval.compile_kernels"], capture_output=True, text=True,
        env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "TRITON_INTERPRET=1 is set" in done.stderr
