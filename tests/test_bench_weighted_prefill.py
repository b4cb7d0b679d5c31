"""eval/bench_weighted_prefill.py on CPU at tiny sizes (Triton in its interpreter): every backend runs, agrees
with the reference and is reported in the table and the JSON. A smoke test, not a measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval import bench_weighted_prefill as bench

TINY = [
    "--device", "cpu", "--dtype", "fp32", "--contexts", "96", "--kept", "0.5", "--new-tokens", "17", "40",
    "--heads", "4", "2", "--head-dim", "16", "--warmup", "1", "--repeats", "2",
]  # fmt: skip


def test_smoke_run_reports_every_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "bench.json"
    assert bench.main([*TINY, "--backends", "triton", "torch", "sdpa", "flex", "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert "median ms" in printed and f"wrote {output}" in printed
    data = json.loads(output.read_text())
    rows = data["rows"]
    assert {(r["new_tokens"], r["backend"]) for r in rows} == {
        (m, b) for m in (17, 40) for b in ("triton", "torch", "sdpa", "flex")
    }
    for row in rows:
        assert "error" not in row, row
        assert row["cache_rows"] == 48 + row["new_tokens"] and row["samples"] == 2
        assert row["median_ms"] > 0 and row["tflops"] > 0 and row["floor_gbps"] > 0
        assert row["rel_error"] < 1e-5  # fp32 against the reference
    assert data["environment"]["device"] == "cpu" and data["settings"]["heads"] == [4, 2]


def test_tiles_add_triton_rows_that_agree_with_the_reference(tmp_path: Path) -> None:
    output = tmp_path / "bench.json"
    # m = 9 runs the decode launcher, m = 40 the multi-token one; warps are the launcher's or the tile's.
    argv = [*TINY, "--new-tokens", "9", "40", "--backends", "torch", "--tiles", "16x32", "32x16x8", "--output"]
    assert bench.main([*argv, str(output)]) == 0
    rows = json.loads(output.read_text())["rows"]
    assert {(r["new_tokens"], r["backend"]) for r in rows} == {
        (m, b) for m in (9, 40) for b in ("torch", "triton 16x32", "triton 32x16x8")
    }
    for row in rows:
        assert "error" not in row, row
        assert row["rel_error"] < 1e-5  # fp32 against the reference


@pytest.mark.parametrize(
    "bad",
    [["--kept", "0"], ["--heads", "6", "4"], ["--new-tokens", "0"], ["--tiles", "8x32"], ["--tiles", "16x24"],
     ["--tiles", "16x32x32"], ["--tiles", "16"], ["--tiles", "axb"]],
)  # fmt: skip
def test_bad_arguments_exit_with_a_message(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main([*TINY, *bad])
    assert bad[0] in capsys.readouterr().err
