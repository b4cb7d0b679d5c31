"""A pilot of issue 20's frontier, not part of the library; it patches the press as of commit c602f2e and runs
`kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: the repeat pass's scores only in the retrieval layers. `balanced()` (or any press with "repeat" in its
reference) runs its repeat pass as usual, but every layer not in RETRIEVAL (comma-separated, default "18") drops the
pass's mass and fit queries before it compresses, so it chooses and fits its rows as the default does (window,
novelty, induction). Why: on the embedded model layer 18 is where the facts are read back (the calibration); if the
second reading's gain over the default comes through that layer, a pass that stops after it (about 19/30 of a partial
forward) and scores one layer buys most of `balanced()`'s answers at a fraction of its cost."""
import os
import sys

from _pilot import run

import kvcompress.presses as pr
from kvcompress.reference import LayerReference

RETRIEVAL = {int(x) for x in os.environ.get("RETRIEVAL", "18").split(",") if x}
compress_middle = pr.CompressKVPress.compress_middle


def without_repeat(reference: LayerReference) -> LayerReference:
    """The reference before the repeat pass added to it: the prefill's parts come first (the window's one part)."""
    parts = 1 if "window" in reference.mass else 0
    return LayerReference(
        mass={source: mass for source, mass in reference.mass.items() if source != "repeat"},
        queries=reference.queries[:parts], positions=reference.positions[:parts], outputs=reference.outputs[:parts],
        query_radius=reference.query_radius, reduce=reference.reduce,
    )


def patched_compress_middle(self, module, keys, values, start, end, rows, reference):
    if module.layer_idx not in RETRIEVAL:
        reference = without_repeat(reference)
    return compress_middle(self, module, keys, values, start, end, rows, reference)


pr.CompressKVPress.compress_middle = patched_compress_middle
sys.exit(run(sys.argv[1:]))
