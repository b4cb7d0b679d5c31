"""eval.probe_workload, what eval.probe_syncs and eval.probe_overlap share: each probe's flags' errors and its
refusal without CUDA, and the workload on CPU with eval.speed's tiny model."""

from __future__ import annotations

import pytest
import torch

from eval import probe_overlap, probe_syncs, probe_workload

PROBES = [probe_syncs.parse, probe_overlap.parse]


@pytest.mark.parametrize("parse", PROBES, ids=["probe_syncs", "probe_overlap"])
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--settings", "default", "defualt"], "--settings: choose from none, snapkv"),
        (["--layers", "0"], "--layers and --tokens: must be >= 1"),
        (["--tokens", "0"], "--layers and --tokens: must be >= 1"),
    ],
)
def test_bad_flags_are_named(parse, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
@pytest.mark.parametrize("parse", PROBES, ids=["probe_syncs", "probe_overlap"])
def test_without_cuda_it_says_so(parse, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(["--settings", "default"])
    assert exit_info.value.code == 2 and "CUDA is not available" in capsys.readouterr().err


def test_the_probes_workload_prefills_each_setting_after_a_warm_up(monkeypatch):
    """eval.probe_workload on CPU with eval.speed's tiny model: one warm-up prefill per setting before it is handed
    out, and each handed-out call a prefill of ``--tokens`` tokens under that setting (a compressed cache for a
    press, the full one without)."""
    import argparse

    from kvcompress.cache import WeightedLayer

    calls, prefill = [], probe_workload.prefill

    def counted(model, press, ids):
        calls.append(type(press).__name__)
        return prefill(model, press, ids)

    monkeypatch.setattr(probe_workload, "prefill", counted)
    args = argparse.Namespace(settings=["none", "default_overlap"], layers=1, tokens=200)
    handed = []
    for name, run in probe_workload.warmed_prefills(args, device=torch.device("cpu"), smoke=True):
        assert len(calls) == len(handed) * 2 + 1  # its warm-up already ran
        handed.append((name, run()))
    assert [name for name, _ in handed] == ["none", "default_overlap"] and calls[0] == "NoneType"
    (_, full), (_, compressed) = handed
    assert full.get_seq_length() == 200 and not isinstance(full.layers[0], WeightedLayer)
    assert isinstance(compressed.layers[0], WeightedLayer) and compressed.layers[0].keys.shape[-2] < 200
