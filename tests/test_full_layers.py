"""CompressKVPress(full_layers=...): the named layers keep every row as the prefill left it (weight 1, no fit), the
other layers pay for them, the total stays the budget; refused layer choices; the cache through generate."""

from __future__ import annotations

import copy

import pytest
import torch

from kvcompress import CompressKVPress
from kvcompress.padding import pad_rows
from kvcompress.static_cache import StaticWeightedCache
from tests.test_padding import answer, prefill, random_ids
from tests.test_press_options import compressed_cache, full_context, tokens
from tests.tiny_models import tiny_model

CONTEXT = 320


def press(preset: str | None = None, cls: type[CompressKVPress] = CompressKVPress, **options) -> CompressKVPress:
    """The default press, or ``CompressKVPress.<preset>()`` (of ``cls``), at 25% kept with a 16-token window."""
    make = getattr(cls, preset) if preset else cls
    return make(compression_ratio=0.75, seed=5, window_size=16, **options)


@pytest.mark.parametrize("options", [{}, {"retrieval_layers": (3,)}, {"fit": "weights"}, {"selection": "rpnys",
                                                                                          "fit": "none"},
                                     {"preset": "balanced"}])  # fmt: skip
def test_a_full_layer_keeps_the_prefills_rows_and_the_others_pay_for_them(options):
    """4 layers, a 320-token context at 25% kept: 80 rows a head (4 sink + 16 window + 60 middle). Layer 1 kept whole
    holds all 320 rows, exactly the stock prefill's keys and values with weight 1 (the fit, which moves the values of
    a widened layer, does not run there; balanced() compresses every layer after its repeat pass, whose queries
    change nothing there); the 240 extra rows are paid by the other layers (80 each, up to one middle row left). With
    layer 3 a retrieval layer (its middle 120), the two remaining layers pay both."""
    model = tiny_model("llama", num_hidden_layers=4)
    context = tokens(CONTEXT, 7)
    exact = full_context(model, context)
    cache = compressed_cache(model, press(full_layers=(1,), **options), context)
    rows = [layer.keys.shape[-2] for layer in cache.layers]
    if "retrieval_layers" in options:  # each of layers 0 and 2 gives up (240 + 60) / 2 = 150 > 60 middle rows
        assert rows == [21, 320, 21, 140]
    else:
        assert rows == [21, 320, 21, 21]
    full = cache.layers[1]
    assert torch.equal(full.keys, exact[1][0]) and torch.equal(full.values, exact[1][1])
    assert torch.equal(full.row_weights, torch.ones_like(full.row_weights))


def test_the_other_layers_pay_an_equal_share_and_the_total_stays_the_budget():
    """8 layers, 25% kept of 320 tokens: layer 5 whole costs 240 rows, the 7 others give up round(240 / 7) = 34 each
    (60 - 34 = 26 middle rows): 320 + 7 x 46 = 642 rows against the uniform 640 (rounding)."""
    model = tiny_model("llama", num_hidden_layers=8)
    cache = compressed_cache(model, press(full_layers=[5]), tokens(CONTEXT, 8))
    rows = [layer.keys.shape[-2] for layer in cache.layers]
    assert rows == [46] * 5 + [320] + [46] * 2
    assert abs(sum(rows) - 8 * 80) <= 7


def test_no_full_layer_keeps_the_default_cache_bit_for_bit():
    """full_layers=() is the default's math: the same cache."""
    model = tiny_model("qwen2", num_hidden_layers=3)
    context = tokens(CONTEXT, 9)
    expected = compressed_cache(model, press(), context)
    got = compressed_cache(model, press(full_layers=()), context)
    for layer, twin in zip(got.layers, expected.layers, strict=True):
        assert torch.equal(layer.keys, twin.keys) and torch.equal(layer.values, twin.values)
        assert torch.equal(layer.row_weights, twin.row_weights)


class RecordsEveryLayer(CompressKVPress):
    """The press as it was before a whole layer stopped recording: every layer's reference sources and repeat-pass
    queries recorded, the whole layers' never read."""

    def _scoring_all(self, method, *args):
        self.scores_layer = lambda layer_idx, tokens: True  # an instance attribute: shadows the method
        try:
            return method(*args)
        finally:
            del self.scores_layer

    def record_reference(self, *args):
        return self._scoring_all(super().record_reference, *args)

    def _record_repeat(self, *args):
        return self._scoring_all(super()._record_repeat, *args)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("preset", [None, "balanced"])
def test_a_whole_layer_records_only_what_another_reads_and_the_cache_is_unchanged(preset, padded, monkeypatch):
    """A whole layer's rows need no scores: its prefill records no window mass and no induction prior (the
    default; balanced() keeps its novelty, which chooses the pieces its repeat pass re-reads over every layer),
    lets go of the queries its prefill attention handed over, and records no repeat-pass query. Every layer's cache
    is bit for bit the one of the press that recorded everything (the math did not change), one context or a
    left-padded batch of two (each row recorded and re-read alone)."""
    from kvcompress import repeat_hooks
    from kvcompress.hf_attention import take_prefill_rows

    model = tiny_model("llama", num_hidden_layers=4)
    context, mask = tokens(CONTEXT, 11), None
    if padded:
        context, mask = pad_rows([random_ids(CONTEXT, seed=11), random_ids(CONTEXT - 57, seed=12)], "left")
    recorded, repeated = {}, []
    record_reference, forward_hook = CompressKVPress.record_reference, CompressKVPress.forward_hook

    def spy(self, module, *args):
        recorded[module.layer_idx] = reference = record_reference(self, module, *args)
        return reference

    def hook_spy(self, module, *args):
        output = forward_hook(self, module, *args)
        assert take_prefill_rows(module.layer_idx) is None  # nothing handed over is left behind
        return output

    record_repeat = repeat_hooks.record_repeat
    monkeypatch.setattr(repeat_hooks, "record_repeat", lambda module, *a: (repeated.append(module.layer_idx),
                                                                           record_repeat(module, *a)))  # fmt: skip
    expected = prefill(model, press(preset, full_layers=(1,), cls=RecordsEveryLayer), context, mask)
    assert 1 in repeated if preset else not repeated
    repeated.clear()
    monkeypatch.setattr(CompressKVPress, "record_reference", spy)
    monkeypatch.setattr(CompressKVPress, "forward_hook", hook_spy)
    got = prefill(model, press(preset, full_layers=(1,)), context, mask)
    assert set(recorded[1].mass) == ({"novelty"} if preset else set()) and not recorded[1].queries
    assert set(recorded[0].mass) == {"window", "novelty", "induction"} | ({"repeat"} if preset else set())
    assert 1 not in repeated and (sorted(set(repeated)) == [0, 2, 3] if preset else not repeated)
    for layer, twin in zip(got.layers, expected.layers, strict=True):
        assert torch.equal(layer.keys, twin.keys) and torch.equal(layer.values, twin.values)
        assert torch.equal(layer.row_weights, twin.row_weights)


@pytest.mark.parametrize(
    "value, message",
    [
        (7, r"^full_layers: must be a list of layer indices or 'auto', got 7$"),
        ("7", r"^full_layers: must be a list of layer indices or 'auto', got '7'$"),
        ([-1], r"^full_layers"),
        ([1.0], r"^full_layers"),
        ([2, 2], r"^full_layers: must be distinct layer indices, got \(2, 2\)$"),
    ],
)
def test_bad_full_layers_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        press(full_layers=value)


@pytest.mark.parametrize(
    "family, options, message",
    [
        ("llama", dict(full_layers=(2,)), r"^full_layers: 2 is not a full-attention layer of this 2-layer model; "
                                          r"accepted: 0 to 1$"),
        ("gemma3", dict(full_layers=(0,)), r"^full_layers: 0 is not a full-attention layer of this 3-layer model; "
                                           r"accepted: 1$"),
        ("llama", dict(full_layers=(0, 1)), r"^full_layers: \(0, 1\) names every full-attention layer"),
        ("llama", dict(full_layers=(0,), retrieval_layers=(1,)),
         r"^retrieval_layers: \(1,\) with full_layers \(0,\) names every full-attention layer"),
        ("llama", dict(full_layers=(1,), retrieval_layers=(1,)),
         r"^full_layers: 1 is also in retrieval_layers: name each layer in one of them$"),
    ],
)  # fmt: skip
def test_layer_choices_the_model_cannot_take_are_refused_before_the_prefill(family, options, message):
    model = tiny_model(family, **({"num_hidden_layers": 2} if family == "llama" else {}))
    with pytest.raises(ValueError, match=message) as refused, press(**options)(model):
        pass
    assert not any(module._forward_hooks for module in model.modules())
    assert refused.value.from_calibration is False  # named by the caller: `kvcompress serve` blames the flag


def test_a_refusal_says_whether_the_calibration_named_the_layer():
    from kvcompress.press_guards import LayerChoiceError, check_layer_options

    origin = " (from the calibration of m)"
    for options, blamed in [([("retrieval_layers", (5,), origin)], True), ([("full_layers", (5,), "")], False),
                            ([("retrieval_layers", (0,), origin), ("full_layers", (0,), "")], False),
                            ([("retrieval_layers", (0,), origin), ("full_layers", (1,), "")], True)]:  # fmt: skip
        with pytest.raises(LayerChoiceError) as refused:
            check_layer_options([None, None], options)
        assert refused.value.from_calibration is blamed, options


def test_generate_on_a_static_cache_equals_the_dynamic_one():
    """A whole layer beside compressed ones through generate: the static copy answers as the dynamic cache does."""
    model = tiny_model("llama", num_hidden_layers=3)
    ids = random_ids(260, seed=4)
    question = random_ids(5, seed=98)
    cache = prefill(model, press(full_layers=(0,)), ids, None)
    assert [layer.keys.shape[-2] for layer in cache.layers][0] == 260
    expected = answer(model, copy.deepcopy(cache), ids, None, question)
    got = answer(model, StaticWeightedCache.from_compressed(cache, max_new_tokens=16), ids, None, question)
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=1e-4, atol=1e-4)


def test_layers_short_of_a_middle_row_shrink_their_sink_and_window_and_the_cache_keeps_its_budget(caplog):
    """6 layers at 25% kept of 200 tokens (50 rows each, 300 in all): layer 1 whole costs 150 rows more, so each of
    the 5 others keeps 20, fewer than its 4 + 16 protected tokens and a middle row; they shrink their sink and window
    as a short context does (half of the 20 rows, 2 + 8) and keep 10 middle rows, and the cache holds its 300 rows,
    without a warning. Before, they kept 4 + 16 + 1 rows each: 305 rows, over the budget README promises."""
    from transformers.utils import logging as hf_logging

    from kvcompress import weighted_press

    weighted_press.logger.warning_once.cache_clear()
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            model = tiny_model("llama", num_hidden_layers=6)
            compressor = press(full_layers=(1,))
            cache = compressed_cache(model, compressor, tokens(200, 3))
    finally:
        hf_logging.disable_propagation()
    assert [layer.keys.shape[-2] for layer in cache.layers] == [20, 200, 20, 20, 20, 20]
    assert compressor.layer_plan(compressor.plan(200), 0) == weighted_press.RowPlan(200, 2, 8, 10)
    assert "cannot pay" not in caplog.text
    weights = cache.layers[0].row_weights
    assert torch.equal(weights[..., :2], torch.ones_like(weights[..., :2]))  # the sink's two rows exact
    assert torch.equal(weights[..., -8:], torch.ones_like(weights[..., -8:]))  # the window's eight


def test_layers_that_cannot_pay_keep_one_middle_row_and_say_the_budget_is_exceeded(caplog):
    """4 layers at 25% kept: layer 1 whole costs 240 rows, the 3 others have 60 middle rows each; they keep one each,
    and the press warns that the cache is over its budget (a silent overrun would break the memory it promises)."""
    from transformers.utils import logging as hf_logging

    from kvcompress import weighted_press

    weighted_press.logger.warning_once.cache_clear()
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            cache = compressed_cache(tiny_model("llama", num_hidden_layers=4), press(full_layers=(1,)), tokens(200, 3))
    finally:
        hf_logging.disable_propagation()
    assert [layer.keys.shape[-2] for layer in cache.layers] == [4 + 16 + 1, 200, 21, 21]
    assert "cannot pay for them at compression_ratio=0.75" in caplog.text
