"""Fused attention-mass kernel (kvcompress.kernels.attention_mass) and the chunked PyTorch path of
kvcompress.selection.attention_mass, both against a float64 reference.

The kernel runs compiled on CUDA tensors where CUDA is present and in the Triton interpreter on CPU tensors
elsewhere (tests/triton_mode.py). Tolerances: the kernel's logits come from dots on the input dtype with fp32
accumulation, so a probability ``p`` carries the input rounding of ``s`` (relative 2^-8 for bf16, 2^-11 for
fp16, ~1e-6 for fp32 times |s| <= ~10 here): a relative error of about ``|s| * eps`` on every p. The
reference is computed from the same rounded inputs, so only the accumulation order differs; bounds below
(``TOL``) are ~4x that.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (the kernel tests need it)")

import torch  # noqa: E402
from triton_mode import DEVICE, INTERPRET  # noqa: E402

from kvcompress import selection  # noqa: E402
from kvcompress.kernels import attention_mass as kernel  # noqa: E402
from kvcompress.selection import attention_mass, attention_mass_torch  # noqa: E402
from tests.references import float64_attention_mass

if kernel.INTERPRET != INTERPRET:
    pytest.skip("kernel module was defined in the other Triton mode (imported too early)", allow_module_level=True)

# fp32 dots run as IEEE fp32 ("ieee" precision) on the GPU too.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def make_inputs(batch, heads_q, heads_kv, m, n, d, dtype, seed, strided=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, m, d, generator=gen) * 1.5
    k = torch.randn(batch, heads_kv, n, d, generator=gen) * 1.5
    if strided:  # [b, m, h, d] storage viewed as [b, h, m, d]: the layout of projections before transpose
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
        assert not q.is_contiguous() and not k.is_contiguous()
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype)


def check(got, queries, keys, scaling, dtype, reduce, **kwargs):
    expected = float64_attention_mass(queries, keys, scaling, reduce=reduce, **kwargs)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # Relative to the largest score per head: max-probabilities and column sums alike.
    scale = expected.amax(-1, keepdim=True).clamp_min(1e-12)
    torch.testing.assert_close(got.cpu().double() / scale, expected / scale, rtol=0, atol=TOL[dtype])


CASES = [  # dtype, heads_q, heads_kv, m, n, d, causal
    (torch.float32, 2, 2, 37, 91, 32, False),  # group 1, odd lengths
    (torch.float32, 8, 2, 19, 150, 64, True),  # group 4
    (torch.float16, 7, 1, 23, 77, 16, True),  # group 7 (not a power of two)
    (torch.bfloat16, 8, 2, 40, 131, 64, False),
    (torch.bfloat16, 7, 1, 33, 65, 32, True),
    (torch.float16, 4, 4, 150, 70, 48, True),  # m > n, d not a power of two, several row blocks
]


@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("dtype, heads_q, heads_kv, m, n, d, causal", CASES)
def test_kernel_matches_float64(dtype, heads_q, heads_kv, m, n, d, causal, reduce):
    q, k = make_inputs(2, heads_q, heads_kv, m, n, d, dtype, seed=m + n + d, strided=heads_q == 8)
    gen = torch.Generator().manual_seed(n)
    # Causal: sorted context positions, some before the first key tile ends (rows that see few keys).
    positions = torch.randint(0, n, (m,), generator=gen).sort().values.to(DEVICE) if causal else None
    got = kernel.attention_mass_kernel(q, k, 0.3, positions, reduce=reduce, block_r=32, block_n=32)
    check(got, q, k, 0.3, dtype, reduce, query_positions=positions)
    if reduce == "sum" and positions is None:  # every query gives 1 in total
        torch.testing.assert_close(
            got.sum(-1).cpu(), torch.full((2, heads_kv), m * heads_q / heads_kv), rtol=1e-4, atol=0
        )


@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_key_mask_unsorted_positions_and_empty_rows(dtype, reduce):
    """Left padding, a hole, a row whose only visible keys are masked (contributes 0), default tiles."""
    q, k = make_inputs(3, 6, 2, 21, 140, 32, dtype, seed=5)
    mask = torch.ones(3, 140, dtype=torch.bool)
    mask[0, :70] = False
    mask[1, 40:60] = False
    mask[2, :3] = False
    positions = torch.randint(0, 140, (21,), generator=torch.Generator().manual_seed(2))
    positions[0] = 1  # batch row 2 masks keys 0..2: this query sees nothing there
    positions, mask = positions.to(DEVICE), mask.to(DEVICE)
    got = kernel.attention_mass_kernel(q, k, 0.25, positions, reduce=reduce, key_mask=mask)
    check(got, q, k, 0.25, dtype, reduce, query_positions=positions, key_mask=mask)
    assert torch.all(got[~mask[:, None, :].expand_as(got)] == 0)


@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_torch_path_chunked_equals_dense_and_float64(reduce, monkeypatch):
    q, k = make_inputs(2, 6, 2, 29, 83, 16, torch.float32, seed=11)
    q, k = q.cpu(), k.cpu()
    positions = torch.randint(0, 83, (29,), generator=torch.Generator().manual_seed(3))
    mask = torch.rand(2, 83, generator=torch.Generator().manual_seed(4)) > 0.2
    dense = attention_mass_torch(q, k, 0.4, positions, reduce=reduce, key_mask=mask)
    check(dense, q, k, 0.4, torch.float32, reduce, query_positions=positions, key_mask=mask)
    for elements in (1, 700, 5000):  # one query at a time, a few, most
        monkeypatch.setattr(selection, "_CHUNK_ELEMENTS", elements)
        chunked = attention_mass_torch(q, k, 0.4, positions, reduce=reduce, key_mask=mask)
        torch.testing.assert_close(chunked, dense, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_lse_of_a_wider_softmax(dtype, reduce, path):
    """A repeat chunk's mass from its own attention's normaliser: c queries after n context keys, each seeing the
    context and the chunk's keys up to itself (lower-right causal); given that softmax's row log-sum-exp, both paths
    reduce its probabilities on the context keys alone (the kernel without its first pass)."""
    n, c, heads_q, heads_kv = 97, 23, 6, 2
    q, every = make_inputs(2, heads_q, heads_kv, c, n + c, 32, dtype, seed=17, strided=True)
    positions = torch.arange(n, n + c)
    expected = float64_attention_mass(q, every, 0.35, positions, reduce=reduce)[..., :n]
    logits = 0.35 * q.cpu().double() @ every.cpu().double().repeat_interleave(heads_q // heads_kv, 1).mT
    lse = torch.logsumexp(logits.masked_fill(torch.arange(n + c) > positions[:, None], -torch.inf), -1)
    context = every[:, :, :n]
    if path == "kernel":
        got = kernel.attention_mass_kernel(q, context, 0.35, reduce=reduce, row_lse=lse.float().to(DEVICE))
    else:
        got = attention_mass_torch(q.cpu(), context.cpu(), 0.35, reduce=reduce, row_lse=lse.float())
    scale = expected.amax(-1, keepdim=True).clamp_min(1e-12)
    tol = TOL[dtype] if path == "kernel" else TOL[torch.float32]
    torch.testing.assert_close(got.cpu().double() / scale, expected / scale, rtol=0, atol=tol)
    if reduce == "sum":  # the chunk's own keys took the rest of each query's 1
        assert torch.all(got.sum(-1).cpu() < c * heads_q / heads_kv * (1 - 1e-3))


@pytest.mark.parametrize(
    "dtype, heads_q, heads_kv", [(torch.float32, 2, 2), (torch.bfloat16, 8, 2), (torch.float16, 7, 1)]
)
def test_row_lse_kernel_is_the_causal_normaliser(dtype, heads_q, heads_kv):
    """Pass 1 alone (the induction prior's normaliser where no attention handed it over): against float64, and the
    CPU path of selection.causal_row_lse. A normaliser off by delta scales every probability by exp(delta), so the
    probabilities' tolerance bounds it."""
    n = 77
    q, k = make_inputs(2, heads_q, heads_kv, n, n, 32, dtype, seed=n + heads_q, strided=heads_q == 8)
    positions = torch.arange(n)
    got = kernel.row_lse_kernel(q, k, 0.3, positions.to(DEVICE), block_r=32, block_n=32)
    logits = 0.3 * q.cpu().double() @ k.cpu().double().repeat_interleave(heads_q // heads_kv, 1).mT
    expected = torch.logsumexp(logits.masked_fill(torch.arange(n) > positions[:, None], -torch.inf), -1)
    assert got.dtype == torch.float32 and got.shape == expected.shape == (2, heads_q, n)
    torch.testing.assert_close(got.cpu().double(), expected, rtol=0, atol=TOL[dtype])
    reference = selection.causal_row_lse(q.cpu().float(), k.cpu().float(), 0.3)
    torch.testing.assert_close(got.cpu(), reference, rtol=0, atol=TOL[dtype])


def test_public_entry_dispatches_and_checks_arguments():
    q, k = make_inputs(1, 4, 2, 9, 40, 16, torch.float32, seed=1)
    got = attention_mass(q, k, 0.5, reduce="max")
    check(got, q, k, 0.5, torch.float32, "max")
    with pytest.raises(ValueError, match="reduce: must be one of"):
        attention_mass(q, k, 0.5, reduce="mean")
    with pytest.raises(ValueError, match="query_positions: must have shape"):
        attention_mass(q, k, 0.5, torch.arange(3))
    with pytest.raises(ValueError, match="key_mask: must be a bool tensor"):
        attention_mass(q, k, 0.5, key_mask=torch.ones(1, 39, dtype=torch.bool))
    with pytest.raises(ValueError, match="keys: shape"):
        attention_mass(q, k[:, :, :, :8], 0.5)
    with pytest.raises(ValueError, match=r"row_lse: must be a floating tensor of shape \[1, 4, 9\]"):
        attention_mass(q, k, 0.5, row_lse=torch.zeros(1, 2, 9))
