"""The attention-matching fit's normal equations (:mod:`kvcompress.fitting`) from one set of reference queries:
sums over the queries of products of their probabilities over the ``n`` context rows.

Two paths with one result: on CPU (and wherever the kernels cannot run) the probabilities ``[P, M, n]`` are held a
chunk of queries at a time and the sums are batched matmuls over them; on a GPU the fused kernels of
:mod:`kvcompress.kernels.fit_products` never hold them (the rows' log-sum-exp and exact outputs in one pass, the
blocks' products in a second). Shapes: ``P`` fit problems (batch row x KV head), ``M`` queries, ``k`` kept rows per
bin, ``T`` bins (the last one padded), ``r`` kept rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_CHUNK_ELEMENTS = 1 << 25
_QUERY_CHUNK_ELEMENTS = 1 << 25  # probabilities held at once: [P, queries, n] float32, 128 MiB
_LOG2E = 1.4426950408889634


def _probabilities(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, positions: torch.Tensor | None
) -> torch.Tensor:
    """Softmax over all n keys (query i sees key j only if ``j <= positions[i]``), in the one logits buffer:
    queries ``[P, M, d]``, keys ``[P, n, d]`` float32 -> ``[P, M, n]`` float32."""
    prob = (queries.float() @ keys.transpose(-1, -2)).mul_(scaling)
    if positions is not None:
        prob.masked_fill_(torch.arange(prob.shape[-1], device=prob.device) > positions[:, None], -math.inf)
    prob.sub_(prob.amax(-1, keepdim=True)).exp_()  # every query sees key 0: no row is all -inf
    return prob.div_(prob.sum(-1, keepdim=True))


def _layout(owner: torch.Tensor, bins: int, k: int, span: int) -> tuple[torch.Tensor, int]:
    """Blocks of ``span`` positions (a multiple of ``k``) for the right-hand sides: each block's first bin
    ``[P, blocks]`` (protected-only blocks: clamped, their products are zeroed later) and how many bins a block can
    meet (:func:`_bins_met`)."""
    problems, n = owner.shape
    count = -(-n // span)
    owner_blocks = torch.nn.functional.pad(owner, (0, count * span - n), value=-1).reshape(problems, count, span)
    lows = owner_blocks.masked_fill(owner_blocks < 0, bins - 1).amin(-1)
    return lows, _bins_met(k, span)


def _bins_met(k: int, span: int) -> int:
    """How many bins of ``k`` kept rows ``span`` consecutive positions can meet. Each bin spans at least ``k``
    positions (from its first kept row to the next bin's), so at most ``span / k + 1`` (``span`` when ``k`` is 1)."""
    return span if k == 1 else span // k + 1


def _torch_block_products(prob: torch.Tensor, a: torch.Tensor, bins: int, k: int, width: int):
    """The block products of :func:`_sums` from held probabilities ``prob [P, M, n]`` (blocks of ``k`` positions):
    ``products(first, last, lows)`` gives blocks ``first:last``' ``[P, c, k, width]``, with ``lows`` their first
    bins, the kept rows' probabilities ``a [P, M, T * k]`` gathered per block (one matmul over the queries each)."""
    problems, m, n = prob.shape
    a_rows = a.transpose(1, 2)  # [P, T * k, M]
    columns = torch.arange(width, device=prob.device)

    def products(first: int, last: int, lows: torch.Tensor) -> torch.Tensor:
        chunk = last - first
        index = (lows[..., None] * k + columns).clamp_max(bins * k - 1).reshape(problems, -1)
        near = a_rows.gather(1, index[..., None].expand(-1, -1, m)).reshape(problems, chunk, width, m)
        chunk_prob = prob[:, :, first * k : last * k]
        tail = last * k - min(n, last * k)  # zero positions after the last one (last chunk only)
        if tail:
            chunk_prob = torch.nn.functional.pad(chunk_prob, (0, tail))
        block_prob = chunk_prob.reshape(problems, m, chunk, k).permute(0, 2, 3, 1)  # [P, c, k, M]
        return block_prob @ near.transpose(-1, -2)  # [P, c, k(positions), width]

    return products


def _sums(
    a: torch.Tensor,
    owner: torch.Tensor,
    values: torch.Tensor,
    bins: int,
    k: int,
    span: int,
    products,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normal-equation pieces of one query set: Gram ``[P, T, k, k]``, mass rhs ``[P, T, k]``, value rhs
    ``[P, T, k, d]``, float64 (the products behind them float32). ``a [P, M, T * k]``: the queries' probabilities
    at the (padded) kept rows; ``values [P, n, d]`` float32; ``owner [P, n]``: bin of each position (-1: protected),
    non-decreasing along positions. ``products(first, last, lows)``: blocks ``first:last`` of ``span`` positions
    against the ``width`` kept rows from each block's first bin ``lows``, ``c[P, c, span, width]`` with
    ``c_ji = sum_q p_j(q) a_i(q)`` (:func:`_torch_block_products`, or the fused kernel's).

    With ``a`` the kept rows' probabilities, the mass rhs of kept row i of bin t is
    ``sum_q a_ti(q) z_t(q) = sum_{j owned by t} c_ji`` and its value rhs ``sum_{j owned by t} c_ji v_j``: per
    block, only the few bins it can meet (:func:`_layout`), so ``O(n M width)`` work in all, static shapes, no
    device sync.
    """
    problems, m = a.shape[:2]
    n, d = values.shape[1:]
    blocks = a.reshape(problems, m, bins, k).permute(0, 2, 3, 1)  # [P, T, k, M]
    gram = (blocks @ blocks.transpose(-1, -2)).double()
    mass = a.new_zeros(problems, bins, k)
    value_rhs = a.new_zeros(problems, bins, k, d)
    lows, touched = _layout(owner, bins, k, span)
    width = touched * k
    count = lows.shape[1]
    owner = torch.nn.functional.pad(owner, (0, count * span - n), value=-1)
    columns = torch.arange(touched, device=a.device)
    column_bins = torch.arange(width, device=a.device) // k  # each product column's bin among a block's
    step = max(1, _CHUNK_ELEMENTS // max(1, problems * max(width * m, width * d, width * span)))
    for first in range(0, count, step):
        last = min(count, first + step)
        chunk = last - first
        low = lows[:, first:last]  # [P, c]
        c_all = products(first, last, low)
        positions = slice(first * span, last * span)
        chunk_values = values[:, positions]
        tail = last * span - min(n, last * span)
        if tail:
            chunk_values = torch.nn.functional.pad(chunk_values, (0, 0, 0, tail))
        owners = owner[:, positions].reshape(problems, chunk, span)
        # Each position's products with its own bin's kept rows only (its bin among the block's: owner - low).
        own = (column_bins == (owners - low[..., None])[..., None]) & (owners >= 0)[..., None]
        split = torch.where(own, c_all, 0.0)  # [P, c, span(positions), u * k]
        # Per block and nearby bin: sum over its positions of c (mass) and of c v (values), one small product.
        block_mass = split.sum(2).reshape(problems, chunk * touched, k)
        block_values = split.transpose(-1, -2) @ chunk_values.reshape(problems, chunk, span, d)  # [P, c, u * k, d]
        target = (low[..., None] + columns).clamp_max(bins - 1).reshape(problems, chunk * touched)
        mass.scatter_add_(1, target[..., None].expand(-1, -1, k), block_mass)
        value_rhs.scatter_add_(
            1, target[..., None, None].expand(-1, -1, k, d), block_values.reshape(problems, chunk * touched, k, d)
        )
    return gram, mass.double(), value_rhs.double()


def held_sums(
    prob: torch.Tensor, kept_prob: torch.Tensor, owner: torch.Tensor, values: torch.Tensor, bins: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_sums` from held probabilities ``prob [P, M, n]`` (blocks of ``k`` positions)."""
    return _sums(
        kept_prob, owner, values, bins, k, k, _torch_block_products(prob, kept_prob, bins, k, _bins_met(k, k) * k)
    )


def _check_parts(kept_prob, exact, guarded, guarded_values) -> tuple:
    """What the fit's validation needs of a set of queries: ``kept_prob [P, M, r]``, ``exact [P, M, d]``, and from
    the protected rows' probabilities ``guarded [P, M, p]`` and values ``[P, p, d]`` their numerators and
    denominators."""
    return kept_prob, exact, guarded @ guarded_values, guarded.sum(-1)


@dataclass
class KeptBins:
    """The kept rows of every problem cut into ``count`` bins of ``k`` (``r`` kept rows): ``padded [P, count * k]``
    their positions, the last repeated to fill the last bin; ``owner [P, n]`` each position's bin (-1: protected);
    ``protected_rows [p]`` the protected positions."""

    padded: torch.Tensor
    owner: torch.Tensor
    protected_rows: torch.Tensor
    count: int
    k: int
    r: int


def normal_equations(
    kernels,
    queries: torch.Tensor,
    positions: torch.Tensor | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    flat_values: torch.Tensor,
    scaling: float,
    kept: KeptBins,
) -> tuple[list, tuple]:
    """One query set's Gram ``[P, T, k, k]``, mass and value right-hand sides (float64, :func:`_sums`) and its
    validation parts (:func:`_check_parts`, float32). queries ``[P, M, d]`` with ``positions [M]`` (or None: every
    row), keys ``[P, n, d]`` and values ``[P, n, d_v]`` in the context's dtype, ``flat_values`` the values in
    float32. ``kernels``: :func:`fused_kernels`'s module, or None for the held probabilities."""
    if kernels is not None:
        return _fused_equations(kernels, queries, positions, keys, values, flat_values, scaling, kept)
    padded, owner, protected_rows = kept.padded, kept.owner, kept.protected_rows
    problems, n, dim = keys.shape
    flat_keys = keys.float()  # a view when the caller already converted them (fitting._fit, once for both halves)
    guarded_values = flat_values.index_select(1, protected_rows)
    step = max(1, _QUERY_CHUNK_ELEMENTS // (problems * n))
    total, chunks = None, []
    for first in range(0, queries.shape[1], step):
        prob = _probabilities(
            queries[:, first : first + step],
            flat_keys,
            scaling,
            None if positions is None else positions[first : first + step],
        )
        kept_prob = prob.gather(2, padded[:, None, :].expand(-1, prob.shape[1], -1))  # [P, M, T * k]
        part = held_sums(prob, kept_prob, owner, flat_values, kept.count, kept.k)
        total = part if total is None else [a + b for a, b in zip(total, part, strict=True)]
        guarded = prob.index_select(2, protected_rows)  # [P, M, p]
        chunks.append(_check_parts(kept_prob[..., : kept.r], prob @ flat_values, guarded, guarded_values))
        del prob, kept_prob
    return total, tuple(torch.cat(parts, 1) for parts in zip(*chunks, strict=True))


def fused_kernels(keys: torch.Tensor, values: torch.Tensor, k: int, backend: str):
    """The fused kernels' module for this fit, or None for the PyTorch path: ``"auto"`` takes them on CUDA tensors
    they can run, ``"triton"`` requires them (an error says why they cannot run), ``"torch"`` never."""
    if backend == "torch" or (backend == "auto" and keys.device.type != "cuda"):
        return None
    try:
        from kvcompress.kernels import fit_products
    except ImportError as exc:
        if backend == "triton":
            raise ImportError("backend='triton' needs the triton package (pip install triton)") from exc
        return None
    width = fused_block(k)[1]
    if width > fit_products.MAX_WIDTH:
        reason = f"bin_rows: must be at most {fit_products.MAX_WIDTH // 2} for the fused kernels, got {k}"
    else:
        reason = fit_products.unsupported_reason(keys, keys, values, width)
    if reason is not None and backend == "triton":
        raise ValueError(f"backend='triton': {reason}; use backend='torch' or 'auto'")
    return fit_products if reason is None else None


def fused_block(k: int) -> tuple[int, int]:
    """Positions per block of the fused products (about 64, a tensor-core tile, a multiple of the bin size ``k``)
    and the kept-row columns such a block meets (:func:`_bins_met` bins of ``k``)."""
    span = max(1, 64 // k) * k
    return span, _bins_met(k, span) * k


def _probabilities_at(
    queries: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    lse: torch.Tensor,
    scaling: float,
    positions: torch.Tensor | None,
) -> torch.Tensor:
    """Probabilities of queries ``[P, M, d]`` at a few keys ``[P, c, d]`` (at ``key_positions`` ``[P, c]`` or ``[c]``),
    from the rows' log-sum-exp ``lse [P, M]`` in log2 units over all keys: ``[P, M, c]`` float32 (0 where unseen)."""
    logits = (queries.float() @ keys.float().transpose(-1, -2)).mul_(scaling * _LOG2E).sub_(lse[..., None])
    prob = logits.exp2_()
    if positions is not None:
        unseen = key_positions[..., None, :] > positions[:, None]  # [P or 1, M, c]
        prob = prob.masked_fill_(unseen, 0.0)
    return prob


def _fused_equations(kernels, queries, positions, keys, values, flat_values, scaling, kept: KeptBins) -> tuple:
    """:func:`normal_equations` from the fused kernels, never holding the ``[P, M, n]`` probabilities: the rows'
    log-sum-exp and exact outputs in one pass, the kept and protected rows' probabilities as small products, the
    blocks' products against the kept rows in a second pass."""
    dim, k = queries.shape[-1], kept.k
    padded, owner, protected_rows = kept.padded, kept.owner, kept.protected_rows
    span, width = fused_block(k)
    lows = _layout(owner, kept.count, k, span)[0]
    lse, exact = kernels.attention_rows(queries, keys, values, scaling, positions)
    kept_keys = keys.gather(1, padded[..., None].expand(-1, -1, dim))
    kept_prob = _probabilities_at(queries, kept_keys, padded, lse, scaling, positions)  # [P, M, T * k]
    guarded = _probabilities_at(queries, keys.index_select(1, protected_rows), protected_rows, lse, scaling, positions)
    blocks = kernels.block_products(
        queries, keys, scaling, positions, lse, kept_prob, lows, k, span, width
    )  # [P, blocks, span, width]
    sums = _sums(kept_prob, owner, flat_values, kept.count, k, span, lambda first, last, _: blocks[:, first:last])
    return sums, _check_parts(kept_prob[..., : kept.r], exact, guarded, flat_values.index_select(1, protected_rows))
