"""eval.probe_syncs: its flags' errors, and its refusal on a machine without CUDA (it counts host-device syncs)."""

from __future__ import annotations

import pytest
import torch

from eval import probe_syncs


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--settings", "default", "defualt"], "--settings: choose from none, snapkv"),
        (["--layers", "0"], "--layers and --tokens: must be >= 1"),
    ],
)
def test_bad_flags_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        probe_syncs.parse(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_says_so(capsys):
    with pytest.raises(SystemExit) as exit_info:
        probe_syncs.parse(["--settings", "default"])
    assert exit_info.value.code == 2 and "CUDA is not available" in capsys.readouterr().err
