"""KVzip's scoring as a setting of CompressKVPress: the max attention each key gets from the reference queries."""

from __future__ import annotations

import pytest
import torch

from kvcompress import CompressKVPress, registry, selection
from kvcompress.reference import LayerReference
from kvcompress.selection import attention_mass
from tests.references import float64_attention_mass


@pytest.mark.parametrize("causal", [False, True])
def test_max_mass_matches_float64_reference_with_gqa_and_chunks(causal, monkeypatch):
    g = torch.Generator().manual_seed(7)
    queries, keys = torch.randn(2, 6, 11, 16, generator=g) * 2, torch.randn(2, 2, 37, 16, generator=g) * 2
    positions = torch.randint(0, 37, (11,), generator=g) if causal else None
    expected = float64_attention_mass(queries, keys, 0.25, positions, reduce="max")
    got = attention_mass(queries, keys, 0.25, query_positions=positions, reduce="max")
    assert got.dtype == torch.float32 and got.shape == (2, 2, 37)
    # fp32 softmax of O(10) logits: relative error a few ulps of float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-7)
    assert (got <= 1).all() and (got >= 0).all()
    monkeypatch.setattr(selection, "_CHUNK_ELEMENTS", 100)  # one query per chunk: the max runs across chunks
    torch.testing.assert_close(attention_mass(queries, keys, 0.25, query_positions=positions, reduce="max"), got)
    # the default is unchanged: the sum, each query giving 1 in total
    summed = attention_mass(queries, keys, 0.25, query_positions=positions)
    torch.testing.assert_close(summed.sum(-1), torch.full((2, 2), 33.0))
    assert (summed >= got - 1e-6).all()  # a sum of nonnegative terms bounds their max


def test_max_differs_from_sum_where_a_key_is_needed_once():
    """One query attends to key 0 sharply; all others spread evenly: max ranks key 0 first, the sum need not."""
    n, d = 8, 4
    keys = torch.zeros(1, 1, n, d)
    keys[0, 0, 0, 0] = 10.0
    queries = torch.zeros(1, 1, 30, d)
    queries[0, 0, 0, 0] = 10.0  # only query 0 looks at key 0 (probability ~1)
    queries[0, 0, 1:, 0] = -1.0  # the rest avoid key 0 and spread over keys 1..7
    got_max = attention_mass(queries, keys, 1.0, reduce="max")[0, 0]
    got_sum = attention_mass(queries, keys, 1.0)[0, 0]
    assert got_max.argmax() == 0 and got_sum.argmax() != 0


def test_bad_reduce_and_score_pooling_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^reduce: must be one of 'sum', 'max', got 'mean'$"):
        attention_mass(torch.randn(1, 2, 3, 4), torch.randn(1, 1, 5, 4), 0.5, reduce="mean")
    with pytest.raises(ValueError, match=r"^score_pooling: must be one of 'sum', 'max', got 'mean'$"):
        CompressKVPress(score_pooling="mean")


def test_repeat_chunks_combine_by_max_under_max_pooling():
    a, b = torch.rand(1, 2, 9), torch.rand(1, 2, 9)
    for reduce, expected in (("max", torch.maximum(a, b)), ("sum", a + b)):
        reference = LayerReference(reduce=reduce)
        reference.add("repeat", a, torch.zeros(1, 4, 1, 8), torch.zeros(1, dtype=torch.long))
        reference.add("repeat", b, torch.zeros(1, 4, 1, 8), torch.zeros(1, dtype=torch.long))
        torch.testing.assert_close(reference.mass["repeat"], expected)


def test_kvzip_setting_and_registry_row():
    press = CompressKVPress.kvzip(0.75, seed=2)
    assert press.reference == ("repeat",) and press.score_pooling == "max" and press.fit == "none"
    assert (press.sink_size, press.window_size, press.compression_ratio) == (4, 0, 0.75)
    assert registry.make_press("compresskv_kvzip", 0.75, seed=2) == press
    assert registry.METHODS["compresskv_kvzip"].label == "KVzip"
    window_only = registry.make_press("compresskv_window", 0.5)
    assert window_only.reference == ("window",) and window_only == CompressKVPress(0.5, seed=0, reference=("window",))


@pytest.mark.parametrize("chunk", [64, 5])
def test_kvzip_press_keeps_the_sink_and_the_rows_its_max_scores_rank_first(chunk):
    """On a tiny model the press keeps, per layer and KV head, the 4 sink rows and the middle rows with the highest
    max attention from the repeat pass (whatever its chunk size), exactly; the cache holds the budget."""
    from transformers import DynamicCache

    from kvcompress import presses
    from kvcompress.selection import top_rows
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    exact = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=exact)
    seen = []
    original = presses.mixed_scores

    def spy(reference, start, end, weights, pool, **kwargs):
        seen.append((reference.mass["repeat"].clone(), start, end))
        return original(reference, start, end, weights, pool, **kwargs)

    cache = DynamicCache()
    try:
        presses.mixed_scores = spy
        with torch.no_grad(), CompressKVPress.kvzip(0.5, repeat_chunk=chunk)(model):
            model.model(input_ids=ids, past_key_values=cache)
    finally:
        presses.mixed_scores = original
    assert len(seen) == model.config.num_hidden_layers
    for layer, (mass, start, end) in enumerate(seen):
        assert mass.shape == (1, 2, 40) and (mass <= 1).all() and (mass > 0).all() and (start, end) == (4, 40)
        rows = torch.cat([torch.arange(4).expand(1, 2, 4), top_rows(mass[:, :, start:end], 16) + start], dim=-1)
        full = exact.layers[layer].keys
        expected = full.gather(2, rows[..., None].expand(-1, -1, -1, full.shape[-1]))
        torch.testing.assert_close(cache.layers[layer].keys, expected, rtol=0, atol=0)
