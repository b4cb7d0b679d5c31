"""Weighted attention (Alg. 3 of WildCat) for many new tokens at once, FlashAttention-2 style, in Triton.

Question prefill, speculative or batched decode over a compressed cache: ``m`` new query rows per head,
more than the decode kernel's ``MAX_NEW_TOKENS``. For each (batch, KV head) the rows are the ``group * m``
(query head, new token) pairs of its GQA group, ``group = h_q // h_kv``; row ``r`` is query head
``r // m`` of the group and token ``i = r % m``::

    s_l = scaling * <q_r, k_l>                     (key l visible iff l <= causal_offset + i and key_mask)
    out = clip( sum_l e^{s_l} v_l / sum_l e^{s_l} w_l , v_min, v_max ),   out = 0 where the denominator <= 0

Grid: (batch * KV head, key split, block of ``BLOCK_R`` rows). A program loops over key tiles with an
online softmax in fp32 (log2 units), keeping the numerator ``acc = sum 2^(s - m) v`` and the denominator
``den = sum 2^(s - m) w`` (not ``sum 2^(s - m)``: weights can be zero or negative). The tiles every row
of the block sees in full run without the causal / bounds mask; the tiles past the causal limit of every
row of the block are never read. Long caches with few (batch, KV head, row block) programs are split
over the keys as in the decode kernel, whose second stage merges the splits (same partial layout).

Bytes and work: each row block reads the K/V/w tiles up to its causal limit once, so K/V are read
``row_blocks`` times per (batch, KV head), mostly from L2; ``4 * rows * n * d`` FLOPs per (batch, KV
head) (QK^T and PV). Set ``TRITON_INTERPRET=1`` before importing this module to run it on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompress.kernels.weighted_decode import NEG_BIG, _finish, launch_split_k
from kvcompress.kernels.weighted_decode import unsupported_reason as _decode_unsupported_reason


@triton.jit
def _attend_tiles(
    acc, den, m_i, q, k_base, v_base, w_base, mask_base, lo, hi, last_key, qk_scale,
    s_kn, s_kd, s_vn, s_vd, s_wn, s_mn, offs_d, offs_dv, d_mask, dv_mask,
    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, BOUNDED: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Online-softmax update of ``(acc, den, m_i)`` over key tiles ``[lo, hi)``. ``BOUNDED``: mask keys past
    ``hi`` and past each row's causal ``last_key``; otherwise every key of every tile is visible (but for
    ``key_mask``)."""
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if BOUNDED:
            n_mask = offs_n < hi
        else:  # whole tiles inside [lo, hi): constant true, so the loads carry no key mask
            n_mask = tl.full([BLOCK_N], 1, tl.int1)
        kt = tl.load(k_base + offs_n[None, :] * s_kn + offs_d[:, None] * s_kd,
                     mask=d_mask[:, None] & n_mask[None, :], other=0.0)  # fmt: skip
        v = tl.load(v_base + offs_n[:, None] * s_vn + offs_dv[None, :] * s_vd,
                    mask=n_mask[:, None] & dv_mask[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_base + offs_n * s_wn, mask=n_mask, other=0.0).to(tl.float32)
        if DOT_FP32:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision="ieee") * qk_scale
        if BOUNDED:
            s = tl.where(n_mask[None, :] & (offs_n[None, :] <= last_key[:, None]), s, float("-inf"))
        if HAS_MASK:  # padding / filler keys of this batch row: invisible to every query
            real = tl.load(mask_base + offs_n * s_mn, mask=n_mask, other=0)
            s = tl.where((real != 0)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # invisible keys: exp2(-inf) = 0
        den = den * alpha + tl.sum(p * w[None, :], 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, den, m_i


@triton.jit
def _weighted_prefill_kernel(
    q_ptr, k_ptr, v_ptr, w_ptr, vmin_ptr, vmax_ptr, mask_ptr, out_ptr, mpart_ptr, dpart_ptr, npart_ptr,
    H_KV, GROUP, N, ROWS, M, split_len, causal_offset, qk_scale,
    s_qb, s_qh, s_qm, s_qd,
    s_kb, s_kh, s_kn, s_kd,
    s_vb, s_vh, s_vn, s_vd,
    s_wb, s_wh, s_wn,
    s_lb, s_lh, s_ld,
    s_ub, s_uh, s_ud,
    s_mb, s_mn,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_VMIN: tl.constexpr, HAS_VMAX: tl.constexpr, HAS_MASK: tl.constexpr, FINAL: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    """One program per (batch * KV head, key split, row block); keys ``[split * split_len, ...)`` of the split."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    rblock = tl.program_id(2)
    b = (bh // H_KV).to(tl.int64)
    h = (bh % H_KV).to(tl.int64)

    offs_r = rblock * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    r_mask = offs_r < ROWS
    d_mask = offs_d < D
    dv_mask = offs_dv < DV
    token = offs_r % M
    head = h * GROUP + offs_r // M  # query head of each row (any query strides)

    q_ptrs = q_ptr + b * s_qb + head[:, None] * s_qh + token[:, None] * s_qm + offs_d[None, :] * s_qd
    q = tl.load(q_ptrs, mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    last_key = causal_offset + token  # row sees keys l <= last_key

    # Keys [lo, full) are visible to every row of the block; keys past `hi` to none.
    lo = split * split_len
    split_hi = tl.minimum(lo + split_len, N)
    hi = tl.minimum(split_hi, causal_offset + tl.max(tl.where(r_mask, token, 0), 0) + 1)
    full = tl.minimum(hi, causal_offset + tl.min(tl.where(r_mask, token, M), 0) + 1)
    full = lo + tl.maximum(full - lo, 0) // BLOCK_N * BLOCK_N

    k_base = k_ptr + b * s_kb + h * s_kh
    v_base = v_ptr + b * s_vb + h * s_vh
    w_base = w_ptr + b * s_wb + h * s_wh
    mask_base = mask_ptr + b * s_mb
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    m_i = tl.full([BLOCK_R], NEG_BIG, tl.float32)
    acc, den, m_i = _attend_tiles(
        acc, den, m_i, q, k_base, v_base, w_base, mask_base, lo, full, last_key, qk_scale,
        s_kn, s_kd, s_vn, s_vd, s_wn, s_mn, offs_d, offs_dv, d_mask, dv_mask,
        BLOCK_N, HAS_MASK, False, DOT_FP32,
    )  # fmt: skip
    acc, den, m_i = _attend_tiles(
        acc, den, m_i, q, k_base, v_base, w_base, mask_base, full, hi, last_key, qk_scale,
        s_kn, s_kd, s_vn, s_vd, s_wn, s_mn, offs_d, offs_dv, d_mask, dv_mask,
        BLOCK_N, HAS_MASK, True, DOT_FP32,
    )  # fmt: skip

    row = bh.to(tl.int64) * ROWS + offs_r  # = output row of [b, h_q, m] (contiguous)
    if FINAL:
        vmin_ptrs = vmin_ptr + b * s_lb + h * s_lh + offs_dv * s_ld
        vmax_ptrs = vmax_ptr + b * s_ub + h * s_uh + offs_dv * s_ud
        out = _finish(acc, den[:, None], vmin_ptrs, vmax_ptrs, dv_mask, HAS_VMIN, HAS_VMAX)
        o_ptrs = out_ptr + row[:, None] * DV + offs_dv[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & dv_mask[None, :])
    else:  # partials in the decode kernel's layout, merged by its reduce kernel
        part = (bh.to(tl.int64) * tl.num_programs(1) + split) * ROWS + offs_r
        tl.store(mpart_ptr + part, m_i, mask=r_mask)
        tl.store(dpart_ptr + part, den, mask=r_mask)
        tl.store(npart_ptr + part[:, None] * DV + offs_dv[None, :], acc, mask=r_mask[:, None] & dv_mask[None, :])


def unsupported_reason(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor,
    v_min: torch.Tensor | None = None,
    v_max: torch.Tensor | None = None,
) -> str | None:
    """Why the kernel cannot run these (already validated) inputs, or None if it can (any ``m >= 1``)."""
    return _decode_unsupported_reason(queries, keys, values, weights, v_min, v_max, max_new_tokens=None)


def weighted_prefill_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor,
    *,
    scaling: float,
    v_min: torch.Tensor | None = None,
    v_max: torch.Tensor | None = None,
    causal_offset: int | None = None,
    key_mask: torch.Tensor | None = None,
    block_r: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Launcher: Alg. 3 on ``[b, h_q, m, d]`` queries (any ``m >= 1``) over a ``[b, h_kv, n, d]`` /
    ``[b, h_kv, n, d_v]`` cache; arguments as for ``weighted_decode.weighted_decode_attention``.

    Any strides, no copies. ``block_r`` (rows per program, default 128; 64 for head dims > 128), ``block_n``
    (keys per tile; powers of two >= 16) and ``num_splits`` override the heuristics (tests, tuning).
    """
    reason = unsupported_reason(queries, keys, values, weights, v_min, v_max)
    if reason is not None:
        raise ValueError(f"weighted prefill kernel: {reason}")
    wide = max(queries.shape[3], values.shape[3]) > 128
    tiles = dict(block_r=block_r, block_n=block_n, num_splits=num_splits, num_stages=2 if wide else 3)
    args = (queries, keys, values, weights, scaling, v_min, v_max, causal_offset, key_mask)
    return launch_split_k(_weighted_prefill_kernel, *args, **tiles)
