"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "The repeat pass's scores on a
GPU's terms"); it patches the press as of commit 58e7747 and runs `kvcompress eval ...` (or `python -m eval.fidelity
...` when the first argument is `fidelity`; PYTHONPATH=. then) with its arguments.

Experiment: the repeat pass's attention mass from every STRIDE-th repeat query only (environment variable STRIDE,
default 2), the other queries still read the context (the forward is unchanged): the mass's cost, about half of a
repeat setting's overhead on a GPU (`balanced()`: 0.63 s of 3.06 s at 32k on an H200), divided by STRIDE."""

import os
import sys

import torch

import kvcompress.weighted_press as weighted_press
from kvcompress.reference import even_sample, post_rope_queries
from kvcompress.selection import attention_mass

STRIDE = int(os.environ.get("STRIDE", "2"))


def record_repeat(module, kwargs, keys, reference, samples, total):
    hidden = kwargs["hidden_states"]
    queries = post_rope_queries(module, hidden, kwargs["position_embeddings"])
    n, chunk = keys.shape[-2], hidden.shape[1]
    offset = (STRIDE - 1) if chunk >= STRIDE else 0  # every STRIDE-th, ending at a chunk's last query
    mass = attention_mass(queries[:, :, offset::STRIDE], keys, module.scaling, reduce=reference.reduce)
    keep = even_sample(chunk, max(1, round(samples * chunk / total)), keys.device)
    positions = torch.full((len(keep),), n - 1, dtype=torch.long, device=keys.device)
    reference.add("repeat", mass, queries[:, :, keep], positions)


weighted_press.record_repeat = record_repeat
if sys.argv[1:2] == ["fidelity"]:
    from eval.fidelity import main as fidelity_main

    sys.exit(fidelity_main(sys.argv[2:]))
from kvcompress.cli import main as cli_main  # noqa: E402

sys.exit(cli_main(sys.argv[1:]))
