"""eval.probe_flash_lse: its flags' errors, and its refusal on a machine without CUDA (it probes GPU operators)."""

from __future__ import annotations

import pytest
import torch

from eval import probe_flash_lse


@pytest.mark.parametrize(("argv", "flag"), [(["--chunk", "1"], "--chunk"), (["--repeats", "0"], "--repeats")])
def test_bad_flags_are_named(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        probe_flash_lse.parse(argv)
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_says_so(capsys):
    with pytest.raises(SystemExit) as exit_info:
        probe_flash_lse.parse([])
    assert exit_info.value.code == 2 and "CUDA is not available" in capsys.readouterr().err


def test_candidates_take_the_press_layout():
    """Each candidate is named and callable with (q, k, v, scale), the layout the repeat chunk's attention has."""
    found = probe_flash_lse.candidates()
    assert set(found) == {
        "aten._scaled_dot_product_flash_attention",
        "aten._flash_attention_forward",
        "aten._scaled_dot_product_cudnn_attention",
        "kvcompress _fused_attention_with_lse",
    }
    assert all(callable(fn) for fn in found.values())
