"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "The repeat pass's scores on a
GPU's terms"); it patches the press as of commit 6f43f66 (the library's scores unchanged since) and runs
`kvcompress eval ...` (or `python -m eval.fidelity ...` when the first argument is `fidelity`; PYTHONPATH=. then)
with its arguments.

Experiment: the repeat pass's scores with KVzip's own normalisation (Kim et al., arXiv 2505.23416): each repeat
query's probabilities over the context keys AND the repeated chunk's own keys before it (the softmax its attention
actually ran), instead of a softmax over the context keys alone. What it would buy on a GPU: the repeat chunk's
flash attention already returns that row log-sum-exp, so the mass kernel could skip its first pass (about half of
the mass, 2.1 no-press prefills for `thorough()` at 32k on an H200)."""

import sys

import torch

import kvcompress.weighted_press as weighted_press
from kvcompress.reference import even_sample, post_rope_queries
from kvcompress.selection import attention_mass


def record_repeat(module, kwargs, keys, reference, samples, total):
    hidden = kwargs["hidden_states"]
    queries = post_rope_queries(module, hidden, kwargs["position_embeddings"])
    n, chunk = keys.shape[-2], hidden.shape[1]
    every = kwargs["past_key_values"].layers[module.layer_idx].keys  # context rows, then the chunk's own
    assert every.shape[-2] == n + chunk, (every.shape, n, chunk)
    causal = torch.arange(n, n + chunk, device=keys.device)  # causal within the chunk
    mass = attention_mass(queries, every, module.scaling, query_positions=causal, reduce=reference.reduce)
    mass = mass[..., :n]
    keep = even_sample(chunk, max(1, round(samples * chunk / total)), keys.device)
    positions = torch.full((len(keep),), n - 1, dtype=torch.long, device=keys.device)
    reference.add("repeat", mass, queries[:, :, keep], positions)


weighted_press.record_repeat = record_repeat
if sys.argv[1:2] == ["fidelity"]:
    from eval.fidelity import main as fidelity_main

    sys.exit(fidelity_main(sys.argv[2:]))
from kvcompress.cli import main as cli_main  # noqa: E402

sys.exit(cli_main(sys.argv[1:]))
