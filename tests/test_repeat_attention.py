"""The repeat pass's attention: new tokens after a full, unpadded cache run a lower-right causal sdpa
(``kvcompress.hf_attention.new_tokens_see_all_cached``) instead of transformers' explicit mask.

Against the float64 definition (query i of q new tokens sees the first ``n - q + i + 1`` of n keys), on the CPU
and compiled on CUDA (flash kernel, grouped-query heads); the stock path wherever the mask says more (a
sliding window, one new token, outside the block); and the repeat settings' caches unchanged by it.
"""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from kvcompress import CompressKVPress, hf_attention, reference
from kvcompress.hf_attention import kvcompress_attention, new_tokens_see_all_cached
from tests.test_press_options import compressed_cache, tokens
from tests.tiny_models import tiny_model

# float16 sdpa on the CPU is no configuration the library runs; on CUDA the lower-right path is flash, which takes
# bf16 and fp16 (float32 runs the stock kernels, whose products may use TF32: not this path's to test)
DEVICE_DTYPES = [("cpu", torch.float32), ("cpu", torch.bfloat16)] + (
    [("cuda", dtype) for dtype in (torch.bfloat16, torch.float16)] if torch.cuda.is_available() else []
)
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def float64_attention(query, key, value, scaling, visible):
    """Softmax attention in float64 over the keys ``visible [q, n]`` marks; ``[b, q, h_q, d]``."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.double().repeat_interleave(groups, 1), value.double().repeat_interleave(groups, 1)
    logits = (query.double() @ key.transpose(-1, -2)) * scaling
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    return (probs @ value).transpose(1, 2)


def lower_right(q_len: int, k_len: int, device) -> torch.Tensor:
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)


def inputs(heads: int, kv_heads: int, q_len: int, k_len: int, dtype, device, seed: int):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((2, heads, q_len, 64), (2, kv_heads, k_len, 64), (2, kv_heads, k_len, 64))
    return [torch.randn(shape, generator=generator).to(device=device, dtype=dtype) for shape in shapes]


def tolerance(value: torch.Tensor, k_len: int, dtype) -> float:
    """A convex combination of the values, times the largest value: the float32 logits' and sums' rounding (about
    (d + n) float32 units, d = 64), and in bf16 / fp16 the probabilities rounded to that type before their product
    with the values (one unit relative each: flash and the CPU kernels keep the logits and the softmax in float32)
    and the output's own rounding (one unit)."""
    low = 0.0 if dtype == torch.float32 else 2 * UNIT[dtype]
    return (4 * (64 + k_len) * UNIT[torch.float32] + UNIT[torch.float32] + low) * value.abs().max().item()


@pytest.mark.parametrize("device, dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (7, 1)])
@pytest.mark.parametrize("q_len, k_len", [(5, 37), (64, 300)])
def test_new_tokens_after_a_cache_against_the_float64_definition(device, dtype, heads, kv_heads, q_len, k_len):
    query, key, value = inputs(heads, kv_heads, q_len, k_len, dtype, device, seed=heads * k_len + q_len)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    visible = lower_right(q_len, k_len, device)
    mask = visible[None, None].expand(2, 1, -1, -1)
    with new_tokens_see_all_cached():
        out, _ = kvcompress_attention(module, query, key, value, mask, scaling=0.125)
    expected = float64_attention(query, key, value, 0.125, visible)
    assert out.shape == expected.shape and out.dtype == dtype
    assert (out.double() - expected).abs().max().item() <= tolerance(value, k_len, dtype)


def _spy(monkeypatch) -> list[bool]:
    """Record whether each lower-right call ran (True) or handed back to the stock path (False)."""
    taken, original = [], hf_attention._lower_right_causal_sdpa

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(hf_attention, "_lower_right_causal_sdpa", spy)
    return taken


@pytest.mark.parametrize("case", ["sliding_window kwarg", "sliding module", "one new token", "outside the block"])
def test_the_stock_mask_stays_wherever_it_says_more(case, monkeypatch):
    taken = _spy(monkeypatch)
    q_len, k_len, window = (1, 40, None) if case == "one new token" else (12, 40, 8)
    query, key, value = inputs(4, 2, q_len, k_len, torch.float32, "cpu", seed=7)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, sliding_window=None)
    kwargs = {}
    visible = lower_right(q_len, k_len, "cpu")
    if case == "sliding_window kwarg":
        kwargs["sliding_window"] = window
    elif case == "sliding module":
        module.sliding_window = window
    if window is not None and case != "outside the block":  # key j visible from position p when p - window < j
        positions = torch.arange(k_len - q_len, k_len)[:, None]
        visible &= torch.arange(k_len)[None, :] > positions - window
    context = nullcontext() if case == "outside the block" else new_tokens_see_all_cached()
    if case == "outside the block":  # a padded key the explicit mask hides: only the mask can say so
        visible[:, 3] = False
    with context:
        out, _ = kvcompress_attention(module, query, key, value, visible[None, None], scaling=0.125, **kwargs)
    expected = float64_attention(query, key, value, 0.125, visible)
    assert (out.double() - expected).abs().max().item() <= tolerance(value, k_len, torch.float32)
    assert taken == ([] if case == "outside the block" else [False])


@pytest.mark.parametrize(
    "press",
    [
        CompressKVPress.thorough(compression_ratio=0.6, seed=0, repeat_chunk=128),
        CompressKVPress.balanced(compression_ratio=0.6, seed=0, repeat_chunk=32),
    ],
    ids=["thorough", "balanced"],
)
@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_repeat_settings_keep_their_cache(press, family, monkeypatch):
    """Same rows, weights within float32 rounding, with and without the lower-right path; the path is taken
    in every full-attention layer of every chunk (gemma3's sliding layer keeps its own mask)."""
    model, context = tiny_model(family), tokens(320, 5)
    monkeypatch.setattr(reference, "new_tokens_see_all_cached", nullcontext)
    stock = compressed_cache(model, press, context)
    monkeypatch.undo()
    taken = _spy(monkeypatch)
    cache = compressed_cache(model, press, context)
    full_attention = sum(getattr(layer.self_attn, "sliding_window", None) is None for layer in model.model.layers)
    pieces = reference.spread_pieces(320, press.repeat_fraction, press.repeat_span)  # as many as the novel ones
    repeat_tokens = 320 if pieces is None else len(pieces)
    chunks = -(-repeat_tokens // press.repeat_chunk)
    assert taken.count(True) == chunks * full_attention and taken.count(False) == chunks * (
        len(model.model.layers) - full_attention
    )
    for expected, layer in zip(stock.layers, cache.layers, strict=True):
        assert torch.equal(layer.keys, expected.keys) and torch.equal(layer.values, expected.values)
        if hasattr(expected, "row_weights"):
            torch.testing.assert_close(layer.row_weights, expected.row_weights, rtol=1e-5, atol=1e-6)


def math_attend(query, key, value, causal, scaling):
    """``(out [b, h_q, q, d], lse [b, h_q, q])`` by the definition in the inputs' dtype: the CPU stand-in of the fused
    operator (``hf_attention._fused_attention_with_lse``); ``causal``: query i sees keys ``<= i`` (as many keys as
    queries)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    logits = (query @ key.transpose(-1, -2)) * scaling
    if causal:
        logits = logits.masked_fill(~lower_right(query.shape[-2], key.shape[-2], query.device), float("-inf"))
    lse = logits.logsumexp(-1)
    return (logits - lse[..., None]).exp() @ value, lse


def _check_split(query, key, value, attend, atol_out: float, atol_lse: float) -> None:
    q_len, k_len = query.shape[-2], key.shape[-2]
    out, whole_lse, lse, out_context = hf_attention.split_at_context(query, key, value, 0.125, attend)
    expected = float64_attention(query, key, value, 0.125, lower_right(q_len, k_len, query.device)).transpose(1, 2)
    assert out.dtype == query.dtype and lse.dtype == torch.float32 and whole_lse.dtype == torch.float32
    assert (out.double().cpu() - expected.cpu()).abs().max().item() <= atol_out
    groups = query.shape[1] // key.shape[1]
    every_key = key.double().repeat_interleave(groups, 1)
    logits = (query.double() @ every_key.transpose(-1, -2)) * 0.125
    expected_whole = logits.masked_fill(~lower_right(q_len, k_len, query.device), float("-inf")).logsumexp(-1)
    assert (whole_lse.double().cpu() - expected_whole.cpu()).abs().max().item() <= atol_lse
    context = key[:, :, : k_len - q_len].double().repeat_interleave(groups, 1)
    expected_lse = ((query.double() @ context.transpose(-1, -2)) * 0.125).logsumexp(-1)
    assert (lse.double().cpu() - expected_lse.cpu()).abs().max().item() <= atol_lse
    every = torch.ones(q_len, k_len - q_len, dtype=torch.bool, device=query.device)  # the context part: all visible
    context_part = key[:, :, : k_len - q_len], value[:, :, : k_len - q_len]
    expected_context = float64_attention(query, *context_part, 0.125, every).transpose(1, 2)
    assert (out_context.double().cpu() - expected_context.cpu()).abs().max().item() <= atol_out


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (7, 1)])
def test_split_at_context_against_the_float64_definition(heads, kv_heads):
    """Context part and own part merged by their log-sum-exps = the lower-right attention over all keys; the
    context part's log-sum-exp is the one over the context keys alone (float64 inputs: exact up to rounding; the
    log-sum-exp is returned in float32, half a unit of it)."""
    query, key, value = inputs(heads, kv_heads, 24, 90, torch.float64, "cpu", seed=heads)
    _check_split(query, key, value, math_attend, atol_out=1e-12, atol_lse=2.0**-24 * 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: torch's flash operator")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_at_context_with_flash_on_cuda(dtype):
    """The flash operator's parts (grouped heads as they are) merged: within the lower-right path's tolerance plus
    the merge's one rounding of the output to ``dtype``; the log-sum-exp within float32 accumulation of 64-term
    dots (|logit| <= ~10)."""
    query, key, value = inputs(8, 2, 64, 300, dtype, "cuda", seed=3)
    atol_out = tolerance(value, 300, dtype) + UNIT[dtype] * value.abs().max().item()
    _check_split(query, key, value, hf_attention._fused_attention_with_lse, atol_out=atol_out, atol_lse=1e-4)


def test_fused_attention_refuses_a_causal_mask_that_is_not_square():
    """cuDNN aligns a causal mask top-left and flash bottom-right: with fewer queries than keys the two differ (the
    H200 probe: cuDNN's output 3.2 off the lower-right one), so the caller must split at the context instead."""
    query, key, value = inputs(8, 2, 16, 48, torch.float32, "cpu", seed=5)
    with pytest.raises(ValueError, match="causal: needs as many keys as queries, got 48 keys for 16"):
        hf_attention._fused_attention_with_lse(query, key, value, True, 0.125)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: sdpa's fused operators (cuDNN or flash)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_fused_attention_hands_the_float64_lse_over_on_cuda(dtype, causal):
    """The kernel sdpa picks (cuDNN on Hopper with torch >= 2.11, else flash), called so that it returns its row
    log-sum-exp, as the induction prior's prefill and the repeat chunks run it: output within the lower-right
    path's tolerance of the float64 definition, log-sum-exp [b, h_q, q] in natural log within float32
    accumulation of 64-term dots (|logit| <= ~10), for grouped heads and a length no tile divides."""
    query, key, value = inputs(8, 2, 300, 300, dtype, "cuda", seed=4)
    out, lse = hf_attention._fused_attention_with_lse(query, key, value, causal, 0.125)
    visible = lower_right(300, 300, "cuda") if causal else torch.ones(300, 300, dtype=torch.bool, device="cuda")
    expected = float64_attention(query, key, value, 0.125, visible).transpose(1, 2)
    assert out.shape == query.shape and lse.shape == query.shape[:-1] and lse.dtype == torch.float32
    assert (out.double() - expected).abs().max().item() <= tolerance(value, 300, dtype)
    logits = (query.double() @ key.double().repeat_interleave(4, 1).transpose(-1, -2)) * 0.125
    expected_lse = logits.masked_fill(~visible, float("-inf")).logsumexp(-1)
    assert (lse.double() - expected_lse).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    "press",
    [
        CompressKVPress.thorough(compression_ratio=0.6, seed=0, repeat_chunk=128),
        CompressKVPress.balanced(compression_ratio=0.6, seed=0, repeat_chunk=32),
    ],
    ids=["thorough", "balanced"],
)
def test_handed_over_lse_keeps_the_cache(press, monkeypatch):
    """The chunk attention split at the context and its log-sum-exp and output handed to the mass and the fit
    (CUDA's path, forced on the CPU with the definition standing in for flash; a float64 model): every repeat chunk
    of every layer hands them over, and the cache is the one without (same rows, values and weights within float64
    rounding). ``balanced()``'s window rows come from its prefill (its induction prior's hand-over), so its fit then
    computes none of its rows; ``thorough()`` has no prefill hand-over, so its fit computes them all."""
    from kvcompress import methods

    model, context = tiny_model("qwen2", dtype=torch.float64), tokens(320, 5)
    plain = compressed_cache(model, press, context)
    monkeypatch.setattr(hf_attention, "_split_wanted", lambda query: True)
    monkeypatch.setattr(hf_attention, "_fused_attention_with_lse", math_attend)
    handed, known, original, fit = [], [], reference.attention_mass, methods.fit_kept_rows

    def spy(*args, **kwargs):
        if kwargs.get("query_positions") is None:  # a repeat chunk's (the window's has positions)
            handed.append(kwargs.get("row_lse") is not None)
        return original(*args, **kwargs)

    def fit_spy(*args, known_rows=None, **kwargs):
        known.append(known_rows is not None)
        return fit(*args, known_rows=known_rows, **kwargs)

    monkeypatch.setattr(reference, "attention_mass", spy)
    monkeypatch.setattr(methods, "fit_kept_rows", fit_spy)
    split = compressed_cache(model, press, context)
    pieces = reference.spread_pieces(320, press.repeat_fraction, press.repeat_span)  # as many as the novel ones
    chunks = -(-(320 if pieces is None else len(pieces)) // press.repeat_chunk)
    assert sum(handed) == len(handed) == chunks * len(model.model.layers)
    assert known == ["induction" in press.reference] * len(model.model.layers)
    for expected, layer in zip(plain.layers, split.layers, strict=True):
        assert torch.equal(layer.keys, expected.keys)
        torch.testing.assert_close(layer.values, expected.values, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(layer.row_weights, expected.row_weights, rtol=1e-9, atol=1e-12)
