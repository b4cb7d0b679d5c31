"""weighted_attention(backend="flex"): FlexAttention with a log-w score bias, against the float64 reference.

On CPU FlexAttention runs eagerly (torch's unfused implementation); the compiled CUDA path runs the same
score_mod and block mask. Tolerances (absolute and relative), as the Triton kernels' (test_kernel_weighted_decode):
bf16 outputs rounded after float32 sums, 4 units of its roundoff 2^-8; fp32 the sums' rounding, ~sqrt(n) x 2^-24.
"""

from __future__ import annotations

import pytest
import torch

from kvcompress import weighted_attention

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def positive_inputs(batch, heads_q, heads_kv, m, n, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(batch, h, rows, d, generator=gen) for h, rows in ((heads_q, m), (heads_kv, n), (heads_kv, n))
    )
    w = 0.05 + 3 * torch.rand(batch, heads_kv, n, generator=gen)  # fitted masses: positive, around 1
    v_min = -0.05 - 0.1 * torch.rand(batch, heads_kv, d, generator=gen)
    v_max = 0.05 + 0.1 * torch.rand(batch, heads_kv, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), w, {"v_min": v_min, "v_max": v_max}


@pytest.mark.parametrize(
    "dtype, heads_q, heads_kv, m, n, offset",
    [
        (torch.float32, 4, 4, 17, 80, "tail"),  # group 1
        (torch.float32, 8, 2, 64, 150, "tail"),  # group 4
        (torch.bfloat16, 7, 1, 20, 60, "tail"),  # group 7
        (torch.float32, 4, 2, 130, 160, 10),  # early causal offset: most keys unseen
        (torch.float32, 4, 2, 5, 40, None),  # decode-sized, no causal rule
    ],
)
def test_flex_matches_float64_reference(dtype, heads_q, heads_kv, m, n, offset):
    q, k, v, w, bounds = positive_inputs(2, heads_q, heads_kv, m, n, 32, dtype, seed=m + n)
    kwargs = {"causal_offset": n - m if offset == "tail" else offset, **bounds}
    out = weighted_attention(q, k, v, w, backend="flex", **kwargs)
    exact = weighted_attention(q.double(), k.double(), v.double(), w.double(), backend="torch", **kwargs)
    assert out.dtype == dtype and out.shape == (2, heads_q, m, 32)
    torch.testing.assert_close(out.double(), exact, rtol=TOL[dtype], atol=TOL[dtype])
    unclipped = weighted_attention(q, k, v, w, backend="flex", causal_offset=kwargs["causal_offset"])
    assert (unclipped.float() > bounds["v_max"].repeat_interleave(heads_q // heads_kv, 1)[:, :, None]).any()


def test_flex_key_mask_padding_and_filler_rows():
    """Hidden keys may hold any weight (0 filler, negative, huge): they change nothing; a row seeing no key gets 0."""
    q, k, v, w, bounds = positive_inputs(3, 4, 2, 24, 100, 16, torch.float32, seed=3)
    mask = torch.ones(3, 100, dtype=torch.bool)
    mask[0, :30] = False  # left padding
    mask[1, 40:50] = False  # filler rows inside the compressed context
    mask[2] = False  # sees nothing
    w[0, :, :30] = -2.0
    w[1, :, 40:50] = 0.0
    kwargs = {"causal_offset": 76, "key_mask": mask}
    out = weighted_attention(q, k, v, w, backend="flex", **kwargs)
    exact = weighted_attention(q.double(), k.double(), v.double(), w.double(), backend="torch", **kwargs)
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.parametrize("bad", [0.0, -0.5])
def test_flex_refuses_visible_nonpositive_weights(bad):
    q, k, v, w, _ = positive_inputs(1, 2, 1, 17, 30, 16, torch.float32, seed=1)
    w[0, 0, 7] = bad
    with pytest.raises(ValueError, match=r"backend='flex': every visible weight must be > 0"):
        weighted_attention(q, k, v, w, backend="flex")
    mask = torch.ones(1, 30, dtype=torch.bool)
    mask[0, 7] = False  # the same weight hidden by key_mask is fine
    weighted_attention(q, k, v, w, backend="flex", key_mask=mask)


def test_flex_refuses_a_weight_whose_values_would_overflow_their_dtype():
    """FlexAttention attends over V / w in the values' dtype: a float16 row of values ~1 under w = 1e-5 overflows
    (it returned Inf). Refused, naming the overflow; the same weight on float32 values, or hidden, runs."""
    q, k, v, w, _ = positive_inputs(1, 2, 1, 5, 30, 16, torch.float16, seed=2)
    w[0, 0, 3] = 1e-5
    with pytest.raises(ValueError, match=r"backend='flex': values / weights overflow torch.float16"):
        weighted_attention(q, k, v, w, backend="flex")
    mask = torch.ones(1, 30, dtype=torch.bool)
    mask[0, 3] = False
    assert torch.isfinite(weighted_attention(q, k, v, w, backend="flex", key_mask=mask)).all()
    out = weighted_attention(q.float(), k.float(), v.float(), w, backend="flex")
    exact = weighted_attention(q.double(), k.double(), v.double(), w.double(), backend="torch")
    torch.testing.assert_close(out.double(), exact, rtol=TOL[torch.float32], atol=TOL[torch.float32])
