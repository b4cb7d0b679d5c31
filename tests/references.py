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
