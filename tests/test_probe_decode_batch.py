"""eval.probe_decode_batch (the server's decode step with per-row causal offsets against the shared mask, and
compiled, for a GPU call): its smoke run on CPU gives every variant's steps and their logits agree, and its flags are
checked."""

from __future__ import annotations

import json

import pytest

from eval import probe_decode_batch


def test_smoke_run_times_both_variants_and_their_logits_agree(tmp_path):
    out = tmp_path / "batch.json"
    assert probe_decode_batch.main(["--smoke", "--rows", "200", "30", "70", "--layers", "2", "--steps", "2",
                                    "--rounds", "2", "--warmup", "1", "--output", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert result["rows"] == [200, 30, 70] and result["steps_timed"] == 4
    assert set(result["median_step_ms"]) == {"per-row offsets", "shared mask", "compiled eager"}
    assert all(ms > 0 for ms in result["median_step_ms"].values())
    # The PyTorch path masks both ways with the same -inf logits: the same sums bit for bit.
    assert result["largest_logit_difference"] == 0.0
    # The static batch sums over its whole capacity (masked rows add exact zeros, in another blocking of the sums):
    # float32 rounding of logits of size ~1, not a row read or missed (O(1e-2) on this model).
    assert result["largest_logit_difference_from_per_row"]["compiled eager"] < 1e-5
    # dynamo's capture is in the compiled variant's first step (seconds), not in the eager ones' (milliseconds)
    first = result["first_step_s"]
    assert set(first) == set(result["median_step_ms"]) and first["compiled eager"] > first["per-row offsets"]


@pytest.mark.parametrize("flags", [["--rows", "0"], ["--steps", "0"], ["--warmup", "-1"]])
def test_bad_flags_are_one_error(flags, capsys):
    with pytest.raises(SystemExit) as stop:
        probe_decode_batch.main(["--smoke", *flags])
    assert stop.value.code == 2 and "must be >= 1" in capsys.readouterr().err
