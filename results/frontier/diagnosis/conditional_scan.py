"""Each layer's answer gain once some layers are already kept whole (docs/BENCHMARKS.md, "The full-layer scan on two
tasks").

A diagnostic, not part of the library. From the repository root:

    python results/frontier/diagnosis/conditional_scan.py TASK KEPT WHOLE LENGTH [LENGTH ...]

``kvcompress calibrate``'s full-layer scan (:func:`kvcompress.calibration_scan.full_layer_gains`) run on the calibrated
press with the layers ``WHOLE`` (comma-separated, e.g. ``7``) already kept whole, the other layers paying for them as
in the default (the retrieval layers the model's calibration names widened, as ``retrieval_layers="auto"`` does): the
gain of one more layer given those. 8 ``TASK`` contexts of seed 0 per length (the scan's), the
embedded model in float32, ``KEPT`` of each context kept, 2 threads.
"""

import sys

import torch

from kvcompress.calibration_scan import full_layer_gains
from kvcompress.models import load_model
from kvcompress.presses import CompressKVPress

task, kept, whole = sys.argv[1], float(sys.argv[2]), tuple(int(x) for x in sys.argv[3].split(","))
torch.set_num_threads(2)
model, tokenizer = load_model(None, dtype=torch.float32, device="cpu")
press = CompressKVPress(compression_ratio=1 - kept, seed=0, retrieval_layers="auto", full_layers=whole)
for length in (int(x) for x in sys.argv[4:]):
    gains = full_layer_gains(model, tokenizer, press, task, length, 8, 0)
    print(f"\n{length} tokens, {task}, {kept:g} kept, layers {list(whole)} whole: the uncompressed cache gains "
          f"{gains['whole']:+.3f} nats per answer; each layer kept whole as well (nats, share):", flush=True)
    top = sorted((g, x) for x, g in enumerate(gains["layers"]) if g is not None)[::-1][:5]
    for gain, layer in top:
        print(f"{layer:5d}  {gain:+.3f}  {gain / gains['whole']:+.2f}", flush=True)
