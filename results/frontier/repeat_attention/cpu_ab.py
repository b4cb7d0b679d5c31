"""A/B in one process: thorough() and balanced() 2k prefill with the lower-right repeat attention (A) and with
transformers' explicit mask (B: the context manager replaced by a no-op), in turn, CPU seconds."""

import contextlib
import sys
import time

import kvpress  # noqa
import torch
from transformers import pipeline

from kvcompress import reference
from kvcompress.fidelity.contexts import build_contexts
from kvcompress.fidelity.measure import prefill
from kvcompress.fidelity.specs import make_press, parse_spec
from kvcompress.models import load_model

torch.set_num_threads(1)
model, tok = load_model()
pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok)
ctx = build_contexts(pipe, ["prose"], [2000], seeds=1, continuation=1)[0]
lower_right = reference.new_tokens_see_all_cached
rows = []
for i in range(int(sys.argv[1])):
    for name in ("compresskv_thorough", "compresskv_balanced"):
        for arm, cm in (("A", lower_right), ("B", contextlib.nullcontext)):
            reference.new_tokens_see_all_cached = cm
            press = make_press(parse_spec(name), 0.25, seed=i)
            t = time.process_time()
            cache = prefill(model, press, ctx.ids)[0]
            t = time.process_time() - t
            rows.append((name, arm, t, cache.layers[5].keys.clone()))
            print(i, name, arm, f"{t:.2f}", flush=True)
for name in ("compresskv_thorough", "compresskv_balanced"):
    a = [r for r in rows if r[0] == name and r[1] == "A"]
    b = [r for r in rows if r[0] == name and r[1] == "B"]
    ratios = sorted(x[2] / y[2] for x, y in zip(a, b, strict=True))
    same = all(torch.equal(x[3], y[3]) for x, y in zip(a, b, strict=True))
    print(
        name,
        "A/B CPU ratios",
        [f"{r:.3f}" for r in ratios],
        "median",
        f"{ratios[len(ratios) // 2]:.3f}",
        "same layer-5 rows:",
        same,
    )
