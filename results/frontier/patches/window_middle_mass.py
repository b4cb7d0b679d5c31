"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit aec6bce and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: each head's split between the window source and the two priors set by how much the window's queries
read the middle at all. f = the window queries' mean softmax mass on the middle rows (summed over the GQA group's
queries, divided by their count: in [0, 1]); the window source then takes round(SCALE * f * rows) of the head's
middle rows, at least the library's 25% and at most MAXWIN of them, and the priors share the rest 2 : 1. Why: on the
continuation study's worst context (mix-4096-s0) the window alone matches SnapKV and the default's priors triple its
KL, while on the RULER-style contexts the window's queries (the end of an unrelated haystack) should hardly read
the middle. DIAG=path appends, per layer, the context length and the quartiles of f over the layer's heads."""
import os
import sys

import torch
from _pilot import run, take_top

import kvcompress.presses as pr
from kvcompress.reference import PRIORS, post_rope_queries
from kvcompress.selection import attention_mass, normalise, pool_scores

SCALE = float(os.environ.get("SCALE", "1.0"))
MAXWIN = float(os.environ.get("MAXWIN", "0.75"))
DIAG = os.environ.get("DIAG")
Press = pr.CompressKVPress
record_reference, reserved_rows = Press.record_reference, Press._reserved_rows


def patched_record_reference(self, module, kwargs, keys, values):
    reference = record_reference(self, module, kwargs, keys, values)
    n = keys.shape[-2]
    plan = self.plan(n)
    if plan is None or "window" not in reference.mass:
        return reference
    index = torch.arange(max(0, n - self.observation_window), n, device=keys.device)
    hidden, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
    queries = post_rope_queries(module, hidden[:, index], (cos[:, index], sin[:, index]))
    mass = attention_mass(queries, keys, module.scaling, query_positions=index, reduce="sum")  # [b, h_kv, n]
    per_query = mass.sum(-1, keepdim=True)  # group size x window queries
    reference.middle_share = (mass[:, :, plan.sink : n - plan.window].sum(-1, keepdim=True) / per_query)[..., 0]
    if DIAG:
        quartiles = torch.quantile(reference.middle_share.flatten().float(), torch.tensor([0.25, 0.5, 0.75]))
        with open(DIAG, "a") as f:
            f.write(f"{n} {module.layer_idx} " + " ".join(f"{x:.3f}" for x in quartiles.tolist()) + "\n")
    return reference



def patched_compress_middle(self, module, keys, values, start, end, rows, reference):
    share = getattr(reference, "middle_share", None)
    if share is None or self.selection != "attention":
        return compress_middle(self, module, keys, values, start, end, rows, reference)
    reserved = reserved_rows(self, rows)
    base = rows - sum(reserved.values())
    window = torch.round(SCALE * share * rows).long().clamp(min=base, max=max(base, round(MAXWIN * rows)))
    total = normalise(pool_scores(reference.mass["window"][:, :, start:end], self.pool_kernel))
    chosen = torch.zeros_like(total, dtype=torch.bool)
    take_top(total, chosen, window)
    left = rows - window
    novelty, induction = reserved.get("novelty", 0), reserved.get("induction", 0)
    novelty_rows = torch.round(left * (novelty / max(novelty + induction, 1))).long()
    for source, counts in zip(PRIORS, (novelty_rows, left - novelty_rows), strict=True):
        if source in reference.mass:
            take_top(reference.mass[source][:, :, start:end], chosen, counts)
    scores = torch.where(chosen, total + (1.0 + total.amax(-1, keepdim=True)), total)
    fit = None if self.fit == "none" else dict(fit_values=self.fit == "values", bin_rows=self.fit_bin_rows,
                                                 ridge=self.fit_ridge)
    return pr.compress_by_attention(module, keys, values, start, end, rows, scores, reference, fit)


compress_middle = Press.compress_middle
Press.record_reference = patched_record_reference
Press.compress_middle = patched_compress_middle

sys.exit(run(sys.argv[1:]))
