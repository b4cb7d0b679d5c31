"""The attention-matching fit's products over the ``m x n`` probabilities as two fused Triton kernels, so that the
probabilities are never held (the fit's math: :mod:`kvcompress.fitting`).

For one fit problem (a (batch row, KV head) pair) with query rows ``r`` (each with a last visible key
``pos_r``), keys ``k_j`` and values ``v_j``::

    p_rj = exp(s_rj - lse_r),   s_rj = scaling * <q_r, k_j>  (j <= pos_r),   lse_r = log sum_{j <= pos_r} exp(s_rj)

* :func:`attention_rows`, one program per (problem, block of rows, split of the keys), FlashAttention's forward:
  ``lse_r`` and the exact attention output ``sum_j p_rj v_j`` (the fit's validation target), online over the key
  tiles a row sees, the splits combined by their log-sum-exp.
* :func:`block_sums`, one program per (problem, block of ``span`` positions, set of rows): ``c[j, w] = sum_r p_rj
  a[r, w]`` over the set's rows, for the block's positions ``j`` against ``width`` columns of ``a`` (the kept rows'
  probabilities) starting at column ``low * bin_rows`` (``low``: the first bin the block meets), kept where column
  w's bin owns position j, then summed over the block's positions, alone and times the values ``v_j``: the fit's
  right-hand sides' partials (:func:`kvcompress.fit_equations._right_hand_sides`; the sets: the fit's two query
  halves). It recomputes each ``p_rj`` from the rows' ``lse_r``.

Logit dots run on the inputs' dtype (bf16 / fp16 tensor cores; fp32 as IEEE fp32) with fp32 accumulation; the
probabilities' products on TF32 for a 16-bit context (each probability rounded to TF32's 10-bit mantissa, as the
PyTorch path's TF32 products round it) and IEEE fp32 for a float32 one; so do the products with the values. Any
strides, no copies. Work per problem: ``2 m n (2 d + d_v + width) + 2 n width d_v`` FLOPs (the logits twice, the
outputs, the products, the values' products), memory ``O(m d_v + n width d_v / span)`` for the results, no ``m x n``
buffer. Set ``TRITON_INTERPRET=1`` before importing this module to run it on CPU
tensors (tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvcompress.attention import merge_partial_attentions
from kvcompress.kernels.launch import (
    cdiv,
    choose_num_splits,
    dot_in_fp32,
    next_power_of_2,
    sm_count,
    whole_tile_splits,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # what triton.jit saw when these kernels were defined

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_WIDTH = 128  # columns of a block's products (one fp32 accumulator tile [span, width] per program)
VALUE_CHUNK = 16  # value columns per product of :func:`block_sums`' epilogue (wider ones spilled on sm_90)
LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: exp2(m_old - m_new) never sees inf - inf


@triton.jit
def _load_rows(q_base, pos_ptr, r0, M, N, s_qm, s_qd, s_p, offs_d, d_mask,
               BLOCK_M: tl.constexpr, HAS_POS: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    """One block of query rows ``[BLOCK_M, D]``, their row indices, validity and last visible key (-1: no row)."""
    offs_m = r0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    q = tl.load(q_base + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
    if DOT_FP32:
        q = q.to(tl.float32)
    if HAS_POS:
        row_pos = tl.load(pos_ptr + offs_m * s_p, mask=m_mask, other=-1)
    else:
        row_pos = tl.zeros([BLOCK_M], tl.int64) + (N - 1)
    return q, tl.where(m_mask, row_pos, -1), offs_m, m_mask


@triton.jit
def _attention_rows_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, lse_ptr, out_ptr,
    M, N, D, DV, qk_scale, SPLIT_KEYS,
    s_qp, s_qm, s_qd, s_kp, s_kn, s_kd, s_vp, s_vn, s_vd, s_p, s_ls, s_lp, s_os, s_op, s_om, s_od,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_POS: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (problem, row block, split of ``SPLIT_KEYS`` keys): each row's log-sum-exp over the split's
    keys (log2 units; -inf where the row sees none of them) and its attention output over them."""
    prob = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    q, row_pos, offs_m, m_mask = _load_rows(
        q_ptr + prob * s_qp, pos_ptr, tl.program_id(1) * BLOCK_M, M, N, s_qm, s_qd, s_p, offs_d, d_mask,
        BLOCK_M, HAS_POS, DOT_FP32,
    )  # fmt: skip
    lo = tl.program_id(2) * SPLIT_KEYS
    hi = tl.minimum(N, tl.max(row_pos, 0) + 1).to(tl.int32)  # keys past every row's position are never read
    hi = tl.minimum(hi, lo + SPLIT_KEYS)
    k_base = k_ptr + prob * s_kp
    v_base = v_ptr + prob * s_vp
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        kt = tl.load(k_base + offs_n[None, :] * s_kn + offs_d[:, None] * s_kd,
                     mask=d_mask[:, None] & n_mask[None, :], other=0.0)  # fmt: skip
        if DOT_FP32:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision="ieee") * qk_scale
        s = tl.where(n_mask[None, :] & (offs_n[None, :] <= row_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * s_vn + offs_dv[None, :] * s_vd,
                    mask=n_mask[:, None] & dv_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    split = tl.program_id(2).to(tl.int64)
    tl.store(lse_ptr + split * s_ls + prob * s_lp + offs_m, lse, mask=m_mask)
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(out_ptr + split * s_os + prob * s_op + offs_m[:, None] * s_om + offs_dv[None, :] * s_od, out,
             mask=m_mask[:, None] & dv_mask[None, :])  # fmt: skip


@triton.jit
def _block_sums_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, lse_ptr, a_ptr, low_ptr, owner_ptr, mass_ptr, vals_ptr,
    M, SET_ROWS, N, D, DV, COLS, SPAN, WIDTH, BIN_ROWS, qk_scale,
    s_qp, s_qm, s_qd, s_kp, s_kn, s_kd, s_vp, s_vn, s_vd, s_p, s_ap, s_am, s_ac, s_lp, s_lb, s_op, s_on,
    s_mp, s_mr, s_mb, s_mw, s_up, s_ur, s_ub, s_uw, s_ud,
    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_POS: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (problem, block of SPAN positions, set of SET_ROWS rows): the products ``c[j, w] = sum_r p_rj
    a[r, low * BIN_ROWS + w]`` over the set's rows ``r``, kept where column w's bin is position j's owner, then summed
    over the block's positions: ``mass[w] = sum_j c[j, w]`` and ``vals[w] = sum_j c[j, w] v_j``."""
    prob = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    row_set = tl.program_id(2).to(tl.int64)
    set_lo = row_set * SET_ROWS
    set_hi = tl.minimum(M, set_lo + SET_ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    slots = tl.arange(0, BLOCK_S)
    first = block * SPAN
    offs_s = first + slots
    s_mask = (slots < SPAN) & (offs_s < N)
    kt = tl.load(k_ptr + prob * s_kp + offs_s[None, :] * s_kn + offs_d[:, None] * s_kd,
                 mask=d_mask[:, None] & s_mask[None, :], other=0.0)  # fmt: skip
    if DOT_FP32:
        kt = kt.to(tl.float32)
    low = tl.load(low_ptr + prob * s_lp + block * s_lb)
    columns = tl.arange(0, BLOCK_W)
    offs_w = low * BIN_ROWS + columns
    w_mask = (columns < WIDTH) & (offs_w < COLS)
    a_base = a_ptr + prob * s_ap
    acc = tl.zeros([BLOCK_S, BLOCK_W], tl.float32)
    for r0 in range(set_lo, set_hi, BLOCK_M):
        q, row_pos, offs_m, m_mask = _load_rows(
            q_ptr + prob * s_qp, pos_ptr, r0, set_hi, N, s_qm, s_qd, s_p, offs_d, d_mask, BLOCK_M, HAS_POS, DOT_FP32
        )
        if tl.max(row_pos, 0) >= first:  # some row of the block sees a position of this one
            lse = tl.load(lse_ptr + prob * M + offs_m, mask=m_mask, other=float("inf"))
            s = tl.dot(q, kt, input_precision="ieee") * qk_scale
            visible = s_mask[None, :] & (offs_s[None, :] <= row_pos[:, None])
            p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
            a = tl.load(a_base + offs_m[:, None] * s_am + offs_w[None, :] * s_ac,
                        mask=m_mask[:, None] & w_mask[None, :], other=0.0)  # fmt: skip
            acc += tl.dot(tl.trans(p), a, input_precision=PRECISION)
    # Each position's products with its own bin's kept rows only (its bin among the block's: owner - low).
    owners = tl.load(owner_ptr + prob * s_op + offs_s * s_on, mask=s_mask, other=-1)
    own = ((owners - low)[:, None] == (columns // BIN_ROWS)[None, :]) & (owners >= 0)[:, None]
    acc = tl.where(own, acc, 0.0)
    out_w = columns < WIDTH
    tl.store(mass_ptr + prob * s_mp + row_set * s_mr + block * s_mb + columns * s_mw, tl.sum(acc, 0), mask=out_w)
    acc_t = tl.trans(acc)  # [BLOCK_W, BLOCK_S]
    vals_base = vals_ptr + prob * s_up + row_set * s_ur + block * s_ub + columns[:, None] * s_uw
    offs_dv = tl.arange(0, BLOCK_DV)
    for dv0 in range(0, DV, BLOCK_DV):  # the values' columns in chunks: fewer live registers than one wide product
        dv = dv0 + offs_dv
        v = tl.load(v_ptr + prob * s_vp + offs_s[:, None] * s_vn + dv[None, :] * s_vd,
                    mask=s_mask[:, None] & (dv < DV)[None, :], other=0.0).to(tl.float32)  # fmt: skip
        part = tl.dot(acc_t, v, input_precision=PRECISION)  # [BLOCK_W, BLOCK_DV]
        tl.store(vals_base + dv[None, :] * s_ud, part, mask=out_w[:, None] & (dv < DV)[None, :])


def unsupported_reason(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, width: int) -> str | None:
    """Why the kernels cannot run these inputs, or None if they can."""
    if queries.device.type != "cuda" and not INTERPRET:
        return f"needs CUDA tensors (got {queries.device}); on CPU set TRITON_INTERPRET=1 before importing"
    if queries.dtype not in SUPPORTED_DTYPES or keys.dtype != queries.dtype or values.dtype != queries.dtype:
        dtypes = f"{queries.dtype}/{keys.dtype}/{values.dtype}"
        return f"queries/keys/values must share a dtype of float16, bfloat16 or float32, got {dtypes}"
    if not 1 <= queries.shape[-1] <= MAX_HEAD_DIM or not 1 <= values.shape[-1] <= MAX_HEAD_DIM:
        return f"head dims must be in [1, {MAX_HEAD_DIM}], got {queries.shape[-1]} / {values.shape[-1]}"
    if not 1 <= width <= MAX_WIDTH:
        return f"width must be in [1, {MAX_WIDTH}], got {width}"
    return None


def _modes(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast the logits' inputs to fp32, precision of the probabilities' products) for an input dtype."""
    return dot_in_fp32(dtype, INTERPRET), "ieee" if dtype == torch.float32 else "tf32"


def rows_config(
    dim: int, d_v: int, dtype: torch.dtype, has_pos: bool, block_m: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> dict:  # fmt: skip
    """Launch options of :func:`attention_rows` (its kernel's constexprs, warps and stages) for these sizes;
    ``block_m`` / ``block_n`` (powers of two >= 16), ``num_warps`` and ``num_stages`` override them (tests, tile
    sweeps: ``python -m eval.bench_fit --kernel-tiles``)."""
    block_d = max(16, next_power_of_2(dim))
    block_dv = max(16, next_power_of_2(d_v))
    # Tiles without register spills on sm_90 (``python -m eval.compile_kernels``): the fp32 probabilities and values
    # of the TF32 output product need more registers than FlashAttention's 16-bit ones.
    # 16-bit up to head dim 128: the fastest of an H200's sweep at d = 128 and 32k keys (``--kernel-tiles``, the
    # fortieth session: 0.547 ms where (64, 32, 8 warps, 2 stages) took 0.848).
    if max(block_d, block_dv) > 128:
        tiles = (16, 16, 4, 2)
    else:
        tiles = (32, 32, 8, 2) if dtype == torch.float32 else (32, 32, 4, 3)
    dot_fp32, precision = _modes(dtype)
    return dict(
        BLOCK_M=block_m or tiles[0], BLOCK_N=block_n or tiles[1], BLOCK_D=block_d, BLOCK_DV=block_dv,
        HAS_POS=has_pos, DOT_FP32=dot_fp32, PRECISION=precision, num_warps=num_warps or tiles[2],
        num_stages=num_stages or tiles[3],
    )  # fmt: skip


def products_config(
    dim: int, span: int, width: int, dtype: torch.dtype, has_pos: bool, block_m: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> dict:  # fmt: skip
    """Launch options of :func:`block_sums` for these sizes; ``block_m`` (the row tile), ``num_warps`` and
    ``num_stages`` override them (tests, tile sweeps)."""
    block_d = max(16, next_power_of_2(dim))
    block_s = max(16, next_power_of_2(span))
    block_w = max(16, next_power_of_2(width))
    dot_fp32, precision = _modes(dtype)
    # Float32: 16 rows and 16 warps (8-24 B a thread spilled on sm_90, ``python -m eval.compile_kernels``; its FMA
    # products with the values spilled 2-7 KB at 8 warps). 16-bit up to head dim 128: 16 rows and 4 warps, no spills,
    # 0.757 / 0.899 ms in two H200 sweeps at d = 128 and 32k keys, where 64 rows and 8 warps took 1.101 / 1.391 (32
    # rows, 4 warps and 3 stages took 0.749 / 0.814 but spill 144 B a thread); wider heads: 32 rows, 8 warps.
    fp32 = dtype == torch.float32
    rows, warps = (16, 16) if fp32 else (32, 8) if block_d > 128 else (16, 4)
    return dict(
        BLOCK_M=block_m or rows, BLOCK_S=block_s, BLOCK_W=block_w, BLOCK_D=block_d, BLOCK_DV=VALUE_CHUNK,
        HAS_POS=has_pos, DOT_FP32=dot_fp32, PRECISION=precision, num_warps=num_warps or warps,
        num_stages=num_stages or 2,
    )  # fmt: skip


def _positions(positions: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if positions is None:
        return torch.zeros(1, dtype=torch.int64, device=device)
    return positions.to(device=device, dtype=torch.int64)


def key_splits(problems: int, row_blocks: int, n: int, block_n: int, device: torch.device) -> int:
    """Splits of the keys for :func:`attention_rows`, by the weighted attention's heuristic
    (:func:`kvcompress.kernels.launch.choose_num_splits`: about two programs per multiprocessor; a fit of 64
    reference queries is 16 (problem, row block) programs at 32k keys, 16 of an H100's 132 SMs) with each split at
    least 4 key tiles; 1 on CPU (the interpreter)."""
    if device.type != "cuda":
        return 1
    return choose_num_splits(n, problems * row_blocks, block_n, sm_count(device), min_keys=4 * block_n)


def attention_rows(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    positions: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """queries ``[P, M, d]``, keys ``[P, n, d]``, values ``[P, n, d_v]`` (one dtype, any strides), ``positions``
    ``[M]`` int (row r sees keys ``j <= positions[r]``, at least key 0; None: every key). Returns ``lse [P, M]``
    float32 in log2 units (``log2 sum_j 2^(s_rj log2 e)``; +inf for a row that sees no key) and the attention output
    ``[P, M, d_v]`` float32. The keys run in ``splits`` parts (default :func:`key_splits`) combined by their
    log-sum-exp, FlashDecoding's split-K; ``block_m`` / ``block_n`` / ``splits`` / ``num_warps`` / ``num_stages``
    override the launch (tests, tile sweeps)."""
    reason = unsupported_reason(queries, keys, values, 1)
    if reason is not None:
        raise ValueError(f"fit products kernel: {reason}")
    problems, m, dim = queries.shape
    n, d_v = keys.shape[1], values.shape[-1]
    config = rows_config(dim, d_v, queries.dtype, positions is not None, block_m, block_n, num_warps, num_stages)
    row_blocks, block_n = cdiv(m, config["BLOCK_M"]), config["BLOCK_N"]
    splits = splits or key_splits(problems, row_blocks, n, block_n, queries.device)
    split_keys, splits = whole_tile_splits(n, splits, block_n)
    lse = torch.empty(splits, problems, m, dtype=torch.float32, device=queries.device)
    out = torch.empty(splits, problems, m, d_v, dtype=torch.float32, device=queries.device)
    pos = _positions(positions, queries.device)
    _attention_rows_kernel[(problems, row_blocks, splits)](
        queries, keys, values, pos, lse, out, m, n, dim, d_v, scaling * LOG2E, split_keys,
        *queries.stride(), *keys.stride(), *values.stride(), pos.stride(0), *lse.stride()[:2], *out.stride(),
        **config,
    )  # fmt: skip
    if splits > 1:
        lse, out = merge_partial_attentions(lse, out, base2=True)
    else:
        lse, out = lse[0], out[0]
    return lse.masked_fill_(lse == float("-inf"), float("inf")), out


def block_sums(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    positions: torch.Tensor | None,
    lse: torch.Tensor,
    kept_prob: torch.Tensor,
    lows: torch.Tensor,
    owners: torch.Tensor,
    bin_rows: int,
    span: int,
    width: int,
    *,
    set_rows: int | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fit's right-hand-side partials per block of ``span`` positions, never holding the ``[M, n]``
    probabilities or the block products. queries ``[P, M, d]``, keys ``[P, n, d]``, values ``[P, n, d_v]`` and
    ``positions`` as in :func:`attention_rows`, ``lse [P, M]`` its result; ``kept_prob [P, M, C]`` float32, ``lows
    [P, blocks]`` int64 (``blocks = ceil(n / span)``) each block's first bin, ``owners [P, blocks * span]`` int64
    each position's bin (-1: none). With ``c[j, w]`` block b's position ``j = b * span + i`` against column ``lows[:,
    b] * bin_rows + w`` of ``kept_prob`` summed over a set's rows, kept where ``owners[j] - lows[:, b] == w //
    bin_rows`` (0 for positions >= n and columns >= C), returns ``mass [P, sets, blocks, width]`` (``sum_j c[j,
    w]``) and ``vals [P, sets, blocks, width, d_v]`` (``sum_j c[j, w] v_j``), float32. The rows are summed in sets
    of ``set_rows`` consecutive rows (the last set may be shorter; None: one set of all ``M``), so that the fit's
    two query halves take one launch; ``block_m``, ``num_warps`` and ``num_stages`` override the launch (tests,
    tile sweeps)."""
    reason = unsupported_reason(queries, keys, values, width)
    if reason is not None:
        raise ValueError(f"fit products kernel: {reason}")
    problems, m, dim = queries.shape
    n, cols, d_v = keys.shape[1], kept_prob.shape[-1], values.shape[-1]
    set_rows = m if set_rows is None else set_rows
    if not 1 <= set_rows <= m:
        raise ValueError(f"set_rows: must be in [1, {m}] (the number of query rows), got {set_rows}")
    sets, blocks = -(-m // set_rows), lows.shape[1]
    if owners.shape != (problems, blocks * span):
        raise ValueError(f"owners: must have shape {(problems, blocks * span)}, got {tuple(owners.shape)}")
    config = products_config(dim, span, width, queries.dtype, positions is not None, block_m, num_warps, num_stages)
    mass = torch.empty(problems, sets, blocks, width, dtype=torch.float32, device=queries.device)
    vals = torch.empty(problems, sets, blocks, width, d_v, dtype=torch.float32, device=queries.device)
    pos = _positions(positions, queries.device)
    _block_sums_kernel[(problems, blocks, sets)](
        queries, keys, values, pos, lse, kept_prob, lows, owners, mass, vals,
        m, set_rows, n, dim, d_v, cols, span, width, bin_rows, scaling * LOG2E,
        *queries.stride(), *keys.stride(), *values.stride(), pos.stride(0), *kept_prob.stride(), *lows.stride(),
        *owners.stride(), *mass.stride(), *vals.stride(),
        **config,
    )  # fmt: skip
    return mass, vals
