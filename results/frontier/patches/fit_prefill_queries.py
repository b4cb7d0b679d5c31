"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit 69c399c and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: the default's fit on FITPRE (default 128) prefill queries spread evenly over the context (causal: each
sees the keys up to its position) beside the window's 64, instead of the window's alone. The selection does not
change (the sampled queries add no mass); only the fit's targets do: a kept row's mass and value are fitted to
stand for the dropped rows it owns for queries from the whole text, not only its end. Why: the priors keep 75% of
the middle rows for facts asked later, and the window's queries are the only ones their fit sees."""
import os
import sys

from _pilot import run

import kvcompress.presses as pr
from kvcompress.reference import even_sample, post_rope_queries

FITPRE = int(os.environ.get("FITPRE", "128"))
record_reference = pr.CompressKVPress.record_reference


def patched_record_reference(self, module, kwargs, keys, values):
    reference = record_reference(self, module, kwargs, keys, values)
    if self.selection == "rpnys" or not reference.queries:
        return reference
    hidden, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
    n = keys.shape[-2]
    index = even_sample(n - self.observation_window, FITPRE, keys.device)  # before the window's own queries
    if len(index):
        reference.queries.append(post_rope_queries(module, hidden[:, index], (cos[:, index], sin[:, index])))
        reference.positions.append(index)
    return reference


pr.CompressKVPress.record_reference = patched_record_reference

sys.exit(run(sys.argv[1:]))
