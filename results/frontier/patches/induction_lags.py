"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "The induction prior"); it patches
the press as of commit d406e4b and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: the induction prior over more than one lag. The library scores key j by how sharply the prefill query
of token j - 1 picks it out of the keys that query saw. A second reading's query also looks ahead: at the start of
a fact it attends to the fact's later tokens too (what `balanced()`'s repeat queries, max-pooled over a piece, find
beyond the prior). Here key j's score is the max over lags l = 1..LAGS (env INDLAGS, default 3) of the same
sharpness for the query of token j - l:

    p_j(l) = exp(s) / (exp(s) + exp(lse_{j-l})),  s = scaling <q_{j-l}, k_j>,  score sigmoid(log((j - l + 1) p_j(l)))

max-pooled over the query group as the library's (lag 1 is the library's score exactly).
"""

import os
import sys

import torch

import kvcompress.reference as reference
from kvcompress.cli import main as cli_main

LAGS = int(os.environ.get("INDLAGS", "3"))
orig = reference.induction_score


def induction_lags(queries, keys, scaling, row_lse=None):
    score = orig(queries, keys, scaling, row_lse)
    if row_lse is None:
        row_lse = reference.causal_row_lse(queries, keys, scaling)
    batch, heads_q, n, dim = queries.shape
    heads_kv = keys.shape[1]
    grouped = queries.reshape(batch, heads_kv, heads_q // heads_kv, n, dim)
    lse = row_lse.reshape(batch, heads_kv, heads_q // heads_kv, n).float()
    for lag in range(2, LAGS + 1):
        if n <= lag:
            break
        earlier, later = grouped[:, :, :, : n - lag].float(), keys[:, :, lag:].float()
        recalled = scaling * torch.einsum("bhgjd,bhjd->bhgj", earlier, later)
        count = torch.arange(1, n - lag + 1, device=keys.device, dtype=torch.float32)  # keys query j - l saw
        lagged = torch.sigmoid(count.log() + recalled - torch.logaddexp(recalled, lse[:, :, :, : n - lag])).amax(2)
        score[:, :, lag:] = torch.maximum(score[:, :, lag:], lagged)
    return score


reference.induction_score = induction_lags
if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")
    from eval.fidelity import main as fid

    sys.exit(fid(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
