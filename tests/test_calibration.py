"""kvcompress calibrate and CompressKVPress(retrieval_layers="auto"): the scan's layer swap is exact, its scores, the
choice, the calibration files, and the press finding a model's calibration."""

from __future__ import annotations

import dataclasses
import json
import math
import types

import pytest
import torch

import kvcompress.calibration as cal
import kvcompress.calibration_scan as scan
from kvcompress import CompressKVPress
from kvcompress.fidelity.measure import prefill
from tests.test_press_options import compressed_cache, tokens
from tests.tiny_models import tiny_model


def press(**options) -> CompressKVPress:
    return CompressKVPress(compression_ratio=0.75, seed=3, window_size=16, **options)


@dataclasses.dataclass
class PlainInOneLayer(CompressKVPress):
    """The default with the priors off in ``plain_layer`` alone (what the scan's swapped cache stands for)."""

    plain_layer: int = 0

    def compress_middle(self, module, *args, **kwargs):
        if module.layer_idx != self.plain_layer:
            return super().compress_middle(module, *args, **kwargs)
        saved = self.novelty_share, self.induction_share
        self.novelty_share = self.induction_share = 0.0
        try:
            return super().compress_middle(module, *args, **kwargs)
        finally:
            self.novelty_share, self.induction_share = saved


def assert_same_layer(a, b) -> None:
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert torch.equal(a.row_weights, b.row_weights)


def test_a_layer_taken_from_the_cache_without_priors_is_that_of_the_press_without_priors_in_that_layer_alone():
    """Each layer is compressed from its own keys and queries: swapping one layer of the default's cache for the
    no-priors cache's gives exactly the cache of the default with the priors off in that layer only."""
    model = tiny_model("llama", num_hidden_layers=3)
    context = tokens(320, 4)
    default = compressed_cache(model, press(), context)
    without = compressed_cache(model, dataclasses.replace(press(), novelty_share=0.0, induction_share=0.0), context)
    for plain in range(3):
        one = compressed_cache(model, PlainInOneLayer(compression_ratio=0.75, seed=3, window_size=16,
                                                      plain_layer=plain), context)  # fmt: skip
        for layer in range(3):
            assert_same_layer(one.layers[layer], (without if layer == plain else default).layers[layer])
    assert not torch.equal(default.layers[1].keys, without.layers[1].keys)  # the priors did choose other rows


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_dir)


def test_the_scan_scores_each_full_attention_layer_by_the_needle_log_prob_it_loses(tokenizer):
    """A gemma3-like model (sliding, full, sliding): the sliding-window layers get no score; the full layer's is
    the needle's log-prob under the default's cache minus under the press without priors in that layer, asked as
    kvpress's pipeline asks (chat template, question after the compressed context)."""
    import kvpress  # noqa: F401
    from transformers import pipeline

    from kvcompress.ruler.generator import generate

    model = tiny_model("gemma3", vocab_size=len(tokenizer), sliding_window=64)
    drops = scan.layer_drops(model, tokenizer, kept=0.25, length=320, contexts=1, seed=5)
    assert drops[0] is None and drops[2] is None and math.isfinite(drops[1])
    example = generate("niah_single", tokenizer, 320, 1, 5)[0]
    inputs = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer).preprocess(
        example.context, list(example.questions), example.answer_prefix, 1 << 30)
    ids, question = inputs["context_ids"], inputs["questions_ids"][0]
    answer = tokenizer.encode(" " + example.answers[0][0], return_tensors="pt", add_special_tokens=False)
    scores = []
    for p in (CompressKVPress(compression_ratio=0.75, seed=5), PlainInOneLayer(compression_ratio=0.75, seed=5,
                                                                             plain_layer=1)):  # fmt: skip
        cache, _ = prefill(model, p, ids)
        with torch.no_grad():
            positions = torch.arange(ids.shape[1], ids.shape[1] + question.shape[1] + answer.shape[1])[None]
            logits = model(input_ids=torch.cat([question, answer], 1), past_key_values=cache,
                           position_ids=positions).logits[0, question.shape[1] - 1 : -1]  # fmt: skip
        scores.append(torch.log_softmax(logits.double(), -1).gather(-1, answer[0][:, None]).sum().item())
    assert drops[1] == pytest.approx(scores[0] - scores[1], abs=1e-3)  # rounded to 4 decimals, float32 logits


def test_the_scan_measures_the_uniform_press_whatever_the_models_calibration(tokenizer, monkeypatch):
    """A model that already has a calibration is scanned as one without: the scan's default names no layer."""
    model = tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=3)
    plain = scan.layer_drops(model, tokenizer, kept=0.25, length=320, contexts=1, seed=2)
    monkeypatch.setattr(cal, "find", lambda m: calibration("x", cal.model_identity(m)[1], (0,)))
    assert scan.layer_drops(model, tokenizer, kept=0.25, length=320, contexts=1, seed=2) == plain
    auto = press(retrieval_layers="auto")  # where the default would have used layer 0
    auto.check_model(model, [None] * 3)
    assert auto.active_retrieval_layers == (0,)


def test_the_choice_keeps_the_layers_losing_at_least_the_threshold_most_affected_first():
    assert cal.choose((0.1, 8.7, None, 0.7, 2.5), threshold=2.0) == (1, 4)
    assert cal.choose((0.1, 8.7, None, 0.7, 2.5), threshold=0.5) == (1, 4, 3)
    assert cal.choose((0.1, 0.2), threshold=2.0) == ()
    assert cal.choose((3.0, None, 2.5), threshold=2.0) == ()  # every full layer: none left to give up rows


def calibration(name: str, shape: dict, layers=(1,)) -> cal.Calibration:
    return cal.Calibration(name, shape, tuple(layers), (0.0, 5.0, 0.1), {"task": "niah_single"})


def named(model, name: str):
    model.config.name_or_path = f"/some/where/{name}"
    return model


def test_a_calibration_file_round_trips_and_a_bad_one_is_refused_naming_the_file(tmp_path):
    found = calibration("m", {"layers": 3}, (2, 1))
    path = found.save(tmp_path / "sub" / "m.json")
    assert cal.Calibration.load(path) == found
    good = json.loads(found.to_json())
    for text in ("not json", json.dumps({"format": 7}), json.dumps({**good, "retrieval_layers": [-1]}),
                 json.dumps({**good, "shape": {"layers": "3"}}), json.dumps({**good, "drops": ["x"]}),
                 json.dumps({**good, "retrieval_layers": [2, 2]}),  # a layer twice, or in both lists
                 json.dumps({**good, "full_layers": [1]})):  # fmt: skip
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match=r"^calibration: .*bad\.json is not a kvcompress calibration"):
            cal.Calibration.load(tmp_path / "bad.json")


def test_a_model_finds_the_calibration_of_its_name_and_shape_the_users_before_the_shipped(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_CALIBRATIONS", str(tmp_path))
    monkeypatch.setattr(cal, "SHIPPED", tmp_path / "shipped")
    model = named(tiny_model("llama", num_hidden_layers=3), "Tiny-Calibrated")
    name, shape = cal.model_identity(model)
    assert (name, shape) == ("tiny-calibrated", {"layers": 3, "hidden_size": 64, "heads": 4, "kv_heads": 2})
    assert cal.find(model) is None
    calibration(name, shape, (2,)).save(tmp_path / "shipped" / cal.file_name(name))
    assert cal.find(model).retrieval_layers == (2,)
    calibration(name, shape, (1,)).save(tmp_path / cal.file_name(name))
    assert cal.find(model).retrieval_layers == (1,)
    assert cal.find(named(tiny_model("llama", num_hidden_layers=2), "Tiny-Calibrated")) is None  # another shape
    assert cal.find(tiny_model("llama", num_hidden_layers=3)) is None  # built from a config: no name


def test_auto_uses_the_models_calibration_and_without_one_is_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_CALIBRATIONS", str(tmp_path))
    monkeypatch.setattr(cal, "SHIPPED", tmp_path / "shipped")
    model = named(tiny_model("llama", num_hidden_layers=3), "tiny-auto")
    context = tokens(320, 6)
    auto = press(retrieval_layers="auto")
    uncalibrated = compressed_cache(model, auto, context)
    assert auto.active_retrieval_layers == ()
    for layer, twin in zip(uncalibrated.layers, compressed_cache(model, press(), context).layers, strict=True):
        assert_same_layer(layer, twin)
    calibration("tiny-auto", cal.model_identity(model)[1], (1,)).save(tmp_path / "tiny-auto.json")
    calibrated = compressed_cache(model, auto, context)
    assert auto.active_retrieval_layers == (1,)
    explicit = compressed_cache(model, press(retrieval_layers=(1,)), context)
    assert [layer.keys.shape[-2] for layer in calibrated.layers] == [50, 140, 50]  # 3 x 80 rows
    for layer, twin in zip(calibrated.layers, explicit.layers, strict=True):
        assert_same_layer(layer, twin)
    calibration("tiny-auto", cal.model_identity(model)[1], (5,)).save(tmp_path / "tiny-auto.json")
    message = r"^retrieval_layers: 5 \(from the calibration of tiny-auto\) is not a full-attention layer"
    with pytest.raises(ValueError, match=message), auto(model):
        pass


def test_the_embedded_model_ships_its_calibration(embedded_dir):
    """`kvcompress calibrate` on SmolLM2-135M-Instruct (its defaults: 8 contexts of 1024 tokens, 25% kept) found
    layer 18 alone (8.7 nats lost; no other layer above 0.71)."""
    from transformers import AutoConfig

    found = cal.find(types.SimpleNamespace(config=AutoConfig.from_pretrained(embedded_dir)))
    assert found is not None and found.retrieval_layers == (18,)
    full = [d for d in found.drops if d is not None]
    assert len(full) == 30 and sorted(full)[-1] > 4 * cal.THRESHOLD and sorted(full)[-2] < cal.THRESHOLD / 2


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ratio", "1.5"], "--ratio: must be in (0, 1), got 1.5"),
        (["--threshold", "0"], "--threshold: must be > 0, got 0.0"),
        (["--contexts", "0"], "--contexts: must be an integer >= 1, got 0"),
        (["--length", "10"], "--length: must be an integer >= 64, got 10"),
        (["--full-lengths", "1024", "--full-ratio", "1.0"], "--full-ratio: must be in (0, 1), got 1.0"),
        (["--full-lengths", "1024", "--full-share", "0"], "--full-share: must be in (0, 1], got 0.0"),
        (["--full-lengths", "1024", "--full-most", "0"], "--full-most: must be an integer >= 1, got 0"),
        (["--full-lengths", "1024", "32"], "--full-lengths: must be an integer >= 64, got 32"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        scan.main(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_files_the_embedded_models_retrieval_layer(tmp_path, capsys, embedded_dir):
    """The whole command on the embedded model, on one context of 512 tokens: layer 18 loses the most, filed where
    asked (one short context is noisier than the default scan: layer 23 may pass the threshold too)."""
    from kvcompress.cli import main

    out = tmp_path / "smol.json"
    assert main(["calibrate", "--contexts", "1", "--length", "512", "--threads", "1", "--output", str(out)]) == 0
    found = cal.Calibration.load(out)
    assert found.retrieval_layers[0] == 18 and found.settings["contexts"] == 1
    assert f"retrieval layers {list(found.retrieval_layers)} filed in {out}" in capsys.readouterr().out
