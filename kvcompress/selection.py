"""Query-aware row selection on plain tensors: the attention mass reference queries give each key, and top rows.

A key's score is the softmax attention it receives from a set of reference queries (the last context
queries, as SnapKV does; queries of a repeat pass over the context, as KVzip does; or any other set),
averaged over the queries and over the query heads of its GQA group. Scores from several sources are
each normalised to sum 1 per KV head and mixed with weights, so no source dominates by its scale.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Logits materialised at once by attention_mass, in elements (~256 MiB of float32).
_CHUNK_ELEMENTS = 1 << 26


def attention_mass(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    query_positions: torch.Tensor | None = None,
    *,
    reduce: str = "sum",
) -> torch.Tensor:
    """Softmax attention of every query over ``keys``, summed (or maxed) over queries and their GQA group.

    queries ``[b, h_q, m, d]`` (post-RoPE), keys ``[b, h_kv, n, d]``, ``h_q`` a multiple of ``h_kv``.
    ``query_positions``: optional ``[m]`` int64 positions of the queries among the keys; query i then
    sees key j only if ``j <= query_positions[i]`` (queries from inside the context); None: every key.
    Softmax in float32 over the n keys. Returns ``[b, h_kv, n]`` float32. ``reduce="sum"``: each query
    contributes 1 in total, so the result sums to ``m * h_q / h_kv`` per KV head; ``reduce="max"``: the largest
    probability any query of the group gives the key (KVzip's score, Kim et al., arXiv 2505.23416). Works in
    query chunks to bound memory.
    """
    if reduce not in ("sum", "max"):
        raise ValueError(f"reduce: must be 'sum' or 'max', got {reduce!r}")
    batch, heads_q, m, dim = queries.shape
    heads_kv, n = keys.shape[1], keys.shape[2]
    group = heads_q // heads_kv
    grouped = queries.reshape(batch, heads_kv, group, m, dim)
    total = torch.zeros(batch, heads_kv, n, dtype=torch.float32, device=keys.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, batch * heads_q * n))
    for start in range(0, m, step):
        chunk = grouped[:, :, :, start : start + step]
        logits = torch.einsum("bhgmd,bhnd->bhgmn", chunk.float(), keys.float()) * scaling
        positions = None if query_positions is None else query_positions[start : start + step]
        probs = causal_softmax(logits, positions)
        if reduce == "sum":
            total += probs.sum(dim=(2, 3))
        else:
            total = torch.maximum(total, probs.amax(dim=(2, 3)))
    return total


def causal_softmax(logits: torch.Tensor, query_positions: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of ``logits [..., m, n]``; with ``query_positions [m]``, query i sees key j
    only if ``j <= query_positions[i]``."""
    if query_positions is not None:
        key_index = torch.arange(logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(key_index[None, :] > query_positions[:, None].to(logits.device), -math.inf)
    return torch.softmax(logits, dim=-1)


def pool_scores(scores: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Average-pool ``[..., n]`` scores over neighbouring keys (SnapKV's smoothing); odd ``kernel_size``."""
    if kernel_size <= 1:
        return scores
    shape = scores.shape
    pooled = F.avg_pool1d(scores.reshape(-1, 1, shape[-1]), kernel_size, stride=1, padding=kernel_size // 2)
    return pooled.reshape(shape)


def normalise(scores: torch.Tensor) -> torch.Tensor:
    """Scale ``[..., n]`` scores to sum 1 over the last dim (a zero row stays zero)."""
    total = scores.sum(-1, keepdim=True)
    return scores / torch.where(total > 0, total, torch.ones_like(total))


def top_rows(scores: torch.Tensor, rows: int) -> torch.Tensor:
    """Indices of the ``rows`` highest scores per ``[..., n]`` row, in position order: ``[..., rows]`` int64.

    Ties break toward the earlier position, so equal scores give the same rows on every run.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :rows]
    return order.sort(-1).values
