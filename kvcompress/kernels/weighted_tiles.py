"""The device functions of the weighted attention kernels (:mod:`kvcompress.kernels.weighted_decode`): the online
softmax over key tiles with a weighted denominator, the merge of key splits, and Alg. 3's tail (``acc / den``, 0 where
the denominator is <= 0, then the clip to ``[v_min, v_max]``, with the rows appended since the caller's last call
folded into that range in place).

Set ``TRITON_INTERPRET=1`` before importing this module to run it on CPU tensors (tests).
"""

from __future__ import annotations

import triton
import triton.language as tl

FOLD_ROWS = tl.constexpr(16)  # value rows per step when a finishing program folds appended rows into the clip range
NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: exp2(m_old - m_new) never sees inf - inf


@triton.jit
def clip_bounds(vmin_ptrs, vmax_ptrs, dv_mask, v_base, s_vn, s_vd, mask_base, s_mn, fold_lo, fold_hi, offs_dv,
                 HAS_VMIN: tl.constexpr, HAS_VMAX: tl.constexpr, HAS_MASK: tl.constexpr,
                 FOLD: tl.constexpr):  # fmt: skip
    """The clip range ``(low, high)`` as fp32 ``[BLOCK_DV]``. ``FOLD`` (both bounds present): rows ``[fold_lo,
    fold_hi)`` of this pair's values, those ``key_mask`` shows, are folded in and the range is stored back in place,
    rounded to its dtype (a running range: the rows appended since the caller's last call). Every program that
    finishes rows of the pair stores the same values, so their order does not matter."""
    if HAS_VMIN:
        low = tl.load(vmin_ptrs, mask=dv_mask, other=0.0).to(tl.float32)
    else:  # no bound: the placeholder pointer is never read
        low = tl.where(dv_mask, float("-inf"), float("-inf"))
    if HAS_VMAX:
        high = tl.load(vmax_ptrs, mask=dv_mask, other=0.0).to(tl.float32)
    else:
        high = tl.where(dv_mask, float("inf"), float("inf"))
    if FOLD:
        for start in range(fold_lo, fold_hi, FOLD_ROWS):
            offs_n = start + tl.arange(0, FOLD_ROWS)
            n_mask = offs_n < fold_hi
            if HAS_MASK:  # padded later rows do not widen the range
                n_mask = n_mask & (tl.load(mask_base + offs_n * s_mn, mask=n_mask, other=0) != 0)
            v = tl.load(v_base + offs_n[:, None] * s_vn + offs_dv[None, :] * s_vd,
                        mask=n_mask[:, None] & dv_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
            low = tl.minimum(low, tl.min(tl.where(n_mask[:, None], v, float("inf")), 0))
            high = tl.maximum(high, tl.max(tl.where(n_mask[:, None], v, float("-inf")), 0))
        low = low.to(vmin_ptrs.dtype.element_ty)
        high = high.to(vmax_ptrs.dtype.element_ty)
        tl.store(vmin_ptrs, low, mask=dv_mask)
        tl.store(vmax_ptrs, high, mask=dv_mask)
        low, high = low.to(tl.float32), high.to(tl.float32)
    return low, high


@triton.jit
def finish(acc, den, low, high, HAS_VMIN: tl.constexpr, HAS_VMAX: tl.constexpr):
    """Alg. 3's tail: ``acc / den`` where ``den > 0``, else 0, then clip to ``[low, high]`` (fp32, from
    :func:`clip_bounds`). fp32 ``acc [.., DV]``, ``den`` broadcast."""
    positive = den > 0
    out = tl.where(positive, acc / tl.where(positive, den, 1.0), 0.0)
    if HAS_VMIN:
        out = tl.maximum(out, low)
    if HAS_VMAX:
        out = tl.minimum(out, high)
    return out


@triton.jit
def store_finished(out_ptr, row, r_mask, offs_dv, dv_mask, acc, den, low, high, DV: tl.constexpr,
                    HAS_VMIN: tl.constexpr, HAS_VMAX: tl.constexpr):  # fmt: skip
    """Rows ``row`` of the output ``[rows, DV]``: :func:`finish` of fp32 ``acc [BLOCK_R, DV]`` / ``den [BLOCK_R]``,
    stored in the output's dtype."""
    out = finish(acc, den[:, None], low[None, :], high[None, :], HAS_VMIN, HAS_VMAX)
    o_ptrs = out_ptr + row[:, None] * DV + offs_dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & dv_mask[None, :])


@triton.jit
def attend_tiles(
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
def merge_splits(mpart_ptr, dpart_ptr, npart_ptr, bh, offs_r, r_mask, offs_dv, dv_mask, ROWS, SPLITS,
                  BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, DV: tl.constexpr):  # fmt: skip
    """Every split's ``(m, den, acc)`` of rows ``offs_r`` of pair ``bh`` merged with 2^(m_s - M): ``(acc, den)``.
    Read past L1 (``.cg``): other programs, on other multiprocessors, wrote them during this launch."""
    m_run = tl.full([BLOCK_R], NEG_BIG, tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for split in range(0, SPLITS):
        part = (bh.to(tl.int64) * SPLITS + split) * ROWS + offs_r
        m_s = tl.load(mpart_ptr + part, mask=r_mask, other=NEG_BIG, cache_modifier=".cg")
        d_s = tl.load(dpart_ptr + part, mask=r_mask, other=0.0, cache_modifier=".cg")
        n_s = tl.load(npart_ptr + part[:, None] * DV + offs_dv[None, :], mask=r_mask[:, None] & dv_mask[None, :],
                      other=0.0, cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m_run, m_s)
        alpha = tl.exp2(m_run - m_new)
        scale = tl.exp2(m_s - m_new)
        den = den * alpha + scale * d_s
        acc = acc * alpha[:, None] + scale[:, None] * n_s
        m_run = m_new
    return acc, den
