"""The ways CompressKVPress replaces the middle of one layer's context, on that layer's tensors.

Each takes the whole context keys/values ``[b, h_kv, n, d]``, the middle ``[start, end)`` and the number of
rows to keep there, and returns ``(K [b, h_kv, rows, d], V [b, h_kv, rows, d_v], w [b, h_kv, rows])``:

* :func:`compress_by_attention`: the ``rows`` middle keys with the highest reference-query scores, kept
  exactly, then optionally fitted (mass and values) to the reference queries;
* :func:`compress_by_rpnys`: the paper's binned RPNys coreset with Nystrom weights (Alg. 2);
* :func:`compress_hybrid`: the best-scored part of the rows kept exactly, an RPNys coreset of the rest.
"""

from __future__ import annotations

import math

import torch

from kvcompress.fitting import fit_kept_rows
from kvcompress.nystrom import compress_kv
from kvcompress.reference import PRIORS, LayerReference
from kvcompress.selection import normalise, pool_scores, top_rows


def mixed_scores(
    reference: LayerReference,
    start: int,
    end: int,
    weights: dict[str, float],
    pool: dict[str, int],
    reserved: dict[str, int] | None = None,
) -> torch.Tensor:
    """Scores of the middle rows ``[start, end)``: ``[b, h_kv, end - start]``. Each query source's attention mass on
    the middle is average-pooled over ``pool[source]`` neighbours (SnapKV pools its window scores, kernel 5),
    normalised to sum 1 per head and weighted by ``weights[source]`` (default 1). The query-free priors
    (``"novelty"``, then ``"induction"``: :data:`kvcompress.reference.PRIORS`) do not mix (a flat prior summed with
    a peaked mass would never outrank it): each prior's ``reserved[prior]`` highest rows per head not yet reserved
    by an earlier prior score above every other row, so a top-``rows`` selection keeps them and fills the rest by
    the query sources. With no query source, the scores are the first prior's own."""
    reserved = reserved or {}
    total = None
    for source, mass in reference.mass.items():
        if source in PRIORS:
            continue
        part = normalise(pool_scores(mass[:, :, start:end], pool.get(source, 1))) * weights.get(source, 1.0)
        total = part if total is None else total + part
    if total is None:
        total = next(reference.mass[source][:, :, start:end] for source in PRIORS if source in reference.mass)
    chosen, taken = torch.zeros_like(total, dtype=torch.bool), 0
    for source in PRIORS:
        count = min(reserved.get(source, 0), total.shape[-1] - taken)
        if source not in reference.mass or count <= 0:
            continue
        prior = reference.mass[source][:, :, start:end].masked_fill(chosen, -math.inf)
        chosen.scatter_(-1, top_rows(prior, count), True)
        taken += count
    if not taken:
        return total
    return torch.where(chosen, total + (1.0 + total.amax(-1, keepdim=True)), total)


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.gather(2, index[..., None].expand(-1, -1, -1, x.shape[-1]))


def compress_by_attention(
    module: torch.nn.Module,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    end: int,
    rows: int,
    scores: torch.Tensor,
    reference: LayerReference,
    fit: dict | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``rows`` middle keys by the middle's ``scores [b, h_kv, end - start]``; ``fit``: keyword arguments of
    :func:`kvcompress.fitting.fit_kept_rows` (None: ``w = 1``, plain eviction)."""
    kept = top_rows(scores, rows) + start
    kept_keys = _gather_rows(keys, kept)
    if fit is None:
        weights = torch.ones(kept.shape, dtype=torch.float32, device=keys.device)
        return kept_keys, _gather_rows(values, kept), weights
    n = keys.shape[-2]
    position = torch.arange(n)  # on the CPU: the fit reads its protected rows without a device sync
    protected = (position < start) | (position >= end)
    queries, positions = reference.fit_queries()
    result = fit_kept_rows(
        keys, values, kept, protected, queries, module.scaling, query_positions=positions,
        known_rows=reference.fit_outputs(), **fit,
    )  # fmt: skip
    return kept_keys, result.values, result.weights


def compress_by_rpnys(
    module: torch.nn.Module,
    middle_keys: torch.Tensor,
    middle_values: torch.Tensor,
    rows: int,
    bin_rank: int,
    query_radius: torch.Tensor | None,
    seed: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The paper's Alg. 2 on the middle rows ``[b, h_kv, L, d]``: ``rows // bin_rank`` bins of equal pivot counts
    (one bin of ``rows`` pivots when ``rows < bin_rank``); ``query_radius``: None or ``[b, h_kv]``. The
    ``rows % bins`` rows the bins cannot take are the last middle rows, kept exactly (``w = 1``), so exactly
    ``rows`` rows come back."""
    bins = max(1, rows // bin_rank)
    exact = rows - bins * (rows // bins)
    length = middle_keys.shape[-2] - exact
    if seed is None:  # one draw per call, shared by the rows
        seed = int(torch.randint(0, 2**62, (1,)).item())
    # One compress_kv call per batch row: its draws are streams (KV head, bin) of the layer's seed, so a row's
    # coreset is the one it gets alone, whatever its place in the batch.
    parts = [
        compress_kv(
            middle_keys[b : b + 1, :, :length],
            middle_values[b : b + 1, :, :length],
            bins * (rows // bins),
            bins=bins,
            scaling=module.scaling,
            query_radius=query_radius if query_radius is None else query_radius[b : b + 1],
            seed=seed,
            check_inputs=False,  # activations: the press reads each layer's finiteness once, after the prefill
        )
        for b in range(middle_keys.shape[0])
    ]
    keys, values, weights = (torch.cat(x) for x in zip(*parts, strict=True))
    if not exact:
        return keys, values, weights
    ones = weights.new_ones(*weights.shape[:2], exact)
    return (
        torch.cat([keys, middle_keys[:, :, length:]], dim=2),
        torch.cat([values, middle_values[:, :, length:]], dim=2),
        torch.cat([weights, ones], dim=2),
    )


def compress_hybrid(
    module: torch.nn.Module,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    end: int,
    rows: int,
    scores: torch.Tensor,
    fraction: float,
    bin_rank: int,
    seed: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``round(fraction * rows)`` middle rows by the middle's ``scores``, kept exactly (``w = 1``); the other
    middle rows, in position order, summarised by an RPNys coreset (:func:`compress_by_rpnys`)."""
    exact_rows = min(rows, round(fraction * rows))
    if exact_rows == rows:
        return compress_by_attention(module, keys, values, start, end, rows, scores, LayerReference(), None)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    exact = order[..., :exact_rows].sort(-1).values + start
    rest = order[..., exact_rows:].sort(-1).values + start
    core_keys, core_values, core_weights = compress_by_rpnys(
        module, _gather_rows(keys, rest), _gather_rows(values, rest), rows - exact_rows, bin_rank, None, seed
    )
    ones = torch.ones(exact.shape, dtype=core_weights.dtype, device=keys.device)
    return (
        torch.cat([_gather_rows(keys, exact), core_keys], dim=2),
        torch.cat([_gather_rows(values, exact), core_values], dim=2),
        torch.cat([ones, core_weights], dim=2),
    )
