"""Binned RPNys + compression (Alg. 1 per bin, then Alg. 2's ``V_S = W V``, ``w = W 1``) as one Triton kernel.

One launch per call, grid ``(problems, bins)``; one program does the whole of one bin on chip:

1. load the bin's ``L`` key rows once (``[BLOCK_L, BLOCK_D]``, ragged bins masked, no padded copy), recentre
   them by the problem's mean key, take ``R_K`` = their max norm and the coefficient ``a = beta / tau^2`` of
   eq. (12) (Lambert W0 by App. L's iteration, float64 scalars), then ``y = sqrt(a) x`` and ``|y|^2``;
2. ``k = rank // bins`` pivot steps of Alg. 1 in the Gaussian-kernel form (the stable form of
   :func:`kvcompress.nystrom.rpnys`): Gumbel-max over ``log res_G + |y|^2 + gumbel`` (the counter-based draws of
   :mod:`kvcompress.rng`, reproduced bit for bit in uint32 arithmetic), the kernel row ``G(y_s, y)``,
   ``g = (M R[:, s], -1) / sqrt(res_G(s))``, ``M <- M + g g^T`` (eq. (7)), ``res_G <- res_G - (g^T R)^2``
   (eq. (8)), clamped at 0 and zeroed at the pivot; an exhausted bin (``res_G <= 1e-5``) makes inert rows;
3. ``W_G = M R``, ``W_h = W_G exp((|y_l|^2 - |y_s|^2) / 2)``, then ``V_S = W_h V`` (V loaded once),
   ``w = W_h 1``, and ``K_S`` = the original key rows of the pivots, written straight into the outputs.
   Where ``exp`` leaves float32 (huge ``a R_K^2``), ``w`` comes out non-finite and ``compress_kv`` redoes the
   call with the PyTorch reference, whose float64 retry handles it (one host sync on ``w``).

For the same seed the pivots are those of the reference: the draws are bit-identical (the Gumbel logs run in
float64 and are rounded to fp32 like ``rng.gumbel``) and the updates run in the reference's order, so only
float32 reduction orders differ (~1e-6 relative in ``V_S``, ``w``); a near-tie of two scores could still flip.

Bytes per call (``es`` = element size of K/V): the kernel reads K (``P n d es``) and V (``P n d_v es``) once,
the fp32 mean key (``4 P d``) and re-reads the ``rank`` selected key rows (``P rank d es``, L2-hot, to copy
them bit-exactly); it writes ``K_S`` (``P rank d es``), ``V_S`` (``P rank d_v es``) and ``w`` (``4 P rank``).
The caller's mean key (one more read of K) is the only other pass over the cache.

State per program (fp32): ``Y [BLOCK_L, BLOCK_D]``, ``R [BLOCK_K, BLOCK_L]``, ``M [BLOCK_K, BLOCK_K]`` and a
few ``[BLOCK_L]`` vectors; ``V [BLOCK_L, BLOCK_DV]`` is loaded after the pivot loop, when Y is dead.
Limits: ``k <= 32``, ``L = ceil(n / bins) <= 256``, ``d, d_v <= 256``, ``bins <= 65535``.

Set ``TRITON_INTERPRET=1`` before importing this module to run it on CPU tensors (tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvcompress.kernels.launch import next_power_of_2
from kvcompress.lambert import RHO0
from kvcompress.nystrom import FLOAT32_SPREAD

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # what triton.jit saw when this kernel was defined

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BIN_RANK = 32
MAX_BIN_LENGTH = 256
MAX_HEAD_DIM = 256
MAX_BINS = 65535  # CUDA's limit on grid axis 1
# A bin's rows x head dim, padded to powers of two: its float32 tile lives in shared memory (256 x 256 needs 272 KiB
# on sm_90, above an H100's 227 KiB; 128 x 256 needs 136 KiB, within an A100's 163: eval.compile_kernels).
MAX_TILE = 128 * 256
EXHAUSTED = 1e-5  # residual floor of the fp32 reference (nystrom._EXHAUSTED[torch.float32])


def _split(x: float) -> tuple[float, float]:
    """A float64 as hi + lo float32 parts (Triton passes Python floats as fp32): exact to ~2^-48 relative."""
    hi = float(torch.tensor(x, dtype=torch.float32))
    return hi, float(torch.tensor(x - hi, dtype=torch.float32))


_RHO0_HI, _RHO0_LO = _split(RHO0)


@triton.jit
def _mix32(x):
    """lowbias32 of uint32 values (``rng.mix32``): xor, logical shifts, multiply mod 2^32."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _lambert_w0(z):
    """W0(z) for float64 z >= 2 / (2 rho0) (``nystrom.lambert_w0``: App. L's iteration, 8 steps)."""
    log_z = tl.log(z)
    e = tl.exp(tl.full([], 1.0, tl.float64))
    w = tl.where(z > e, log_z - tl.log(tl.maximum(log_z, 1.0)), z / e)
    for _ in tl.static_range(8):
        w = w / (1 + w) * (1 + log_z - tl.log(w))
    return w


@triton.jit(do_not_specialize=["seed_key"])
def _rpnys_bins_kernel(
    k_ptr, v_ptr, mean_ptr, qr_ptr, ks_ptr, vs_ptr, w_ptr,
    n, dim, dim_v, bins, seed_key, beta_hi, beta_lo, rho_hi, rho_lo,
    s_kp, s_kn, s_kd,
    s_vp, s_vn, s_vd,
    s_ksp, s_ksr, s_ksd,
    s_vsp, s_vsr, s_vsd,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_QR: tl.constexpr, FLOOR: tl.constexpr, SPREAD: tl.constexpr,
):  # fmt: skip
    """One program = bin ``b`` of problem ``p``: Alg. 1 for ``K`` pivots, then ``K_S``, ``V_S``, ``w`` (see module)."""
    p = tl.program_id(0)
    b = tl.program_id(1)
    p64 = p.to(tl.int64)
    base = n // bins
    extra = n % bins
    start = b * base + tl.minimum(b, extra)  # bin_bounds: the first n % bins bins are one row longer
    size = base + (b < extra).to(tl.int32)

    offs_l = tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    valid = offs_l < size
    d_mask = offs_d < dim

    # ---- Alg. 2 per bin, from the bin's keys loaded once: recentre, R_K, tau and a = beta / tau^2 (eq. 12),
    # then y = sqrt(a) x and |y|^2
    rows = (start + offs_l).to(tl.int64)
    k_ptrs = k_ptr + p64 * s_kp + rows[:, None] * s_kn + offs_d[None, :] * s_kd
    tile = tl.load(k_ptrs, mask=valid[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + p64 * dim + offs_d, mask=d_mask, other=0.0)
    x = tl.where(valid[:, None] & d_mask[None, :], tile - mean[None, :], 0.0)
    key_radius = tl.max(tl.sqrt_rn(tl.sum(x * x, 1)), 0).to(tl.float64)
    flat = key_radius <= 0
    r_k = tl.where(flat, 1.0, key_radius)
    if HAS_QR:
        r_q = tl.load(qr_ptr + p64)
    else:
        r_q = r_k
    beta = tl.cast(beta_hi, tl.float64) + tl.cast(beta_lo, tl.float64)
    rho0 = tl.cast(rho_hi, tl.float64) + tl.cast(rho_lo, tl.float64)
    b0 = tl.log(size.to(tl.float64)) / (beta * r_q * r_k) + 2
    tau = tl.sqrt(r_k / r_q * b0 / (2 * _lambert_w0(b0 / (2 * rho0))))
    coefficient = tl.where(flat, 0.0, beta / (tau * tau)).to(tl.float32)
    root = tl.sqrt_rn(tl.maximum(coefficient, 0.0))
    y = x * root
    sq = tl.sum(y * y, 1)  # |y_l|^2

    # ---- Alg. 1 on G = exp(-|y_i - y_j|^2 / 2)
    stream = (p * bins + b).to(tl.uint32)
    stream_hash = _mix32(stream ^ tl.cast(seed_key, tl.uint32, bitcast=True))
    position_hash = _mix32(offs_l.to(tl.uint32) + 0x632BE5AB)
    residual = valid.to(tl.float32)
    inverse = tl.zeros([BLOCK_K, BLOCK_K], dtype=tl.float32)  # M (G space)
    kernel_rows = tl.zeros([BLOCK_K, BLOCK_L], dtype=tl.float32)  # R: G(y_s, y) per pivot
    pivots = tl.full([BLOCK_K], -1, tl.int32)
    pivot_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    c1 = tl.full([], 0x7FEB352D, tl.uint32)
    c2 = tl.full([], 0x846CA68B, tl.uint32)
    for i in range(K):
        # Alg. 1's draw s ~ res_h(l) = res_G(l) exp(|y_l|^2), by Gumbel-max in log space. The bits of rng.gumbel:
        # step key mix32(stream_hash ^ i), then mix32(step key ^ position_hash) (_mix32 written out: the loop
        # makes no function calls); float64 logs, then fp32, like the reference.
        bits = stream_hash ^ tl.cast(i, tl.uint32)
        bits = bits ^ (bits >> 16)
        bits = bits * c1
        bits = bits ^ (bits >> 15)
        bits = bits * c2
        bits = (bits ^ (bits >> 16)) ^ position_hash
        bits = bits ^ (bits >> 16)
        bits = bits * c1
        bits = bits ^ (bits >> 15)
        bits = bits * c2
        bits = bits ^ (bits >> 16)
        uniform = ((bits >> 8).to(tl.float64) + 0.5) / 16777216.0
        gumbel = (-tl.log(-tl.log(uniform))).to(tl.float32)
        log_residual = tl.where(residual > FLOOR, tl.log(tl.maximum(residual, FLOOR)), -float("inf"))
        best, pivot = tl.max(log_residual + sq + gumbel, 0, return_indices=True)
        alive = best > -float("inf")  # else the bin is exhausted: this and all later rows are inert
        hit = offs_l == pivot
        res_pivot, sq_pivot = tl.split(tl.sum(tl.where(hit[:, None], tl.join(residual, sq), 0.0), 0))  # one reduction
        y_pivot = tl.sum(tl.where(hit[:, None], y, 0.0), 0)  # [BLOCK_D]
        kernel_row = tl.exp(tl.sum(y * y_pivot[None, :], 1) - 0.5 * sq - 0.5 * sq_pivot)
        kernel_row = tl.where(valid, tl.where(alive, kernel_row, 0.0), 0.0)  # (no "&" on the scalar: interpreter)
        # g = (M R[:, s], -1) / sqrt(res(s)), M <- M + g g^T (eq. (7)); rows >= i of M and R are still 0.
        column = tl.sum(tl.where(hit[None, :], kernel_rows, 0.0), 1)  # R[:, s]
        g = tl.sum(inverse * column[None, :], 1)
        g = tl.where(offs_k == i, -1.0, g)
        g = g * tl.where(alive, tl.math.rsqrt(tl.maximum(res_pivot, FLOOR)), 0.0)
        inverse = inverse + g[:, None] * g[None, :]
        kernel_rows = tl.where(offs_k[:, None] == i, kernel_row[None, :], kernel_rows)
        # Residual diagonal, eq. (8): clamp at 0, zero at the pivot.
        delta = tl.sum(g[:, None] * kernel_rows, 0)
        residual = tl.maximum(residual - delta * delta, 0.0)
        residual = tl.where(hit, tl.where(alive, 0.0, residual), residual)
        pivots = tl.where(offs_k == i, tl.where(alive, pivot, -1), pivots)
        pivot_sq = tl.where(offs_k == i, sq_pivot, pivot_sq)

    # ---- W_G = M R, W_h = W_G exp((|y_l|^2 - |y_s|^2) / 2); an overflow shows as a non-finite w (caller's fallback)
    weights_g = tl.dot(inverse, kernel_rows, input_precision="ieee")  # [BLOCK_K, BLOCK_L]
    weights = weights_g * tl.exp(0.5 * (sq[None, :] - pivot_sq[:, None]))
    weights = tl.where(weights_g == 0, 0.0, weights)
    # A factor past float32's range meets entries flushed to 0 (0 * inf hidden as 0): NaN, the caller's fallback.
    spread = 0.5 * (tl.max(tl.where(valid, sq, -float("inf")), 0) - tl.min(tl.where(valid, sq, float("inf")), 0))
    weights = tl.where(spread > SPREAD, float("nan"), weights)

    # ---- outputs: w = W 1, V_S = W V, K_S = original pivot keys (inert rows repeat the first pivot)
    out_rows = b * K + offs_k
    k_rows = offs_k < K
    tl.store(w_ptr + p64 * (bins * K) + out_rows, tl.sum(weights, 1), mask=k_rows)

    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < dim_v
    v_ptrs = v_ptr + p64 * s_vp + rows[:, None] * s_vn + offs_dv[None, :] * s_vd
    values = tl.load(v_ptrs, mask=valid[:, None] & dv_mask[None, :], other=0.0).to(tl.float32)
    compressed = tl.dot(weights, values, input_precision="ieee")  # [BLOCK_K, BLOCK_DV]
    vs_ptrs = vs_ptr + p64 * s_vsp + out_rows[:, None] * s_vsr + offs_dv[None, :] * s_vsd
    tl.store(vs_ptrs, compressed.to(vs_ptr.dtype.element_ty), mask=k_rows[:, None] & dv_mask[None, :])

    first = tl.sum(tl.where(offs_k == 0, pivots, 0), 0)
    chosen = (start + tl.where(pivots >= 0, pivots, first)).to(tl.int64)
    key_rows = tl.load(
        k_ptr + p64 * s_kp + chosen[:, None] * s_kn + offs_d[None, :] * s_kd,
        mask=k_rows[:, None] & d_mask[None, :],
    )
    ks_ptrs = ks_ptr + p64 * s_ksp + out_rows[:, None] * s_ksr + offs_d[None, :] * s_ksd
    tl.store(ks_ptrs, key_rows, mask=k_rows[:, None] & d_mask[None, :])


def unsupported(keys: torch.Tensor, values: torch.Tensor, bins: int, bin_rank: int) -> str | None:
    """Why this kernel cannot run ``compress_kv`` on these inputs (``[..., n, d]``), or None if it can."""
    if keys.dtype not in SUPPORTED_DTYPES:
        return f"supports {', '.join(str(t) for t in SUPPORTED_DTYPES)} inputs (fp32 compute), got {keys.dtype}"
    if keys.device.type != "cuda" and not INTERPRET:
        return (
            f"runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1 set before triton is imported), "
            f"got a {keys.device.type} tensor"
        )
    length = -(-keys.shape[-2] // bins)
    if bin_rank > MAX_BIN_RANK or length > MAX_BIN_LENGTH:
        return (
            f"supports rank // bins <= {MAX_BIN_RANK} and bin length ceil(n / bins) <= {MAX_BIN_LENGTH}, "
            f"got {bin_rank} and {length}"
        )
    if bins > MAX_BINS:
        return f"supports bins <= {MAX_BINS} (CUDA grid axis 1), got {bins}"
    if keys.shape[-1] > MAX_HEAD_DIM or values.shape[-1] > MAX_HEAD_DIM:
        return f"supports head dims <= {MAX_HEAD_DIM}, got d={keys.shape[-1]}, d_v={values.shape[-1]}"
    options = launch_options(keys.shape[-2], keys.shape[-1], values.shape[-1], bins * bin_rank, bins, False)
    tile = options["BLOCK_L"] * max(options["BLOCK_D"], options["BLOCK_DV"])
    if tile > MAX_TILE:
        return (
            f"supports bin length x head dim tiles up to {MAX_TILE} elements (powers of two: shared memory), got "
            f"{options['BLOCK_L']} x {max(options['BLOCK_D'], options['BLOCK_DV'])} (bin length {length}, "
            f"d={keys.shape[-1]}, d_v={values.shape[-1]})"
        )
    return None


def launch_options(n: int, dim: int, dim_v: int, rank: int, bins: int, has_radius: bool) -> dict:
    """The kernel's constexprs and launch options for ``rank`` pivots over ``bins`` bins of an ``n``-row problem:
    what :func:`rpnys_compress` passes, and what ``eval.compile_kernels`` compiles for a GPU without one."""
    per_bin = rank // bins
    block_l = max(16, next_power_of_2(-(-n // bins)))
    block_d, block_dv = max(16, next_power_of_2(dim)), max(16, next_power_of_2(dim_v))
    tile = block_l * max(block_d, block_dv)
    return dict(
        K=per_bin, BLOCK_K=max(16, next_power_of_2(per_bin)), BLOCK_L=block_l, BLOCK_D=block_d,
        BLOCK_DV=block_dv, HAS_QR=has_radius, FLOOR=EXHAUSTED, SPREAD=FLOAT32_SPREAD,
        num_warps=4 if tile <= 4096 else 8 if tile <= 16384 else 16, num_stages=1,
    )  # fmt: skip


def rpnys_compress(
    keys: torch.Tensor,
    values: torch.Tensor,
    mean: torch.Tensor,
    rank: int,
    bins: int,
    scaling: float,
    query_radius: torch.Tensor | None,
    seed_key: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the kernel: binned RPNys + compression of ``P`` problems in one go.

    keys ``[P, n, d]`` and values ``[P, n, d_v]`` (fp16 / bf16 / fp32, any strides); mean ``[P, d]`` float32,
    the mean key of each problem; query_radius ``[P]`` float64 (None: R_Q = R_K per bin); seed_key: the
    32-bit ``rng.seed_key(seed)``. Validation is the caller's (``compress_kv``; see :func:`unsupported`).
    Returns ``K_S [P, rank, d]`` (keys.dtype), ``V_S [P, rank, d_v]`` (values.dtype), ``w [P, rank]`` float32.
    """
    problems, n, dim = keys.shape
    dim_v = values.shape[-1]
    mean = mean.to(torch.float32).contiguous()
    selected_keys = torch.empty(problems, rank, dim, dtype=keys.dtype, device=keys.device)
    compressed_values = torch.empty(problems, rank, dim_v, dtype=values.dtype, device=values.device)
    row_weights = torch.empty(problems, rank, dtype=torch.float32, device=keys.device)
    radius = mean if query_radius is None else query_radius.to(torch.float64).contiguous()
    beta_hi, beta_lo = _split(scaling)
    key32 = seed_key - 2**32 if seed_key >= 2**31 else seed_key  # the same 32 bits as an int32 argument
    _rpnys_bins_kernel[(problems, bins)](
        keys, values, mean, radius, selected_keys, compressed_values, row_weights,
        n, dim, dim_v, bins, key32, beta_hi, beta_lo, _RHO0_HI, _RHO0_LO,
        *keys.stride(), *values.stride(), *selected_keys.stride(), *compressed_values.stride(),
        **launch_options(n, dim, dim_v, rank, bins, query_radius is not None),
    )  # fmt: skip
    return selected_keys, compressed_values, row_weights


__all__ = [
    "INTERPRET", "MAX_BINS", "MAX_BIN_LENGTH", "MAX_BIN_RANK", "MAX_HEAD_DIM", "MAX_TILE", "launch_options",
    "rpnys_compress", "unsupported",
]  # fmt: skip
