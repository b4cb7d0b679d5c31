"""Diagnostic of issue 20's frontier (docs/BENCHMARKS.md, "Pilots not kept"), not part of the library: the share of
the answer tokens of the RULER-style contexts (1024 tokens, 8 per task, raw context tokens) that fall in the pieces
balanced() re-reads (32 tokens, an eighth or a quarter), for per-head normalisations of the key novelty and piece
aggregates. Run: [SPAN=32] python results/frontier/patches/piece_coverage.py [LIMIT] [LENGTH]."""
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvcompress.models import resolve_model_name
from kvcompress.ruler.generator import generate
from kvcompress.selection import key_novelty

torch.set_num_threads(1)
name = resolve_model_name(None)
tok = AutoTokenizer.from_pretrained(name)
model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.float32).eval()
LIMIT = int(sys.argv[1]) if len(sys.argv) > 1 else 8
LENGTH = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
SPAN = int(os.environ.get("SPAN", 32))  # tokens a piece


def norm_minmax(x):
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    return (x - lo) / (hi - lo).clamp_min(1e-12)


def norm_rank(x):
    return x.argsort(-1).argsort(-1).float() / (x.shape[-1] - 1)


def norm_z(x):
    return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True).clamp_min(1e-12)


def norm_minmax_clip(x):  # min-max after clipping at the 99th percentile
    hi = x.quantile(0.99, dim=-1, keepdim=True)
    return norm_minmax(torch.minimum(x, hi))


NORMS = dict(minmax=norm_minmax, rank=norm_rank, z=norm_z, clip99=norm_minmax_clip)
AGGS = dict(max=lambda p: p.amax(-1), mean=lambda p: p.mean(-1), top4=lambda p: p.topk(4, -1).values.mean(-1))
results = {}
for task in ("niah_single", "niah_multikey", "niah_multiquery", "qa"):
    for ex in generate(task, tok, LENGTH, LIMIT, 0):
        enc = tok(ex.context, add_special_tokens=False, return_offsets_mapping=True)
        ids = torch.tensor([enc["input_ids"]])
        n = ids.shape[1]
        answer_tokens = set()
        for strings in ex.answers:
            for s in strings:
                start = ex.context.find(s)
                while start >= 0:
                    for t, (a, b) in enumerate(enc["offset_mapping"]):
                        if a < start + len(s) and b > start:
                            answer_tokens.add(t)
                    start = ex.context.find(s, start + 1)
        if not answer_tokens:
            continue
        with torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
        nov = torch.stack([key_novelty(layer.keys)[0] for layer in cache.layers])  # [L, h, n]
        flat = nov.reshape(-1, n)
        pieces = -(-n // SPAN)
        for nname, f in NORMS.items():
            score = f(flat).mean(0)
            padded = torch.nn.functional.pad(score, (0, pieces * SPAN - n), value=-1e9).view(pieces, SPAN)
            for aname, g in AGGS.items():
                ps = g(padded)
                order = ps.argsort(descending=True)
                for frac in (0.125, 0.25):
                    chosen = order[: max(1, round(frac * pieces))]
                    covered = set()
                    for c in chosen.tolist():
                        covered.update(range(c * SPAN, min(n, (c + 1) * SPAN)))
                    cov = len(answer_tokens & covered) / len(answer_tokens)
                    results.setdefault((nname, aname, frac), []).append(cov)
                    results.setdefault((nname, aname, frac, task), []).append(cov)
for key in sorted(k for k in results if len(k) == 3):
    short = {"niah_single": "niah-s", "niah_multikey": "niah-mk", "niah_multiquery": "niah-mq", "qa": "qa"}
    per = " ".join(f"{short[t]}={sum(results[key + (t,)]) / len(results[key + (t,)]):.2f}"
                   for t in short if key + (t,) in results)
    v = results[key]
    print(f"{key[0]:7s} {key[1]:5s} {key[2]:.3f}  coverage {sum(v) / len(v):.3f}  {per}")
