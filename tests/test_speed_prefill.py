"""eval/speed/prefill.py (the ``prefill`` section of python -m eval.speed) in smoke mode on CPU: every setting
runs, its stages add up to its instrumented total, and each stage is timed where the setting has it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eval import speed
from eval.speed.clock import Clock
from eval.speed.prefill import SETTINGS

ARGS = ["--device", "cpu", "--smoke", "--dtype", "float32", "--only", "prefill", "--breakdown-lengths", "320"]


def test_breakdown_covers_every_setting_and_stage(tmp_path: Path) -> None:
    output = tmp_path / "speed.json"
    assert speed.main([*ARGS, "--output", str(output)]) == 0
    data = json.loads(output.read_text())
    rows = data["prefill_breakdown"]["rows"]
    assert [r["setting"] for r in rows] == list(SETTINGS)
    by_name = {r["setting"]: r for r in rows}
    resident = cpu_peak_readable()
    for row in rows:
        assert "error" not in row, row
        assert row["n"] == 320 and row["total_s"] > 0 and row["vs_none"] > 0
        assert min(row["total_s_runs"]) <= row["total_s"] <= max(row["total_s_runs"])
        if resident:  # the process's peak resident memory: at least the model's weights, far below the machine's
            assert 0.001 < row["peak_gib"] < 64 and row["peak_vs_snapkv"] > 0, row
        else:
            assert row["peak_gib"] is None and "peak_vs_snapkv" not in row
        assert row["forward_s"] > 0 and min(row[k] for k in ("repeat_forward_s", "mass_s", "selection_s", "fit_s")) >= 0
    for name in ("none", "snapkv"):  # nothing of ours runs: all in the forward
        assert by_name[name]["mass_s"] == by_name[name]["fit_s"] == by_name[name]["selection_s"] == 0
    assert by_name["paper"]["selection_s"] > 0 and by_name["paper"]["mass_s"] == 0  # RPNys, no reference queries
    for name in (
        "thorough", "balanced", "balanced_window_novelty", "balanced_eighth", "window_repeat_sum", "repeat_quarter",
    ):
        assert by_name[name]["repeat_forward_s"] > 0 and by_name[name]["mass_s"] > 0 and by_name[name]["fit_s"] > 0
    for name in ("default", "calibrated", "window", "context", "accumulated"):
        assert by_name[name]["repeat_forward_s"] == 0 and by_name[name]["mass_s"] > 0 and by_name[name]["fit_s"] > 0
    for name in ("none_chunks", "default_chunks"):  # 320 tokens in 4 calls of 80
        assert by_name[name]["repeat_forward_s"] == 0
    assert by_name["default_chunks"]["mass_s"] > 0 and by_name["default_chunks"]["fit_s"] > 0
    chunked_repeat = by_name["balanced_chunks"]  # the pass after the last of 4 calls
    assert chunked_repeat["repeat_forward_s"] > 0 and chunked_repeat["mass_s"] > 0 and chunked_repeat["fit_s"] > 0
    assert by_name["none_chunks"]["mass_s"] == by_name["none_chunks"]["fit_s"] == 0
    nofit = by_name["default_nofit"]
    assert by_name["window_nofit"]["fit_s"] == nofit["fit_s"] == 0 < nofit["mass_s"]
    mass = data["prefill_breakdown"]["mass"]
    assert [(r["queries"], r["causal"], r["backend"]) for r in mass] == [
        (320, False, "torch"),
        (320, True, "torch"),
        (64, True, "torch"),
    ]
    assert all(r["median_s"] > 0 and r["tflops"] > 0 for r in mass)


def test_a_setting_can_change_a_named_settings_fields() -> None:
    from eval.speed.config import resolve_config
    from eval.speed.prefill import make_setting
    from kvcompress import CompressKVPress

    cfg = resolve_config(ARGS)
    built = make_setting("balanced_window_novelty", cfg)
    assert built == CompressKVPress.balanced(1.0 - cfg.kept, seed=cfg.seed, reference=("window", "novelty", "repeat"))
    assert built.repeat_pieces == "novel" and built != make_setting("balanced", cfg)


def test_the_calibrated_setting_puts_the_embedded_models_layers_at_the_same_depths() -> None:
    from eval.speed.config import resolve_config
    from eval.speed.prefill import make_setting
    from kvcompress import CompressKVPress

    qwen = resolve_config(["--device", "cpu", "--only", "prefill"])  # Qwen2.5-7B's 28 layers: 18/30 -> 16, 7/30 -> 6
    ratio = 1.0 - qwen.kept
    assert make_setting("calibrated", qwen) == CompressKVPress(ratio, seed=qwen.seed, retrieval_layers=(16,),
                                                               full_layers=(6,))  # fmt: skip
    smoke = resolve_config(ARGS)  # 2 layers: the whole layer alone, the other pays for it
    assert make_setting("calibrated", smoke) == CompressKVPress(ratio, seed=smoke.seed, full_layers=(0,))


def cpu_peak_readable() -> bool:
    clock = Clock(torch.device("cpu"))
    clock.memory_reset()
    return clock.memory_peak_gib() is not None


def test_cpu_peak_sees_a_tensor_allocated_after_the_reset_and_not_one_freed_before() -> None:
    if not cpu_peak_readable():
        pytest.skip("this OS does not let a process reset and read its peak resident memory (Linux /proc)")
    clock = Clock(torch.device("cpu"))
    before = torch.rand(64, 1024, 1024)  # 256 MiB, touched
    del before
    clock.memory_reset()
    base = clock.memory_peak_gib()
    big = torch.rand(128, 1024, 1024)  # 512 MiB
    grown = clock.memory_peak_gib() - base
    del big
    clock.memory_reset()
    after = clock.memory_peak_gib()
    assert 0.45 < grown < 0.75, grown  # 0.5 GiB, give or take what the interpreter allocated meanwhile
    assert after < base + 0.1, (base, after)  # the freed tensor left the resident set and the peak was reset


def test_breakdown_settings_choose_the_rows_and_reject_an_unknown_name(tmp_path: Path) -> None:
    output = tmp_path / "speed.json"
    chosen = ["none", "snapkv", "default"]
    assert speed.main([*ARGS, "--breakdown-settings", *chosen, "--e2e-repeats", "1", "--output", str(output)]) == 0
    rows = json.loads(output.read_text())["prefill_breakdown"]["rows"]
    assert [r["setting"] for r in rows] == chosen and all("error" not in r for r in rows)
    with pytest.raises(SystemExit, match="breakdown_settings: choose from .*default.*got"):
        speed.main([*ARGS, "--breakdown-settings", "defualt"])
