"""Attention mass as a fused two-pass Triton kernel: the softmax probabilities of ``m`` queries over ``n`` keys,
reduced over the queries (and their GQA group) per key, without ever holding the ``m x n`` probabilities.

For a KV head with query rows ``r`` (the ``group * m`` (query head, query) pairs of its GQA group) and keys ``j``::

    s_rj = scaling * <q_r, k_j>        (key j visible to row r iff j <= position(r) and key_mask[j])
    p_rj = exp(s_rj - lse_r),          lse_r = log sum_{visible j} exp(s_rj)
    out_j = sum_r p_rj   (reduce="sum")   or   max_r p_rj   (reduce="max", KVzip's score)

Pass 1, one program per (batch * KV head, block of rows): the rows stay on chip while the program runs over
the key tiles they can see with an online max and sum (FlashAttention style, fp32, log2 units) and writes
``lse_r`` (``+inf`` for a row that sees no key, so it contributes 0). Pass 2, one program per (batch * KV head,
block of keys): the key tile stays on chip while the program runs over every row block, recomputes
``s_rj`` with the same dot, and reduces ``exp2(s_rj - lse_r)`` over the rows; row blocks whose every row is
causally before the tile are skipped. Dots run on the inputs' dtype (bf16 / fp16 tensor cores) with fp32
accumulation; any strides, no copies.

When an attention over these queries already ran, its row log-sum-exp can be handed in (``row_lse``) and pass 1 is
skipped: the probabilities are then that softmax's, whatever keys it covered beyond these (the repeat chunk's own).

Work per (batch, KV head): ``4 * group * m * n * d`` FLOPs (the ``QK^T`` of both passes), less the causal skip;
memory: ``group * m`` fp32 row statistics and the ``[n]`` output. Set ``TRITON_INTERPRET=1`` before importing
this module to run it on CPU tensors (tests); the public entry is :func:`kvcompress.selection.attention_mass`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvcompress.kernels.launch import cdiv, dot_in_fp32, next_power_of_2

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # what triton.jit saw when these kernels were defined

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
REDUCTIONS = ("sum", "max")
LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: exp2(m_old - m_new) never sees inf - inf


@triton.jit
def _logits(q, k_base, offs_n, offs_d, n_mask, d_mask, row_pos, mask_base, s_kn, s_kd, s_mn, qk_scale,
            HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    """Scaled logits (log2 units) of the rows ``q [R, D]`` against one key tile ``[N]``; invisible keys -inf."""
    kt = tl.load(k_base + offs_n[None, :] * s_kn + offs_d[:, None] * s_kd,
                 mask=d_mask[:, None] & n_mask[None, :], other=0.0)  # fmt: skip
    if DOT_FP32:
        kt = kt.to(tl.float32)
    s = tl.dot(q, kt, input_precision="ieee") * qk_scale
    visible = n_mask[None, :]
    if HAS_POS:
        visible = visible & (offs_n[None, :] <= row_pos[:, None])
    if HAS_MASK:  # padding / filler keys of this batch row: invisible to every query
        real = tl.load(mask_base + offs_n * s_mn, mask=n_mask, other=0)
        visible = visible & (real != 0)[None, :]
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _load_rows(q_ptr, pos_ptr, b, h, r0, GROUP, M, ROWS, N, s_qb, s_qh, s_qm, s_qd, s_p, offs_d, d_mask,
               BLOCK_R: tl.constexpr, HAS_POS: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    """One block of rows: queries ``[R, D]``, each row's last visible key, its row index and validity."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < ROWS
    token = offs_r % M
    head = h * GROUP + offs_r // M  # query head of each row (any query strides)
    q = tl.load(q_ptr + b * s_qb + head[:, None] * s_qh + token[:, None] * s_qm + offs_d[None, :] * s_qd,
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
    if DOT_FP32:
        q = q.to(tl.float32)
    if HAS_POS:
        row_pos = tl.load(pos_ptr + token * s_p, mask=r_mask, other=-1)
    else:
        row_pos = tl.zeros([BLOCK_R], tl.int64) + (N - 1)
    row_pos = tl.where(r_mask, row_pos, -1)
    return q, row_pos, offs_r, r_mask


@triton.jit
def _row_lse_kernel(
    q_ptr, k_ptr, pos_ptr, mask_ptr, lse_ptr,
    H_KV, GROUP, M, ROWS, N, qk_scale,
    s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_p, s_mb, s_mn,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Pass 1, one program per (batch * KV head, row block): ``lse_r`` (log2 units) of every row of the block."""
    bh = tl.program_id(0)
    b = (bh // H_KV).to(tl.int64)
    h = (bh % H_KV).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    q, row_pos, offs_r, r_mask = _load_rows(
        q_ptr, pos_ptr, b, h, tl.program_id(1) * BLOCK_R, GROUP, M, ROWS, N, s_qb, s_qh, s_qm, s_qd, s_p,
        offs_d, d_mask, BLOCK_R, HAS_POS, DOT_FP32,
    )  # fmt: skip
    hi = tl.minimum(N, tl.max(row_pos, 0) + 1).to(tl.int32)  # keys past every row's position are never read
    k_base = k_ptr + b * s_kb + h * s_kh
    mask_base = mask_ptr + b * s_mb
    m_i = tl.full([BLOCK_R], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        s = _logits(q, k_base, offs_n, offs_d, offs_n < hi, d_mask, row_pos, mask_base, s_kn, s_kd, s_mn,
                    qk_scale, HAS_POS, HAS_MASK, DOT_FP32)  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
    tl.store(lse_ptr + bh.to(tl.int64) * ROWS + offs_r, lse, mask=r_mask)


@triton.jit
def _column_kernel(
    q_ptr, k_ptr, pos_ptr, mask_ptr, lse_ptr, out_ptr,
    H_KV, GROUP, M, ROWS, N, qk_scale,
    s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_p, s_mb, s_mn,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr, REDUCE_MAX: tl.constexpr,
):  # fmt: skip
    """Pass 2, one program per (batch * KV head, key block): the rows' probabilities reduced per key."""
    bh = tl.program_id(0)
    b = (bh // H_KV).to(tl.int64)
    h = (bh % H_KV).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    first_key = tl.program_id(1) * BLOCK_N
    k_base = k_ptr + b * s_kb + h * s_kh
    mask_base = mask_ptr + b * s_mb
    acc = tl.zeros([BLOCK_N], tl.float32)
    for r0 in range(0, ROWS, BLOCK_R):
        q, row_pos, offs_r, r_mask = _load_rows(
            q_ptr, pos_ptr, b, h, r0, GROUP, M, ROWS, N, s_qb, s_qh, s_qm, s_qd, s_p,
            offs_d, d_mask, BLOCK_R, HAS_POS, DOT_FP32,
        )  # fmt: skip
        if tl.max(row_pos, 0) >= first_key:  # some row of the block sees a key of this tile
            lse = tl.load(lse_ptr + bh.to(tl.int64) * ROWS + offs_r, mask=r_mask, other=float("inf"))
            s = _logits(q, k_base, offs_n, offs_d, n_mask, d_mask, row_pos, mask_base, s_kn, s_kd, s_mn,
                        qk_scale, HAS_POS, HAS_MASK, DOT_FP32)  # fmt: skip
            p = tl.exp2(s - lse[:, None])  # invisible keys and empty rows: exp2(-inf) = 0
            if REDUCE_MAX:
                acc = tl.maximum(acc, tl.max(p, 0))
            else:
                acc += tl.sum(p, 0)
    tl.store(out_ptr + bh.to(tl.int64) * N + offs_n, acc, mask=n_mask)


def unsupported_reason(queries: torch.Tensor, keys: torch.Tensor) -> str | None:
    """Why the kernel cannot run these (already validated) inputs, or None if it can."""
    if queries.device.type != "cuda" and not INTERPRET:
        return f"needs CUDA tensors (got {queries.device}); on CPU set TRITON_INTERPRET=1 before importing"
    if queries.dtype not in SUPPORTED_DTYPES or keys.dtype != queries.dtype:
        return f"queries/keys must share a dtype of float16, bfloat16 or float32, got {queries.dtype}/{keys.dtype}"
    if not 1 <= queries.shape[-1] <= MAX_HEAD_DIM:
        return f"head dim must be in [1, {MAX_HEAD_DIM}], got {queries.shape[-1]}"
    return None


def launch_config(
    dim: int,
    dtype: torch.dtype,
    has_pos: bool,
    has_mask: bool,
    reduce: str = "sum",
    block_r: int | None = None,
    block_n: int | None = None,
) -> tuple[dict, dict]:
    """Launch options (constexprs, warps, stages) of the two passes for head dim ``dim`` and input ``dtype``;
    ``block_r`` / ``block_n`` (powers of two >= 16) override the tiles (tests, tuning)."""
    block_d = max(16, next_power_of_2(dim))
    wide = block_d > 128
    if dtype == torch.float32:  # FMA dots: tiles small enough not to spill registers on sm_90 (eval.compile_kernels)
        block_r, block_n1, block_n2, warps = block_r or 16, block_n or 16, block_n or 16, 4
    else:
        # Pass 1 streams keys past resident rows (FlashAttention tiles); pass 2 streams rows past a resident key
        # tile, so a wider tile there amortises every query load over more keys. 8 warps: 4 spilled below d = 128.
        block_r, block_n1, block_n2, warps = (
            block_r or (64 if wide else 128),
            block_n or (32 if wide else 64),
            block_n or (64 if wide else 128),
            8,
        )
    dot_fp32 = dot_in_fp32(dtype, INTERPRET)
    flags = dict(
        D=dim, BLOCK_R=block_r, BLOCK_D=block_d, HAS_POS=has_pos, HAS_MASK=has_mask, DOT_FP32=dot_fp32,
        num_warps=warps, num_stages=2,
    )  # fmt: skip
    return dict(flags, BLOCK_N=block_n1), dict(flags, BLOCK_N=block_n2, REDUCE_MAX=reduce == "max")


def _launch(queries, keys, scaling, query_positions, key_mask, reduce, block_r, block_n):
    """Shapes, pointers and per-pass options both launchers share."""
    reason = unsupported_reason(queries, keys)
    if reason is not None:
        raise ValueError(f"attention mass kernel: {reason}")
    batch, heads_q, m, dim = queries.shape
    _, heads_kv, n, _ = keys.shape
    rows = heads_q // heads_kv * m
    device = queries.device
    positions = query_positions.to(device=device, dtype=torch.int64) if query_positions is not None else None
    pos_t = positions if positions is not None else torch.zeros(1, dtype=torch.int64, device=device)
    mask_t = key_mask.view(torch.uint8) if key_mask is not None else torch.zeros(1, 1, dtype=torch.uint8, device=device)
    rows_pass, column_pass = launch_config(
        dim, queries.dtype, positions is not None, key_mask is not None, reduce, block_r, block_n
    )
    common = (
        heads_kv, heads_q // heads_kv, m, rows, n, scaling * LOG2E,
        *queries.stride(), *keys.stride(), pos_t.stride(0), *mask_t.stride(),
    )  # fmt: skip
    return pos_t, mask_t, common, rows_pass, column_pass


def _row_lse_log2(queries, keys, pos_t, mask_t, common, rows_pass) -> torch.Tensor:
    """Pass 1: ``[b * h_kv, group * m]`` float32 log2 normalisers (a KV head's rows: its group's query heads one
    after the other, each over the m queries; ``+inf`` for a row that sees no key)."""
    batch, heads_kv, rows = queries.shape[0], keys.shape[1], common[3]
    lse = torch.empty(batch * heads_kv, rows, dtype=torch.float32, device=queries.device)
    _row_lse_kernel[(batch * heads_kv, cdiv(rows, rows_pass["BLOCK_R"]))](
        queries, keys, pos_t, mask_t, lse, *common, **rows_pass
    )
    return lse


def row_lse_kernel(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    query_positions: torch.Tensor | None = None,
    *,
    key_mask: torch.Tensor | None = None,
    block_r: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Pass 1 alone: each query's softmax normaliser ``log sum_{visible j} exp(scaling <q, k_j>)``, natural log,
    ``[b, h_q, m]`` float32 (``+inf`` for a query that sees no key); arguments as :func:`attention_mass_kernel`."""
    pos_t, mask_t, common, rows_pass, _ = _launch(
        queries, keys, scaling, query_positions, key_mask, "sum", block_r, block_n
    )
    lse = _row_lse_log2(queries, keys, pos_t, mask_t, common, rows_pass)
    return (lse / LOG2E).reshape(queries.shape[:3])


def attention_mass_kernel(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    query_positions: torch.Tensor | None = None,
    *,
    reduce: str = "sum",
    key_mask: torch.Tensor | None = None,
    row_lse: torch.Tensor | None = None,
    block_r: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Launcher of both passes: queries ``[b, h_q, m, d]``, keys ``[b, h_kv, n, d]`` (same dtype, any strides),
    ``query_positions [m]`` int (query i sees keys ``j <= query_positions[i]``; None: every key), ``key_mask``
    ``[b, n]`` bool (False: a key no query sees). ``row_lse``: ``[b, h_q, m]`` float32 natural-log normaliser of
    each query's softmax, when an attention that already ran computed it: pass 1 is skipped. Inputs must be
    validated by :func:`kvcompress.selection.attention_mass`. ``block_r`` / ``block_n``: tile sizes (powers of two
    >= 16) overriding the defaults (tests, tuning). Returns ``[b, h_kv, n]`` float32."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce: must be one of 'sum', 'max', got {reduce!r}")
    pos_t, mask_t, common, rows_pass, column_pass = _launch(
        queries, keys, scaling, query_positions, key_mask, reduce, block_r, block_n
    )
    batch, heads_kv, n = keys.shape[0], keys.shape[1], keys.shape[2]
    if row_lse is None:
        lse = _row_lse_log2(queries, keys, pos_t, mask_t, common, rows_pass)
    else:  # rows of a KV head: its group's query heads one after the other, each over the m queries; log2 units
        lse = (row_lse.to(device=queries.device, dtype=torch.float32) * LOG2E).reshape(batch * heads_kv, -1)
    out = torch.empty(batch, heads_kv, n, dtype=torch.float32, device=queries.device)
    _column_kernel[(batch * heads_kv, cdiv(n, column_pass["BLOCK_N"]))](
        queries, keys, pos_t, mask_t, lse, out, *common, **column_pass
    )
    return out
