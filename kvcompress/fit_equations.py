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

_CHUNK_ELEMENTS = 1 << 25  # a chunk's held block products and their gathers: at most 128 MiB each in float32
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


@dataclass
class _Layout:
    """Blocks of ``span`` positions (a multiple of ``k``) for the right-hand sides: ``owners [P, blocks, span]`` each
    position's bin (-1: protected or past the end), ``lows [P, blocks]`` each block's first bin (protected-only
    blocks: clamped, their products are zeroed later), ``touched`` how many bins a block can meet
    (:func:`_bins_met`)."""

    owners: torch.Tensor
    lows: torch.Tensor
    span: int
    touched: int

    @staticmethod
    def of(owner: torch.Tensor, bins: int, k: int, span: int) -> _Layout:
        problems, n = owner.shape
        count = -(-n // span)
        owners = torch.nn.functional.pad(owner, (0, count * span - n), value=-1).reshape(problems, count, span)
        lows = owners.masked_fill(owners < 0, bins - 1).amin(-1)
        return _Layout(owners, lows, span, _bins_met(k, span))


def _bins_met(k: int, span: int) -> int:
    """How many bins of ``k`` kept rows ``span`` consecutive positions can meet. Each bin spans at least ``k``
    positions (from its first kept row to the next bin's), so at most ``span / k + 1`` (``span`` when ``k`` is 1)."""
    return span if k == 1 else span // k + 1


def _torch_block_products(prob: torch.Tensor, a: torch.Tensor, bins: int, k: int, width: int):
    """The block products of :func:`_right_hand_sides` from held probabilities ``prob [P, M, n]`` (blocks of ``k``
    positions): ``products(first, last, lows)`` gives blocks ``first:last``' ``[P, c, k, width]``, with ``lows`` their
    first bins, the kept rows' probabilities ``a [P, M, T * k]`` gathered per block (one matmul over the queries
    each)."""
    problems, m, n = prob.shape
    a_rows = a.transpose(1, 2).reshape(problems * bins * k, m)  # every problem's kept rows, one row each: [P T k, M]
    columns = torch.arange(width, device=prob.device)
    first_row = torch.arange(problems, device=prob.device)[:, None, None] * (bins * k)

    def products(first: int, last: int, lows: torch.Tensor) -> torch.Tensor:
        chunk = last - first
        index = (lows[..., None] * k + columns).clamp_max(bins * k - 1) + first_row  # [P, c, width]
        # Whole rows by index_select (a row copy each; a gather over an expanded index was a scalar loop on CPU).
        near = a_rows.index_select(0, index.flatten()).reshape(problems, chunk, width, m)
        chunk_prob = prob[:, :, first * k : last * k]
        tail = last * k - min(n, last * k)  # zero positions after the last one (last chunk only)
        if tail:
            chunk_prob = torch.nn.functional.pad(chunk_prob, (0, tail))
        # Per problem, [c, M, k] is a strided view bmm reads as it is (a [P, c, ...] batch would be copied first).
        block_prob = chunk_prob.reshape(problems, m, chunk, k).transpose(1, 2)
        return torch.stack([torch.bmm(near[p], block_prob[p]) for p in range(problems)]).transpose(-1, -2)

    return products


def _gram(a: torch.Tensor, bins: int, k: int) -> torch.Tensor:
    """Gram matrices ``[P, T, k, k]`` float64 of the kept rows' probabilities ``a [P, M, T * k]`` (float32 products)
    per bin: ``G_t = sum_q a_t(q) a_t(q)^T``."""
    problems, m = a.shape[:2]
    blocks = a.reshape(problems, m, bins, k).permute(0, 2, 3, 1)  # [P, T, k, M]
    return (blocks @ blocks.transpose(-1, -2)).double()


def _add_rows_(target: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``target[index[i]] += rows[i]`` in place, in the same order every run: on CUDA ``index_add_`` adds with atomics
    (another order each run, so the fitted values changed in their last bits from run to run) and ``index_put_``'s
    accumulation sorts the indices first; on the CPU ``index_add_`` adds row by row in order."""
    if target.is_cuda:
        target.index_put_((index,), rows, accumulate=True)
    else:
        target.index_add_(0, index, rows)


def _right_hand_sides(
    layout: _Layout, bins: int, k: int, sets: int, d: int, partials, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mass rhs ``[S, P, T, k]`` and value rhs ``[S, P, T, k, d]`` float64 (the sums behind them float32) of ``S =
    sets`` sets of queries, from each block's partials ``step`` blocks at a time. ``partials(first, last, lows)``:
    blocks ``first:last`` of ``span`` positions (``lows``: their first bins), ``([P, S, c, width], [P, S, c, width,
    d])``: over the block's positions j owned by column w's bin, ``sum_j c_jw`` and ``sum_j c_jw v_j``, where ``c_jw
    = sum_q p_j(q) a_w(q)`` over one set's queries (:func:`_owned_partials` from held products, or the fused
    kernel's :func:`kvcompress.kernels.fit_products.block_sums`).

    With ``a`` the kept rows' probabilities, the mass rhs of kept row i of bin t is
    ``sum_q a_ti(q) z_t(q) = sum_{j owned by t} c_ji`` and its value rhs ``sum_{j owned by t} c_ji v_j``: per
    block, only the few bins it can meet, so ``O(n M width)`` work in all, static shapes, no device sync.
    """
    lows, touched = layout.lows, layout.touched
    problems, count = lows.shape
    # One row per (problem, set, bin), summed into by row adds (_add_rows_; scatter_add_ was a scalar loop on CPU).
    mass = torch.zeros(problems * sets * bins, k, dtype=torch.float32, device=lows.device)
    value_rhs = torch.zeros(problems * sets * bins, k * d, dtype=torch.float32, device=lows.device)
    columns = torch.arange(touched, device=lows.device)
    first_bin = torch.arange(problems * sets, device=lows.device).reshape(problems, sets, 1) * bins
    for first in range(0, count, step):
        last = min(count, first + step)
        low = lows[:, first:last]  # [P, c]
        block_mass, block_values = partials(first, last, low)
        target = ((low[..., None] + columns).clamp_max(bins - 1).reshape(problems, 1, -1) + first_bin).flatten()
        _add_rows_(mass, target, block_mass.reshape(-1, k))
        _add_rows_(value_rhs, target, block_values.reshape(-1, k * d))
    shape = (problems, sets, bins, k)
    return mass.reshape(shape).double().movedim(1, 0), value_rhs.reshape(*shape, d).double().movedim(1, 0)


def _owned_partials(layout: _Layout, values: torch.Tensor, k: int, products):
    """:func:`_right_hand_sides`' ``partials`` from block products: ``products(first, last, lows)`` gives blocks
    ``first:last``' ``[P, S, c, span, width]`` (:func:`_torch_block_products`); ``values [P, n, d]`` float32."""
    problems, n, d = values.shape
    span = layout.span
    column_bins = torch.arange(layout.touched * k, device=values.device) // k  # each column's bin among a block's

    def partials(first: int, last: int, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c_all = products(first, last, low)  # [P, S, c, span, u * k]
        chunk_values = values[:, first * span : last * span]
        tail = last * span - min(n, last * span)
        if tail:
            chunk_values = torch.nn.functional.pad(chunk_values, (0, 0, 0, tail))
        owners = layout.owners[:, first:last]
        # Each position's products with its own bin's kept rows only (its bin among the block's: owner - low).
        own = (column_bins == (owners - low[..., None])[..., None]) & (owners >= 0)[..., None]
        split = torch.where(own[:, None], c_all, 0.0)  # [P, S, c, span(positions), u * k]
        # Per block and nearby bin: sum over its positions of c (mass) and of c v (values), one small product.
        values_product = split.transpose(-1, -2) @ chunk_values.reshape(problems, 1, last - first, span, d)
        return split.sum(3), values_product

    return partials


def held_sums(
    prob: torch.Tensor, kept_prob: torch.Tensor, owner: torch.Tensor, values: torch.Tensor, bins: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One query set's Gram ``[P, T, k, k]``, mass rhs ``[P, T, k]`` and value rhs ``[P, T, k, d]`` (float64) from
    held probabilities ``prob [P, M, n]`` (blocks of ``k`` positions); ``kept_prob [P, M, T * k]`` their kept rows'
    (padded) columns, ``owner [P, n]`` each position's bin (-1: protected), non-decreasing along positions."""
    layout = _Layout.of(owner, bins, k, k)
    width, (problems, m), d = layout.touched * k, prob.shape[:2], values.shape[-1]
    block_products = _torch_block_products(prob, kept_prob, bins, k, width)
    partials = _owned_partials(layout, values, k, lambda first, last, lows: block_products(first, last, lows)[:, None])
    # A chunk's gathered kept-row probabilities [P, c, width, M], products and value products stay within the bound.
    step = max(1, _CHUNK_ELEMENTS // max(1, problems * max(width * m, width * d, width * k)))
    mass, value_rhs = _right_hand_sides(layout, bins, k, 1, d, partials, step)
    return _gram(kept_prob, bins, k), mass[0], value_rhs[0]


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
    query_sets: list[tuple[torch.Tensor, torch.Tensor | None]],
    keys: torch.Tensor,
    values: torch.Tensor,
    flat_values: torch.Tensor,
    scaling: float,
    kept: KeptBins,
) -> tuple[list, tuple]:
    """The sets of reference queries ``(queries [P, M_s, d], positions [M_s] or None: every row, known)``' Grams
    ``[S, P, T, k, k]``, mass and value right-hand sides (float64, :func:`_gram`, :func:`_right_hand_sides`) and the
    validation parts of every set's rows in turn (:func:`_check_parts`, float32). ``known``: None, or the rows' ``(lse
    [P, M_s]`` natural log, ``exact outputs [P, M_s, d_v])`` float32 from an attention that already ran (then not
    computed again). keys ``[P, n, d]`` and values ``[P, n, d_v]`` in the context's dtype, ``flat_values`` the values
    in float32. ``kernels``: :func:`fused_kernels`'s module (every set in one pass: each set but the last must have
    the first one's row count), or None for the held probabilities (one set at a time)."""
    if kernels is not None:
        return _fused_equations(kernels, query_sets, keys, values, flat_values, scaling, kept)
    padded, owner, protected_rows = kept.padded, kept.owner, kept.protected_rows
    problems, n, dim = keys.shape
    flat_keys = keys.float()  # a view when the caller already converted them (fitting._fit, once for both halves)
    guarded_values = flat_values.index_select(1, protected_rows)
    step = max(1, _QUERY_CHUNK_ELEMENTS // (problems * n))
    sums, checks = [], []
    for queries, positions, known in query_sets:
        total, chunks = None, []
        for first in range(0, queries.shape[1], step):
            rows = slice(first, first + step)
            prob = _probabilities(queries[:, rows], flat_keys, scaling, None if positions is None else positions[rows])
            kept_prob = prob.gather(2, padded[:, None, :].expand(-1, prob.shape[1], -1))  # [P, M, T * k]
            part = held_sums(prob, kept_prob, owner, flat_values, kept.count, kept.k)
            total = part if total is None else [a + b for a, b in zip(total, part, strict=True)]
            guarded = prob.index_select(2, protected_rows)  # [P, M, p]
            exact = prob @ flat_values if known is None else known[1][:, rows]
            chunks.append(_check_parts(kept_prob[..., : kept.r], exact, guarded, guarded_values))
            del prob, kept_prob
        sums.append(total)
        checks.extend(chunks)
    parts = tuple(torch.cat(part, 1) for part in zip(*checks, strict=True))
    return [torch.stack(part) for part in zip(*sums, strict=True)], parts


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


def _fused_equations(kernels, query_sets, keys, values, flat_values, scaling, kept: KeptBins) -> tuple[list, tuple]:
    """:func:`normal_equations` from the fused kernels, never holding the ``[P, M, n]`` probabilities: every set's
    rows in one pass for the rows' log-sum-exp and exact outputs, the kept and protected rows' probabilities as
    small products, each block's right-hand-side partials per set in a second pass."""
    dim, k = keys.shape[-1], kept.k
    padded, owner, protected_rows = kept.padded, kept.owner, kept.protected_rows
    span, width = fused_block(k)
    layout = _Layout.of(owner, kept.count, k, span)
    counts = [queries.shape[1] for queries, _, _ in query_sets]
    if any(count != counts[0] for count in counts[:-1]) or counts[-1] > counts[0]:
        raise ValueError(f"query_sets: every set but the last must have the first one's rows, got {counts}")
    queries = torch.cat([queries for queries, _, _ in query_sets], 1) if len(query_sets) > 1 else query_sets[0][0]
    has_positions = [positions is not None for _, positions, _ in query_sets]
    if any(has_positions) and not all(has_positions):
        raise ValueError("query_sets: positions must be given for every set or for none")
    positions = torch.cat([positions for _, positions, _ in query_sets]) if all(has_positions) else None
    if all(known is not None for _, _, known in query_sets):  # the rows' attention already ran: no first pass
        lse = torch.cat([known[0] for _, _, known in query_sets], 1) * _LOG2E
        exact = torch.cat([known[1] for _, _, known in query_sets], 1)
    else:
        lse, exact = kernels.attention_rows(queries, keys, values, scaling, positions)
    # The kept and protected rows' probabilities from one product over both key lists.
    rows = torch.cat([padded, protected_rows.expand(padded.shape[0], -1)], 1)  # [P, T * k + p]
    row_keys = keys.gather(1, rows[..., None].expand(-1, -1, dim))
    prob = _probabilities_at(queries, row_keys, rows, lse, scaling, positions)
    kept_prob, guarded = prob[..., : padded.shape[1]], prob[..., padded.shape[1] :]  # [P, M, T * k], [P, M, p]
    # The blocks' partials ([P, sets, c, width] and [P, sets, c, width, d_v]) a launch per run of blocks, the runs'
    # partials at most 256 MiB of float32 (one launch up to about 50k tokens at Qwen2.5-7B's head shape).
    n, d_v = keys.shape[1], values.shape[-1]
    step = max(1, 2 * _CHUNK_ELEMENTS // (kept_prob.shape[0] * len(counts) * width * (d_v + 1)))

    def partials(first: int, last: int, lows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, stop = first * span, min(n, last * span)  # the run's keys; its rows' positions shifted with them
        shifted = positions if positions is None or start == 0 else positions - start
        return kernels.block_sums(
            queries, keys[:, start:stop], values[:, start:stop], scaling, shifted, lse, kept_prob, lows,
            layout.owners[:, first:last].flatten(1), k, span, width, set_rows=counts[0],
        )  # fmt: skip

    mass, value_rhs = _right_hand_sides(layout, kept.count, k, len(counts), d_v, partials, step)
    parts = _check_parts(kept_prob[..., : kept.r], exact, guarded, flat_values.index_select(1, protected_rows))
    grams = [_gram(half, kept.count, k) for half in kept_prob.split(counts, 1)]
    return [torch.stack(grams), mass, value_rhs], parts
