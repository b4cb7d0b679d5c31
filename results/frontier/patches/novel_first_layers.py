"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit 0806e88 and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: balanced()'s novel pieces chosen from the first NOVLAYERS layers' novelty only (default 1: layer 0), as
a repeat pass streamed layer by layer would have to (it starts at layer 0)."""

import os
import sys

import kvcompress.presses as pr
from kvcompress.cli import main as cli_main
from kvcompress.reference import novel_pieces

K = int(os.environ.get("NOVLAYERS", "1"))
orig = pr.CompressKVPress.repeat_positions


def repeat_positions(self, n, device, references):
    if self.repeat_pieces == "novel":
        novelty = [reference.mass["novelty"] for reference in references[:K]]
        return novel_pieces(novelty, self.repeat_fraction, self.repeat_span, device)
    return orig(self, n, device, references)


pr.CompressKVPress.repeat_positions = repeat_positions
if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")
    from eval.fidelity import main as fid

    sys.exit(fid(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
