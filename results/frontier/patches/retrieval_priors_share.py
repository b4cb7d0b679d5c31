"""A pilot of issue 20's frontier, not part of the library; it patches the press as of commit c602f2e and runs
`kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: in a retrieval layer, the priors (novelty, induction) take their shares of part of the widened middle.
The library gives the priors their uniform row counts there and every extra row to the window's attention (for the
continuation); here the priors' shares are taken of `uniform + SHARE * (rows - uniform)` rows (SHARE=1: of the whole
widened middle, as in any other layer; 0: the library). Why: the repeat pass's gain over the default comes most through
layer 18 (results/frontier/diagnosis/repeat_layer_gain_*.txt), whose question-time reads the priors proxy."""
import os
import sys

from _pilot import run

import kvcompress.presses as pr

SHARE = float(os.environ.get("SHARE", "1"))


def patched_prior_rows(self, n, rows):
    if not self._retrieval:
        return rows
    uniform = self.plan(n).middle
    return rows if rows <= uniform else uniform + round(SHARE * (rows - uniform))


pr.CompressKVPress._prior_rows = patched_prior_rows
sys.exit(run(sys.argv[1:]))
