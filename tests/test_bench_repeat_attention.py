"""eval/bench_repeat_attention.py at tiny sizes on CPU: every variant timed and reported in the table and the
JSON with the path each ran, their outputs equal, bad arguments exit with a message naming the flag. A smoke
test, not a measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eval import bench_repeat_attention as bench

TINY = [
    "--device", "cpu", "--dtype", "fp32", "--contexts", "300", "--chunk", "64", "--heads", "4", "2",
    "--head-dim", "16", "--warmup", "0", "--repeats", "2", "--layers", "3",
]  # fmt: skip


def test_smoke_run_reports_every_variant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "repeat.json"
    assert bench.main([*TINY, "--output", str(output)]) == 0
    assert f"wrote {output}" in capsys.readouterr().out
    data = json.loads(output.read_text())
    variants = [(r["context"], r["variant"]) for r in data["rows"]]
    assert variants == [(300, "masked"), (300, "lower-right"), (300, "split")]
    masked, lower_right, split = data["rows"]
    value = bench.make_case(300, 64, 4, 2, 16, torch.float32, torch.device("cpu"))["value"]
    bound = (4 * (16 + 364) + 1) * 2.0**-24 * value.abs().max().item()  # both float32: logits' and sums' rounding
    assert masked["path"] == "transformers sdpa, explicit mask" and lower_right["path"].startswith("lower-right")
    assert split["path"] == lower_right["path"]  # the CPU does not split (no flash operator to hand an LSE over)
    for row in data["rows"]:
        assert 0 < row["min_ms"] <= row["median_ms"] and row["samples"] == 2
        assert row["pass_s"] == pytest.approx(3 * 5 * row["median_ms"] / 1e3)  # 3 layers x 5 chunks of 64
        assert row["max_abs_diff"] <= bound
    assert data["command"].startswith("python -m eval.bench_repeat_attention")


def test_the_case_is_one_chunk_after_its_context() -> None:
    case = bench.make_case(100, 8, 4, 2, 16, torch.float32, torch.device("cpu"))
    assert case["query"].shape == (1, 4, 8, 16) and case["key"].shape == (1, 2, 108, 16)
    assert case["mask"].shape == (1, 1, 8, 108) and case["mask"].sum().item() == 8 * 100 + 36  # context + triangle


@pytest.mark.parametrize(
    "bad, flag",
    [(["--heads", "6", "4"], "--heads"), (["--chunk", "1"], "--chunk"), (["--contexts", "0"], "--contexts"),
     (["--repeats", "0"], "--repeats")],
)  # fmt: skip
def test_bad_arguments_exit_with_a_message(bad: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main([*TINY, *bad])
    assert flag in capsys.readouterr().err
