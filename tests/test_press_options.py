"""CompressKVPress options on tiny random models: selection, reference queries, fit, the paper's setting."""

from __future__ import annotations

import copy

import pytest
import torch
from kvpress import SnapKVPress
from transformers import DynamicCache

from kvcompress import CompressKVPress, compress_kv
from kvcompress.cache import WeightedLayer
from tests.tiny_models import tiny_model

CONTEXT = 320


def tokens(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def compressed_cache(model, press, context, config=None) -> DynamicCache:
    cache = DynamicCache(config=config)
    with press(model):
        model.model(input_ids=context, past_key_values=cache)
    return cache


def full_context(model, context):
    """Each layer's keys/values after a stock prefill (the tensors every press starts from)."""
    model.set_attn_implementation("sdpa")
    cache = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=context, past_key_values=cache)
    return [(layer.keys, layer.values) for layer in cache.layers]


VARIANTS = {
    "default": {},
    "no fit": dict(fit="none"),
    "weights fit": dict(fit="weights"),
    "window only": dict(reference=["window"]),
    "prefill sample": dict(reference=["window", "prefill"], fit_queries=32),
    "repeat only": dict(reference=["repeat"], repeat_chunk=100),
    "hybrid": dict(selection="hybrid", fit="none"),
    "longer window": dict(window_size=48),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_every_variant_keeps_exactly_the_budget_and_is_deterministic(name):
    model = tiny_model("qwen2", num_hidden_layers=2)
    context = tokens(CONTEXT, 1)
    press = CompressKVPress(compression_ratio=0.75, seed=3, **VARIANTS[name])
    cache = compressed_cache(model, press, context)
    again = compressed_cache(model, CompressKVPress(compression_ratio=0.75, seed=3, **VARIANTS[name]), context)
    budget = int(CONTEXT * 0.25)
    for layer, twin in zip(cache.layers, again.layers, strict=True):
        assert isinstance(layer, WeightedLayer)
        assert layer.keys.shape[-2] == layer.values.shape[-2] == layer.row_weights.shape[-1] == budget
        assert torch.isfinite(layer.values).all() and torch.isfinite(layer.row_weights).all()
        if press.selection == "attention":  # fitted masses are clamped positive; Nystrom weights may not be
            assert (layer.row_weights > 0).all()
        assert torch.equal(layer.keys, twin.keys) and torch.equal(layer.values, twin.values)
        assert torch.equal(layer.row_weights, twin.row_weights)
    assert cache.get_seq_length() == CONTEXT
    with torch.no_grad():
        logits = model(tokens(5, 2), past_key_values=cache).logits
    assert torch.isfinite(logits).all()


def test_a_fit_changes_weights_and_values_but_adds_no_bytes():
    model = tiny_model("llama", num_hidden_layers=2)
    context = tokens(CONTEXT, 4)
    plain = compressed_cache(model, CompressKVPress(compression_ratio=0.75, fit="none"), context)
    fitted = compressed_cache(model, CompressKVPress(compression_ratio=0.75), context)
    for a, b in zip(plain.layers, fitted.layers, strict=True):
        assert torch.equal(a.keys, b.keys)  # same selection
        assert torch.all(a.row_weights == 1)
        assert a.keys.nbytes + a.values.nbytes + a.row_weights.nbytes == b.keys.nbytes + b.values.nbytes + (
            b.row_weights.nbytes
        )
    assert any(not torch.all(layer.row_weights == 1) for layer in fitted.layers)


def test_window_attention_selection_is_snapkv_selection():
    """With SnapKV's settings (window queries only, kernel 5, 64 exact recent rows, no sink, no fit) the
    attention selection keeps exactly the rows kvpress's SnapKVPress keeps."""
    model = tiny_model("llama", num_hidden_layers=2)
    context = tokens(CONTEXT, 5)
    ours = compressed_cache(
        model,
        CompressKVPress(
            compression_ratio=0.7, reference=["window"], score_pooling="sum", fit="none", sink_size=0, window_size=64
        ),
        context,
    )
    model.set_attn_implementation("sdpa")
    theirs = compressed_cache(model, SnapKVPress(compression_ratio=0.7, window_size=64, kernel_size=5), context)
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        assert a.keys.shape == b.keys.shape
        # SnapKV keeps its rows in score order; compare the sets of kept key rows.
        order_a = torch.sort(a.keys[..., 0], dim=-1).indices
        order_b = torch.sort(b.keys[..., 0], dim=-1).indices
        sorted_a = a.keys.gather(2, order_a[..., None].expand_as(a.keys))
        sorted_b = b.keys.gather(2, order_b[..., None].expand_as(b.keys))
        torch.testing.assert_close(sorted_a, sorted_b, rtol=0, atol=0)


def test_paper_setting_is_the_binned_rpnys_coreset_of_the_middle():
    model = tiny_model("llama", num_hidden_layers=2)
    context = tokens(CONTEXT, 6)
    full = full_context(model, context)
    press = CompressKVPress.paper(compression_ratio=0.6, seed=11)
    assert (press.selection, press.sink_size, press.window_size, press.bin_rank, press.fit) == (
        "rpnys",
        32,
        32,
        12,
        "none",
    )
    cache = compressed_cache(model, press, context)
    rows = int(CONTEXT * 0.4) - 64
    bins = rows // 12
    coreset = bins * (rows // bins)
    exact = rows - coreset  # the last middle rows the equal bins cannot take stay exact: exactly the budget
    assert exact > 0
    for idx, (layer, (keys, values)) in enumerate(zip(cache.layers, full, strict=True)):
        assert layer.keys.shape[-2] == int(CONTEXT * 0.4)
        k_s, v_s, w = compress_kv(
            keys[:, :, 32 : -32 - exact],
            values[:, :, 32 : -32 - exact],
            coreset,
            bins=bins,
            scaling=model.model.layers[idx].self_attn.scaling,
            seed=press.layer_seed(idx),
        )
        middle = slice(32, 32 + coreset)
        torch.testing.assert_close(layer.keys[:, :, middle], k_s)
        torch.testing.assert_close(layer.values[:, :, middle], v_s)
        torch.testing.assert_close(layer.row_weights[:, :, middle], w)
        torch.testing.assert_close(layer.keys[:, :, :32], keys[:, :, :32])
        torch.testing.assert_close(layer.keys[:, :, -32 - exact :], keys[:, :, -32 - exact :])
        assert torch.all(layer.row_weights[:, :, 32 + coreset :] == 1)


def float64_query_radius(model, context) -> list[torch.Tensor]:
    """Per layer, the largest post-RoPE query norm per (batch row, KV head) over the context's queries, from a
    float64 copy of the model's own modules (its projections, query norm where it has one, its RoPE)."""
    model64 = copy.deepcopy(model).double()
    with torch.no_grad():
        hidden = model64.model(input_ids=context, output_hidden_states=True).hidden_states
        positions = torch.arange(context.shape[1])[None]
        radii = []
        for idx, layer in enumerate(model64.model.layers):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden[idx])
            q = attention.q_proj(x).view(1, context.shape[1], -1, attention.head_dim)
            q = (attention.q_norm(q) if hasattr(attention, "q_norm") else q).transpose(1, 2)
            cos, sin = model64.model.rotary_emb(x, positions)
            half = q.shape[-1] // 2
            rotated = torch.cat([-q[..., half:], q[..., :half]], -1)
            q = q * cos[:, None] + rotated * sin[:, None]
            norms = q.norm(dim=-1).amax(-1)  # [1, h_q]
            radii.append(norms.view(1, -1, attention.num_key_value_groups).amax(-1))
    return radii


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_paper_with_query_radius_from_the_queries(family, monkeypatch):
    """``query_radius="queries"``: each layer's R_Q (eq. 12) is its prefill queries' largest post-RoPE norm per KV
    head (over the GQA group), as a float64 copy of the model computes it, and the coreset is ``compress_kv``'s
    with that radius. Tolerance: the press reads the float32 forward's queries, a few float32 roundings (2^-24
    each) through two layers: 1e-5 relative is ~100x that. qwen3 normalises its queries before RoPE (every norm
    then the same with its initial weights): the case checks that norm is applied."""
    from kvcompress import methods

    model = tiny_model(family, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
    context = tokens(CONTEXT, 8)
    full = full_context(model, context)
    seen = []

    def spy(*args, query_radius=None, **kwargs):
        seen.append(query_radius)
        return compress_kv(*args, query_radius=query_radius, **kwargs)

    monkeypatch.setattr(methods, "compress_kv", spy)
    press = CompressKVPress.paper(compression_ratio=0.6, seed=11, query_radius="queries")
    cache = compressed_cache(model, press, context)
    assert len(seen) == len(cache.layers)
    rows = int(CONTEXT * 0.4) - 64
    bins = rows // 12
    coreset = bins * (rows // bins)
    exact = rows - coreset
    for idx, (layer, (keys, values), radius, want) in enumerate(
        zip(cache.layers, full, seen, float64_query_radius(model, context), strict=True)
    ):
        assert radius.shape == (1, 2)
        torch.testing.assert_close(radius.double(), want, rtol=1e-5, atol=0)
        k_s, v_s, w = compress_kv(
            keys[:, :, 32 : -32 - exact], values[:, :, 32 : -32 - exact], coreset, bins=bins,
            scaling=model.model.layers[idx].self_attn.scaling, seed=press.layer_seed(idx), query_radius=radius,
        )  # fmt: skip
        middle = slice(32, 32 + coreset)
        torch.testing.assert_close(layer.keys[:, :, middle], k_s)
        torch.testing.assert_close(layer.values[:, :, middle], v_s)
        torch.testing.assert_close(layer.row_weights[:, :, middle], w)


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_repeat_pass_leaves_sliding_and_uncompressed_state_as_a_plain_prefill(family):
    """The repeat pass runs after the prefill and is undone: sliding-window layers (which cannot be cropped once
    past their window) and every position count are as after a plain prefill, and answers run on the cache."""
    overrides = dict(sliding_window=64) if family == "gemma3" else {}
    model = tiny_model(family, **overrides)
    context = tokens(CONTEXT, 7)
    plain = DynamicCache(config=model.config)  # as generate builds it: sliding-window layers where the model has them
    with torch.no_grad():
        model.model(input_ids=context, past_key_values=plain)
    press = CompressKVPress(compression_ratio=0.75, reference=("window", "repeat"), repeat_chunk=128)
    cache = compressed_cache(model, press, context, config=model.config)
    assert cache.get_seq_length() == CONTEXT
    sliding = [getattr(layer.self_attn, "is_sliding", False) for layer in model.model.layers]
    assert any(sliding) == (family == "gemma3")
    for layer, reference, is_sliding in zip(cache.layers, plain.layers, sliding, strict=True):
        if is_sliding:
            assert not isinstance(layer, WeightedLayer) and reference.keys.shape[-2] == 63  # past its window
            assert torch.equal(layer.keys, reference.keys) and layer.cumulative_length == reference.cumulative_length
        else:
            assert isinstance(layer, WeightedLayer) and layer.keys.shape[-2] == int(CONTEXT * 0.25)
    with torch.no_grad():
        out = model.generate(
            torch.cat([context, tokens(4, 8)], 1), past_key_values=cache, max_new_tokens=3, do_sample=False
        )
    assert out.shape[-1] == CONTEXT + 4 + 3


def test_compression_is_done_when_the_prefill_call_returns_and_only_once():
    model = tiny_model("llama", num_hidden_layers=2)
    press = CompressKVPress(compression_ratio=0.5)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=tokens(CONTEXT, 9), past_key_values=cache)
        assert all(isinstance(layer, WeightedLayer) for layer in cache.layers)  # already, inside the block
        before = copy.deepcopy(cache)
        model(tokens(6, 10), past_key_values=cache)  # a later call inside the block is not a prefill
    for layer, kept in zip(cache.layers, before.layers, strict=True):
        assert torch.equal(layer.keys[:, :, : kept.keys.shape[-2]], kept.keys)
        assert layer.keys.shape[-2] == kept.keys.shape[-2] + 6


def test_repeat_needs_input_ids():
    model = tiny_model("llama", num_hidden_layers=2)
    embeds = model.model.embed_tokens(tokens(CONTEXT, 12)).detach()
    cache = DynamicCache()
    with pytest.raises(ValueError, match="^input_ids: CompressKVPress with reference 'repeat'"):
        with torch.no_grad(), CompressKVPress.thorough(compression_ratio=0.5)(model):
            model.model(inputs_embeds=embeds, past_key_values=cache)
    assert cache.get_seq_length() == 0  # refused before the prefill ran
    cache = compressed_cache_embeds(model, CompressKVPress(compression_ratio=0.5, reference=["window"]), embeds)
    assert all(layer.keys.shape[-2] == CONTEXT // 2 for layer in cache.layers)


@torch.no_grad()
def compressed_cache_embeds(model, press, embeds) -> DynamicCache:
    cache = DynamicCache()
    with press(model):
        model.model(inputs_embeds=embeds, past_key_values=cache)
    return cache


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(selection="topk"), "selection"),
        (dict(fit="all"), "fit"),
        (dict(reference="window"), "reference"),
        (dict(reference=["window", "future"]), "reference"),
        (dict(reference=[]), "reference"),
        (dict(selection="hybrid"), "fit"),  # the default fit needs the attention selection
        (dict(repeat_weight=-1.0), "repeat_weight"),
        (dict(repeat_weight=float("inf")), "repeat_weight"),  # accepted before: an infinite weight
        (dict(fit_ridge=float("inf")), "fit_ridge"),
        (dict(fit_ridge=0.0), "fit_ridge"),
        (dict(hybrid_fraction=1.5), "hybrid_fraction"),
        (dict(observation_window=0), "observation_window"),
        (dict(pool_kernel=4), "pool_kernel"),
        (dict(fit_bin_rows=0), "fit_bin_rows"),
        (dict(fit_queries=1), "fit_queries"),
        (dict(repeat_chunk=0), "repeat_chunk"),
        (dict(bin_rank=0), "bin_rank"),
        (dict(query_radius="values"), "query_radius"),
        (dict(window_size=-1), "window_size"),
        (dict(compression_ratio=1.0), "compression_ratio"),
        (dict(compression_ratio="half"), "compression_ratio"),
        (dict(seed=1.5), "seed"),
        (dict(retrieval_layers=18), "retrieval_layers"),
        (dict(retrieval_layers="18"), "retrieval_layers"),
        (dict(retrieval_layers=[-1]), "retrieval_layers"),
        (dict(retrieval_layers=[1.0]), "retrieval_layers"),
        (dict(retrieval_layers=[3, 3]), "retrieval_layers"),
        (dict(retrieval_rows=0.5), "retrieval_rows"),
        (dict(retrieval_rows=float("nan")), "retrieval_rows"),
        (dict(retrieval_prior_share=-0.1), "retrieval_prior_share"),
        (dict(retrieval_prior_share=1.5), "retrieval_prior_share"),
        (dict(retrieval_prior_share=float("nan")), "retrieval_prior_share"),
    ],
)
def test_bad_options_get_one_line_errors_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}: ") as error:
        CompressKVPress(**kwargs)
    assert "\n" not in str(error.value)


def test_numpy_scalars_are_numbers_and_uniform_press_checks_weighted():
    """A ratio or a window from numpy (a config computed with numpy) is a number: taken as the Python number it holds
    (settings are written as JSON); out of range it is refused like any other. ``UniformPress.weighted`` is a bool
    ("no" was truthy: the weighted estimator ran)."""
    import json

    import numpy as np

    from kvcompress import UniformPress
    from kvcompress.registry import make_press

    press = CompressKVPress(compression_ratio=np.float32(0.75), window_size=np.int64(32), novelty_share=np.float32(0.5))
    assert (press.compression_ratio, press.window_size, press.novelty_share) == (0.75, 32, 0.5)
    assert {type(press.compression_ratio), type(press.window_size)} == {float, int}
    json.dumps({"ratio": press.compression_ratio, "window": press.window_size})
    assert make_press("snapkv", np.float32(0.5)).compression_ratio == 0.5
    with pytest.raises(ValueError, match=r"^compression_ratio: must be a number in \[0, 1\)"):
        CompressKVPress(compression_ratio=np.float32(1.5))
    with pytest.raises(ValueError, match="^window_size: must be an int >= 0"):
        CompressKVPress(window_size=np.float64(3.0))
    with pytest.raises(ValueError, match="^weighted: must be True or False, got 'no'"):
        UniformPress(compression_ratio=0.5, weighted="no")


@pytest.mark.parametrize("ratio", [float("nan"), 1.0, 1.5, -0.5, "0.5", None])
def test_a_ratio_set_after_construction_is_checked_on_entry(ratio):
    """kvpress's benchmarks set ``press.compression_ratio`` on a built press: a bad value is refused when the press
    is applied (was: a crash in the budget, or the context silently left whole), and the model is left as it was."""
    model = tiny_model("llama")
    press = CompressKVPress()
    press.compression_ratio = ratio
    with pytest.raises(ValueError, match=r"^compression_ratio: must be a number in \[0, 1\)"), press(model):
        pass
    assert not any(module._forward_hooks for module in model.modules())


def test_seeds_are_int64_and_numpy_integers_and_tensor_api_flags_are_bools():
    """A press's seed and compress_kv's are 64-bit ints (numpy's too: compress_kv refused np.int64 where the presses
    took it; 2**64 was accepted by the presses); ``check_finite="no"`` was truthy; lambert_w0 names NaN input as
    NaN (it said "must be >= 0") and a non-tensor as such."""
    import numpy as np

    from kvcompress import compress_kv, lambert_w0, weighted_attention

    with pytest.raises(ValueError, match=r"^seed: must be an int in \[-9223372036854775808, 9223372036854775807\]"):
        CompressKVPress(seed=2**64)
    keys, values = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    one, two = compress_kv(keys, values, 16, seed=np.int64(2)), compress_kv(keys, values, 16, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    q, w = torch.randn(1, 2, 1, 16), torch.rand(1, 2, 64)
    with pytest.raises(ValueError, match="^check_finite: must be True or False, got 'no'"):
        weighted_attention(q, keys, values, w, check_finite="no")
    with pytest.raises(ValueError, match="^lambert_w0: z holds NaN"):
        lambert_w0(torch.tensor([1.0, float("nan")]))
    with pytest.raises(TypeError, match="^lambert_w0: z must be a torch.Tensor, got float"):
        lambert_w0(2.0)
