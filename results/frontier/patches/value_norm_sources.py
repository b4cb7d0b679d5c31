"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "The novelty prior weighted by the
value norm"); it patches the press as of commit 1acdb31 and runs ``kvcompress eval ...`` (or ``fidelity ...``) with
its arguments.

Experiment: the value norm (VATP, arXiv 2406.12335) on the default's other sources too: each key's mass from the
sources named in ``VN_SOURCES`` (comma-separated, e.g. ``induction`` or ``window,induction``) times
``||v_j|| / mean_j ||v_j||`` per head, as the novelty prior already is."""

import os
import sys

from kvcompress.cli import main as cli_main
from kvcompress.presses import CompressKVPress

SOURCES = tuple(s for s in os.environ.get("VN_SOURCES", "induction").split(",") if s)
_record = CompressKVPress.record_reference


def record_reference(self, module, kwargs, keys, values):
    reference = _record(self, module, kwargs, keys, values)
    if values is None:
        raise RuntimeError("value_norm_sources: the press did not hand the layer's values (novelty_value_norm off?)")
    norms = values.float().norm(dim=-1)
    ratio = norms / norms.mean(-1, keepdim=True)
    for source in SOURCES:
        if source in reference.mass:
            reference.mass[source] = reference.mass[source] * ratio
    return reference


CompressKVPress.record_reference = record_reference
if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")
    from eval.fidelity import main as fidelity_main

    sys.exit(fidelity_main(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
