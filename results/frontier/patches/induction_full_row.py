"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches the
press as of commit ff5741d and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: the induction prior normalised over the whole context instead of the keys before it. The library
scores key j by how sharply the prefill query of token j - 1 picks it out of keys 0..j (causal). A second reading's
query of token j - 1 sees every key: when the text repeats (a haystack's recurring sentences), every occurrence's
follower competes, and only tokens whose predecessor is rare (a needle's key words and digits) keep a sharp
induction match. The causal score cannot see the later competitors, so a repeated phrase's first occurrence scores
as high as a fact. Here (INDROW=full)

    p_j = exp(s_j - lse_{j-1}),  s_j = scaling <q_{j-1}, k_j>,  lse_{j-1} = log sum_{i < n} exp(scaling <q_{j-1}, k_i>)

score sigmoid(log(n) + log p_j), max-pooled over the query group (0 for key 0). It costs one non-causal pass of
logits per layer (n x n; the "context" source's price), so on a GPU it is a row log-sum-exp kernel call, not free.
INDROW=both: the max of the library's causal score and this one.
"""

import math
import os
import sys

import torch

import kvcompress.reference as reference
from kvcompress.selection import _chunk_elements

sys.path.insert(0, os.path.dirname(__file__))
from _pilot import run  # noqa: E402

ROW = os.environ.get("INDROW", "full")
causal_score = reference.induction_score


def full_row_lse(queries, keys, scaling):
    """``[b, h_q, n]`` float32: each query's log-sum-exp over all n keys (no causal mask), in bounded chunks."""
    b, h_q, n, d = queries.shape
    h_kv = keys.shape[1]
    grouped = queries.reshape(b, h_kv, h_q // h_kv, n, d)
    k = keys.float()
    lse = torch.empty(b, h_kv, h_q // h_kv, n, dtype=torch.float32, device=keys.device)
    step = max(1, _chunk_elements(keys.device) // max(1, b * h_q * n))
    for start in range(0, n, step):
        end = min(n, start + step)
        logits = torch.einsum("bhgmd,bhnd->bhgmn", grouped[:, :, :, start:end].float() * scaling, k)
        lse[..., start:end] = logits.logsumexp(-1)
    return lse.reshape(b, h_q, n)


def induction_full_row(queries, keys, scaling, row_lse=None):
    b, h_q, n, d = queries.shape
    h_kv = keys.shape[1]
    lse = full_row_lse(queries, keys, scaling).reshape(b, h_kv, h_q // h_kv, n)
    previous = queries.reshape(b, h_kv, h_q // h_kv, n, d)[:, :, :, :-1].float()
    recalled = scaling * torch.einsum("bhgjd,bhjd->bhgj", previous, keys[:, :, 1:].float())
    score = torch.sigmoid(math.log(n) + recalled - lse[..., :-1]).amax(2)
    score = torch.nn.functional.pad(score, (1, 0))  # key 0: 0
    if ROW == "both":
        score = torch.maximum(score, causal_score(queries, keys, scaling, row_lse))
    return score


reference.induction_score = induction_full_row
sys.exit(run(sys.argv[1:]))
