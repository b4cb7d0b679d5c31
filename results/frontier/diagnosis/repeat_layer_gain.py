"""Diagnosis for issue 20 (not part of the library): in which layers does a second reading's scoring help the answers?

Per RULER-style context of TASK (default niah_multikey), one prefill under press A (default `compresskv`) and one
under press B (default `compresskv_balanced`), both with the same row plan (the same retrieval layers and kept
fraction). As in `kvcompress.calibration.layer_drops`, each layer is compressed from its own keys and queries, so A's
cache with layer l swapped in from B's is the cache of A with B's rows in layer l alone. Prints, per layer, the mean
log-prob (nats) of the expected answers gained by that swap, and B's whole gain over A.

    python results/frontier/diagnosis/repeat_layer_gain.py [TASK] [CONTEXTS] [SEED] [KEPT]
"""
import copy
import sys

import kvpress  # noqa: F401
import torch
from transformers import pipeline

from kvcompress.calibration import _answer_logprob
from kvcompress.fidelity.measure import prefill
from kvcompress.models import load_model
from kvcompress.presses import CompressKVPress
from kvcompress.ruler.generator import generate

task = sys.argv[1] if len(sys.argv) > 1 else "niah_multikey"
contexts = int(sys.argv[2]) if len(sys.argv) > 2 else 8
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
kept = float(sys.argv[4]) if len(sys.argv) > 4 else 0.25
torch.set_num_threads(1)
model, tokenizer = load_model(None)
pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
a = CompressKVPress(compression_ratio=1 - kept, seed=seed)
b = CompressKVPress.balanced(compression_ratio=1 - kept, seed=seed)
layers = model.config.num_hidden_layers
gains, whole, asked = [0.0] * layers, 0.0, 0
with torch.no_grad():
    for example in generate(task, tokenizer, 1024, contexts, seed):
        inputs = pipe.preprocess(example.context, list(example.questions), example.answer_prefix, 1 << 30)
        ids = inputs["context_ids"]
        cache_a, _ = prefill(model, a, ids)
        cache_b, _ = prefill(model, b, ids)
        for question, expected in zip(inputs["questions_ids"], example.answers, strict=True):
            for answer_text in expected:
                answer = tokenizer.encode(" " + answer_text, return_tensors="pt", add_special_tokens=False)
                base = _answer_logprob(model, cache_a, ids.shape[1], question, answer)
                whole += _answer_logprob(model, cache_b, ids.shape[1], question, answer) - base
                for layer in range(layers):
                    mixed = copy.copy(cache_a)
                    mixed.layers = list(cache_a.layers)
                    mixed.layers[layer] = cache_b.layers[layer]
                    gains[layer] += _answer_logprob(model, mixed, ids.shape[1], question, answer) - base
                asked += 1
        print(f"context {example.index + 1}/{contexts}", file=sys.stderr, flush=True)
print(f"{task}, {contexts} contexts, seed {seed}, kept {kept}: {asked} answers; B over A in every layer: "
      f"{whole / asked:+.3f} nats")
for layer in sorted(range(layers), key=lambda i: -gains[i]):
    print(f"layer {layer:2d}: {gains[layer] / asked:+.3f}")
