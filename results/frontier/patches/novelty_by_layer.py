"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit cce5ea8 and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: novelty_share per layer. NOVMID=share for layers in [LO, HI], NOVOUT=share elsewhere."""
import os
import sys

import kvcompress.presses as pr
from kvcompress.cli import main as cli_main

LO, HI = int(os.environ.get("LO", "4")), int(os.environ.get("HI", "22"))
MID, OUT = float(os.environ.get("NOVMID", "1.0")), float(os.environ.get("NOVOUT", "0.0"))
orig = pr.CompressKVPress.compress_middle
def compress_middle(self, module, keys, values, start, end, rows, reference):
    saved = self.novelty_share
    self.novelty_share = MID if LO <= module.layer_idx <= HI else OUT
    try:
        return orig(self, module, keys, values, start, end, rows, reference)
    finally:
        self.novelty_share = saved
pr.CompressKVPress.compress_middle = compress_middle

if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")  # run from the repository root
    from eval.fidelity import main as fid
    sys.exit(fid(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
