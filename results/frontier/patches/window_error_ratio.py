"""A diagnostic of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit aec6bce and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Question: is there a per-head signal that tells the contexts whose continuation the priors hurt (the study's
mix-4096-s0: the window alone matches SnapKV, the default triples its KL) from those whose facts are asked later
(RULER-style)? Per (layer, KV head), the window queries' attention output over the kept rows (plain eviction:
sink + middle + window, w = 1) is compared with their output over the whole context, for the default's middle rows
and for the window source's own top rows; DIAG=path appends, per layer, the context length and the quartiles over
the layer's heads of error(default) / error(window only), errors relative to the output's norm, averaged over the
queries. The press itself runs unchanged."""
import os
import sys

import torch
from _pilot import run

import kvcompress.presses as pr
from kvcompress.reference import post_rope_queries
from kvcompress.selection import normalise, pool_scores, top_rows

DIAG = os.environ["DIAG"]
Press = pr.CompressKVPress
record_reference, compress_middle = Press.record_reference, Press.compress_middle


def patched_record_reference(self, module, kwargs, keys, values):
    reference = record_reference(self, module, kwargs, keys, values)
    n = keys.shape[-2]
    index = torch.arange(max(0, n - self.observation_window), n, device=keys.device)
    hidden, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
    reference.window_queries = post_rope_queries(module, hidden[:, index], (cos[:, index], sin[:, index]))
    return reference


def window_error(queries, keys, values, rows, scaling):
    """Relative error of the window queries' output over ``rows [b, h_kv, r]`` (None: all rows) against the full
    output: ``[b, h_kv]``, the mean over the queries and the GQA group."""
    b, h_q, m, d = queries.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    grouped = queries.reshape(b, h_kv, h_q // h_kv, m, d).float()
    logits = scaling * torch.einsum("bhgmd,bhnd->bhgmn", grouped, keys.float())
    causal = torch.arange(n) > (n - m + torch.arange(m))[:, None]  # [m, n]: key after the query
    logits = logits.masked_fill(causal, -torch.inf)
    full = torch.einsum("bhgmn,bhnd->bhgmd", logits.softmax(-1), values.float())
    mask = torch.zeros(b, h_kv, n, dtype=torch.bool)
    mask.scatter_(-1, rows, True)
    kept = logits.masked_fill(~mask[:, :, None, None, :], -torch.inf)
    out = torch.einsum("bhgmn,bhnd->bhgmd", kept.softmax(-1), values.float())
    return ((out - full).norm(dim=-1) / full.norm(dim=-1)).mean((2, 3))


def patched_compress_middle(self, module, keys, values, start, end, rows, reference):
    queries = getattr(reference, "window_queries", None)
    if queries is not None and self.selection == "attention":
        n = keys.shape[-2]
        scores = pr.mixed_scores(reference, start, end, {"repeat": self.repeat_weight}, {"window": self.pool_kernel},
                                 reserved=self._reserved_rows(rows))
        window = normalise(pool_scores(reference.mass["window"][:, :, start:end], self.pool_kernel))
        protected = torch.cat([torch.arange(start), torch.arange(end, n)]).expand(*keys.shape[:2], -1)
        errors = []
        for chosen in (top_rows(scores, rows) + start, top_rows(window, rows) + start):
            errors.append(window_error(queries, keys, values, torch.cat([protected, chosen], -1), module.scaling))
        ratio = (errors[0] / errors[1].clamp_min(1e-9)).flatten()
        quartiles = torch.quantile(ratio, torch.tensor([0.25, 0.5, 0.75]))
        with open(DIAG, "a") as f:
            f.write(f"{n} {module.layer_idx} " + " ".join(f"{x:.3f}" for x in quartiles.tolist()) + "\n")
    return compress_middle(self, module, keys, values, start, end, rows, reference)


Press.record_reference = patched_record_reference
Press.compress_middle = patched_compress_middle

sys.exit(run(sys.argv[1:]))
