"""Diagnosis for issue 20 (not part of the library): in which layers does a second reading's scoring help the answers?

Per RULER-style context of TASK (default niah_multikey), one prefill under press A (default `compresskv`) and one under
press B (default `compresskv_balanced`), both with the same row plan (the same retrieval layers and kept fraction). As
in `kvcompress.calibration_scan.layer_drops`, each layer is compressed from its own keys and queries, so A's cache with
layer l swapped in from B's is the cache of A with B's rows in layer l alone. Prints, per layer, the mean log-prob
(nats) of the expected answers gained by that swap, and B's whole gain over A.

DONOR ``full`` (the thirtieth session: which layers lose the multi-key needles at 2048 tokens) makes B the full cache:
A's cache with layer l replaced by the full cache's layer (wrapped as a compressed layer, every row with weight 1 and no
clip range, so its attention is exactly the full layer's) is A with nothing dropped in layer l.

python results/frontier/diagnosis/repeat_layer_gain.py [TASK] [CONTEXTS] [SEED] [KEPT] [LENGTH] [DONOR]
"""
import os
import sys

import kvpress  # noqa: F401
import torch
from transformers import pipeline

from kvcompress.calibration_scan import _answer_logprob
from kvcompress.fidelity.measure import prefill
from kvcompress.models import load_model
from kvcompress.presses import CompressKVPress
from kvcompress.ruler.generator import generate

task = sys.argv[1] if len(sys.argv) > 1 else "niah_multikey"
contexts = int(sys.argv[2]) if len(sys.argv) > 2 else 8
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
kept = float(sys.argv[4]) if len(sys.argv) > 4 else 0.25
length = int(sys.argv[5]) if len(sys.argv) > 5 else 1024
donor = sys.argv[6] if len(sys.argv) > 6 else "balanced"
if donor not in ("balanced", "full"):
    sys.exit(f"DONOR: 'balanced' or 'full', got {donor!r}")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worst_context import as_weighted, with_layers  # noqa: E402  (this directory's diagnostic, not an installed module)

torch.set_num_threads(1)
model, tokenizer = load_model(None)
pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
a = CompressKVPress(compression_ratio=1 - kept, seed=seed)
b = CompressKVPress.balanced(compression_ratio=1 - kept, seed=seed) if donor == "balanced" else None  # None: exact
layers = model.config.num_hidden_layers
gains, whole, asked = [0.0] * layers, 0.0, 0
with torch.no_grad():
    for example in generate(task, tokenizer, length, contexts, seed):
        inputs = pipe.preprocess(example.context, list(example.questions), example.answer_prefix, 1 << 30)
        ids = inputs["context_ids"]
        cache_a, _ = prefill(model, a, ids)
        cache_b, _ = prefill(model, b, ids)
        donor_layers = cache_b.layers if b is not None else [as_weighted(x, ids.shape[1]) for x in cache_b.layers]
        for question, expected in zip(inputs["questions_ids"], example.answers, strict=True):
            for answer_text in expected:
                answer = tokenizer.encode(" " + answer_text, return_tensors="pt", add_special_tokens=False)
                base = _answer_logprob(model, cache_a, ids.shape[1], question, answer)
                whole += _answer_logprob(model, cache_b, ids.shape[1], question, answer) - base
                for layer in range(layers):
                    mixed = with_layers(cache_a, {layer: donor_layers[layer]})
                    gains[layer] += _answer_logprob(model, mixed, ids.shape[1], question, answer) - base
                asked += 1
        print(f"context {example.index + 1}/{contexts}", file=sys.stderr, flush=True)
if donor == "balanced":
    print(f"{task}, {contexts} contexts, seed {seed}, kept {kept}: {asked} answers; B over A in every layer: "
          f"{whole / asked:+.3f} nats")
else:
    print(f"{task}, {contexts} contexts, seed {seed}, kept {kept}, {length} tokens: {asked} answers; "
          f"the full cache over the default: {whole / asked:+.3f} nats")
for layer in sorted(range(layers), key=lambda i: -gains[i]):
    print(f"layer {layer:2d}: {gains[layer] / asked:+.3f}")
