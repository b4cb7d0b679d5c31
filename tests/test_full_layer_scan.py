"""kvcompress calibrate --full-lengths and CompressKVPress(full_layers="auto"): the swap scored is the layer kept
whole, the choice across lengths, the calibration's new fields (old files still load), the press finding them, and
earlier runs' settings still matching a press that keeps no layer whole."""

from __future__ import annotations

import json

import pytest

import kvcompress.calibration as cal
from kvcompress import CompressKVPress
from kvcompress.registry import press_change
from tests.test_calibration import assert_same_layer, named
from tests.test_press_options import compressed_cache, tokens
from tests.tiny_models import tiny_model


def press(**options) -> CompressKVPress:
    return CompressKVPress(compression_ratio=0.75, seed=3, window_size=16, **options)


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_dir)


def test_a_models_only_full_attention_layer_kept_whole_gains_what_the_whole_cache_gains(tokenizer):
    """A gemma3-like model (sliding, full, sliding): its sliding layers hold the same window under the press and
    without it, so the press's cache with its one full-attention layer taken from the uncompressed prefill is the
    uncompressed cache: that layer's gain equals the whole cache's (both rounded to 4 decimals, float32 logits), and
    the sliding layers get no score. The gain is not zero: the press did lose something there."""
    model = tiny_model("gemma3", vocab_size=len(tokenizer), sliding_window=64)
    gains = cal.full_layer_gains(model, tokenizer, CompressKVPress(compression_ratio=0.75, seed=1),
                                 task="niah_multikey", length=320, contexts=2, seed=4)  # fmt: skip
    assert gains["layers"][0] is None and gains["layers"][2] is None
    assert gains["layers"][1] == pytest.approx(gains["whole"], abs=2e-3)
    assert abs(gains["whole"]) > 1e-3


def test_the_full_layer_scan_gives_each_full_layer_its_own_gain(tokenizer):
    """Three full-attention layers: each gets a finite score of its own, and no single layer stands for the whole
    uncompressed cache (the other two layers stay compressed)."""
    model = tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=3)
    gains = cal.full_layer_gains(model, tokenizer, press(), task="niah_multikey", length=320, contexts=1, seed=2)
    assert len(gains["layers"]) == 3 and all(isinstance(g, float) for g in gains["layers"])
    assert len({round(g, 4) for g in gains["layers"]}) == 3


def test_the_choice_keeps_layers_holding_their_share_at_every_length():
    """The embedded model's qa scans (docs/BENCHMARKS.md): at 2048 tokens layer 7 recovers 0.485 of 0.515 nats, layer
    23 0.118; at 1024 tokens layer 23 0.366 and layer 7 0.335 of 0.741. Layer 7 holds at least a quarter at both
    lengths, layer 23 not at 2048."""
    layers_2k, layers_1k = [0.0] * 30, [0.0] * 30
    layers_2k[7], layers_2k[23], layers_1k[7], layers_1k[23] = 0.485, 0.118, 0.335, 0.366
    gains = {"2048": {"whole": 0.515, "layers": layers_2k}, "1024": {"whole": 0.741, "layers": layers_1k}}
    assert cal.choose_full(gains) == (7,)
    assert cal.choose_full(gains, share=0.2, most=2) == (7, 23)  # 23 holds 0.229 at 2048: the smaller share second
    assert cal.choose_full({"1024": gains["1024"]}, most=2) == (23, 7)
    assert cal.choose_full(gains, share=0.5) == ()
    assert cal.choose_full({"1024": {"whole": -0.1, "layers": layers_1k}}) == ()  # nothing to recover
    assert cal.choose_full({}) == ()
    sliding = {"1024": {"whole": 0.5, "layers": [None, 0.4, None]}}
    assert cal.choose_full(sliding) == (1,)


def test_a_calibration_with_full_layers_round_trips_and_an_older_file_still_loads(tmp_path):
    gains = {"1024": {"whole": 0.5, "layers": [0.1, 0.4, None]}}
    found = cal.Calibration("m", {"layers": 3}, (0,), (1.0, 0.1, None), {"task": "niah_single"}, (1,), gains,
                            {"task": "qa", "lengths": [1024]})  # fmt: skip
    path = found.save(tmp_path / "m.json")
    assert cal.Calibration.load(path) == found
    older = json.loads(found.to_json())
    for key in ("full_layers", "full_gains", "full_settings"):
        del older[key]
    path.write_text(json.dumps(older))
    loaded = cal.Calibration.load(path)
    assert loaded.full_layers == () and loaded.full_gains == {} and loaded.retrieval_layers == (0,)
    path.write_text(json.dumps({**older, "full_layers": [-2]}))
    with pytest.raises(ValueError, match=r"^calibration: .*m\.json is not a kvcompress calibration \(full_layers"):
        cal.Calibration.load(path)


def test_auto_keeps_the_calibrations_full_layers_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_CALIBRATIONS", str(tmp_path))
    monkeypatch.setattr(cal, "SHIPPED", tmp_path / "shipped")
    model = named(tiny_model("llama", num_hidden_layers=4), "tiny-full")
    context = tokens(320, 6)
    auto = press(full_layers="auto", retrieval_layers=())
    for layer, twin in zip(compressed_cache(model, auto, context).layers,
                           compressed_cache(model, press(retrieval_layers=()), context).layers, strict=True):
        assert_same_layer(layer, twin)  # no calibration: nothing kept whole
    assert auto.active_full_layers == ()
    shape = cal.model_identity(model)[1]
    cal.Calibration("tiny-full", shape, (), (0.0,) * 4, {}, (2,)).save(tmp_path / "tiny-full.json")
    calibrated = compressed_cache(model, auto, context)
    assert auto.active_full_layers == (2,)
    explicit = compressed_cache(model, press(full_layers=(2,), retrieval_layers=()), context)
    assert [layer.keys.shape[-2] for layer in calibrated.layers] == [21, 21, 320, 21]
    for layer, twin in zip(calibrated.layers, explicit.layers, strict=True):
        assert_same_layer(layer, twin)
    cal.Calibration("tiny-full", shape, (2,), (0.0,) * 4, {}, (2,)).save(tmp_path / "tiny-full.json")
    message = r"^full_layers: 2 \(from the calibration of tiny-full\) is also in retrieval_layers \(from the"
    with pytest.raises(ValueError, match=message), press(full_layers="auto")(model):
        pass


def test_earlier_runs_settings_match_a_press_that_keeps_no_layer_whole():
    """Runs recorded before ``full_layers`` existed computed what ``full_layers=[]`` computes: not a change."""
    before = {"compression_ratio": 0.75, "retrieval_layers": "auto"}
    assert press_change(before, {**before, "full_layers": []}, []) == ""
    assert press_change(before, {**before, "full_layers": [7]}, []) == "full_layers: [] there, [7] now"


@pytest.mark.slow
def test_calibrate_with_a_full_layer_scan_files_its_gains(tmp_path, capsys, embedded_dir):
    """The whole command on the embedded model, one context per scan: the full-layer scan's gains are filed per
    length, the uncompressed cache gains on the answers, and the layers kept whole are those the choice names."""
    from kvcompress.cli import main

    out = tmp_path / "smol.json"
    flags = ["--contexts", "1", "--length", "512", "--full-lengths", "512", "--threads", "1", "--output", str(out)]
    assert main(["calibrate", *flags]) == 0
    found = cal.Calibration.load(out)
    assert list(found.full_gains) == ["512"] and len(found.full_gains["512"]["layers"]) == 30
    assert found.full_gains["512"]["whole"] > 0
    assert found.full_layers == cal.choose_full(found.full_gains)
    assert found.full_settings["task"] == "qa" and found.full_settings["kept"] == 0.5
    printed = capsys.readouterr().out
    assert "512 tokens, qa: the uncompressed cache gains" in printed
    assert f"layers kept whole {list(found.full_layers)} filed in {out}" in printed


def test_the_embedded_models_calibration_names_layer_7_to_keep_whole(embedded_dir):
    """`kvcompress calibrate --full-lengths 1024 2048` on SmolLM2-135M-Instruct (8 qa contexts a length, 50% kept):
    layer 7 recovers 0.485 of the uncompressed cache's 0.515 nats at 2048 tokens and 0.335 of 0.741 at 1024, where
    layer 23 leads (0.366) but holds under a quarter at 2048; the retrieval scan's drops are the shipped ones."""
    import types

    from transformers import AutoConfig

    found = cal.find(types.SimpleNamespace(config=AutoConfig.from_pretrained(embedded_dir)))
    assert found.full_layers == (7,) and found.retrieval_layers == (18,)
    assert set(found.full_gains) == {"1024", "2048"} and found.full_settings["task"] == "qa"
    assert found.full_layers == cal.choose_full(found.full_gains, found.full_settings["share"])
    assert max(found.full_gains["1024"]["layers"]) == found.full_gains["1024"]["layers"][23]


def test_both_scans_measure_presses_that_keep_no_layer_whole_whatever_the_models_calibration(tokenizer, monkeypatch):
    """A model whose calibration keeps a layer whole is scanned as one without: the retrieval scan's uniform press and
    the full-layer scan's press keep every layer compressed (the default's full_layers="auto" would not)."""
    model = tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=3)
    plain = cal.layer_drops(model, tokenizer, kept=0.25, length=320, contexts=1, seed=2)
    gains = cal.calibrate(model, tokenizer, 0.25, 320, 1, 2, full_lengths=(320,), full_task="niah_multikey").full_gains
    found = cal.Calibration("x", cal.model_identity(model)[1], (), (0.0,) * 3, {}, (1,))
    monkeypatch.setattr(cal, "find", lambda m: found)
    assert cal.layer_drops(model, tokenizer, kept=0.25, length=320, contexts=1, seed=2) == plain
    again = cal.calibrate(model, tokenizer, 0.25, 320, 1, 2, full_lengths=(320,), full_task="niah_multikey")
    assert again.full_gains == gains
    auto = press()
    auto.check_model(model, [None] * 3)
    assert auto.active_full_layers == (1,)  # where the default would have kept layer 1 whole
