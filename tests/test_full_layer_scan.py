"""kvcompress calibrate --full-lengths and CompressKVPress(full_layers="auto"): the swap scored is the layer kept
whole, the choice per length and a context's use of the nearest one, the calibration's new fields (old files still
load), the press finding them, and earlier runs' settings still matching a press that keeps no layer whole."""

from __future__ import annotations

import json

import pytest

import kvcompress.calibration as cal
import kvcompress.calibration_scan as scan
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
    gains = scan.full_layer_gains(model, tokenizer, CompressKVPress(compression_ratio=0.75, seed=1),
                                 task="niah_multikey", length=320, contexts=2, seed=4)  # fmt: skip
    assert gains["layers"][0] is None and gains["layers"][2] is None
    assert gains["layers"][1] == pytest.approx(gains["whole"], abs=2e-3)
    assert abs(gains["whole"]) > 1e-3


def test_the_full_layer_scan_gives_each_full_layer_its_own_gain(tokenizer):
    """Three full-attention layers: each gets a finite score of its own, and no single layer stands for the whole
    uncompressed cache (the other two layers stay compressed)."""
    model = tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=3)
    gains = scan.full_layer_gains(model, tokenizer, press(), task="niah_multikey", length=320, contexts=1, seed=2)
    assert len(gains["layers"]) == 3 and all(isinstance(g, float) for g in gains["layers"])
    assert len({round(g, 4) for g in gains["layers"]}) == 3


def test_the_choice_per_length_takes_the_fewest_layers_that_cover_most_of_the_gain():
    """The embedded model's qa scans (docs/BENCHMARKS.md): at 2048 tokens layer 7 recovers 0.485 of 0.515 nats (0.94),
    layer 8 0.150 (0.29), layer 23 0.118; at 1024 tokens layer 23 0.366 (0.49) and layer 7 0.335 (0.45) of 0.741.
    At 2048 layer 7 alone covers three quarters; at 1024 it takes both (larger share first)."""
    layers_2k, layers_1k = [0.0] * 30, [0.0] * 30
    layers_2k[7], layers_2k[8], layers_2k[23], layers_1k[7], layers_1k[23] = 0.485, 0.150, 0.118, 0.335, 0.366
    gains = {"2048": {"whole": 0.515, "layers": layers_2k}, "1024": {"whole": 0.741, "layers": layers_1k}}
    assert cal.choose_full(gains) == {2048: (7,), 1024: (23, 7)}
    assert cal.choose_full(gains, cover=0.99) == {2048: (7, 8), 1024: (23, 7)}  # 8 holds its quarter at 2048
    assert cal.choose_full(gains, most=1) == {2048: (7,), 1024: (23,)}
    assert cal.choose_full(gains, share=0.46) == {2048: (7,), 1024: (23,)}  # 7 holds 0.452 at 1024
    assert cal.choose_full(gains, share=0.95) == {2048: (), 1024: ()}
    assert cal.choose_full({"1024": {"whole": -0.1, "layers": layers_1k}}) == {1024: ()}  # nothing to recover
    assert cal.choose_full({}) == {}
    sliding = {"1024": {"whole": 0.5, "layers": [None, 0.4, None]}}
    assert cal.choose_full(sliding) == {1024: (1,)}
    # a retrieval layer is widened, never kept whole (a calibration naming a layer in both would not load): the
    # embedded model's qa scan at 1536 tokens and 25% kept, where layer 18 recovers the most (1.041 of 3.252 nats)
    layers_15 = [0.0] * 30
    layers_15[7], layers_15[17], layers_15[18], layers_15[23] = 0.748, 0.269, 1.041, 0.878
    at_1536 = {"1536": {"whole": 3.252, "layers": layers_15}}
    assert cal.choose_full(at_1536) == {1536: (18, 23)}
    assert cal.choose_full(at_1536, retrieval=(18,)) == {1536: (23,)}  # 7 holds 0.23, under a quarter
    assert cal.choose_full(at_1536, share=0.2, retrieval=(18,)) == {1536: (23, 7)}


def test_several_tasks_pool_each_layers_share_of_each_tasks_gain_with_equal_weight():
    """The embedded model's scans at 1536 tokens, 25% kept (docs/BENCHMARKS.md): qa gains 3.252 nats, layer 23 0.878
    (0.270) and layer 7 0.748 (0.230, under a quarter); niah_multikey 0.537, layer 7 0.300 (0.559) and 23 0.276
    (0.514). Alone qa keeps layer 23 only; pooled, the shares are 0.394 (7) and 0.392 (23) and both are kept, although
    in nats qa's larger gains would outweigh the needles'. A task the press loses nothing on gives no share; one task
    passes through unchanged."""
    qa, keys = [0.0] * 30, [0.0] * 30
    qa[7], qa[18], qa[23], keys[7], keys[23] = 0.748, 1.041, 0.878, 0.300, 0.276
    keys[5] = -0.029
    by_task = {"qa": {"whole": 3.252, "layers": qa}, "niah_multikey": {"whole": 0.537, "layers": keys}}
    pooled = cal.pool_tasks(by_task)
    assert pooled["whole"] == 1.0 and pooled["tasks"] == by_task
    assert pooled["layers"][7] == pytest.approx((0.748 / 3.252 + 0.300 / 0.537) / 2, abs=1e-4)
    assert pooled["layers"][5] == pytest.approx(-0.029 / 0.537 / 2, abs=1e-4)
    assert cal.choose_full({"1536": by_task["qa"]}, retrieval=(18,)) == {1536: (23,)}
    assert cal.choose_full({"1536": pooled}, retrieval=(18,)) == {1536: (7, 23)}
    assert cal.pool_tasks({"qa": by_task["qa"]}) is by_task["qa"]
    nothing_lost = {"whole": -0.2, "layers": [0.5] * 30}
    one_losing = cal.pool_tasks({"qa": by_task["qa"], "niah_single": nothing_lost})
    assert one_losing["layers"][23] == pytest.approx(0.878 / 3.252, abs=1e-4)
    none_lost = cal.pool_tasks({"a": nothing_lost, "b": nothing_lost})
    assert none_lost["whole"] == 0.0 and cal.choose_full({"512": none_lost}) == {512: ()}
    sliding = cal.pool_tasks({"a": {"whole": 1.0, "layers": [None, 0.4]}, "b": {"whole": 2.0, "layers": [None, 0.4]}})
    assert sliding["layers"] == [None, 0.3]


def test_a_context_takes_the_choice_of_the_scanned_length_nearest_its_own():
    """Nearest on a log scale: the boundary between 1024 and 2048 is their geometric mean (1448.2); beyond the
    longest scanned length, the longest's. ``{0: layers}`` (a list in the file) holds at every length."""
    by_length = {1024: (23, 7), 2048: (7,)}
    assert [cal.layers_at(by_length, n) for n in (100, 1024, 1448, 1449, 2048, 32768)] == [
        (23, 7), (23, 7), (23, 7), (7,), (7,), (7,)]  # fmt: skip
    assert cal.layers_at({0: (5,)}, 7) == cal.layers_at({0: (5,)}, 10**6) == (5,)
    assert cal.layers_at({}, 1024) == ()
    with pytest.raises(ValueError, match=r"^full_layers: context lengths > 0 \(or 0 alone: .*got \[0, 1024\]$"):
        cal.Calibration("m", {}, (), (), {}, {0: (1,), 1024: (2,)})
    with pytest.raises(ValueError, match=r"^full_layers: layers \[18\] are retrieval_layers too"):
        cal.Calibration("m", {}, (18,), (), {}, {1024: (23, 7), 1536: (18, 23)})  # never filed, as a file is refused
    assert cal.layers_at({1024: (1,), 4096: (2,)}, 2048) == (2,)  # a tie: the longer
    assert cal.describe_full(by_length) == "[23, 7] near 1024 tokens, [7] near 2048"
    assert cal.describe_full({0: (5,)}) == "[5]" and cal.describe_full({}) == "none"


def test_a_calibration_with_full_layers_round_trips_and_an_older_file_still_loads(tmp_path):
    gains = {"1024": {"whole": 0.5, "layers": [0.1, 0.4, None]}}
    found = cal.Calibration("m", {"layers": 3}, (0,), (1.0, 0.1, None), {"task": "niah_single"}, {1024: (1,)},
                            gains, {"task": "qa", "lengths": [1024]})  # fmt: skip
    path = found.save(tmp_path / "m.json")
    assert cal.Calibration.load(path) == found
    assert json.loads(path.read_text())["full_layers"] == {"1024": [1]}
    older = json.loads(found.to_json())
    path.write_text(json.dumps({**older, "full_layers": [1]}))  # filed before the choice depended on the length
    assert cal.Calibration.load(path).full_layers == {0: (1,)}
    for key in ("full_layers", "full_gains", "full_settings"):
        del older[key]
    path.write_text(json.dumps(older))
    loaded = cal.Calibration.load(path)
    assert loaded.full_layers == {} and loaded.full_gains == {} and loaded.retrieval_layers == (0,)
    for bad in ([-2], {"1024": [-2]}, {"x": [1]}, {"1024": [0]}):  # layer 0 is a retrieval layer
        path.write_text(json.dumps({**older, "full_layers": bad}))
        with pytest.raises(ValueError, match=r"^calibration: .*m\.json is not a kvcompress calibration \(.*full_"):
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
    assert auto.active_full_layers == {}
    shape = cal.model_identity(model)[1]
    cal.Calibration("tiny-full", shape, (), (0.0,) * 4, {}, {256: (2,), 512: (1,)}).save(tmp_path / "tiny-full.json")
    calibrated = compressed_cache(model, auto, context)  # 320 tokens: nearer 256 than 512 (boundary 362)
    assert auto.active_full_layers == {256: (2,), 512: (1,)} and auto.full_layers_at(320) == (2,)
    explicit = compressed_cache(model, press(full_layers=(2,), retrieval_layers=()), context)
    assert [layer.keys.shape[-2] for layer in calibrated.layers] == [21, 21, 320, 21]
    for layer, twin in zip(calibrated.layers, explicit.layers, strict=True):
        assert_same_layer(layer, twin)
    longer = tokens(400, 6)  # nearer 512: layer 1 whole
    for layer, twin in zip(compressed_cache(model, auto, longer).layers,
                           compressed_cache(model, press(full_layers=(1,), retrieval_layers=()), longer).layers,
                           strict=True):  # fmt: skip
        assert_same_layer(layer, twin)
    message = r"^full_layers: 1 \(from the calibration of tiny-full\) is also in retrieval_layers: name each"
    with pytest.raises(ValueError, match=message), press(full_layers="auto", retrieval_layers=(1,))(model):
        pass  # any length's layers


def test_earlier_runs_settings_match_a_press_that_keeps_no_layer_whole():
    """Runs recorded before ``full_layers`` existed computed what ``full_layers=[]`` computes: not a change."""
    before = {"compression_ratio": 0.75, "retrieval_layers": "auto"}
    assert press_change(before, {**before, "full_layers": []}, []) == ""
    assert press_change(before, {**before, "full_layers": [7]}, []) == "full_layers: [] there, [7] now"


def test_runs_from_before_the_choice_by_length_match_a_press_that_takes_the_layers_named_at_every_length(
    embedded_dir,
):
    """A run of ``full_layers="auto"`` recorded before ``full_layers_by_length`` kept the layers named at every length
    (layer 7): ``balanced()`` (False) still matches it, the default (True, layers 23 and 7 near 1024 tokens) does
    not; with layers named, the field reads nothing and is not recorded."""
    import types

    from transformers import AutoConfig

    from kvcompress.registry import press_settings

    model = types.SimpleNamespace(config=AutoConfig.from_pretrained(embedded_dir))  # the lookup reads only its config
    balanced = press_settings(CompressKVPress.balanced(compression_ratio=0.75), model)
    earlier = {key: value for key, value in balanced.items() if key != "full_layers_by_length"}
    assert earlier["active_full_layers"] == [7] and press_change(earlier, balanced, []) == ""
    default = press_settings(CompressKVPress(compression_ratio=0.75), model)
    assert default["active_full_layers"] == {"1024": [23, 7], "2048": [7]}
    earlier_default = {key: value for key, value in default.items() if key != "full_layers_by_length"}
    earlier_default["active_full_layers"] = [7]
    change = press_change(earlier_default, default, [])
    assert "active_full_layers: [7] there" in change and "full_layers_by_length: False there, True now" in change
    assert "full_layers_by_length" not in press_settings(CompressKVPress(full_layers=(7,)), model)


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
    assert found.full_layers == cal.choose_full(found.full_gains, retrieval=found.retrieval_layers)
    assert found.full_settings["task"] == "qa" and found.full_settings["kept"] == 0.5
    printed = capsys.readouterr().out
    assert "512 tokens: the uncompressed cache gains" in printed and " on qa (nats per answer)" in printed
    assert f"layers kept whole {cal.describe_full(found.full_layers)} filed in {out}" in printed


def test_the_embedded_models_calibration_keeps_layers_23_and_7_whole_near_1024_tokens_and_7_near_2048(embedded_dir):
    """`kvcompress calibrate --full-lengths 1024 2048` on SmolLM2-135M-Instruct (8 qa contexts a length, 50% kept):
    layer 7 recovers 0.485 of the uncompressed cache's 0.515 nats at 2048 tokens and 0.335 of 0.741 at 1024, where
    layer 23 leads (0.366); the retrieval scan's drops are the shipped ones. The file's choice is what
    :func:`choose_full` makes of its gains with its settings."""
    import types

    from transformers import AutoConfig

    found = cal.find(types.SimpleNamespace(config=AutoConfig.from_pretrained(embedded_dir)))
    assert found.full_layers == {1024: (23, 7), 2048: (7,)} and found.retrieval_layers == (18,)
    assert set(found.full_gains) == {"1024", "2048"} and found.full_settings["task"] == "qa"
    rule = found.full_settings
    assert found.full_layers == cal.choose_full(
        found.full_gains, rule["share"], rule["most"], rule["cover"], found.retrieval_layers
    )
    assert max(found.full_gains["1024"]["layers"]) == found.full_gains["1024"]["layers"][23]


def test_calibrate_on_several_tasks_files_each_tasks_gains_and_chooses_from_their_pooled_shares(tokenizer):
    """``full_task`` with two tasks scans each as a one-task calibration would (same gains), files both, and keeps
    whole what :func:`choose_full` makes of their pooled shares."""
    model = tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=3)
    args = (model, tokenizer, 0.25, 320, 1, 2)
    alone = {task: scan.calibrate(*args, full_lengths=(320,), full_task=task).full_gains["320"]
             for task in ("niah_multikey", "qa")}  # fmt: skip
    both = scan.calibrate(*args, full_lengths=(320,), full_task=("niah_multikey", "qa", "qa"))  # each task once
    assert both.full_gains["320"]["tasks"] == alone
    assert both.full_gains["320"] == cal.pool_tasks(alone)
    assert both.full_settings["task"] == ["niah_multikey", "qa"]
    assert both.full_layers == cal.choose_full(both.full_gains, retrieval=both.retrieval_layers)
    assert cal.Calibration.from_json(both.to_json()) == both


def test_the_cli_prints_each_tasks_gains_and_the_pooled_share_of_each_layer(tokenizer, tmp_path, capsys, monkeypatch):
    """``kvcompress calibrate --full-task niah_multikey qa``: a row per layer with both tasks' gains and their pooled
    share, the layers kept whole marked; a task named twice is scanned once."""
    import kvcompress.models
    from kvcompress.cli import main

    model = tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=3)
    monkeypatch.setattr(kvcompress.models, "load_model", lambda *a, **k: (model, tokenizer))
    out = tmp_path / "tiny.json"
    flags = ["--contexts", "1", "--length", "320", "--full-lengths", "320", "--threads", "1", "--output", str(out)]
    assert main(["calibrate", *flags, "--full-task", "niah_multikey", "qa", "qa"]) == 0
    found = cal.Calibration.load(out)
    gains = found.full_gains["320"]
    assert found.full_settings["task"] == ["niah_multikey", "qa"]
    printed = capsys.readouterr().out
    keys, qa = gains["tasks"]["niah_multikey"], gains["tasks"]["qa"]
    wholes = f"{keys['whole']:+.3f} on niah_multikey, {qa['whole']:+.3f} on qa"
    assert f"320 tokens: the uncompressed cache gains {wholes} (nats per answer); each layer" in printed
    for layer in range(3):
        mark = "  <- kept whole" if layer in found.full_layers[320] else ""
        row = f"{keys['layers'][layer]:+.3f}  {qa['layers'][layer]:+.3f}  {gains['layers'][layer]:+.3f}{mark}\n"
        assert f"{layer:5d}  {row}" in printed


def test_both_scans_measure_presses_that_keep_no_layer_whole_whatever_the_models_calibration(tokenizer, monkeypatch):
    """A model whose calibration keeps a layer whole is scanned as one without: the retrieval scan's uniform press and
    the full-layer scan's press keep every layer compressed (the default's full_layers="auto" would not)."""
    model = tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=3)
    plain = scan.layer_drops(model, tokenizer, kept=0.25, length=320, contexts=1, seed=2)
    gains = scan.calibrate(model, tokenizer, 0.25, 320, 1, 2, full_lengths=(320,), full_task="niah_multikey").full_gains
    found = cal.Calibration("x", cal.model_identity(model)[1], (), (0.0,) * 3, {}, {320: (1,)})
    monkeypatch.setattr(cal, "find", lambda m: found)
    assert scan.layer_drops(model, tokenizer, kept=0.25, length=320, contexts=1, seed=2) == plain
    again = scan.calibrate(model, tokenizer, 0.25, 320, 1, 2, full_lengths=(320,), full_task="niah_multikey")
    assert again.full_gains == gains
    auto = press()
    auto.check_model(model, [None] * 3)
    assert auto.active_full_layers == {320: (1,)}  # where the default would have kept layer 1 whole


def test_calibrate_refuses_scan_flags_without_lengths_and_an_unwritable_output_before_the_scan(tmp_path, capsys):
    """Before any model loads: a --full-* flag without --full-lengths (its scan would silently not run), and an
    --output that cannot be written (found only after the scan, with a traceback)."""
    from kvcompress.cli import main

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cases = [(["--full-task", "qa"], "--full-task: sets the scan for layers kept whole"),
             (["--full-most", "2"], "--full-most: sets the scan"),
             (["--output", str(blocker / "c.json")], f"--output: {blocker} is a file"),
             (["--output", str(tmp_path)], f"--output: {tmp_path} is a directory")]  # fmt: skip
    for flags, message in cases:
        with pytest.raises(SystemExit) as exit_:
            main(["calibrate", "--device", "cpu", *flags])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (flags, err)
