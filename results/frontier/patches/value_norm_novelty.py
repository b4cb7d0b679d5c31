"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit 808edaf and runs `kvcompress eval ...` with its arguments.

Experiment: the novelty prior weighted by each key's value norm (VATP, Guo et al., "Attention Score is not All You
Need for Token Importance Indicator in KV Cache Reduction: Value Also Matters", arXiv 2406.12335): a row's output
contribution scales with ||v_j||, so an outlying key with a small value changes little. Score: KeyDiff's
``1 - cos(k_j, mean k)`` times ``||v_j|| / mean_j ||v_j||`` per head (``VNORM=1``: the L1 norm, VATP's; else L2)."""

import os
import sys

from kvcompress.cli import main as cli_main
from kvcompress.presses import CompressKVPress

ORDER = 1 if os.environ.get("VNORM", "2") == "1" else 2
_record = CompressKVPress.record_reference


def record_reference(self, module, kwargs, keys):
    reference = _record(self, module, kwargs, keys)
    if "novelty" in reference.mass:
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        values = layer.values[..., : keys.shape[-2], :] if layer.values.shape[0] == keys.shape[0] else None
        if values is not None and values.shape[:3] == keys.shape[:3]:
            norms = values.float().norm(p=ORDER, dim=-1)
            reference.mass["novelty"] = reference.mass["novelty"] * norms / norms.mean(-1, keepdim=True)
        else:
            raise RuntimeError("value_norm_novelty: the layer's values do not line up with its keys")
    return reference


CompressKVPress.record_reference = record_reference
if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")
    from eval.fidelity import main as fidelity_main

    sys.exit(fidelity_main(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
