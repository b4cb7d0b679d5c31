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

from kvcompress._checks import check_int_range

# Logits materialised at once by the chunked PyTorch path of attention_mass, in elements. On CPU 4 MiB of float32:
# chunks that stay in cache ran 1.6x faster than 256 MiB ones (one thread, 2k keys, 9 heads) and bound the peak;
# on an accelerator (where this path is only the fallback of the fused kernel) 256 MiB, for large launches.
_CHUNK_ELEMENTS = 1 << 20
_DEVICE_CHUNK_ELEMENTS = 1 << 26
REDUCTIONS = ("sum", "max")


def _chunk_elements(device: torch.device) -> int:
    """Elements a chunked PyTorch path holds at once on ``device`` (the comment above says why they differ)."""
    return _CHUNK_ELEMENTS if device.type == "cpu" else _DEVICE_CHUNK_ELEMENTS


def attention_mass(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    query_positions: torch.Tensor | None = None,
    *,
    reduce: str = "sum",
    key_mask: torch.Tensor | None = None,
    row_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of every query over ``keys``, reduced per key over the queries and their GQA group.

    queries ``[b, h_q, m, d]`` (post-RoPE), keys ``[b, h_kv, n, d]``, ``h_q`` a multiple of ``h_kv``.
    ``query_positions``: optional ``[m]`` int64 positions of the queries among the keys; query i then
    sees key j only if ``j <= query_positions[i]`` (queries from inside the context); None: every key.
    ``key_mask``: optional ``[b, n]`` bool, False for keys no query sees (padding). ``reduce="sum"``: each
    query contributes 1 in total, so the result sums to ``m * h_q / h_kv`` per KV head (a query that sees
    no key contributes 0); ``reduce="max"``: the largest probability any query of the group gives the key
    (KVzip's score, Kim et al., arXiv 2505.23416). ``row_lse``: optional ``[b, h_q, m]`` float32, each query's
    softmax normaliser (natural log) as an attention that already ran computed it, over ``keys`` and possibly more
    (a repeat chunk's own keys): the probabilities are then ``exp(logit - row_lse)``, and the fused kernel skips its
    first pass. Returns ``[b, h_kv, n]`` float32.

    The m x n probabilities are never held at once: on CUDA a fused two-pass Triton kernel
    (:mod:`kvcompress.kernels.attention_mass`, 16-bit tensor-core dots, fp32 statistics); elsewhere softmax
    in float32 over query chunks of at most ``_CHUNK_ELEMENTS`` logits (``_DEVICE_CHUNK_ELEMENTS`` off the CPU).
    """
    _check_mass_inputs(queries, keys, query_positions, reduce, key_mask, row_lse)
    if queries.device.type == "cuda" and queries.shape[2] > 0:
        from kvcompress.kernels import attention_mass as kernel

        if kernel.unsupported_reason(queries, keys) is None:
            return kernel.attention_mass_kernel(
                queries, keys, scaling, query_positions, reduce=reduce, key_mask=key_mask, row_lse=row_lse
            )
    return attention_mass_torch(
        queries, keys, scaling, query_positions, reduce=reduce, key_mask=key_mask, row_lse=row_lse
    )


def _check_mass_inputs(queries, keys, query_positions, reduce, key_mask, row_lse=None) -> None:
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce: must be one of 'sum', 'max', got {reduce!r}")
    if queries.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"queries/keys: must be [b, h, m, d] / [b, h_kv, n, d], got {queries.shape} / {keys.shape}")
    (batch, heads_q, m, dim), (kb, heads_kv, n, kd) = queries.shape, keys.shape
    if kb != batch or kd != dim or heads_kv < 1 or heads_q % heads_kv:
        raise ValueError(f"keys: shape {tuple(keys.shape)} does not match queries {tuple(queries.shape)} (GQA)")
    if query_positions is not None and tuple(query_positions.shape) != (m,):
        raise ValueError(f"query_positions: must have shape [{m}], got {tuple(query_positions.shape)}")
    if key_mask is not None and (key_mask.dtype != torch.bool or tuple(key_mask.shape) != (batch, n)):
        got = f"{key_mask.dtype} {tuple(key_mask.shape)}"
        raise ValueError(f"key_mask: must be a bool tensor of shape [{batch}, {n}], got {got}")
    if row_lse is not None and (not row_lse.is_floating_point() or tuple(row_lse.shape) != (batch, heads_q, m)):
        got = f"{row_lse.dtype} {tuple(row_lse.shape)}"
        raise ValueError(f"row_lse: must be a floating tensor of shape [{batch}, {heads_q}, {m}], got {got}")


def attention_mass_torch(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    query_positions: torch.Tensor | None = None,
    *,
    reduce: str = "sum",
    key_mask: torch.Tensor | None = None,
    row_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """The PyTorch path of :func:`attention_mass` (same arguments and result): float32 softmax over query
    chunks, each at most ``_CHUNK_ELEMENTS`` logits."""
    batch, heads_q, m, dim = queries.shape
    heads_kv, n = keys.shape[1], keys.shape[2]
    group = heads_q // heads_kv
    grouped = queries.reshape(batch, heads_kv, group, m, dim)
    if row_lse is not None:
        row_lse = row_lse.to(device=keys.device, dtype=torch.float32).reshape(batch, heads_kv, group, m)
    keys = keys.float()
    hidden = None if key_mask is None else ~key_mask.to(keys.device)[:, None, None, None, :]
    total = torch.zeros(batch, heads_kv, n, dtype=torch.float32, device=keys.device)
    elements = _chunk_elements(keys.device)
    step = max(1, elements // max(1, batch * heads_q * n))
    key_index = torch.arange(n, device=keys.device)
    for start in range(0, m, step):
        chunk = grouped[:, :, :, start : start + step].float() * scaling
        seen = n  # keys past every query of the chunk are skipped (a host sync: this is the CPU path)
        if query_positions is not None:
            positions = query_positions[start : start + step].to(keys.device)
            seen = max(0, min(n, int(positions.max()) + 1))
            if seen == 0:
                continue
        logits = torch.einsum("bhgmd,bhnd->bhgmn", chunk, keys[:, :, :seen])  # the one [.., m, n] buffer
        if hidden is not None:
            logits.masked_fill_(hidden[..., :seen], -math.inf)
        if query_positions is not None:
            logits.masked_fill_(key_index[:seen] > positions[:, None], -math.inf)
        if row_lse is None:
            peak = logits.amax(-1, keepdim=True)
            peak = torch.where(peak > -math.inf, peak, 0.0)  # a query that sees no key: all terms 0
            probs = logits.sub_(peak).exp_()
            total_row = probs.sum(-1)  # [b, h, g, c]
            inverse = torch.where(total_row > 0, 1.0 / total_row, 0.0)
        else:  # the normaliser of an attention that already ran
            probs = logits.sub_(row_lse[:, :, :, start : start + step, None]).exp_()
            inverse = torch.ones_like(probs[..., 0])
        if reduce == "sum":  # sum_i e_ij / Z_i: one matrix-vector product per KV head
            total[..., :seen] += torch.einsum("bhgmn,bhgm->bhn", probs, inverse)
        elif seen:
            total[..., :seen] = torch.maximum(total[..., :seen], probs.mul_(inverse[..., None]).amax(dim=(2, 3)))
        del logits, probs
    return total


def key_novelty(keys: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    """How far each key points from its head's mean key: ``1 - cos(k_j, mean_j k_j)`` for keys ``[b, h_kv, n, d]``,
    ``[b, h_kv, n]`` float32 >= 0. Query-free: a key unlike the others (a fact in a repetitive context) scores
    high (KeyDiff's score, Park et al., arXiv 2504.15364). With ``values [b, h_kv, n, d_v]``: times
    ``||v_j|| / mean_j ||v_j||`` (VATP, Guo et al., arXiv 2406.12335): a row adds to the output in proportion to its
    value's norm, so an outlying key whose value is small changes little."""
    keys = keys.float()
    anchor = F.normalize(keys.mean(dim=2, keepdim=True), dim=-1)
    novelty = 1.0 - (F.normalize(keys, dim=-1) * anchor).sum(-1)
    if values is None:
        return novelty
    norms = values.float().norm(dim=-1)
    return novelty * norms / norms.mean(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def causal_row_lse(queries: torch.Tensor, keys: torch.Tensor, scaling: float, first: int = 0) -> torch.Tensor:
    """Each context query's causal softmax normaliser: ``log sum_{i <= j} exp(scaling <q_j, k_i>)`` for queries
    ``[b, h_q, m, d]`` at positions ``first .. first + m - 1`` and keys ``[b, h_kv, >= first + m, d]`` (GQA; keys
    after the last query's position are not read) -> ``[b, h_q, m]`` float32. ``first`` > 0: a chunk of the context
    after ``first`` earlier tokens. On CUDA the attention-mass kernel's first pass
    (:func:`kvcompress.kernels.attention_mass.row_lse_kernel`); elsewhere over query chunks of at most
    ``_CHUNK_ELEMENTS`` logits (``_DEVICE_CHUNK_ELEMENTS`` off the CPU)."""
    batch, heads_q, m, dim = queries.shape
    n = first + m
    keys = keys[:, :, :n]
    if queries.device.type == "cuda" and m > 0:
        from kvcompress.kernels import attention_mass as kernel

        if kernel.unsupported_reason(queries, keys) is None:
            return kernel.row_lse_kernel(queries, keys, scaling, torch.arange(first, n, device=queries.device))
    heads_kv = keys.shape[1]
    group = heads_q // heads_kv
    grouped = queries.reshape(batch, heads_kv, group, m, dim)
    keys = keys.float()
    lse = torch.empty(batch, heads_kv, group, m, dtype=torch.float32, device=keys.device)
    elements = _chunk_elements(keys.device)
    step = max(1, elements // max(1, batch * heads_q * n))
    key_index = torch.arange(n, device=keys.device)
    for start in range(0, m, step):
        end = min(m, start + step)  # the chunk's queries see keys < first + end only
        logits = torch.einsum(
            "bhgmd,bhnd->bhgmn", grouped[:, :, :, start:end].float() * scaling, keys[:, :, : first + end]
        )
        logits.masked_fill_(key_index[: first + end] > key_index[first + start : first + end, None], -math.inf)
        lse[..., start:end] = logits.logsumexp(-1)
        del logits
    return lse.reshape(batch, heads_q, m)


def induction_score(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, row_lse: torch.Tensor | None = None
) -> torch.Tensor:
    """How sharply the query of the token before each key already picks that key out of the context before it:
    what an induction head does when the context is read again (the token ``j - 1`` recalls key ``j``), the
    signal the repeat pass measures, from the prefill's own queries and no extra forward.

    ``p_j = exp(s_j) / (exp(s_j) + sum_{i <= j-1} exp(s_i))`` with ``s_i = scaling <q_{j-1}, k_i>``; the score is
    ``p_j`` against the uniform share ``1 / j`` of the ``j`` keys the query then sees (raw ``p_j`` favours the
    first keys, whose queries see few others), ``sigmoid(log(j p_j))``, max-pooled over the KV head's query group;
    key 0 scores 0. queries ``[b, h_q, n, d]`` (post-RoPE, the context's own), keys ``[b, h_kv, n, d]``;
    ``row_lse``: optional ``[b, h_q, n]`` causal normalisers of those queries (natural log) as the prefill's
    attention computed them, else :func:`causal_row_lse`. Returns ``[b, h_kv, n]`` float32 in [0, 1)."""
    if row_lse is None:
        row_lse = causal_row_lse(queries, keys, scaling)
    score = torch.zeros(*keys.shape[:3], dtype=torch.float32, device=keys.device)  # key 0: 0
    score[:, :, 1:] = recall_score(queries[:, :, :-1], row_lse[:, :, :-1], keys[:, :, 1:], scaling, first=1)
    return score


def recall_score(
    previous: torch.Tensor, previous_lse: torch.Tensor, keys: torch.Tensor, scaling: float, first: int
) -> torch.Tensor:
    """:func:`induction_score` of the ``m`` keys ``[b, h_kv, m, d]`` at positions ``first .. first + m - 1``
    (``first`` >= 1), each recalled by the query before it: ``previous [b, h_q, m, d]`` the queries at positions
    ``first - 1 ..``, ``previous_lse [b, h_q, m]`` their causal normalisers. Any span of a context scores alone, so a
    context read in chunks (:mod:`kvcompress.context_chunks`) gets the scores of one read. ``[b, h_kv, m]`` float32."""
    batch, heads_q, m, dim = previous.shape
    heads_kv = keys.shape[1]
    group = heads_q // heads_kv
    grouped = previous.reshape(batch, heads_kv, group, m, dim)
    lse = previous_lse.reshape(batch, heads_kv, group, m)
    score = torch.empty(batch, heads_kv, m, dtype=torch.float32, device=keys.device)
    elements = _chunk_elements(keys.device)
    step = max(1, elements // max(1, batch * heads_q * dim))  # float32 copies of a chunk of queries at a time
    for start in range(0, m, step):
        end = min(m, start + step)
        recalled = scaling * torch.einsum(
            "bhgjd,bhjd->bhgj", grouped[:, :, :, start:end].float(), keys[:, :, start:end].float()
        )
        before = lse[:, :, :, start:end].float()
        count = torch.arange(first + start, first + end, device=keys.device, dtype=torch.float32)
        score[:, :, start:end] = torch.sigmoid(count.log() + recalled - torch.logaddexp(recalled, before)).amax(2)
    return score


def pool_scores(scores: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Average-pool ``[..., n]`` scores over neighbouring keys (SnapKV's smoothing); odd ``kernel_size``."""
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size: must be an odd int >= 1, got {kernel_size!r}")
    if kernel_size == 1:
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

    Ties break toward the earlier position, so equal scores give the same rows on every run; a NaN score ranks last.
    """
    check_int_range("rows", rows, 0, scores.shape[-1])
    scores = torch.where(scores.isnan(), -math.inf, scores)  # torch's descending sort puts NaN first
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :rows]
    return order.sort(-1).values
