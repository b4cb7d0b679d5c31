"""A check of issue 20's value-weighted novelty prior, not part of the library (docs/BENCHMARKS.md, "The novelty
prior weighted by the value norm: better on long contexts, broken on short chat prompts"): ten one-line chat
prompts, each compressed to 25% kept by the default press with and without ``novelty_value_norm``, 40 greedy tokens.
Run from the repository root: ``python results/frontier/patches/value_norm_chat_prompts.py``."""

import torch

from kvcompress.models import load_model
from kvcompress.presses import CompressKVPress

torch.set_num_threads(1)
model, tok = load_model()
prompts = [
    "Tell a long story.", "Write a poem about the sea.", "Explain how a rainbow forms.", "Count from one to fifty.",
    "Describe your favourite city.", "Give me three tips for learning Python.",
    "What is the capital of France? Explain its history.", "Write a short letter to a friend.",
    "List the planets of the solar system.", "Summarize the plot of Romeo and Juliet.",
]  # fmt: skip
for flag in (False, True):
    lens = []
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        press = CompressKVPress(compression_ratio=0.75, novelty_value_norm=flag)
        with torch.no_grad(), press(model):
            out = model.generate(ids, max_new_tokens=40, do_sample=False)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        lens.append(len(out[0]) - ids.shape[1])
        print(flag, ids.shape[1], repr(text[:70]), flush=True)
    print("value_norm", flag, "new tokens", lens)
