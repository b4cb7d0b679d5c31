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


def test_output_attentions_of_a_plain_call_are_the_eager_models(model):
    """After a press the model keeps the kvcompress attention; a call over a cache that was never compressed returns
    the attention weights and outputs of the same weights loaded with ``attn_implementation="eager"`` (a left-padded
    prefill, then two tokens), within float32 rounding."""
    from kvcompress.hf_attention import use_weighted_attention

    ours, eager = tiny_model("llama"), tiny_model("llama")
    use_weighted_attention(ours)
    eager.set_attn_implementation("eager")
    ids = torch.randint(1, 256, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    steps = []
    for net in (ours, eager):
        cache = DynamicCache()
        with torch.no_grad():
            first = net(ids, attention_mask=mask, past_key_values=cache, output_attentions=True)
            new = torch.tensor([[7, 8], [9, 10]])
            second = net(new, attention_mask=torch.cat([mask, torch.ones_like(new)], 1), past_key_values=cache,
                         output_attentions=True)  # fmt: skip
        steps.append((first, second))
    real_queries = (mask.bool(), torch.ones(2, 2, dtype=torch.bool))  # a padded query's row is not compared
    for got, expected, real in zip(steps[0], steps[1], real_queries, strict=True):
        assert len(got.attentions) == len(expected.attentions) == ours.config.num_hidden_layers
        for a, b in zip(got.attentions, expected.attentions, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.logits[real], expected.logits[real], rtol=1e-4, atol=1e-5)
    # Under a press with a repeat pass: one entry per layer (the pass's own reading is not the caller's), eager's.
    with torch.no_grad(), CompressKVPress.thorough(0.5)(ours):
        pressed = ours(ids[:1], past_key_values=DynamicCache(), output_attentions=True)
    with torch.no_grad():
        reference = eager(ids[:1], output_attentions=True)
    assert len(pressed.attentions) == len(reference.attentions) == ours.config.num_hidden_layers
    for a, b in zip(pressed.attentions, reference.attentions, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_output_attentions_over_a_compressed_cache_are_each_querys_shares_of_the_rows(model):
    """Over a compressed cache (a left-padded batch: filler rows), a 3-token step with ``output_attentions=True``
    gives the logits of the same step without it, and per layer ``[b, heads, 3, rows]`` shares equal to the float64
    definition ``w_j e^{s_j} / sum_i w_i e^{s_i}`` from the layer's own queries (recorded at the attention call):
    summing to 1, 0 on filler rows and on later tokens a query does not see yet."""
    import copy

    from transformers import AttentionInterface

    from kvcompress import hf_attention
    from kvcompress.attention import weighted_attention_probabilities

    ids = torch.randint(1, 256, (2, 96), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, :30] = 0
    cache = DynamicCache()
    with torch.no_grad(), CompressKVPress(compression_ratio=0.5, seed=0)(model):
        model(ids, attention_mask=mask, past_key_values=cache)
    plain_cache = copy.deepcopy(cache)
    new = torch.randint(1, 256, (2, 3), generator=torch.Generator().manual_seed(7))
    step_mask = torch.cat([mask, torch.ones_like(new)], 1)
    queries = []

    def recording(module, query, *args, **kwargs):
        queries.append(query)
        return hf_attention.kvcompress_attention(module, query, *args, **kwargs)

    AttentionInterface.register(hf_attention.ATTENTION_NAME, recording)
    try:
        with torch.no_grad():
            out = model(new, attention_mask=step_mask, past_key_values=cache, output_attentions=True)
    finally:
        hf_attention.register()
    with torch.no_grad():
        plain = model(new, attention_mask=step_mask, past_key_values=plain_cache)
    torch.testing.assert_close(out.logits, plain.logits, rtol=1e-5, atol=1e-5)
    assert len(out.attentions) == len(queries) == model.config.num_hidden_layers
    for i, (shares, layer, query) in enumerate(zip(out.attentions, cache.layers, queries, strict=True)):
        rows = layer.keys.shape[-2]
        assert shares.shape == (2, model.config.num_attention_heads, 3, rows), i
        key_mask = layer.key_mask(rows, None)
        assert not bool(key_mask[0].all()) and bool(key_mask[1].all())  # the padded row's filler rows
        ref = weighted_attention_probabilities(query.double(), layer.keys.double(), layer.weights_for(rows).double(),
                                               scaling=model.model.layers[i].self_attn.scaling,
                                               causal_offset=rows - 3, key_mask=key_mask)  # fmt: skip
        torch.testing.assert_close(shares.double(), ref, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(shares.sum(-1), torch.ones(2, shares.shape[1], 3), rtol=1e-5, atol=1e-5)
        assert bool((shares[:, :, 0, -2:] == 0).all()) and bool((shares[:, :, 1, -1] == 0).all())  # causal
        assert bool((shares[0][..., : layer.context_rows][..., ~key_mask[0, : layer.context_rows]] == 0).all())


def test_a_compressed_cache_on_a_model_without_the_kvcompress_attention_is_refused_before_it_changes(model):
    """A compressed cache read by stock attention is read unweighted: a fresh model (the cache pickled, or saved and
    loaded) gave other tokens without an error, and a 2-token step crashed inside sdpa. Refused, naming
    past_key_values and the cure, with the cache unchanged; after ``use_weighted_attention`` the fresh model gives
    the pressed model's logits. A cache of another dtype than the model's is refused the same way."""
    import pickle

    from kvcompress import use_weighted_attention

    ids = torch.randint(3, 256, (1, 120), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    with torch.no_grad(), CompressKVPress(compression_ratio=0.5, seed=0)(model):
        model.model(ids, past_key_values=cache)
    for switched in (False, True):
        fresh = tiny_model("llama")
        if switched:  # the press's model switched back
            use_weighted_attention(fresh)
            fresh.set_attn_implementation("sdpa")
        loaded = pickle.loads(pickle.dumps(cache))
        rows = [layer.keys.shape[-2] for layer in loaded.layers]
        for step in (ids[:, :1], ids[:, :2]):
            with pytest.raises(ValueError, match=r"^past_key_values: .* attention to be 'kvcompress', got 'sdpa': "
                                                 r"call kvcompress.use_weighted_attention\(model\)"):
                with torch.no_grad():
                    fresh(step, past_key_values=loaded)
            assert [layer.keys.shape[-2] for layer in loaded.layers] == rows
        use_weighted_attention(fresh)
        with torch.no_grad():
            got = fresh(ids[:, :2], past_key_values=loaded).logits
            expected = model(ids[:, :2], past_key_values=pickle.loads(pickle.dumps(cache))).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    wider = tiny_model("llama", dtype=torch.float64)
    use_weighted_attention(wider)
    with pytest.raises(ValueError, match=r"^past_key_values: the cache holds torch.float32 .* computes torch.float64"):
        with torch.no_grad():
            wider(ids[:, :1], past_key_values=cache)
    assert [layer.keys.shape[-2] for layer in cache.layers] == rows
