"""kvpress's own idioms with our presses: its generic press test, a direct post_init_from_model call, and
batch rows that give exactly what each row gives alone (tiny random-weight models, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcompress import CompressKVPress, UniformPress
from kvcompress.cache import WeightedLayer
from tests.tiny_models import tiny_model

PRESSES = {
    "compresskv": lambda ratio: CompressKVPress(compression_ratio=ratio, seed=0),
    "compresskv_window": lambda ratio: CompressKVPress(compression_ratio=ratio, reference=("window",), seed=0),
    "compresskv_paper": lambda ratio: CompressKVPress.paper(ratio, seed=0),
    "uniform": lambda ratio: UniformPress(compression_ratio=ratio, seed=0),
    "uniform_weighted": lambda ratio: UniformPress(compression_ratio=ratio, seed=0, weighted=True),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("name", list(PRESSES))
def test_kvpress_generic_press_run(model, name):
    """kvpress's ``test_presses_run`` without a wrapper: post_init_from_model(model), then the press's own
    ``with``, at several ratios; the cache ends at the press's budget in every layer."""
    for ratio in (0.2, 0.4, 0.6, 0.8):
        press = PRESSES[name](ratio)
        if hasattr(press, "post_init_from_model"):
            press.post_init_from_model(model)
        cache = DynamicCache()
        with torch.no_grad(), press(model):
            model(torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(3)), past_key_values=cache)
        assert hasattr(press, "compression_ratio")
        assert all(isinstance(layer, WeightedLayer) for layer in cache.layers)
        assert {layer.keys.shape[-2] for layer in cache.layers} == {press.budget(128)}
        assert cache.get_seq_length() == 128


def test_direct_post_init_still_refuses_real_wrappers(model):
    """A direct call is accepted; a wrapper calling it from its own post_init_from_model is refused by name."""
    from kvpress import ComposedPress, KnormPress

    ours = CompressKVPress(compression_ratio=0.5)
    ours.post_init_from_model(model)  # kvpress's idiom before a wrapper too
    composed = ComposedPress([ours, KnormPress(compression_ratio=0.5)])
    with pytest.raises(ValueError, match="^press: CompressKVPress cannot run inside ComposedPress"):
        composed.post_init_from_model(model)


def test_a_second_press_is_refused_before_it_runs(model):
    """Two presses on one model would each compress the other's output (the paper's press twice gave a cache that
    counted 120 of 300 tokens, silently): the same press entered twice, a second kvcompress press, or ours inside
    a kvpress press are refused on entry; a kvpress press entered inside a kvcompress press's block is refused
    before the prefill writes anything (ThinK pruned the fitted keys' channels silently; Knorm's eviction was
    caught only mid-prefill, the cache half written). The model then runs as before, and a press applied alone
    works."""
    from kvpress import KnormPress, ThinKPress

    ids = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(4))
    press, other = CompressKVPress.paper(0.5, seed=0), CompressKVPress(compression_ratio=0.5, seed=0)
    for outer, inner, message in (
        (press, press, "^press: this CompressKVPress is already applied"),
        (press, other, "^press: CompressKVPress is already applied to this model"),
        (KnormPress(compression_ratio=0.5), press, "^press: KnormPress is already applied to this model"),
    ):
        with pytest.raises(ValueError, match=message), outer(model), inner(model):
            pass
    for inner in (KnormPress(compression_ratio=0.5), ThinKPress(key_channel_compression_ratio=0.5)):
        cache = DynamicCache()
        with pytest.raises(ValueError, match=f"^press: {type(inner).__name__} is already applied to this model"):
            with torch.no_grad(), press(model), inner(model):
                model(ids, past_key_values=cache)
        assert cache.get_seq_length() == 0  # nothing written
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(ids, past_key_values=cache)
    assert cache.get_seq_length() == 96 and all(layer.keys.shape[-2] == 48 for layer in cache.layers)


def test_a_layer_another_hook_evicted_is_refused_by_name(model):
    """A layer that already lost rows when the press's hook runs (a hook outside kvpress cropped it) is refused
    with the layer's index, not compressed from the wrong number of rows."""

    def evict(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        layer.keys, layer.values = layer.keys[:, :, 8:], layer.values[:, :, 8:]

    handle = model.model.layers[1].self_attn.register_forward_hook(evict, with_kwargs=True)
    try:
        with pytest.raises(ValueError, match="^press: layer 1 holds 88 rows after a 96-token prefill"):
            with torch.no_grad(), CompressKVPress(compression_ratio=0.5)(model):
                model(torch.randint(0, 256, (1, 96)), past_key_values=DynamicCache())
    finally:
        handle.remove()


@torch.no_grad()
def _compress(model, press, ids: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=ids, past_key_values=cache)
    question = torch.arange(10, 16).expand(ids.shape[0], -1)
    return cache, model(question, past_key_values=cache).logits


@pytest.mark.parametrize("name", ["uniform", "uniform_weighted", "compresskv", "compresskv_paper"])
def test_unpadded_batch_row_equals_the_row_alone(model, name):
    """Each row's random draws depend on (seed, layer, KV head) only, never on its place in the batch: the rows
    of an unpadded batch of two hold the same cache rows and answer the same logits as each row alone.

    Tolerance: the batch and the single row go through the same float32 operations, but matmuls of a different
    batch size may block their sums differently; each such reordering changes a result by a few units of
    float32 rounding (6e-8) relative, and two layers of 64-wide dot products, softmax and RMSNorm leave the
    O(1) logits within ~1e-5. A row whose draws differed keeps other rows: logits differ by ~1e-2 or more
    (the issue measured 0.1 for UniformPress), far outside 1e-4.
    """
    gen = torch.Generator().manual_seed(17)
    ids = torch.randint(0, 256, (2, 300), generator=gen)
    batched, batched_logits = _compress(model, PRESSES[name](0.75), ids)
    for b in range(2):
        alone, alone_logits = _compress(model, PRESSES[name](0.75), ids[b : b + 1])
        for i, (layer, row_layer) in enumerate(zip(batched.layers, alone.layers, strict=True)):
            assert layer.keys.shape[-2] == row_layer.keys.shape[-2], i
            torch.testing.assert_close(layer.keys[b : b + 1], row_layer.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(layer.row_weights[b : b + 1], row_layer.row_weights, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(batched_logits[b : b + 1], alone_logits, rtol=1e-4, atol=1e-4)


def test_a_cache_the_press_cannot_compress_is_refused_before_it_is_written(model):
    """A StaticCache passed to a prefill under our press: refused before layer 0 wrote its rows (it held 96), naming
    the static cache that does work; likewise the one ``generate(cache_implementation="static")`` builds."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=128)
    expected = r"^past_key_values: kvcompress compresses a transformers DynamicCache.*StaticWeightedCache"
    with pytest.raises(ValueError, match=expected):
        with torch.no_grad(), CompressKVPress(compression_ratio=0.5)(model):
            model(torch.randint(0, 256, (1, 96)), past_key_values=cache)
    assert cache.get_seq_length() == 0
    ids = torch.randint(0, 256, (1, 96))
    with pytest.raises(ValueError, match=expected):
        with torch.no_grad(), CompressKVPress(compression_ratio=0.5)(model):
            model.generate(ids, attention_mask=torch.ones_like(ids), cache_implementation="static", max_new_tokens=2,
                           do_sample=False)  # fmt: skip


@pytest.mark.parametrize("kind", ["assistant_model", "prompt_lookup_num_tokens"])
def test_assisted_generation_under_the_press_is_refused_and_a_compressed_cache_serves_it(model, kind):
    """Under ``with press(model)``, assisted decoding's first forward carries the drafts with the prompt, which
    the press compressed as context (other tokens than greedy, or a crop into the context when drafts were
    rejected): refused. Over a cache compressed first, assisted decoding gives greedy decoding's tokens."""
    ids = torch.randint(1, 256, (1, 120), generator=torch.Generator().manual_seed(5))
    options = {"assistant_model": tiny_model("llama", num_hidden_layers=1)} if kind == "assistant_model" else {
        "prompt_lookup_num_tokens": 3}
    generate = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match="^press: CompressKVPress under assisted decoding"):
        with torch.no_grad(), CompressKVPress(compression_ratio=0.5, seed=0)(model):
            model.generate(ids, **generate, **options)
    answers = []
    for extra in ({}, options):
        cache = DynamicCache()
        with torch.no_grad(), CompressKVPress(compression_ratio=0.5, seed=0)(model):
            model.model(input_ids=ids[:, :-1], past_key_values=cache)
        answers.append(model.generate(ids, past_key_values=cache, **generate, **extra))
    assert torch.equal(answers[0], answers[1])


def test_output_attentions_over_the_press_attention_warns_that_none_come_back(model, caplog):
    from transformers.utils import logging as hf_logging

    from kvcompress import hf_attention

    cache = DynamicCache()
    with torch.no_grad(), CompressKVPress(compression_ratio=0.5, seed=0)(model):
        model.model(input_ids=torch.randint(1, 256, (1, 64)), past_key_values=cache)
    hf_attention.logger.warning_once.cache_clear()
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"), torch.no_grad():
            out = model(torch.randint(1, 256, (1, 3)), past_key_values=cache, output_attentions=True)
    finally:
        hf_logging.disable_propagation()
    assert out.attentions == () and "returns no attention weights" in caplog.text
