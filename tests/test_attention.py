"""Weighted attention (Alg. 3) against a naive float64 loop."""

from __future__ import annotations

import math

import pytest
import torch

from kvcompress import weighted_attention


def naive_weighted_attention(q, k, v, w, scaling, v_min=None, v_max=None, causal_offset=None, key_mask=None):
    """One query head and one query at a time, in float64, straight from Alg. 3."""
    q, k, v, w = q.double(), k.double(), v.double(), w.double()
    batch, heads_q, m, _ = q.shape
    heads_kv, n = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    out = torch.zeros(batch, heads_q, m, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads_q):
            kv = h // group
            for i in range(m):
                visible = [j for j in range(n) if causal_offset is None or j <= causal_offset + i]
                visible = [j for j in visible if key_mask is None or key_mask[b, j]]
                o = torch.zeros(v.shape[-1], dtype=torch.float64)  # no visible key, or denominator <= 0
                if visible:
                    logits = torch.stack([scaling * q[b, h, i] @ k[b, kv, j] for j in visible])
                    e = torch.exp(logits - logits.max())
                    num = sum(e[t] * v[b, kv, j] for t, j in enumerate(visible))
                    den = sum(e[t] * w[b, kv, j] for t, j in enumerate(visible))
                    o = num / den if den > 0 else o
                if v_min is not None:
                    o = torch.maximum(o, v_min[b, kv].double())
                if v_max is not None:
                    o = torch.minimum(o, v_max[b, kv].double())
                out[b, h, i] = o
    return out


def random_inputs(batch, heads_q, heads_kv, m, n, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, m, d, generator=gen)
    k = torch.randn(batch, heads_kv, n, d, generator=gen)
    v = torch.randn(batch, heads_kv, n, d, generator=gen)
    w = torch.rand(batch, heads_kv, n, generator=gen) * 2 - 0.3  # some weights negative, as Nystrom gives
    return q.to(dtype), k.to(dtype), v.to(dtype), w


@pytest.mark.parametrize("heads_q, heads_kv", [(4, 4), (6, 2), (7, 1)])
def test_gqa_matches_naive_loop(heads_q, heads_kv):
    q, k, v, w = random_inputs(2, heads_q, heads_kv, 3, 11, 8, dtype=torch.float64)
    out = weighted_attention(q, k, v, w, scaling=0.3)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, naive_weighted_attention(q, k, v, w, 0.3), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("offset", [0, 4, 9, 12, 20])  # 12 = n - 1 and past it: nothing hidden (the decode form)
def test_causal_offset_matches_naive_loop(offset):
    q, k, v, w = random_inputs(1, 4, 2, 4, 13, 8, dtype=torch.float64, seed=offset)
    out = weighted_attention(q, k, v, w, causal_offset=offset)
    ref = naive_weighted_attention(q, k, v, w, 1 / math.sqrt(8), causal_offset=offset)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_causal_offset_with_unit_weights_is_causal_softmax():
    q, k, v, _ = random_inputs(2, 4, 2, 5, 12, 16, dtype=torch.float64, seed=3)
    w = torch.ones(2, 2, 12, dtype=torch.float64)
    out = weighted_attention(q, k, v, w, causal_offset=7)
    mask = torch.ones(5, 12, dtype=torch.bool).tril(7)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_clipping_and_nonpositive_denominator():
    q, k, v, w = random_inputs(2, 4, 2, 6, 10, 8, dtype=torch.float64, seed=5)
    w[0, 0] = -torch.rand(10, dtype=torch.float64) - 0.1  # head with denominator < 0 everywhere
    gen = torch.Generator().manual_seed(1)
    v_min = -0.2 - torch.rand(2, 2, 8, generator=gen, dtype=torch.float64)
    v_max = 0.2 + torch.rand(2, 2, 8, generator=gen, dtype=torch.float64)
    out = weighted_attention(q, k, v, w, v_min=v_min, v_max=v_max)
    ref = naive_weighted_attention(q, k, v, w, 1 / math.sqrt(8), v_min, v_max)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # Denominator <= 0 -> 0 before clipping, so those outputs sit at clip(0).
    torch.testing.assert_close(
        out[0, :2], torch.clamp(torch.zeros(2, 6, 8, dtype=torch.float64), v_min[0, 0], v_max[0, 0])
    )
    assert (out >= v_min.repeat_interleave(2, 1)[:, :, None]).all() and (
        out <= v_max.repeat_interleave(2, 1)[:, :, None]
    ).all()
    # Only one bound given.
    only_max = weighted_attention(q, k, v, w, v_max=v_max)
    torch.testing.assert_close(only_max, naive_weighted_attention(q, k, v, w, 1 / math.sqrt(8), v_max=v_max))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_low_precision_inputs_accumulate_in_fp32(dtype, tol):
    q, k, v, w = random_inputs(2, 8, 2, 3, 700, 64, dtype=dtype, seed=2)
    w = w.abs() + 0.05
    k = k * 8  # large logits: exp must not overflow in low precision
    out = weighted_attention(q, k, v, w, causal_offset=697)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = naive_weighted_attention(q, k, v, w, 1 / 8, causal_offset=697) if dtype == torch.float32 else None
    ref = (
        ref
        if ref is not None
        else weighted_attention(q.double(), k.double(), v.double(), w.double(), causal_offset=697)
    )
    assert (out.double() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def _good():
    return random_inputs(1, 4, 2, 3, 9, 8)


@pytest.mark.parametrize(
    "change, kwargs, name",
    [
        (lambda q, k, v, w: (q[:, :3], k, v, w), {}, "queries"),  # 3 query heads over 2 KV heads
        (lambda q, k, v, w: (q, k[..., :4], v, w), {}, "keys"),
        (lambda q, k, v, w: (q, k, v[:, :, :5], w), {}, "values"),
        (lambda q, k, v, w: (q, k, v, w[..., :5]), {}, "weights"),
        (lambda q, k, v, w: (q, k.double(), v, w), {}, "keys"),
        (lambda q, k, v, w: (q[0], k, v, w), {}, "queries"),
        (lambda q, k, v, w: (q, k, v, w.long()), {}, "weights"),
        (lambda q, k, v, w: (q, k, v, w), {"v_min": torch.zeros(1, 4, 8)}, "v_min"),
        (lambda q, k, v, w: (q, k, v, w), {"v_max": torch.zeros(1, 2)}, "v_max"),
        (lambda q, k, v, w: (q, k, v, w), {"causal_offset": -1}, "causal_offset"),
        (lambda q, k, v, w: (q, k, v, w), {"scaling": -0.1}, "scaling"),
        (lambda q, k, v, w: (q, k[:, :, :0], v[:, :, :0], w[..., :0]), {}, "keys"),  # no key row at all
        (lambda q, k, v, w: (q[..., :0], k[..., :0], v, w), {}, "queries"),  # head dim 0
        (lambda q, k, v, w: (q, k, v, w.to("meta")), {}, "weights"),  # another device than the queries'
        (lambda q, k, v, w: (q, k, v, w), {"v_max": torch.ones(1, 2, 8, device="meta")}, "v_max"),
        (lambda q, k, v, w: (q, k, v, w), {"v_min": torch.full((1, 2, 8), 0.5), "v_max": torch.rand(1, 2, 8) * 0.49},
         "v_min"),  # an empty clip range
    ],
)
def test_bad_input_names_the_parameter(change, kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        weighted_attention(*change(*_good()), **kwargs)


@pytest.mark.parametrize("backend", ["torch", "sdpa", "flex"])
@pytest.mark.parametrize("empty", ["batch", "heads", "queries"])
def test_no_query_gives_an_empty_output(backend, empty):
    q, k, v, w = random_inputs(2, 4, 2, 3, 9, 8, seed=3)
    w = w.abs() + 0.1  # flex takes positive weights only
    if empty == "batch":
        q, k, v, w = q[:0], k[:0], v[:0], w[:0]
    elif empty == "heads":
        q = q[:, :0]
    else:
        q = q[:, :, :0]
    out = weighted_attention(q, k, v, w, backend=backend)
    assert out.shape == (*q.shape[:3], v.shape[-1]) and out.dtype == v.dtype


def random_key_mask(batch, n, seed):
    """Rows padded on the left, on the right and in the middle (filler), each with at least one real key."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, n, generator=gen) > 0.3
    mask[0, :3] = False  # left padding
    mask[-1, -2:] = False  # right padding
    mask[:, n // 2] = True
    return mask


@pytest.mark.parametrize("offset", [None, 0, 6])
def test_key_mask_matches_naive_loop(offset):
    q, k, v, w = random_inputs(3, 6, 2, 4, 13, 8, dtype=torch.float64, seed=11)
    mask = random_key_mask(3, 13, seed=2)
    gen = torch.Generator().manual_seed(4)
    v_min = -0.5 - torch.rand(3, 2, 8, generator=gen, dtype=torch.float64)
    out = weighted_attention(q, k, v, w, causal_offset=offset, key_mask=mask, v_min=v_min)
    ref = naive_weighted_attention(q, k, v, w, 1 / math.sqrt(8), v_min=v_min, causal_offset=offset, key_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_masked_keys_change_nothing():
    """Whatever a masked key holds (huge logits, any weight), the output is that of the cache without it."""
    q, k, v, w = random_inputs(2, 4, 2, 3, 10, 8, dtype=torch.float64, seed=7)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[:, 4] = False
    k_bad, v_bad, w_bad = k.clone(), v.clone(), w.clone()
    k_bad[:, :, 4] = 1e3 * q[:, ::2, 0]  # would dominate every softmax
    v_bad[:, :, 4], w_bad[:, :, 4] = 1e6, -5.0
    out = weighted_attention(q, k_bad, v_bad, w_bad, key_mask=mask)
    keep = torch.tensor([j for j in range(10) if j != 4])
    ref = weighted_attention(q, k[:, :, keep], v[:, :, keep], w[:, :, keep])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["queries", "keys", "values", "weights", "v_min", "v_max"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_are_rejected_by_name(name, bad):
    q, k, v, w = random_inputs(1, 2, 1, 2, 6, 8, seed=3)
    args = dict(queries=q, keys=k, values=v, weights=w, v_min=-torch.rand(1, 1, 8), v_max=torch.rand(1, 1, 8))
    args[name] = args[name].clone()
    args[name].view(-1)[1] = bad
    with pytest.raises(ValueError, match=f"^{name}: contains NaN or Inf"):
        weighted_attention(**args)
    args["check_finite"] = False  # the documented switch skips the check
    weighted_attention(**args)


@pytest.mark.parametrize(
    "mask, message",
    [
        (torch.ones(1, 6), "key_mask: must be a bool torch.Tensor"),
        (torch.ones(1, 5, dtype=torch.bool), r"key_mask: shape \(1, 5\)"),
        ([True] * 6, "key_mask: must be a bool torch.Tensor"),
    ],
)
def test_bad_key_mask_is_rejected(mask, message):
    q, k, v, w = random_inputs(1, 2, 1, 2, 6, 8, seed=3)
    with pytest.raises(ValueError, match=message):
        weighted_attention(q, k, v, w, key_mask=mask)


@pytest.mark.parametrize("base2", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_merging_partial_attentions_is_the_attention_over_all_keys(base2, dtype, tol):
    """Softmax attention over 3 disjoint key sets merged by their log-sum-exps = the one over every key (float64
    reference); a part that saw no key (-inf, output 0) counts for nothing, and a row no part saw stays -inf / 0.
    Tolerance: float32's rounding of O(1) logits and outputs, a few units of 2^-24."""
    from kvcompress.attention import merge_partial_attentions

    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 6, 40, generator=gen, dtype=torch.float64) * 3
    values = torch.randn(5, 40, 9, generator=gen, dtype=torch.float64)
    visible = torch.rand(5, 6, 40, generator=gen) < 0.7
    visible[:, :, 10:20] = False  # part 1 (keys 10-19) sees nothing
    visible[4, 5] = False  # a row that sees no key at all
    logits = logits.masked_fill(~visible, -math.inf)
    parts = [slice(0, 10), slice(10, 20), slice(20, 40)]
    lse, out = [], []
    for part in parts:
        piece = logits[..., part]
        part_lse = piece.logsumexp(-1)
        prob = (piece - part_lse[..., None].masked_fill(part_lse[..., None] == -math.inf, 0.0)).exp()
        out.append(prob @ values[:, part])
        lse.append(part_lse / math.log(2) if base2 else part_lse)
    merged_lse, merged_out = merge_partial_attentions(
        torch.stack(lse).to(dtype), torch.stack(out).to(dtype), base2=base2
    )
    whole_lse = logits.logsumexp(-1)
    prob = (logits - whole_lse[..., None].masked_fill(whole_lse[..., None] == -math.inf, 0.0)).exp()
    expected = prob @ values
    expected_lse = whole_lse / math.log(2) if base2 else whole_lse
    assert merged_out.dtype == dtype and merged_lse.dtype == dtype
    assert merged_lse[4, 5].item() == -math.inf and merged_out[4, 5].abs().max().item() == 0.0
    seen = whole_lse > -math.inf
    assert (merged_lse - expected_lse)[seen].abs().max().item() <= tol * 10
    assert (merged_out - expected).abs().max().item() <= tol * 10
    # A part that saw no key may hand over NaN (a softmax over -inf logits is 0 / 0): it still counts for nothing.
    out[1] = torch.full_like(out[1], math.nan)
    again = merge_partial_attentions(torch.stack(lse).to(dtype), torch.stack(out).to(dtype), base2=base2)[1]
    assert torch.equal(again, merged_out)


# The sdpa backend (the weight as one more value column of sdpa's fused kernel): what "auto" runs on CPU from
# SDPA_MIN_QUERIES queries on (a question or a chat turn after a compressed context).


@pytest.mark.parametrize("heads_q, heads_kv", [(4, 4), (6, 2), (7, 1)])
@pytest.mark.parametrize("offset", [None, 0, 9, 23, 40])  # 23 = n - m: the new rows' own causal rule; 40 past n
def test_sdpa_backend_matches_naive_loop(heads_q, heads_kv, offset):
    """Negative weights, a head whose denominator is < 0 everywhere, padding and filler keys, a query that sees no
    key (row 0 is masked up to key 4: offset 0 hides the rest from its first query), both clip bounds."""
    m, n = 17, 40
    q, k, v, w = random_inputs(3, heads_q, heads_kv, m, n, 8, dtype=torch.float64, seed=heads_q + (offset or 1))
    w[1, 0] = -torch.rand(n, dtype=torch.float64) - 0.1
    mask = random_key_mask(3, n, seed=5)
    mask[0, :5] = False
    gen = torch.Generator().manual_seed(6)
    v_min = -0.4 - torch.rand(3, heads_kv, 8, generator=gen, dtype=torch.float64)
    v_max = 0.4 + torch.rand(3, heads_kv, 8, generator=gen, dtype=torch.float64)
    kwargs = dict(causal_offset=offset, key_mask=mask, v_min=v_min, v_max=v_max)
    out = weighted_attention(q, k, v, w, backend="sdpa", **kwargs)
    ref = naive_weighted_attention(q, k, v, w, 1 / math.sqrt(8), **kwargs)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    unmasked = weighted_attention(q, k, v, w, backend="sdpa", causal_offset=offset)
    torch.testing.assert_close(unmasked, naive_weighted_attention(q, k, v, w, 1 / math.sqrt(8), causal_offset=offset),
                               rtol=1e-12, atol=1e-12)  # fmt: skip


def test_sdpa_backend_takes_value_and_key_widths_that_differ():
    """The zero columns make every head dim the same whatever the widths: keys wider or narrower than values."""
    for dim, d_v in ((16, 5), (4, 12)):
        q, k, _, w = random_inputs(2, 4, 2, 18, 25, dim, dtype=torch.float64, seed=dim)
        v = torch.randn(2, 2, 25, d_v, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        out = weighted_attention(q, k, v, w, scaling=0.4, causal_offset=7, backend="sdpa")
        ref = naive_weighted_attention(q, k, v, w, 0.4, causal_offset=7)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_sdpa_backend_low_precision_inputs_accumulate_in_fp32(dtype, tol):
    """As the reference: float32 math for 16-bit inputs, so the error is one rounding of the output to the dtype
    (2^-9 relative for bfloat16, 2^-12 for float16) plus float32's over 700 keys; tolerances as the reference's."""
    q, k, v, w = random_inputs(2, 8, 2, 20, 700, 64, dtype=dtype, seed=2)
    w = w.abs() + 0.05
    k = k * 8  # large logits: exp must not overflow in low precision
    out = weighted_attention(q, k, v, w, causal_offset=680, backend="sdpa")
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = weighted_attention(q.double(), k.double(), v.double(), w.double(), causal_offset=680, backend="torch")
    assert (out.double() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_cpu_auto_runs_sdpa_from_the_threshold_and_per_row_offsets_agree(monkeypatch):
    """``weighted_attention_unchecked`` (what the attention function calls) picks the sdpa path on CPU from
    SDPA_MIN_QUERIES queries on and the reference below; a ``[b]`` tensor of causal offsets (a decode batch's) gives
    each row what its own int offset gives."""
    from kvcompress import attention

    calls = []
    sdpa = attention._weighted_attention_sdpa
    monkeypatch.setattr(attention, "_weighted_attention_sdpa", lambda *a: calls.append(a[0].shape[2]) or sdpa(*a))
    for m in (attention.SDPA_MIN_QUERIES - 1, attention.SDPA_MIN_QUERIES):
        q, k, v, w = random_inputs(2, 6, 2, m, 30, 8, dtype=torch.float64, seed=m)
        offsets = torch.tensor([30 - m, 4])
        out = attention.weighted_attention_unchecked(q, k, v, w, scaling=0.3, causal_offset=offsets)
        for row, offset in enumerate(offsets.tolist()):
            ref = naive_weighted_attention(q[row : row + 1], k[row : row + 1], v[row : row + 1], w[row : row + 1], 0.3,
                                           causal_offset=offset)  # fmt: skip
            torch.testing.assert_close(out[row : row + 1], ref, rtol=1e-12, atol=1e-12)
    assert calls == [attention.SDPA_MIN_QUERIES]


def naive_row_shares(q, k, w, scaling, causal_offset=None, key_mask=None):
    """``w_j e^{s_j} / sum_i w_i e^{s_i}`` over the visible keys, one query at a time in float64 (0 where hidden, or
    where the denominator is <= 0)."""
    q, k, w = q.double(), k.double(), w.double()
    batch, heads_q, m, _ = q.shape
    heads_kv, n = k.shape[1], k.shape[2]
    out = torch.zeros(batch, heads_q, m, n, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads_q):
            kv = h // (heads_q // heads_kv)
            for i in range(m):
                visible = [j for j in range(n) if (causal_offset is None or j <= causal_offset + i)
                           and (key_mask is None or key_mask[b, j])]  # fmt: skip
                terms = {j: w[b, kv, j] * torch.exp(scaling * q[b, h, i] @ k[b, kv, j]) for j in visible}
                den = sum(terms.values())
                if visible and den > 0:
                    for j, term in terms.items():
                        out[b, h, i, j] = term / den
    return out


@pytest.mark.parametrize("dtype, rounding, math_tol", [(torch.float64, 1e-15, 1e-12), (torch.float32, 2**-24, 1e-5),
                                                        (torch.bfloat16, 2**-8, 1e-5)])  # fmt: skip
@pytest.mark.parametrize("offset, masked", [(None, False), (6, True), (13, True)])
def test_row_shares_are_the_weighted_distribution_the_output_averages(dtype, rounding, math_tol, offset, masked):
    """``weighted_attention_probabilities`` (what output_attentions reports over a compressed cache) against the
    float64 definition on the same (rounded) inputs, with some weights negative (a query whose denominator is <= 0
    gets 0 shares), a causal offset and a key mask; its average of ``v_j / w_j`` is weighted attention's output.
    Tolerance: the result's rounding of each share, plus the float32 math's error amplified by the cancellation in
    the denominator (``sum_j |a_j|``, 1 when no weight is negative)."""
    from kvcompress.attention import weighted_attention_probabilities

    q, k, v, w = random_inputs(2, 6, 2, 4, 14, 16, dtype=dtype, seed=11)
    w[1, 0] = -torch.rand(14) - 0.1  # a head whose every denominator is negative
    key_mask = torch.rand(2, 14, generator=torch.Generator().manual_seed(2)) > 0.3 if masked else None
    shares = weighted_attention_probabilities(q, k, w, scaling=0.4, causal_offset=offset, key_mask=key_mask)
    assert shares.dtype == dtype and shares.shape == (2, 6, 4, 14)
    ref = naive_row_shares(q, k, w, 0.4, offset, key_mask)
    bound = rounding * ref.abs() + math_tol * ref.abs().sum(-1, keepdim=True)
    assert bool(((shares.double() - ref).abs() <= bound).all())
    assert bool((shares[1, :3] == 0).all())  # the negative head's group of three query heads
    out = weighted_attention(q.double(), k.double(), v.double(), w.double(), scaling=0.4, causal_offset=offset,
                             key_mask=key_mask)  # fmt: skip
    average = ref @ (v.double() / w.double()[..., None]).repeat_interleave(3, 1)
    torch.testing.assert_close(average, out, rtol=1e-12, atol=1e-12)
