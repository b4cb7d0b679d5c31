"""Triton multi-token weighted attention kernel (kvcompress.kernels.weighted_prefill) against the references.

Runs compiled on CUDA tensors where CUDA is present and in the Triton interpreter on CPU tensors elsewhere
(tests/triton_mode.py).
Tolerances as for the decode kernel (``TOL``: fp32 1e-5, fp16 2e-3, bf16 1.6e-2, absolute and relative); the
PyTorch reference is itself checked against the float64 reference with the same tolerance.
"""

from __future__ import annotations

import pytest
import torch
from triton_mode import INTERPRET

pytest.importorskip("triton", reason="triton is not installed (the kernel tests need it, CPU interpreter mode)")

from test_kernel_weighted_decode import DEVICE, check_close, make_inputs  # noqa: E402

from kvcompress import weighted_attention  # noqa: E402
from kvcompress.kernels import weighted_decode, weighted_prefill  # noqa: E402

if weighted_decode.INTERPRET != INTERPRET:
    pytest.skip("kernel module was defined in the other Triton mode (imported too early)", allow_module_level=True)


def float64_reference(q, k, v, w, **kwargs):
    cast = {key: val.double() if key in ("v_min", "v_max") else val for key, val in kwargs.items()}
    return weighted_attention(q.double(), k.double(), v.double(), w.double(), backend="torch", **cast)


@pytest.mark.parametrize(
    "dtype, d, heads_q, heads_kv, m, n, offset, clip",
    [
        (torch.float32, 32, 2, 2, 17, 90, "tail", True),  # group 1, question prefill over a cache
        (torch.float16, 64, 8, 2, 64, 150, "tail", False),  # group 4
        (torch.bfloat16, 32, 7, 1, 17, 70, "tail", True),  # group 7 (not a power of two)
        (torch.float32, 16, 2, 1, 130, 200, "tail", True),  # m = 130: several row blocks
        (torch.float32, 32, 4, 2, 17, 90, "early", True),  # keys past c + m - 1 never read
        (torch.float16, 32, 4, 1, 20, 60, None, False),  # no causal rule: every key visible
    ],
)
def test_prefill_kernel_matches_torch_and_float64(dtype, d, heads_q, heads_kv, m, n, offset, clip):
    q, k, v, w, bounds = make_inputs(2, heads_q, heads_kv, m, n, d, dtype, clip=clip, seed=n + m)
    causal = {"tail": n - m, "early": 30, None: None}[offset]
    kwargs = {"causal_offset": causal, **bounds}
    out = weighted_attention(q, k, v, w, backend="triton", **kwargs)
    ref = weighted_attention(q, k, v, w, backend="torch", **kwargs)
    assert out.dtype == dtype and out.shape == (2, heads_q, m, d)
    check_close(out, ref, dtype)
    check_close(ref, float64_reference(q, k, v, w, **kwargs), dtype)
    group = heads_q // heads_kv
    negative_head = out[0, :group].float()  # KV head 0 of batch row 0: every weight < 0 -> 0, then clipped
    expected = torch.zeros_like(negative_head)
    if clip:
        expected = expected.clamp(bounds["v_min"][0, 0], bounds["v_max"][0, 0]).to(dtype).float()
    assert torch.equal(negative_head, expected)


@pytest.mark.parametrize("block_r, block_n, splits", [(16, 16, 1), (32, 16, 3), (128, 64, 2)])
def test_tiles_splits_and_row_blocks_across_heads_agree(block_r, block_n, splits):
    """Row blocks that straddle query heads, whole and partial causal tiles, splits past a block's causal limit."""
    q, k, v, w, bounds = make_inputs(1, 4, 2, 19, 120, 16, torch.float32, clip=True, seed=block_r + splits)
    for offset in (101, 40, 0):
        kwargs = {"causal_offset": offset, **bounds}
        ref = weighted_attention(q, k, v, w, backend="torch", **kwargs)
        out = weighted_prefill.weighted_prefill_attention(
            q, k, v, w, scaling=0.25, block_r=block_r, block_n=block_n, num_splits=splits, **kwargs
        )
        check_close(out, ref, torch.float32)


@pytest.mark.parametrize("dtype, splits", [(torch.float32, 1), (torch.bfloat16, 3)])
def test_key_mask_left_right_padding_and_filler(dtype, splits):
    batch, n, m = 3, 160, 24
    q, k, v, w, bounds = make_inputs(batch, 4, 2, m, n, 32, dtype, clip=True, seed=9)
    mask = torch.ones(batch, n, dtype=torch.bool, device=q.device)
    mask[0, :70] = False  # left padding longer than a tile and a split
    mask[1, 40:60] = False  # filler rows inside the compressed context
    mask[2, n - m - 25 : n - m] = False  # right padding before the new tokens
    w[1, :, 40:60] = 0.0  # filler rows carry w = 0
    kwargs = {"causal_offset": n - m, "key_mask": mask, **bounds}
    ref = weighted_attention(q, k, v, w, backend="torch", **kwargs)
    check_close(ref, float64_reference(q, k, v, w, **kwargs), dtype)
    out = weighted_prefill.weighted_prefill_attention(
        q, k, v, w, scaling=32**-0.5, block_r=64, block_n=32, num_splits=splits, **kwargs
    )
    check_close(out, ref, dtype)
    # A batch row that sees no key at all gets clip(0) on every query head.
    mask[0] = False
    out = weighted_attention(q, k, v, w, backend="triton", **kwargs)
    low, high = (bounds[name][0].repeat_interleave(2, 0)[:, None, :] for name in ("v_min", "v_max"))
    assert torch.equal(out[0], torch.zeros(4, m, 32, device=q.device).clamp(low, high).to(dtype))


def test_non_contiguous_strides_and_odd_dims():
    """Queries [b, m, h, d] and a cache [b, n, h, d] viewed head-major; d = 48, d_v = 32; strided w and clip range."""
    batch, heads_q, heads_kv, m, n = 2, 4, 2, 33, 100
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(batch, m, heads_q, 48, generator=gen).to(DEVICE).transpose(1, 2)
    k = torch.randn(batch, n, heads_kv, 48, generator=gen).to(DEVICE).transpose(1, 2)
    v = torch.randn(batch, n, heads_kv, 32, generator=gen).to(DEVICE).transpose(1, 2)
    w = (torch.rand(batch, n, heads_kv, generator=gen) * 2 - 0.3).to(DEVICE).transpose(1, 2)
    v_max = (0.1 + torch.rand(batch, 32, heads_kv, generator=gen)).to(DEVICE).transpose(1, 2)
    assert not any(x.is_contiguous() for x in (q, k, v, w, v_max))
    kwargs = {"causal_offset": n - m, "v_max": v_max}
    out = weighted_attention(q, k, v, w, backend="triton", **kwargs)
    assert out.is_contiguous()
    check_close(out, weighted_attention(q, k, v, w, backend="torch", **kwargs), torch.float32)


def test_dispatch_by_number_of_new_tokens(monkeypatch):
    """16 new tokens take the decode kernel, 17 the multi-token kernel; "auto" on CPU takes neither."""
    calls = []
    for module, name in (
        (weighted_decode, "weighted_decode_attention"),
        (weighted_prefill, "weighted_prefill_attention"),
    ):
        original = getattr(module, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    for m in (16, 17):
        q, k, v, w, _ = make_inputs(1, 2, 1, m, 40, 16, torch.float32, seed=m)
        weighted_attention(q, k, v, w, causal_offset=40 - m, backend="triton")
        q, k, v, w = (x.cpu() for x in (q, k, v, w))
        weighted_attention(q, k, v, w, causal_offset=40 - m)  # auto, CPU tensors: the reference
    assert calls == ["weighted_decode_attention", "weighted_prefill_attention"]


@pytest.mark.parametrize("change, match", [({"d": 40}, "head dim"), ({"dtype": torch.float64}, "dtype")])
def test_prefill_unsupported_inputs_raise(change, match):
    shape = {"d": 16, "dtype": torch.float32, **change}
    q, k, v, w, _ = make_inputs(1, 2, 1, 20, 30, shape["d"], shape["dtype"])
    with pytest.raises(ValueError, match=rf"backend='triton'.*{match}"):
        weighted_attention(q, k, v, w, backend="triton")
    assert torch.equal(weighted_attention(q, k, v, w), weighted_attention(q, k, v, w, backend="torch"))
