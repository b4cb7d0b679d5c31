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
