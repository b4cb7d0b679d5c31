"""Float64 definitions the tests compare the library's fast paths against."""

from __future__ import annotations

import math

import torch


def float64_attention_mass(queries, keys, scaling, query_positions=None, *, reduce="sum", key_mask=None):
    """``kvcompress.selection.attention_mass`` by its definition, one (batch row, query head) at a time in float64:
    softmax of ``scaling <q, k>`` over the keys a query sees, summed (``"sum"``) or maxed (``"max"``) over the queries
    and the GQA group. Returns ``[b, h_kv, n]`` float64 on the CPU; a query that sees no key contributes 0."""
    batch, heads_q, _, _ = queries.shape
    heads_kv, n = keys.shape[1], keys.shape[2]
    group = heads_q // heads_kv
    out = torch.zeros(batch, heads_kv, n, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads_q):
            logits = scaling * queries[b, h].cpu().double() @ keys[b, h // group].cpu().double().T  # [m, n]
            if query_positions is not None:
                logits[torch.arange(n)[None, :] > query_positions.cpu()[:, None]] = -math.inf
            if key_mask is not None:
                logits[:, ~key_mask[b].cpu()] = -math.inf
            probs = torch.softmax(logits, -1).nan_to_num(0.0)
            if reduce == "sum":
                out[b, h // group] += probs.sum(0)
            else:
                out[b, h // group] = torch.maximum(out[b, h // group], probs.amax(0))
    return out


def float64_fit_rows(queries, keys, values, scaling, positions=None):
    """The fit's per-row softmax over all keys by definition, in float64 on the CPU: queries ``[P, M, d]``, keys
    ``[P, n, d]``, values ``[P, n, d_v]``, row r seeing keys ``j <= positions[r]``. Returns the probabilities
    ``[P, M, n]``, the natural log-sum-exp ``[P, M]`` and the attention output ``[P, M, d_v]``."""
    logits = scaling * queries.cpu().double() @ keys.cpu().double().transpose(-1, -2)
    if positions is not None:
        logits = logits.masked_fill(torch.arange(keys.shape[1])[None, :] > positions.cpu()[:, None], -math.inf)
    lse = torch.logsumexp(logits, -1)
    prob = (logits - lse[..., None]).exp()
    return prob, lse, prob @ values.cpu().double()


def float64_bin_fit(keys, values, kept, protected, queries, scaling, positions=None, *, bin_rows=16, ridge=0.1,
                    max_log_weight=3.0):  # fmt: skip
    """``kvcompress.fitting.fit_kept_rows``'s full fit (every reference query) by its module docstring, one (batch
    row, KV head) and one bin at a time in float64: bins of ``bin_rows`` kept rows in position order; bin t owns the
    non-protected positions from its first kept row to the next bin's (the first also those before it); mass
    ``sum_i p_i w_i ~ sum_{j owned} p_j`` and values ``sum_i p_i V_i ~ sum_{j owned} p_j v_j`` by least squares
    over the queries, regularised toward ``w = 1``, ``V = w v`` by ``ridge x`` the mean of the Gram matrices'
    diagonals over the head's ``bins x bin_rows`` slots (a partial last bin's empty slots counting as copies of its
    last kept row); ``w`` clamped to ``[e^-c, e^c]``. Returns weights ``[b, h_kv, r]`` and values
    ``[b, h_kv, r, d_v]``."""
    batch, heads_kv, n, _ = keys.shape
    group, r = queries.shape[1] // heads_kv, kept.shape[-1]
    weights = torch.zeros(batch, heads_kv, r, dtype=torch.float64)
    fitted = torch.zeros(batch, heads_kv, r, values.shape[-1], dtype=torch.float64)
    k = min(bin_rows, r)
    for b in range(batch):
        for h in range(heads_kv):
            q = queries[b, h * group : (h + 1) * group].reshape(-1, keys.shape[-1]).double()
            logits = scaling * q @ keys[b, h].double().T
            if positions is not None:
                seen = positions.repeat(group)
                logits = logits.masked_fill(torch.arange(n)[None, :] > seen[:, None], -math.inf)
            probs = torch.softmax(logits, -1)
            rows = kept[b, h].tolist()
            owner = [None if protected[j] else max(sum(x <= j for x in rows) - 1, 0) // k for j in range(n)]
            systems = []
            for start in range(0, r, k):
                mine = rows[start : start + k]
                owned = [j for j in range(n) if owner[j] == start // k]
                a = probs[:, mine]
                systems.append((start, mine, a.T @ a, a.T @ probs[:, owned].sum(-1),
                                a.T @ (probs[:, owned] @ values[b, h, owned].double())))  # fmt: skip
            diagonal = torch.cat([gram.diagonal() for _, _, gram, _, _ in systems])
            empty = -(-r // k) * k - r  # the last bin's empty slots
            lam = ridge * (diagonal.sum() + empty * diagonal[-1]) / (diagonal.numel() + empty)
            for start, mine, gram, mass, value_rhs in systems:
                system = gram + lam * torch.eye(len(mine), dtype=torch.float64)
                w = torch.linalg.solve(system, mass + lam).clamp(math.exp(-max_log_weight), math.exp(max_log_weight))
                prior = values[b, h, mine].double() * w[:, None]
                weights[b, h, start : start + len(mine)] = w
                fitted[b, h, start : start + len(mine)] = torch.linalg.solve(system, value_rhs + lam * prior)
    return weights, fitted
