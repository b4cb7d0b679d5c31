"""eval/speed/prefill.py (the ``prefill`` section of python -m eval.speed) in smoke mode on CPU: every setting
runs, its stages add up to its instrumented total, and each stage is timed where the setting has it."""

from __future__ import annotations

import json
from pathlib import Path

from eval import speed
from eval.speed.prefill import SETTINGS

ARGS = ["--device", "cpu", "--smoke", "--dtype", "float32", "--only", "prefill", "--breakdown-lengths", "320"]


def test_breakdown_covers_every_setting_and_stage(tmp_path: Path) -> None:
    output = tmp_path / "speed.json"
    assert speed.main([*ARGS, "--output", str(output)]) == 0
    data = json.loads(output.read_text())
    rows = data["prefill_breakdown"]["rows"]
    assert [r["setting"] for r in rows] == list(SETTINGS)
    by_name = {r["setting"]: r for r in rows}
    for row in rows:
        assert "error" not in row, row
        assert row["n"] == 320 and row["total_s"] > 0 and row["vs_none"] > 0 and row["peak_gib"] is None
        assert row["forward_s"] > 0 and min(row[k] for k in ("repeat_forward_s", "mass_s", "selection_s", "fit_s")) >= 0
    for name in ("none", "snapkv"):  # nothing of ours runs: all in the forward
        assert by_name[name]["mass_s"] == by_name[name]["fit_s"] == by_name[name]["selection_s"] == 0
    assert by_name["paper"]["selection_s"] > 0 and by_name["paper"]["mass_s"] == 0  # RPNys, no reference queries
    for name in ("thorough", "window_repeat_sum", "repeat_quarter"):
        assert by_name[name]["repeat_forward_s"] > 0 and by_name[name]["mass_s"] > 0 and by_name[name]["fit_s"] > 0
    for name in ("default", "window", "context", "accumulated"):
        assert by_name[name]["repeat_forward_s"] == 0 and by_name[name]["mass_s"] > 0 and by_name[name]["fit_s"] > 0
    assert by_name["window_nofit"]["fit_s"] == 0
    mass = data["prefill_breakdown"]["mass"]
    assert [(r["queries"], r["causal"], r["backend"]) for r in mass] == [
        (320, False, "torch"),
        (320, True, "torch"),
        (64, True, "torch"),
    ]
    assert all(r["median_s"] > 0 and r["tflops"] > 0 for r in mass)
