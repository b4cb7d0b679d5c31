"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept" and "The
induction prior"); it patches the press as of commit 4b96678 and runs `kvcompress eval ...` or `fidelity ...`
(eval.fidelity) with its arguments. What it found became the library's "induction" source (kvcompress.selection.
induction_score, the default since 2026-11-26), with the reserved rows taken in turn instead of interleaved.

Experiment: an induction score in place of (or beside) the novelty prior, from the prefill's own queries and no
extra forward. A copy of the context read again retrieves key j with the query of the token before it (an
induction head matches "current token t" to "previous token t"); how sharply the prefill's query at j - 1 already
picks key j out of everything before it is

    score_j = exp(s_j) / (exp(s_j) + sum_{i <= j-1} exp(s_i)),   s_i = scaling <q_{j-1}, k_i>,

max-pooled over the KV head's query group (0 for key 0). INDUCTION=replace: the novelty rows go to the top
induction scores; INDUCTION=mix: to the max of the two scores, each min-max normalised per head (INDNORM=rank: their
ranks instead, the reserved rows split about evenly between the two tops); INDUCTION=interleave: the reserved rows
go to novelty's and induction's top keys in turn, INDFRAC (2/3) of them to novelty (with novelty_share 0.75: half
of the middle rows to novelty as in the default, a quarter to induction, a quarter to the window).
INDSCALE=uniform: the score against the uniform share 1 / j of the keys the query sees (the raw score favours early
keys, whose queries see few others): sigmoid(log j + log score_j).
"""

import os
import sys

import torch

import kvcompress.presses as presses
import kvcompress.reference as ref
from kvcompress.cli import main as cli_main

MODE = os.environ.get("INDUCTION", "replace")
SCALE = os.environ.get("INDSCALE", "none")
NORM = os.environ.get("INDNORM", "minmax")
FRAC = float(os.environ.get("INDFRAC", str(2 / 3)))  # interleave: novelty's part of the reserved rows
orig_record_prefill = ref.record_prefill


def induction_score(module, kwargs, keys):
    hidden, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
    queries = ref.post_rope_queries(module, hidden, (cos, sin)).float()  # [b, h_q, n, d]
    b, h_q, n, d = queries.shape
    h_kv = keys.shape[1]
    group = h_q // h_kv
    k = keys.float().repeat_interleave(group, 1)  # [b, h_q, n, d]
    logits = (queries @ k.transpose(-1, -2)) * module.scaling  # [b, h_q, n(query), n(key)]
    causal = torch.ones(n, n, dtype=torch.bool, device=keys.device).tril()
    lse = logits.masked_fill(~causal, -float("inf")).logsumexp(-1)  # [b, h_q, n]: query i over keys <= i
    diag = (queries[:, :, :-1] * k[:, :, 1:]).sum(-1) * module.scaling  # s(q_{j-1}, k_j), j = 1..n-1
    if SCALE == "uniform":  # how many times the uniform share 1 / j key j gets: log(j) + s_j - lse_{j-1}, squashed
        count = torch.arange(1, n, device=keys.device, dtype=torch.float32)
        score = torch.sigmoid(diag - torch.logaddexp(lse[:, :, :-1], diag) + count.log())
    else:
        score = torch.sigmoid(diag - lse[:, :, :-1])
    score = torch.nn.functional.pad(score, (1, 0))  # key 0: 0
    return score.reshape(b, h_kv, group, n).amax(2)


def rank_of(x):
    """0 for each head's highest score, 1 for the next, ..."""
    return (-x).argsort(-1).argsort(-1).float()


def normalised(x):
    if NORM == "rank":  # the max of two ranks: the top r of the mix is about the union of each score's top r / 2
        return x.argsort(-1).argsort(-1).float() / x.shape[-1]
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    return (x - low) / (high - low).clamp_min(1e-12)


def record_prefill(module, kwargs, keys, sources, *args, **kw):
    reference = orig_record_prefill(module, kwargs, keys, sources, *args, **kw)
    if "novelty" in sources:
        score = induction_score(module, kwargs, keys)
        if MODE == "interleave":  # novelty's top keys and induction's, taken 2 : 1 in turn (ties: the earlier)
            novelty_step, induction_step = 1.0 / FRAC, 1.0 / (1.0 - FRAC)
            priority = torch.minimum(
                novelty_step * rank_of(reference.mass["novelty"]), induction_step * (rank_of(score) + 0.5)
            )
            score = -priority
        elif MODE == "mix":
            score = torch.maximum(normalised(score), normalised(reference.mass["novelty"]))
        reference.mass["novelty"] = score
    return reference


ref.record_prefill = presses.record_prefill = record_prefill
if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")
    from eval.fidelity import main as fid

    sys.exit(fid(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
