"""CompressKV on plain tensors: RPNys (Alg. 1) and Alg. 2 (eq. (12)'s temperature: :mod:`kvcompress.bin_temperature`).

Reference implementation in PyTorch. Everything is batched over leading dimensions and bins; the
only Python loop is over the pivot steps of Alg. 1, which are sequential by nature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcompress import rng
from kvcompress._checks import (
    as_finite_float64,
    check_backend,
    check_bool,
    check_finite,
    check_float_tensor,
    check_int_range,
    check_positive,
)
from kvcompress.bin_temperature import kernel_coefficient

# Residual diagonal of the Gaussian kernel (its diagonal is 1) below which a bin counts as exhausted.
_EXHAUSTED = {torch.float32: 1e-5, torch.float64: 1e-12}
# Largest (|y_l|^2 - |y_s|^2) / 2 of a bin that RPNys computes in float32: Gaussian entries float32 flushes (below
# 2^-126) times e^60 stay under 2e-12, far below float32's rounding of the weights. Past it the weights come back
# non-finite (the callers' float64 fallback): a flushed entry times an infinite factor would otherwise hide as 0.
FLOAT32_SPREAD = 60.0


@dataclass
class RPNysResult:
    """Output of :func:`rpnys` for inputs ``[..., L, d]`` and ``rank`` pivots.

    pivots:  ``[..., rank]`` int64 row indices in selection order; -1 for inert rows (residual exhausted).
    weights: ``[..., rank, L]`` Nystrom weights ``W = h(K_S, K_S)^-1 h(K_S, K)`` of the kernel
             ``h(x, y) = exp(a <x, y>)``; inert rows are 0.
    """

    pivots: torch.Tensor
    weights: torch.Tensor


@torch.no_grad()
def rpnys(
    keys: torch.Tensor,
    rank: int,
    coefficient: torch.Tensor | float,
    step_keys: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> RPNysResult:
    """Randomly pivoted Nystrom (Alg. 1) for the kernel ``h(x, y) = exp(a <x, y>)``, batched.

    keys:        ``[..., L, d]`` (already recentred); computed in float32, or float64 for float64 input.
    coefficient: ``[...]`` the kernel coefficient ``a`` (beta / tau^2) per problem (a number or any shape that
                 broadcasts to ``[...]``).
    step_keys:   ``[..., rank]`` int64 random keys, one per pivot step (see :mod:`kvcompress.rng`).
    valid:       optional ``[..., L]`` bool mask; masked rows are never selected and get weight 0.
    Runs outside autograd (no graph through the pivot loop: :func:`compress_kv`).

    Stable form: with ``y = sqrt(a) x``, ``h = D G D`` for the Gaussian kernel
    ``G_ij = exp(-|y_i - y_j|^2 / 2)`` and ``D_i = exp(|y_i|^2 / 2)``. The Cholesky-style updates run
    on G (bounded by 1); pivots are drawn from the residual diagonal of h, ``res_G(l) exp(|y_l|^2)``,
    by the Gumbel-max trick in log space; the weights are mapped back by
    ``W_h[s, l] = W_G[s, l] exp((|y_l|^2 - |y_s|^2) / 2)``. A bin whose residual is exhausted stops
    early: its remaining rows are inert and the result is still an exact Nystrom approximation. In float32, a
    problem whose ``(max |y|^2 - min |y|^2) / 2`` exceeds ``FLOAT32_SPREAD`` gets NaN weights: recompute it in
    float64.

    Raises ValueError naming the argument for a keys tensor that is not floating point or not finite, a ``rank``
    outside ``[1, L]``, a ``coefficient`` that is not finite and >= 0 or does not broadcast to ``[...]``,
    ``step_keys`` that are not int64 of shape ``[..., rank]``, or a ``valid`` that is not bool of shape
    ``[..., L]``.
    """
    check_float_tensor("keys", keys, min_dim=2)
    check_finite("keys", keys)
    *lead, length, _ = keys.shape
    check_int_range("rank", rank, 1, length)
    coefficient = as_finite_float64("coefficient", coefficient)
    if bool((coefficient < 0).any()):
        raise ValueError("coefficient: must be >= 0 everywhere (the kernel exp(a <x, y>) needs a >= 0)")
    try:
        coefficient = torch.broadcast_to(coefficient.to(keys.device), tuple(lead))
    except RuntimeError as err:
        raise ValueError(
            f"coefficient: shape {tuple(coefficient.shape)} does not broadcast to the leading dims {tuple(lead)}"
        ) from err
    if not isinstance(step_keys, torch.Tensor) or step_keys.dtype != torch.int64:
        kind = step_keys.dtype if isinstance(step_keys, torch.Tensor) else type(step_keys).__name__
        raise ValueError(f"step_keys: must be an int64 torch.Tensor (see kvcompress.rng), got {kind}")
    if tuple(step_keys.shape) != (*lead, rank):
        raise ValueError(f"step_keys: must have shape {(*lead, rank)} ([..., rank]), got {tuple(step_keys.shape)}")
    if valid is not None and (
        not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or tuple(valid.shape) != (*lead, length)
    ):
        got = f"{valid.dtype} {tuple(valid.shape)}" if isinstance(valid, torch.Tensor) else type(valid).__name__
        raise ValueError(f"valid: must be a bool torch.Tensor of shape {(*lead, length)} ([..., L]), got {got}")
    return _rpnys(keys, rank, coefficient, step_keys.to(keys.device), valid)


def _rpnys(
    keys: torch.Tensor,
    rank: int,
    coefficient: torch.Tensor,
    step_keys: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> RPNysResult:
    """:func:`rpnys` on inputs the caller guarantees (no checks, no host reads before the pivot loop)."""
    compute = torch.float64 if keys.dtype == torch.float64 else torch.float32
    *lead, length, _ = keys.shape
    y = keys.to(compute) * coefficient.to(compute).clamp_min(0).sqrt().unsqueeze(-1).unsqueeze(-1)
    y = y.reshape(-1, length, y.shape[-1])
    problems = y.shape[0]
    mask = torch.ones(problems, length, dtype=torch.bool, device=y.device)
    if valid is not None:
        mask = valid.reshape(problems, length)
    step_keys = step_keys.reshape(problems, rank)

    sq_norm = (y * y).sum(-1)  # |y_l|^2
    residual = mask.to(compute)  # residual diagonal of G
    inverse = y.new_zeros(problems, rank, rank)  # M of Alg. 1 (in G space)
    rows = y.new_zeros(problems, rank, length)  # R of Alg. 1: G(y_s, y) per pivot
    pivots = torch.full((problems, rank), -1, dtype=torch.int64, device=y.device)
    batch = torch.arange(problems, device=y.device)
    floor = _EXHAUSTED[compute]

    for i in range(rank):
        log_residual = torch.where(residual > floor, residual.clamp_min(floor).log(), -math.inf)
        scores = log_residual + sq_norm + rng.gumbel(step_keys[:, i], length, compute)
        best, pivot = scores.max(-1)
        alive = best > -math.inf
        if not bool(alive.any()):
            break
        res_pivot = residual[batch, pivot]
        y_pivot = y[batch, pivot]  # [P, d]
        kernel_row = torch.exp(
            torch.einsum("pld,pd->pl", y, y_pivot) - 0.5 * sq_norm - 0.5 * sq_norm[batch, pivot, None]
        ).masked_fill(~mask, 0.0)
        # g = (M R[:, s], -1) / sqrt(res(s)) and M <- M + g g^T (eq. (7)); inactive problems get g = 0.
        g = y.new_zeros(problems, i + 1)
        g[:, :i] = torch.einsum("pij,pj->pi", inverse[:, :i, :i], rows[:, :i, :][batch, :, pivot])
        g[:, i] = -1.0
        g = g * torch.where(alive, res_pivot.clamp_min(floor).rsqrt(), torch.zeros_like(res_pivot))[:, None]
        inverse[:, : i + 1, : i + 1] += g[:, :, None] * g[:, None, :]
        rows[:, i] = kernel_row * alive[:, None]
        # Residual diagonal update of eq. (8), clamped at 0 and zeroed at the pivot.
        delta = torch.einsum("pi,pil->pl", g, rows[:, : i + 1])
        residual = (residual - delta * delta).clamp_min(0)
        residual[batch, pivot] = torch.where(alive, torch.zeros_like(res_pivot), residual[batch, pivot])
        pivots[:, i] = torch.where(alive, pivot, -1)

    weights_g = inverse @ rows  # W = M R, Gaussian-kernel weights
    chosen_sq = sq_norm.gather(1, pivots.clamp_min(0))
    weights = weights_g * torch.exp(0.5 * (sq_norm[:, None, :] - chosen_sq[:, :, None]))
    weights = torch.where(weights_g == 0, torch.zeros_like(weights), weights)
    if compute == torch.float32:
        spread = 0.5 * (sq_norm.masked_fill(~mask, -math.inf).amax(-1) - sq_norm.masked_fill(~mask, math.inf).amin(-1))
        weights = torch.where((spread > FLOAT32_SPREAD)[:, None, None], math.nan, weights)
    return RPNysResult(pivots=pivots.reshape(*lead, rank), weights=weights.reshape(*lead, rank, length))


def bin_bounds(n: int, bins: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` row ranges of ``bins`` bins over n rows; sizes differ by at most one
    (the first ``n % bins`` bins are one row longer)."""
    base, extra = divmod(n, bins)
    bounds, start = [], 0
    for b in range(bins):
        end = start + base + (b < extra)
        bounds.append((start, end))
        start = end
    return bounds


@torch.no_grad()
def compress_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    rank: int,
    *,
    bins: int = 1,
    scaling: float | None = None,
    query_radius: float | torch.Tensor | None = None,
    seed: int | None = None,
    backend: str = "auto",
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CompressKV (Alg. 2): a weighted coreset of ``rank`` rows for keys/values ``[..., n, d]``.

    Keys are recentred by their mean, the n rows split into ``bins`` contiguous bins (sizes differ by
    at most one), and each bin runs RPNys for ``rank // bins`` pivots under ``exp(beta <x, y> / tau^2)``
    with tau from eq. (12) (R_K = the bin's max recentred key norm; R_Q = ``query_radius``, default
    R_K). ``seed`` fixes the draws; the draws of bin b of problem p form stream ``p * bins + b``.

    Returns ``K_S [..., rank, d]`` (the ORIGINAL selected keys, in ``keys.dtype``), ``V_S = W V``
    ``[..., rank, d_v]`` (``values.dtype``) and ``w = W 1`` ``[..., rank]`` (float32; float64 for float64
    input). Rows of a bin whose residual ran out early are inert: ``w = 0`` and ``V_S = 0``. float32 / 16-bit input
    runs RPNys in float32 on either backend, and again in float64 (same draws) where its weights came out non-finite:
    an overflow, or a bin whose map-back factor ``exp((|y_l|^2 - |y_s|^2) / 2)`` could leave float32's range
    (:data:`FLOAT32_SPREAD`), which both backends report that way.

    ``backend``: ``"torch"`` (this reference), ``"triton"`` (one fused kernel launch, see
    :mod:`kvcompress.kernels.rpnys`: same draws, hence the same pivots up to float32 rounding; fp16 / bf16 /
    fp32 inputs, ``rank // bins <= 32``, bins of <= 256 rows) or ``"auto"`` (triton for CUDA tensors it
    supports when triton imports, else torch).

    ``check_inputs=False`` does not read the inputs' values before the kernel (finite keys and values, a finite
    positive ``query_radius``: on a GPU each read is a host-device sync); non-finite keys or values then give
    non-finite values and weights instead of an error. For callers that check finiteness themselves (the paper
    press reads every layer's once, after the prefill): the kernel's path then syncs once, on its result.

    Runs outside autograd (as :func:`rpnys`): a coreset is chosen, not differentiated, and a graph through the
    pivot loop's in-place updates was a reference cycle that outlived every call's result.
    """
    check_backend(backend)
    check_float_tensor("keys", keys, min_dim=2)
    check_float_tensor("values", values, min_dim=2)
    if values.dtype != keys.dtype or values.device != keys.device:
        raise ValueError(
            f"values: dtype/device must match keys ({keys.dtype}, {keys.device}), got ({values.dtype}, {values.device})"
        )
    if values.shape[:-1] != keys.shape[:-1]:
        raise ValueError(f"values: shape {tuple(values.shape)} must match keys {tuple(keys.shape)} except the last dim")
    *lead, n, dim = keys.shape
    if n < 1:
        raise ValueError("keys: need at least one row (n >= 1)")
    check_int_range("rank", rank, 1)
    check_int_range("bins", bins, 1)
    if rank % bins:
        raise ValueError(f"rank: must be a multiple of bins={bins}, got rank={rank}")
    per_bin = rank // bins
    if bins > 1 and n // bins < per_bin:
        raise ValueError(
            f"bins: the shortest bin has {n // bins} rows, fewer than its {per_bin} pivots (rank / bins); "
            f"use bins <= {n // per_bin} or a smaller rank"
        )
    check_int_range("rank", rank, 1, n)
    scaling = 1.0 / math.sqrt(dim) if scaling is None else check_positive("scaling", scaling)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    else:
        seed = check_int_range("seed", seed, -(2**63), 2**63 - 1)  # numpy integers too
    check_bool("check_inputs", check_inputs)
    if check_inputs:
        check_finite("keys", keys)
        check_finite("values", values)
    if _use_triton(backend, keys, values, bins, per_bin):
        result = _compress_kv_triton(keys, values, rank, bins, scaling, query_radius, seed, check_inputs)
        if bool(torch.isfinite(result[2]).all()):
            return result
        # exp(|y|^2 / 2) overflowed float32 in the kernel: the reference below redoes it in float64 (same draws).
    compute = torch.float64 if keys.dtype == torch.float64 else torch.float32
    if not check_inputs and not (bool(torch.isfinite(keys).all()) and bool(torch.isfinite(values).all())):
        # Reached on CPU, or after the kernel's non-finite result: the caller reports the inputs.
        nan = float("nan")
        return (keys[..., :rank, :], values.new_full((*lead, rank, values.shape[-1]), nan),
                torch.full((*lead, rank), nan, device=keys.device, dtype=compute))  # fmt: skip

    problems = math.prod(lead)
    flat_keys = keys.reshape(problems, n, dim)
    flat_values = values.reshape(problems, n, values.shape[-1])
    centred = flat_keys.to(compute) - flat_keys.to(compute).mean(1, keepdim=True)

    # Bins as a padded [P, B, L] view (the reference pays one gather; the GPU kernel masks instead).
    bounds = bin_bounds(n, bins)
    length = bounds[0][1] - bounds[0][0]
    starts = torch.tensor([s for s, _ in bounds], device=keys.device)
    sizes = torch.tensor([e - s for s, e in bounds], device=keys.device)
    offsets = torch.arange(length, device=keys.device)
    valid = offsets[None, :] < sizes[:, None]  # [B, L]
    index = torch.where(valid, starts[:, None] + offsets[None, :], 0)  # [B, L]
    binned = centred[:, index]  # [P, B, L, d]

    key_radius = binned.norm(dim=-1).masked_fill(~valid, 0).amax(-1).to(torch.float64)  # [P, B]
    if query_radius is None:
        q_radius = key_radius
    else:
        q_radius = _query_radius_tensor(query_radius, lead, keys.device, check_inputs)
        q_radius = q_radius.reshape(problems, 1).expand(problems, bins)
    coefficient = kernel_coefficient(
        torch.tensor(scaling, dtype=torch.float64), q_radius, key_radius, sizes.to(torch.float64)[None, :]
    )

    key = rng.seed_key(seed)
    streams = torch.arange(problems * bins, device=keys.device, dtype=torch.int64).reshape(problems, bins)
    step_keys = torch.stack([rng.stream_step_key(key, streams, i) for i in range(per_bin)], -1)
    result = _rpnys(binned, per_bin, coefficient, step_keys, valid.expand(problems, bins, length))
    if not bool(torch.isfinite(result.weights).all()):
        # exp(|y|^2 / 2) left the float32 range (huge beta R_Q R_K): redo the selection in float64.
        result = _rpnys(binned.double(), per_bin, coefficient, step_keys, valid.expand(problems, bins, length))

    weights = result.weights  # [P, B, k, L]; float64 after the fallback above
    values_binned = flat_values.to(weights.dtype)[:, index] * valid[None, :, :, None]
    compressed_values = torch.einsum("pbkl,pbld->pbkd", weights, values_binned)
    row_weights = weights.sum(-1)

    # Inert rows repeat the bin's first pivot key, so no phantom logit enters the max of Alg. 3.
    pivots = torch.where(result.pivots >= 0, result.pivots, result.pivots[..., :1])
    global_rows = (starts[None, :, None] + pivots).reshape(problems, rank)
    selected_keys = flat_keys.gather(1, global_rows[..., None].expand(problems, rank, dim))
    return (
        selected_keys.reshape(*lead, rank, dim),
        compressed_values.reshape(*lead, rank, values.shape[-1]).to(values.dtype),
        row_weights.reshape(*lead, rank).to(compute),  # float32 weights after a float64 fallback
    )


def _use_triton(backend: str, keys: torch.Tensor, values: torch.Tensor, bins: int, bin_rank: int) -> bool:
    """Resolve ``backend`` for validated inputs: True runs the Triton kernel; "triton" raises if it cannot."""
    if backend == "torch" or (backend == "auto" and keys.device.type != "cuda"):
        return False
    try:
        from kvcompress.kernels import rpnys as rpnys_kernel
    except ImportError as err:
        if backend == "auto":
            return False
        raise ValueError(f"backend: 'triton' needs the triton package ({err})") from err
    reason = rpnys_kernel.unsupported(keys, values, bins, bin_rank)
    if reason is not None and backend == "triton":
        raise ValueError(f"backend: the 'triton' kernel {reason}; use backend='torch'")
    return reason is None


def _compress_kv_triton(
    keys: torch.Tensor,
    values: torch.Tensor,
    rank: int,
    bins: int,
    scaling: float,
    query_radius: float | torch.Tensor | None,
    seed: int,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`compress_kv` through the fused kernel; the mean key is the only work done here."""
    from kvcompress.kernels.rpnys import rpnys_compress

    *lead, n, dim = keys.shape
    problems = math.prod(lead)
    flat_keys = keys.reshape(problems, n, dim)
    flat_values = values.reshape(problems, n, values.shape[-1])
    mean = flat_keys.mean(1, dtype=torch.float32)
    radius = None
    if query_radius is not None:
        radius = _query_radius_tensor(query_radius, lead, keys.device, check_inputs).reshape(problems)
    selected_keys, compressed_values, row_weights = rpnys_compress(
        flat_keys, flat_values, mean, rank, bins, scaling, radius, rng.seed_key(seed)
    )
    return (
        selected_keys.reshape(*lead, rank, dim),
        compressed_values.reshape(*lead, rank, values.shape[-1]),
        row_weights.reshape(*lead, rank),
    )


def _query_radius_tensor(
    query_radius: float | torch.Tensor, lead: list[int], device: torch.device, check: bool = True
) -> torch.Tensor:
    radius = torch.as_tensor(query_radius, dtype=torch.float64, device=device)
    try:
        radius = radius.expand(*lead) if lead else radius.reshape(())
    except RuntimeError as err:
        raise ValueError(
            f"query_radius: shape {tuple(radius.shape)} is not broadcastable to the leading dims {tuple(lead)}"
        ) from err
    if check and (not bool(torch.isfinite(radius).all()) or bool((radius <= 0).any())):
        raise ValueError("query_radius: must be finite and > 0")
    return radius
