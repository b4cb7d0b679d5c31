"""The one method registry: every name builds its press, options replace fields, bad input is named."""

from __future__ import annotations

import re

import pytest

from kvcompress import CompressKVPress, registry


@pytest.mark.parametrize("name", [n for n in registry.METHODS if n != "exact"])
def test_every_method_builds_its_press_at_the_ratio(name):
    press = registry.make_press(name, 0.6, seed=3)
    ratio = press.press.compression_ratio if name == "adakv" else press.compression_ratio
    assert ratio == pytest.approx(0.6)


def test_exact_is_no_press_and_labels_are_distinct():
    assert registry.make_press("exact", 0.5) is None
    labels = [m.label for m in registry.METHODS.values()]
    assert len(set(labels)) == len(labels)


def test_options_replace_single_fields_and_paper_is_the_paper_setting():
    press = registry.make_press("compresskv", 0.75, seed=1, window_size=32, fit="none")
    assert (press.window_size, press.fit, press.sink_size, press.seed) == (32, "none", 4, 1)
    paper = registry.make_press("compresskv_paper", 0.75, seed=1, window_size=128)
    expected = CompressKVPress.paper(0.75, seed=1, window_size=128)
    assert paper == expected and paper.selection == "rpnys"
    assert registry.make_press("snapkv", 0.5, kernel_size=7).kernel_size == 7


@pytest.mark.parametrize(
    ("args", "options", "message"),
    [
        (("nope", 0.5), {}, "method: unknown method 'nope'; choose from exact, compresskv"),
        (("exact", 0.5), {"window_size": 3}, "method: exact has no press and takes no options"),
        (("compresskv", 0.5), {"fit": "all"}, "fit:"),
        (("compresskv", 1.5), {}, "compression_ratio:"),
        (("snapkv", 1.5), {}, "compression_ratio: must be a number in [0, 1)"),  # kvpress's AssertionError
        (("exact", -0.5), {}, "compression_ratio: must be a number in [0, 1)"),  # was accepted
        (("streamingllm", 0.5), {"window": 8}, "window: streamingllm has no option 'window'"),  # a TypeError
    ],
)
def test_bad_input_names_the_parameter(args, options, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        registry.make_press(*args, **options)
    assert "\n" not in str(info.value)


def test_pyramidkv_refuses_a_cache_of_layers_of_different_lengths_and_runs_where_they_are_one():
    """kvpress's PyramidKV gives layers different budgets, and transformers' attention takes one mask length for all
    of a cache's layers: the forward after such a prefill failed inside sdpa. Ours refuses before the prefill writes
    anything, naming the method and the ratio, and the caller's cache stays usable; where every layer keeps one
    length, the next forward runs."""
    import torch
    from transformers import DynamicCache

    from tests.tiny_models import tiny_model

    model = tiny_model("llama", num_hidden_layers=4)
    ids = torch.randint(1, 200, (1, 300), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    with pytest.raises(ValueError, match=r"^pyramidkv: .* keep \d+ to \d+ rows per layer of a 300-token context at "
                       r"compression_ratio=0.5, .*\(the cache is untouched\)$"):  # fmt: skip
        with torch.no_grad(), registry.make_press("pyramidkv", 0.5)(model):
            model.model(input_ids=ids, past_key_values=cache)
    assert cache.get_seq_length() == 0
    with torch.no_grad(), registry.make_press("snapkv", 0.5)(model):  # the same cache, another press
        model.model(input_ids=ids, past_key_values=cache)
    assert {layer.keys.shape[-2] for layer in cache.layers} == {150}
    assert not model.model.layers[0].self_attn._forward_pre_hooks  # the check left with the press
    cache = DynamicCache()
    with torch.no_grad(), registry.make_press("pyramidkv", 0.75)(model):
        model.model(input_ids=ids, past_key_values=cache)
    assert {layer.keys.shape[-2] for layer in cache.layers} == {75}
    with torch.no_grad():
        model(input_ids=ids[:, :5], past_key_values=cache)  # the question's forward
    assert {layer.keys.shape[-2] for layer in cache.layers} == {80}


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [  # each was a bare AssertionError, a shape error inside the prefill, or a press that ran with it
        ("adakv", {"alpha_safeguard": 2.0}, "alpha_safeguard: must be a number in [0, 1], got 2.0"),
        ("snapkv", {"window_size": -1}, "window_size: must be an int >= 1, got -1"),
        ("snapkv", {"window_size": 0}, "window_size: must be an int >= 1, got 0"),
        ("snapkv", {"kernel_size": 0}, "kernel_size: must be an int >= 1, got 0"),
        ("snapkv", {"kernel_size": 4}, "kernel_size: must be an odd int >= 1, got 4"),
        ("pyramidkv", {"window_size": 0}, "window_size: must be an int >= 1, got 0"),
        ("pyramidkv", {"beta": 0}, "beta: must be an int >= 1, got 0"),
        ("streamingllm", {"n_sink": -1}, "n_sink: must be an int >= 0, got -1"),
        ("streamingllm", {"n_sink": 1.5}, "n_sink: must be an int >= 0, got 1.5"),
        ("streamingllm", {"n_sink": True}, "n_sink: must be an int >= 0, got True"),
        ("expected_attention", {"n_future_positions": -1}, "n_future_positions: must be an int >= 1, got -1"),
        ("expected_attention", {"epsilon": float("nan")}, "epsilon: must be a number in [0, inf), got nan"),
        ("expected_attention", {"use_covariance": "no"}, "use_covariance: must be True or False, got 'no'"),
        ("kvzip", {"chunk_size": 0}, "chunk_size: must be an int >= 1, got 0"),
        ("kvzip", {"n_sink": -4}, "n_sink: must be an int >= 0, got -4"),
        ("compactor", {"sink_size_start": -1}, "sink_size_start: must be an int >= 0, got -1"),
        ("compactor", {"sketch_dimension": 0}, "sketch_dimension: must be an int >= 1, got 0"),
        ("compactor", {"blending": "a"}, "blending: must be a number in [0, inf), got 'a'"),
        ("compactor", {"_leverage_press": 3}, "_leverage_press: compactor has no option '_leverage_press'"),
        ("adakv", {"press": "x"}, "adakv: kvpress refused the options press='x': AdaKVPress requires a ScorerPress"),
    ],
)
def test_kvpress_options_are_checked_when_the_press_is_made(name, options, message):
    """kvpress's presses check few of their fields: make_press refuses a bad one, naming it and its range, and turns
    kvpress's own asserts into a ValueError naming the method and the options."""
    with pytest.raises(ValueError, match="^" + re.escape(message)) as info:
        registry.make_press(name, 0.5, **options)
    assert "\n" not in str(info.value)


def test_kvpress_options_in_range_are_taken_as_plain_numbers():
    import numpy as np

    assert registry.make_press("streamingllm", 0.5, n_sink=0).n_sink == 0
    press = registry.make_press("snapkv", 0.5, window_size=np.int64(1), kernel_size=1)
    assert (press.window_size, type(press.window_size), press.kernel_size) == (1, int, 1)
    assert registry.make_press("adakv", 0.5, alpha_safeguard=1).alpha_safeguard == 1.0
    assert registry.make_press("compactor", 0.5, blending=None, sink_size_end=0).blending is None
    assert registry.make_press("expected_attention", 0.5, use_vnorm=False, epsilon=0.5).epsilon == 0.5


def test_a_press_option_that_is_not_yaml_names_the_flag():
    with pytest.raises(ValueError, match=re.escape("--press-option: 'compresskv.reference=[': the value '[' is not "
                                                   "valid YAML (expected the node content")):  # fmt: skip
        registry.parse_press_option("compresskv.reference=[")
    assert registry.parse_press_option("reference=[window]", "compresskv") == ("compresskv", "reference", ["window"])
