"""Diagnosis for issue 20 (not part of the library): which layers lose the multi-key needles at 2048 tokens?

Per RULER-style context of TASK, one prefill under the default press at KEPT and one with the full cache. The
default's cache with layer l replaced by the full cache's layer (wrapped as a compressed layer: every row, weight 1,
no clip range, so its attention is exactly the full layer's) is the default with nothing dropped in layer l.
Prints, per layer, the mean log-prob (nats) of the expected answers gained by that swap, and the full cache's whole
gain. The same method as `repeat_layer_gain.py`, with the full cache as the donor.

    python results/frontier/diagnosis/full_layer_gain.py [TASK] [CONTEXTS] [SEED] [KEPT] [LENGTH]
"""
import copy
import sys

import kvpress  # noqa: F401
import torch
from transformers import pipeline

from kvcompress.cache import WeightedLayer
from kvcompress.calibration import _answer_logprob
from kvcompress.fidelity.measure import prefill
from kvcompress.models import load_model
from kvcompress.presses import CompressKVPress
from kvcompress.ruler.generator import generate

task = sys.argv[1] if len(sys.argv) > 1 else "niah_multikey"
contexts = int(sys.argv[2]) if len(sys.argv) > 2 else 8
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
kept = float(sys.argv[4]) if len(sys.argv) > 4 else 0.5
length = int(sys.argv[5]) if len(sys.argv) > 5 else 2048
torch.set_num_threads(1)
model, tokenizer = load_model(None)
pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
press = CompressKVPress(compression_ratio=1 - kept, seed=seed)
layers = model.config.num_hidden_layers


def as_weighted(layer, tokens: int) -> WeightedLayer:
    b, h, r, d = layer.values.shape
    inf = torch.full((b, h, d), torch.inf)
    return WeightedLayer(layer.keys, layer.values, torch.ones(b, h, r), -inf, inf, tokens)


gains, whole, asked = [0.0] * layers, 0.0, 0
with torch.no_grad():
    for example in generate(task, tokenizer, length, contexts, seed):
        inputs = pipe.preprocess(example.context, list(example.questions), example.answer_prefix, 1 << 30)
        ids = inputs["context_ids"]
        cache_a, _ = prefill(model, press, ids)
        cache_full, _ = prefill(model, None, ids)
        full_layers = [as_weighted(layer, ids.shape[1]) for layer in cache_full.layers]
        for question, expected in zip(inputs["questions_ids"], example.answers, strict=True):
            for answer_text in expected:
                answer = tokenizer.encode(" " + answer_text, return_tensors="pt", add_special_tokens=False)
                base = _answer_logprob(model, cache_a, ids.shape[1], question, answer)
                whole += _answer_logprob(model, cache_full, ids.shape[1], question, answer) - base
                for layer in range(layers):
                    mixed = copy.copy(cache_a)
                    mixed.layers = list(cache_a.layers)
                    mixed.layers[layer] = full_layers[layer]
                    gains[layer] += _answer_logprob(model, mixed, ids.shape[1], question, answer) - base
                asked += 1
        print(f"context {example.index + 1}/{contexts}", file=sys.stderr, flush=True)
print(f"{task}, {contexts} contexts, seed {seed}, kept {kept}, {length} tokens: {asked} answers; "
      f"the full cache over the default: {whole / asked:+.3f} nats")
for layer in sorted(range(layers), key=lambda i: -gains[i]):
    print(f"layer {layer:2d}: {gains[layer] / asked:+.3f}")
