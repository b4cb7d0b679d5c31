"""eval/bench_fit.py at tiny sizes on CPU: every row is timed and reported in the table and the JSON, the
profile prints, bad arguments exit with a message naming the flag. A smoke test, not a measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval import bench_fit as bench

TINY = [
    "--device", "cpu", "--dtype", "fp32", "--contexts", "400", "--queries", "8", "70", "--heads", "4", "2",
    "--head-dim", "16", "--warmup", "0", "--repeats", "2", "--layers", "3",
]  # fmt: skip


def test_smoke_run_reports_every_row_and_the_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "fit.json"
    assert bench.main([*TINY, "--profile", "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert "median ms" in printed and "aten::" in printed and f"wrote {output}" in printed
    data = json.loads(output.read_text())
    assert [(r["context"], r["queries"], r["backend"]) for r in data["rows"]] == [(400, 8, "auto"), (400, 70, "auto")]
    for row in data["rows"]:
        assert row["kept_rows"] == 100 - 68 and row["samples"] == 2
        assert 0 < row["min_ms"] <= row["median_ms"] and row["model_s"] == pytest.approx(3 * row["median_ms"] / 1e3)
        assert 0 <= row["accepted"] <= 1
        assert row["peak_mib"] >= 0 if Path("/proc/self/clear_refs").exists() else row["peak_mib"] is None
    assert data["environment"]["device"] == "cpu" and data["settings"]["heads"] == [4, 2]


def test_cases_follow_the_press_conventions() -> None:
    import torch

    case = bench.make_case(1000, 0.25, 100, 4, 2, 16, torch.float32, torch.device("cpu"))
    kept, positions, protected = case["kept"], case["query_positions"], case["protected"]
    assert kept.shape == (1, 2, 250 - 68) and (kept.diff(dim=-1) > 0).all()
    assert not protected[kept].any() and protected.sum() == 4 + 64 and protected.device.type == "cpu"
    assert positions.shape == (100,) and (positions.diff() >= 0).all()
    assert positions[-64:].tolist() == list(range(936, 1000))  # the window's queries, the rest spread before


def test_known_rows_are_the_window_queries_attention(tmp_path: Path) -> None:
    """``--known-rows`` hands the fit the case's queries' causal log-sum-exp and outputs: their float64 definition
    within float32 rounding (1e-5 of the largest), and the rows say so."""
    import torch

    from tests.references import float64_fit_rows

    case = bench.make_case(400, 0.25, 8, 4, 2, 16, torch.float32, torch.device("cpu"))
    lse, outputs = bench.known_rows(case)
    queries = case["queries"].reshape(2, 2 * 8, 16)
    _, want_lse, want_outputs = float64_fit_rows(
        queries, case["keys"][0], case["values"][0], case["scaling"], case["query_positions"].repeat(2)
    )
    torch.testing.assert_close(lse.double(), want_lse.reshape(1, 4, 8), rtol=0, atol=1e-5)
    scale = want_outputs.abs().max().item()
    torch.testing.assert_close(outputs.double(), want_outputs.reshape(1, 4, 8, 16), rtol=0, atol=1e-5 * scale)
    output = tmp_path / "fit.json"
    tiny = [arg if arg != "70" else "64" for arg in TINY]
    assert bench.main([*tiny, "--known-rows", "--output", str(output)]) == 0
    assert [row["known_rows"] for row in json.loads(output.read_text())["rows"]] == [True, True]


@pytest.mark.parametrize(
    "bad, flag",
    [(["--kept", "0"], "--kept"), (["--heads", "6", "4"], "--heads"), (["--contexts", "50"], "--contexts"),
     (["--queries", "1"], "--queries"), (["--repeats", "0"], "--repeats"), (["--backends", "cuda"], "--backends"),
     (["--known-rows"], "--known-rows")],
)  # fmt: skip
def test_bad_arguments_exit_with_a_message(bad: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main([*TINY, *bad])
    assert flag in capsys.readouterr().err


def test_kernel_tiles_time_every_tile_and_agree_with_the_launchers(tmp_path: Path, capsys) -> None:
    """The tile sweep on CPU tensors under the interpreter (the GPU run is the measurement): a row per kernel and
    tile, each tile's result the launcher's own up to float32 reordering, and the rows in the JSON."""
    pytest.importorskip("triton", reason="triton is not installed (the fused kernels need it)")
    from kvcompress.kernels import fit_products

    if not fit_products.INTERPRET:
        pytest.skip("the kernels were defined for a GPU; this smoke run uses CPU tensors in the interpreter")
    output = tmp_path / "tiles.json"
    one_case = [
        "--device", "cpu", "--dtype", "fp32", "--contexts", "400", "--queries", "20", "--heads", "4", "2",
        "--head-dim", "16", "--warmup", "0", "--repeats", "1",
    ]  # fmt: skip
    assert bench.main([*one_case, "--kernel-tiles", "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert "TFLOP/s" in printed
    tiles = [r for r in json.loads(output.read_text())["rows"] if "kernel" in r]
    kernels = [r["kernel"] for r in tiles]
    assert kernels.count("attention_rows") == 1 + len(bench.ROWS_TILES)
    assert kernels.count("block_sums") == 1 + len(bench.PRODUCTS_TILES)
    for row in tiles:
        assert "error" not in row, row
        assert row["median_ms"] > 0 and row["tflops"] > 0
        assert row["max_rel_diff"] <= 1e-5  # the same float32 sums in another order (the interpreter: IEEE fp32)
