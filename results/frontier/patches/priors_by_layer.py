"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit f33e87f and runs `kvcompress eval ...` or `fidelity ...` (eval.fidelity) with its arguments.

Experiment: the default's query-free priors (novelty, induction) switched off in the layers listed in PLAIN
(comma-separated, default "0"): there every middle row is chosen by the window's attention, pooled by WINPOOL
("max", the default's, or "sum", SnapKV's). Why: the default's per-layer attention error against SnapKV's is
1.68x in layer 0 (geometric mean over the fidelity study's 12 contexts), 0.9-1.4x elsewhere."""
import os
import sys

import kvcompress.presses as pr
from kvcompress.cli import main as cli_main

PLAIN = {int(x) for x in os.environ.get("PLAIN", "0").split(",") if x}
WINPOOL = os.environ.get("WINPOOL", "max")
compress_middle, record_reference = pr.CompressKVPress.compress_middle, pr.CompressKVPress.record_reference


def swapped(self, layer: int, **fields):
    saved = {name: getattr(self, name) for name in fields}
    if layer in PLAIN:
        for name, value in fields.items():
            object.__setattr__(self, name, value)
    return saved


def patched_compress_middle(self, module, keys, values, start, end, rows, reference):
    saved = swapped(self, module.layer_idx, novelty_share=0.0, induction_share=0.0)
    try:
        return compress_middle(self, module, keys, values, start, end, rows, reference)
    finally:
        for name, value in saved.items():
            object.__setattr__(self, name, value)


def patched_record_reference(self, module, kwargs, keys, values):
    saved = swapped(self, module.layer_idx, score_pooling=WINPOOL)
    try:
        return record_reference(self, module, kwargs, keys, values)
    finally:
        for name, value in saved.items():
            object.__setattr__(self, name, value)


pr.CompressKVPress.compress_middle = patched_compress_middle
pr.CompressKVPress.record_reference = patched_record_reference

if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")  # run from the repository root
    from eval.fidelity import main as fid
    sys.exit(fid(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
