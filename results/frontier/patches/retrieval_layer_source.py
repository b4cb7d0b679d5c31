"""A pilot of issue 20's frontier, not part of the library; it patches the press as of commit c602f2e and runs
`kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: one more query source in the retrieval layers only. Each layer the press widens (the calibration's,
`retrieval_layers`) also records SOURCE (default "context": every prefill query against every context key,
non-causally, max-pooled as the default pools; "accumulated": the same, causal), mixed with the window's attention
for the rows the priors leave. No extra forward: one n x n attention mass in one layer (about 0.08 s of an H200's
1.15 s prefill at 32k for a 7B layer, measured for the non-causal mass in the seventeenth session). Why: the
second reading's gain over the default comes most through layer 18 (repeat_layer_gain), and its queries are
what a question later reads with; the prefill's own queries over the whole context are the cheapest stand-in."""
import os
import sys

from _pilot import run

import kvcompress.presses as pr

SOURCE = os.environ.get("SOURCE", "context")
record_reference = pr.CompressKVPress.record_reference


def patched_record_reference(self, module, kwargs, keys, values):
    if module.layer_idx not in self._retrieval or SOURCE in self.reference:
        return record_reference(self, module, kwargs, keys, values)
    saved = self.reference
    self.reference = (*saved, SOURCE)
    try:
        return record_reference(self, module, kwargs, keys, values)
    finally:
        self.reference = saved


pr.CompressKVPress.record_reference = patched_record_reference
sys.exit(run(sys.argv[1:]))
