"""A pilot of issue 20's frontier, not part of the library (docs/BENCHMARKS.md, "Pilots not kept"); it patches
the press as of commit d258aa6 and runs `kvcompress eval ...` (or `fidelity ...`) with its arguments.

Experiment: the novelty prior on each key before RoPE. The cache holds keys rotated by their positions, so the same
content at two positions gives two keys whose high-frequency pairs point different ways, and the head's mean key is
mostly its low-frequency pairs: KeyDiff's ``1 - cos(k_j, mean k)`` then mixes where a key is with what it says. Here
each context key is rotated back by its own position (the prefill call's ``position_embeddings``: ``k cos - rot(k)
sin``) before the score; the value norm, the window and the induction prior are the default's."""

import sys

import torch

from kvcompress import reference
from kvcompress.cli import main as cli_main

_original_novelty, _original_record = reference.key_novelty, reference.record_prefill
_rotation = {}


def record_prefill(module, kwargs, keys, *args, **options):
    _rotation["cos_sin"] = kwargs["position_embeddings"]
    try:
        return _original_record(module, kwargs, keys, *args, **options)
    finally:
        _rotation.clear()


def key_novelty(keys: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    cos, sin = _rotation["cos_sin"]
    cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    if cos.shape[-2] != keys.shape[-2]:
        raise RuntimeError(f"prerope_novelty: {cos.shape[-2]} positions for {keys.shape[-2]} keys")
    keys = keys.float()
    half = keys.shape[-1] // 2
    rotated_half = torch.cat((-keys[..., half:], keys[..., :half]), dim=-1)
    return _original_novelty(keys * cos - rotated_half * sin, values)


reference.record_prefill, reference.key_novelty = record_prefill, key_novelty
import kvcompress.presses as presses  # noqa: E402

presses.record_prefill = record_prefill
if sys.argv[1] == "fidelity":
    sys.path.insert(0, ".")
    from eval.fidelity import main as fidelity_main

    sys.exit(fidelity_main(sys.argv[2:]))
sys.exit(cli_main(sys.argv[1:]))
