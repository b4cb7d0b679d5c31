"""Weighted attention (Alg. 3 of WildCat) over a (compressed) cache as a split-K Triton kernel: decode here,
and any number of new tokens through :mod:`kvcompress.kernels.weighted_prefill` (same kernel).

For each (batch, KV head) the output rows are the ``group * m`` (query head, new token) pairs of that KV
head's GQA group, ``group = h_q // h_kv``. For row ``r`` (query head ``r // m``, token ``i = r % m``)::

    s_l = scaling * <q_r, k_l>                     (key l visible iff l <= causal_offset + i and key_mask)
    out = clip( sum_l e^{s_l} v_l / sum_l e^{s_l} w_l , v_min, v_max ),   out = 0 where the denominator <= 0

Stage 1, one program per (batch * KV head, key split, block of rows), FlashAttention-2 style: the block's
queries stay on chip while the program loops over the split's key tiles with an online softmax in fp32
(log2 units), keeping the numerator ``acc = sum 2^(s - m) v`` and the denominator ``den = sum 2^(s - m) w``
(not ``sum 2^(s - m)``: weights can be zero or negative). Tiles that every row of the block sees in full
run without the causal / bounds mask; tiles past the causal limit of every row of the block are never read.

Bytes (the memory-bound limit of decode): per (batch, KV head) the kernel must read ``K`` (``n * d``
elements), ``V`` (``n * d_v``) and ``w`` (``n`` floats) once. Stage 1 reads each K/V/w tile once per row
block and serves all query heads of the group and all new tokens of the block with it (keys past
``causal_offset + m - 1`` are never read; ``group * m`` above 128 rows, 64 for head dims > 128, re-reads
K/V once per extra row block). The rest is small for decode: the queries, the output, and per-split fp32
partials (``splits * rows * (d_v + 2)`` floats written by stage 1 and read by stage 2, which merges the
splits with log-sum-exp rescaling and applies Alg. 3's ``den <= 0 -> 0`` and the clip). With a single
split, stage 1 writes the output itself (one launch); with ``FUSED_MERGE``, the last program of each row block to
finish its split does stage 2's work for that block (one launch, counted in per-block int32 counters). With
``CACHED_LAUNCH``, both kernels launch without Triton's per-call argument binding (:mod:`.cached_launch`). With
``fold_from``, the programs that finish rows first fold the value rows appended since the caller's last call into its
running clip range, in place (a decode step's fold costs no launch). Device functions: :mod:`.weighted_tiles`.

Set ``TRITON_INTERPRET=1`` before importing this module to run it on CPU tensors (tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvcompress._checks import check_fold_from
from kvcompress.kernels.cached_launch import launch
from kvcompress.kernels.launch import (  # noqa: F401  (the tiling constants and heuristic, re-exported)
    DEFAULT_SM_COUNT,
    MAX_BLOCK_ROWS,
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    REDUCE_CHUNK,
    SPLITS_PER_SM,
    LaunchPlan,
    choose_num_splits,
    dummies,
    kernel_options,
    launch_plan,
    workspace,
)
from kvcompress.kernels.weighted_tiles import NEG_BIG, attend_tiles, clip_bounds, finish, merge_splits, store_finished

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # what triton.jit saw when these kernels were defined

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_NEW_TOKENS = 16  # m: one decode step, or a short chunk of new tokens (speculative / chunked prefill tail)
# The split partials merged by the last split's program instead of a second launch (``fused_merge``), and launches
# through kvcompress.kernels.cached_launch (the compiled kernel kept per specialization, no per-call binding by
# Triton): on since an H200 ran their kernel tests compiled and measured one 32k decode attention call's host time
# 106.8 -> 55.6 us with both (device time per call 124 -> 69 us; docs/BENCHMARKS.md, "The fortieth session's GPU run").
FUSED_MERGE = True
CACHED_LAUNCH = True
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634


@triton.jit
def _weighted_split_kernel(
    q_ptr, k_ptr, v_ptr, w_ptr, vmin_ptr, vmax_ptr, mask_ptr, out_ptr, mpart_ptr, dpart_ptr, npart_ptr, offset_ptr,
    lock_ptr, fold_ptr,
    H_KV, GROUP, N, ROWS, M, split_len, causal_offset, qk_scale, fold_lo, fold_hi,
    s_qb, s_qh, s_qm, s_qd,
    s_kb, s_kh, s_kn, s_kd,
    s_vb, s_vh, s_vn, s_vd,
    s_wb, s_wh, s_wn,
    s_lb, s_lh, s_ld,
    s_ub, s_uh, s_ud,
    s_mb, s_mn,
    s_ob,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_VMIN: tl.constexpr, HAS_VMAX: tl.constexpr, HAS_MASK: tl.constexpr, FINAL: tl.constexpr,
    DOT_FP32: tl.constexpr, OFFSET_PTR: tl.constexpr, FUSED_MERGE: tl.constexpr, FOLD: tl.constexpr,
    FOLD_PTR: tl.constexpr,
):  # fmt: skip
    """Stage 1, one program per (batch * KV head, key split, row block): keys ``[split * split_len, ...)``.
    ``FOLD``: the program that finishes rows folds values ``[fold_lo, fold_hi)`` into the clip range in place
    (``FOLD_PTR``: the one row ``fold_ptr[b]`` of each batch row instead)
    (:func:`clip_bounds`).
    ``OFFSET_PTR``: the causal offset is read from device memory, ``offset_ptr[b * s_ob]`` (static caches: no host
    value per step, ``s_ob`` 0; a decode batch: each batch row's own, so no program reads keys past its row's).
    ``FUSED_MERGE`` (several splits): the last program of a (pair, row block) to store its partials, counted in
    ``lock_ptr`` (int32, zero before the launch and again after it), merges them and writes the output: stage 2
    without its launch."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    rblock = tl.program_id(2)
    b = (bh // H_KV).to(tl.int64)
    h = (bh % H_KV).to(tl.int64)
    if OFFSET_PTR:
        offset = tl.load(offset_ptr + b * s_ob).to(tl.int32)
    else:
        offset = causal_offset
    if FOLD_PTR:  # each batch row folds its own new row (a decode batch's rows sit at each row's own length)
        fold_lo = tl.load(fold_ptr + b).to(tl.int32)
        fold_hi = fold_lo + 1

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
    last_key = offset + token  # row sees keys l <= last_key

    # Keys [lo, full) are visible to every row of the block; keys past `hi` to none.
    lo = split * split_len
    split_hi = tl.minimum(lo + split_len, N)
    hi = tl.minimum(split_hi, offset + tl.max(tl.where(r_mask, token, 0), 0) + 1)
    full = tl.minimum(hi, offset + tl.min(tl.where(r_mask, token, M), 0) + 1)
    full = lo + tl.maximum(full - lo, 0) // BLOCK_N * BLOCK_N

    k_base = k_ptr + b * s_kb + h * s_kh
    v_base = v_ptr + b * s_vb + h * s_vh
    w_base = w_ptr + b * s_wb + h * s_wh
    mask_base = mask_ptr + b * s_mb
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    m_i = tl.full([BLOCK_R], NEG_BIG, tl.float32)
    acc, den, m_i = attend_tiles(
        acc, den, m_i, q, k_base, v_base, w_base, mask_base, lo, full, last_key, qk_scale,
        s_kn, s_kd, s_vn, s_vd, s_wn, s_mn, offs_d, offs_dv, d_mask, dv_mask,
        BLOCK_N, HAS_MASK, False, DOT_FP32,
    )  # fmt: skip
    acc, den, m_i = attend_tiles(
        acc, den, m_i, q, k_base, v_base, w_base, mask_base, full, hi, last_key, qk_scale,
        s_kn, s_kd, s_vn, s_vd, s_wn, s_mn, offs_d, offs_dv, d_mask, dv_mask,
        BLOCK_N, HAS_MASK, True, DOT_FP32,
    )  # fmt: skip

    row = bh.to(tl.int64) * ROWS + offs_r  # = output row of [b, h_q, m] (contiguous)
    vmin_ptrs = vmin_ptr + b * s_lb + h * s_lh + offs_dv * s_ld
    vmax_ptrs = vmax_ptr + b * s_ub + h * s_uh + offs_dv * s_ud
    if FINAL:
        low, high = clip_bounds(vmin_ptrs, vmax_ptrs, dv_mask, v_base, s_vn, s_vd, mask_base, s_mn, fold_lo, fold_hi,
                                 offs_dv, HAS_VMIN, HAS_VMAX, HAS_MASK, FOLD)  # fmt: skip
        store_finished(out_ptr, row, r_mask, offs_dv, dv_mask, acc, den, low, high, DV, HAS_VMIN, HAS_VMAX)
    else:  # partials in the decode kernel's layout, merged by its reduce kernel (or the last split: FUSED_MERGE)
        part = (bh.to(tl.int64) * tl.num_programs(1) + split) * ROWS + offs_r
        tl.store(mpart_ptr + part, m_i, mask=r_mask)
        tl.store(dpart_ptr + part, den, mask=r_mask)
        tl.store(npart_ptr + part[:, None] * DV + offs_dv[None, :], acc, mask=r_mask[:, None] & dv_mask[None, :])
        if FUSED_MERGE:
            # Every thread's stores before the count (the barrier), the count a release and, for the program that
            # sees the others' counts, an acquire: the last one reads every split's partials as stored.
            tl.debug_barrier()
            lock = lock_ptr + bh * tl.num_programs(2) + rblock
            stored = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
            if stored == tl.num_programs(1) - 1:
                acc, den = merge_splits(mpart_ptr, dpart_ptr, npart_ptr, bh, offs_r, r_mask, offs_dv, dv_mask,
                                         ROWS, tl.num_programs(1), BLOCK_R, BLOCK_DV, DV)  # fmt: skip
                low, high = clip_bounds(vmin_ptrs, vmax_ptrs, dv_mask, v_base, s_vn, s_vd, mask_base, s_mn, fold_lo,
                                         fold_hi, offs_dv, HAS_VMIN, HAS_VMAX, HAS_MASK, FOLD)  # fmt: skip
                store_finished(out_ptr, row, r_mask, offs_dv, dv_mask, acc, den, low, high, DV, HAS_VMIN, HAS_VMAX)
                tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")  # zero again for the next launch


@triton.jit
def _weighted_decode_reduce_kernel(
    mpart_ptr, dpart_ptr, npart_ptr, vmin_ptr, vmax_ptr, out_ptr, v_ptr, mask_ptr, fold_ptr,
    H_KV, ROWS, SPLITS, fold_lo, fold_hi,
    s_lb, s_lh, s_ld,
    s_ub, s_uh, s_ud,
    s_vb, s_vh, s_vn, s_vd,
    s_mb, s_mn,
    DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_VMIN: tl.constexpr, HAS_VMAX: tl.constexpr, HAS_MASK: tl.constexpr, FOLD: tl.constexpr,
    FOLD_PTR: tl.constexpr,
):  # fmt: skip
    """Stage 2, one program per output row: merge the splits' (m, den, acc) with 2^(m_s - M), then finish
    (``FOLD``: folding values ``[fold_lo, fold_hi)``, or row ``fold_ptr[b]``, into the clip range first, as stage 1
    does)."""
    row = tl.program_id(0).to(tl.int64)  # = bh * ROWS + r
    bh = row // ROWS
    r = row % ROWS
    b = bh // H_KV
    h = bh % H_KV
    if FOLD_PTR:
        fold_lo = tl.load(fold_ptr + b).to(tl.int32)
        fold_hi = fold_lo + 1
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    base = bh * SPLITS * ROWS + r  # partial of split s at base + s * ROWS

    s_mask = offs_s < SPLITS
    m_s = tl.load(mpart_ptr + base + offs_s * ROWS, mask=s_mask, other=float("-inf"))
    d_s = tl.load(dpart_ptr + base + offs_s * ROWS, mask=s_mask, other=0.0)
    n_ptrs = npart_ptr + (base + offs_s * ROWS)[:, None] * DV + offs_dv[None, :]
    n_s = tl.load(n_ptrs, mask=s_mask[:, None] & dv_mask[None, :], other=0.0)
    m_run = tl.max(m_s, 0)  # >= NEG_BIG (finite): split 0 always exists
    scale = tl.exp2(m_s - m_run)
    den = tl.sum(scale * d_s, 0)
    acc = tl.sum(scale[:, None] * n_s, 0)
    for s0 in range(BLOCK_S, SPLITS, BLOCK_S):
        s_idx = s0 + offs_s
        s_mask = s_idx < SPLITS
        m_s = tl.load(mpart_ptr + base + s_idx * ROWS, mask=s_mask, other=float("-inf"))
        d_s = tl.load(dpart_ptr + base + s_idx * ROWS, mask=s_mask, other=0.0)
        n_ptrs = npart_ptr + (base + s_idx * ROWS)[:, None] * DV + offs_dv[None, :]
        n_s = tl.load(n_ptrs, mask=s_mask[:, None] & dv_mask[None, :], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_s, 0))
        alpha = tl.exp2(m_run - m_new)
        scale = tl.exp2(m_s - m_new)
        den = den * alpha + tl.sum(scale * d_s, 0)
        acc = acc * alpha + tl.sum(scale[:, None] * n_s, 0)
        m_run = m_new

    vmin_ptrs = vmin_ptr + b * s_lb + h * s_lh + offs_dv * s_ld
    vmax_ptrs = vmax_ptr + b * s_ub + h * s_uh + offs_dv * s_ud
    low, high = clip_bounds(vmin_ptrs, vmax_ptrs, dv_mask, v_ptr + b * s_vb + h * s_vh, s_vn, s_vd,
                             mask_ptr + b * s_mb, s_mn, fold_lo, fold_hi, offs_dv, HAS_VMIN, HAS_VMAX, HAS_MASK,
                             FOLD)  # fmt: skip
    out = finish(acc, den, low, high, HAS_VMIN, HAS_VMAX)
    tl.store(out_ptr + row * DV + offs_dv, out.to(out_ptr.dtype.element_ty), mask=dv_mask)


def unsupported_reason(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor,
    v_min: torch.Tensor | None = None,
    v_max: torch.Tensor | None = None,
    max_new_tokens: int | None = MAX_NEW_TOKENS,
) -> str | None:
    """Why the kernel cannot run these (already validated) inputs, or None if it can.

    ``max_new_tokens``: the most query rows ``m`` per call (None: any; the multi-token kernel
    ``kvcompress.kernels.weighted_prefill`` shares these checks)."""
    # Every decode step's attention call runs these checks: attribute reads only, no loop, until one fails.
    device = queries.device
    if not (queries.is_cuda or INTERPRET):
        return f"needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 before importing triton kernels"
    if queries.dtype not in SUPPORTED_DTYPES:
        return f"queries/keys/values dtype must be float16, bfloat16 or float32, got {queries.dtype}"
    if (
        weights.dtype not in SUPPORTED_DTYPES or weights.device != device
        or (v_min is not None and (v_min.dtype not in SUPPORTED_DTYPES or v_min.device != device))
        or (v_max is not None and (v_max.dtype not in SUPPORTED_DTYPES or v_max.device != device))
    ):  # fmt: skip
        for name, x in (("weights", weights), ("v_min", v_min), ("v_max", v_max)):
            if x is not None and (x.dtype not in SUPPORTED_DTYPES or x.device != device):
                return f"{name} must be float16/bfloat16/float32 on {device}, got {x.dtype} on {x.device}"
    batch, _, m, dim = queries.shape
    n, d_v = keys.shape[2], values.shape[3]
    if m < 1 or (max_new_tokens is not None and m > max_new_tokens):
        return f"supports 1..{max_new_tokens} new tokens per call (queries m={m})"
    for name, size in (("head dim d", dim), ("value dim d_v", d_v)):
        if size % 16 or not 16 <= size <= MAX_HEAD_DIM:
            return f"{name}={size} must be a multiple of 16 in [16, {MAX_HEAD_DIM}]"
    if batch < 1 or n < 1:
        return f"needs batch >= 1 and cache length n >= 1 (got batch={batch}, n={n})"
    return None


def weighted_decode_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor,
    *,
    scaling: float,
    v_min: torch.Tensor | None = None,
    v_max: torch.Tensor | None = None,
    causal_offset: int | torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    block_r: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    max_new_tokens: int | None = MAX_NEW_TOKENS,
    check: bool = True,
    fused_merge: bool | None = None,
    fold_from: int | torch.Tensor | None = None,
    reuse_buffers: bool = True,
) -> torch.Tensor:
    """Launcher: Alg. 3 on ``[b, h_q, m, d]`` queries (``m <= max_new_tokens``) over a ``[b, h_kv, n, d]`` /
    ``[b, h_kv, n, d_v]`` cache.

    ``weights`` ``[b, h_kv, n]``; ``v_min`` / ``v_max`` ``[b, h_kv, d_v]``; ``key_mask`` ``[b, n]`` bool (False:
    a key no query of that row sees); any strides, no copies. ``causal_offset``: an int, or an int64 tensor on the
    inputs' device that the kernel reads (no host sync): one element (static caches), or ``[b]``, one per batch row
    (a decode batch's rows of different lengths: no program reads a key past its own row's offset + m - 1). Inputs
    must already be validated (``kvcompress.weighted_attention(..., backend="triton")`` does that) and pass
    ``unsupported_reason`` (``check=False`` skips that test and ``fold_from``'s: callers that already made them).
    ``num_splits`` /
    ``block_n`` (keys per tile) / ``block_r`` (rows per program; powers of two >= 16) / ``num_warps`` (stage 1's:
    1, 2, 4, 8 or 16) override the heuristics (tests, tuning); ``num_stages``: Triton's software pipelining depth.
    Launch plans and the split partials are cached per shape. Accumulates in fp32; returns ``[b, h_q, m, d_v]``
    contiguous in ``values.dtype``. ``fused_merge``: with several splits, the last split of each row block merges
    them (one launch instead of two: the host's cost of a decode call is mostly launches); None: ``FUSED_MERGE``.
    ``fold_from``: rows ``[fold_from, n)`` of ``values`` (those ``key_mask`` shows) are folded into ``v_min`` /
    ``v_max`` in place, by the programs that finish rows, before they clip (a caller's running clip range: a decode
    step's new row costs no launch of its own); needs both bounds. A ``[b]`` int64 tensor on the inputs' device instead:
    batch row ``i`` folds its one row ``fold_from[i]`` (a decode batch's new rows, each at its row's own length; the
    kernel reads the indices, which the caller keeps in ``[0, n)``).
    ``reuse_buffers=False``: the split partials and placeholders are allocated for this call, not taken from (or
    kept in) the per-shape cache: a call that a CUDA graph records (torch.compile's ``reduce-overhead``) allocates
    from the graph's private pool, and a cached tensor from that pool is a live allocation the graph does not own
    (torch's CUDA-graph trees refuse it) or, evicted from the cache, memory the graph replays on after it was freed.
    """
    if check:
        reason = unsupported_reason(queries, keys, values, weights, v_min, v_max, max_new_tokens)
        if reason is not None:
            raise ValueError(f"weighted attention kernel: {reason}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps: must be 1, 2, 4, 8 or 16, got {num_warps!r}")
    if fused_merge is not None and not isinstance(fused_merge, bool):
        raise ValueError(f"fused_merge: must be True, False or None, got {fused_merge!r}")
    plan = launch_plan(queries, keys, values, causal_offset, num_splits, block_n, block_r, INTERPRET)
    batch, heads_q, m, dim = queries.shape
    heads_kv, n, d_v = keys.shape[1], keys.shape[2], values.shape[3]
    fold_rows = isinstance(fold_from, torch.Tensor)
    if check and fold_from is not None:
        check_fold_from(fold_from, batch, n, queries.device, v_min, v_max, read_indices=False)
    fold = fold_rows or (fold_from is not None and fold_from < n)
    out = values.new_empty(batch, heads_q, m, d_v)
    final = plan.num_splits == 1
    fused = not final and (FUSED_MERGE if fused_merge is None else fused_merge)
    if final:
        mpart = dpart = npart = out
    else:
        mpart, dpart, npart, locks = workspace(out.device, batch * heads_kv, plan, d_v, reuse_buffers)
    dummy, dummy_mask = dummies(out.device, values.dtype, reuse_buffers)
    lo_t = v_min if v_min is not None else dummy
    hi_t = v_max if v_max is not None else dummy
    mask_t = key_mask.view(torch.uint8) if key_mask is not None else dummy_mask
    on_device = isinstance(causal_offset, torch.Tensor)
    offset_t = causal_offset if on_device else dummy_mask

    split_options, reduce_options = kernel_options(
        plan, dim, d_v, has_vmin=v_min is not None, has_vmax=v_max is not None, has_mask=key_mask is not None,
        offset_on_device=on_device, num_stages=num_stages, fused_merge=fused, fold=fold, fold_on_device=fold_rows,
    )  # fmt: skip
    fold_lo, fold_hi = (fold_from, n) if fold and not fold_rows else (0, 0)
    fold_t = fold_from if fold_rows else dummy_mask
    if num_warps is not None:
        split_options = {**split_options, "num_warps": num_warps}
    split_args = (
        queries, keys, values, weights, lo_t, hi_t, mask_t, out, mpart, dpart, npart, offset_t,
        locks if fused else dummy_mask, fold_t,
        heads_kv, heads_q // heads_kv, plan.n_read, plan.tiles.rows, m, plan.split_len, plan.causal_offset,
        scaling * LOG2E, fold_lo, fold_hi,
        *queries.stride(), *keys.stride(), *values.stride(), *weights.stride(), *lo_t.stride(), *hi_t.stride(),
        *mask_t.stride(), offset_t.stride(0) if offset_t.shape[0] > 1 else 0,
    )  # fmt: skip
    launch(_weighted_split_kernel, plan.grid, split_args, split_options, cached=CACHED_LAUNCH)
    if not final and not fused:
        reduce_args = (mpart, dpart, npart, lo_t, hi_t, out, values, mask_t, fold_t, heads_kv, plan.tiles.rows,
                       plan.num_splits, fold_lo, fold_hi, *lo_t.stride(), *hi_t.stride(), *values.stride(),
                       *mask_t.stride())  # fmt: skip
        launch(_weighted_decode_reduce_kernel, (batch * heads_kv * plan.tiles.rows,), reduce_args, reduce_options,
               cached=CACHED_LAUNCH)  # fmt: skip
    return out
