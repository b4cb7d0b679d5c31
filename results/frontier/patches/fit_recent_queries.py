"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit 144b731 and runs the continuation study of ``continuation_prefixes.py`` (each row's KL also per
32 tokens) with its arguments: ``python results/frontier/patches/fit_recent_queries.py fidelity ...``.

Experiment: the default's fit weights the window's last FITREC (default 16) queries FITDUP (default 3) times, by
appending FITDUP - 1 more copies of them (with their exact outputs) to the fit's queries; the selection does not
change. Why: the continuation's first tokens lose most against SnapKV ("Three knobs for the first tokens after the
context"), and their queries look most like the context's last ones; the fit weighs all 64 window queries alike."""
import os
import sys

import continuation_prefixes  # noqa: F401  (patches the study's rows with kl_bins)
from _pilot import run

import kvcompress.presses as pr

FITREC = int(os.environ.get("FITREC", "16"))
FITDUP = int(os.environ.get("FITDUP", "3"))
record_reference = pr.CompressKVPress.record_reference


def patched_record_reference(self, module, kwargs, keys, values):
    reference = record_reference(self, module, kwargs, keys, values)
    if not reference.queries or FITDUP <= 1:
        return reference
    queries, positions = reference.queries[0][:, :, -FITREC:], reference.positions[0][-FITREC:]
    outputs = reference.outputs[0]
    if outputs is not None:
        outputs = (outputs[0][:, :, -FITREC:], outputs[1][:, :, -FITREC:])
    for _ in range(FITDUP - 1):
        reference.queries.append(queries)
        reference.positions.append(positions)
        reference.outputs.append(outputs)
    return reference


pr.CompressKVPress.record_reference = patched_record_reference

sys.exit(run(sys.argv[1:]))
