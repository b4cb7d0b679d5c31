"""eval/compile_kernels.py: every kernel family (the fit's, the attention mass's, the RPNys coreset's, the weighted
attention's) compiles for an H100 (sm_90) on this CPU-only machine with the launch options its launchers choose,
the fit's without register spills; bad arguments exit with a message naming the flag.

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


def test_prefill_kernels_compile_for_sm90_the_fit_without_spills():
    done = _run("--kernels", "fit", "mass", "--dtypes", "bf16", "fp32", "--head-dims", "128", "--bin-rows", "1", "16")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("ok")]
    # Two dtypes x (attention_rows with and without positions, block_sums at 2 bin sizes, the mass's row pass
    # and its column pass summed and maxed).
    assert len(lines) == 2 * (2 + 2 + 3) and done.stdout.rstrip().endswith("0 failed for sm_90")
    fit = [line for line in lines if "attention_rows" in line or "block_sums" in line]
    assert len(fit) == 8, fit
    # float32's block sums keep a few bytes of stack at 16 warps (their FMA products with the values); none else.
    spill_free = [line for line in fit if "block_sums fp32" not in line]
    assert all(line.endswith("stack + local 0 B") for line in spill_free), fit
    small = [int(line.split("stack + local ")[1].split()[0]) for line in fit if "block_sums fp32" in line]
    assert len(small) == 2 and max(small) <= 32, fit


def test_weighted_attention_and_rpnys_kernels_compile_for_sm90_float32_attention_without_spills():
    done = _run("--kernels", "attention", "rpnys", "--dtypes", "bf16", "fp32", "--head-dims", "128")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("ok")]
    # Decode (plain, the merge fused into stage 1, each folding the step's row into the clip range, a decode batch
    # folding each row's own row, static) and a 512-token prefill chunk: stage 1, and the merge where the keys are
    # split (bf16: all five unfused; float32: its 16-row tiles give the chunk enough programs unsplit). The fused
    # merge and the folds keep stage 1's spills (bf16) or none (float32).
    weighted = [line for line in lines if line.startswith("ok     weighted")]
    bf16, fp32 = ([line for line in weighted if f" {dtype} " in line] for dtype in ("bf16", "fp32"))
    assert len(bf16) == 12 and sum(" merge:" in line for line in bf16) == 5, done.stdout
    assert len(fp32) == 11 and all(line.endswith("stack + local 0 B") for line in fp32), done.stdout
    stack = {
        line.split("weighted ")[1].split(" splits=")[0]: int(line.split("stack + local ")[1].split()[0])
        for line in bf16
        if "splits=" in line
    }
    assert stack["decode fused merge bf16 d=128"] <= stack["decode bf16 d=128"], done.stdout
    assert stack["decode folding bf16 d=128"] <= stack["decode bf16 d=128"], done.stdout
    assert stack["decode batch folding bf16 d=128"] <= stack["decode static bf16 d=128"], done.stdout
    assert stack["decode fused merge folding bf16 d=128"] <= stack["decode fused merge bf16 d=128"], done.stdout
    # RPNys: 48-row bins with and without a query radius, 256-row bins; per dtype.
    assert len([line for line in lines if "rpnys" in line]) == 6, done.stdout
    assert done.stdout.rstrip().endswith("0 failed for sm_90")


@pytest.mark.parametrize("bad, flag", [(["--head-dims", "300"], "--head-dims"), (["--bin-rows", "65"], "--bin-rows"),
                                       (["--arch", "70"], "--arch"),
                                       (["--kernels", "decode"], "--kernels")])  # fmt: skip
def test_bad_arguments_exit_with_a_message(bad, flag):
    done = _run(*bad)
    assert done.returncode == 2 and flag in done.stderr


def test_refuses_to_run_under_the_interpreter():
    done = subprocess.run(
        [sys.executable, "-m", "eval.compile_kernels"], capture_output=True, text=True,
        env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "TRITON_INTERPRET=1 is set" in done.stderr
