"""A diagnostic of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit aec6bce and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Question: is there a per-head signal that tells the contexts whose continuation the priors hurt (the study's
mix-4096-s0: the window alone matches SnapKV, the default triples its KL) from those whose facts are asked later
(RULER-style)? Per (layer, KV head), the window queries' attention output over the kept rows (plain eviction:
sink + middle + window, w = 1) is compared with their output over the whole context, for the default's middle rows
and for the window source's own top rows; DIAG=path appends, per layer, the context length and the quartiles over
the layer's heads of error(default) / error(window only), errors relative to the output's norm, averaged over the
queries (the default press, without options: its `pool_kernel`). The press itself runs unchanged."""
import os
import sys

import torch
from _pilot import run, window_queries

import kvcompress.presses as pr
from kvcompress.selection import normalise, pool_scores, top_rows

DIAG = os.environ["DIAG"]
POOL_KERNEL = pr.CompressKVPress.pool_kernel  # the default press's: the diagnostic runs it without options
compress_by_attention = pr.compress_by_attention


def window_error(queries, keys, values, rows, scaling):
    """Relative error of the window queries' output over ``rows [b, h_kv, r]`` against the full
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


def recording(module, keys, values, start, end, rows, scores, reference, fit):
    n = keys.shape[-2]
    window = normalise(pool_scores(reference.mass["window"][:, :, start:end], POOL_KERNEL))
    protected = torch.cat([torch.arange(start), torch.arange(end, n)]).expand(*keys.shape[:2], -1)
    errors = []
    for chosen in (top_rows(scores, rows) + start, top_rows(window, rows) + start):
        rows_kept = torch.cat([protected, chosen], -1)
        errors.append(window_error(window_queries(reference), keys, values, rows_kept, module.scaling))
    ratio = (errors[0] / errors[1].clamp_min(1e-9)).flatten()
    quartiles = torch.quantile(ratio, torch.tensor([0.25, 0.5, 0.75]))
    with open(DIAG, "a") as f:
        f.write(f"{n} {module.layer_idx} " + " ".join(f"{x:.3f}" for x in quartiles.tolist()) + "\n")
    return compress_by_attention(module, keys, values, start, end, rows, scores, reference, fit)


pr.compress_by_attention = recording

sys.exit(run(sys.argv[1:]))
