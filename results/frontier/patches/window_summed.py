"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit cce5ea8 and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: the window source pooled by WINDOW_REDUCE (default sum) whatever score_pooling is (the repeat pass
keeps score_pooling)."""
import os
import sys

import kvcompress.reference as ref
from kvcompress.cli import main as cli_main

WINDOW_REDUCE = os.environ.get("WINDOW_REDUCE", "sum")
orig = ref.attention_mass


def attention_mass(queries, keys, scaling, query_positions=None, *, reduce="sum", key_mask=None):
    if query_positions is not None:  # the prefill's causal window queries (the repeat pass passes None)
        reduce = WINDOW_REDUCE
    return orig(queries, keys, scaling, query_positions, reduce=reduce, key_mask=key_mask)


ref.attention_mass = attention_mass
if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")
    from eval.fidelity import main as fid

    sys.exit(fid(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
