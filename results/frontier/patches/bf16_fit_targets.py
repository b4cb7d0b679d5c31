"""Does rounding the fit's validation targets (the window rows' exact outputs) to bf16, as a GPU's prefill hands
them over, change the default's accept decisions? The embedded model (float32, CPU), one 2k context of each kind,
25% kept; the fit's weights do not depend on the targets, only its decisions do. From the repository root:
``PYTHONPATH=. python results/frontier/patches/bf16_fit_targets.py``."""

from __future__ import annotations

import kvpress  # noqa: F401  (registers the kv-press-text-generation pipeline)
import torch
from transformers import DynamicCache, pipeline

from kvcompress import CompressKVPress, methods
from kvcompress.fidelity.contexts import build_contexts
from kvcompress.models import load_model


def decisions(model, contexts, round_targets: bool) -> list[torch.Tensor]:
    """Every fit call's ``accepted [b, h_kv]`` over the contexts, its known rows' outputs rounded to bf16 or not."""
    original, accepted = methods.fit_kept_rows, []

    def fit(*args, known_rows=None, **options):
        if round_targets and known_rows is not None:
            known_rows = (known_rows[0], known_rows[1].bfloat16().float())
        result = original(*args, known_rows=known_rows, **options)
        accepted.append(result.accepted)
        return result

    methods.fit_kept_rows = fit
    try:
        for context in contexts:
            with torch.no_grad(), CompressKVPress(compression_ratio=0.75, seed=0)(model):
                model(input_ids=context.ids, past_key_values=DynamicCache())
    finally:
        methods.fit_kept_rows = original
    return accepted


def main() -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    contexts = build_contexts(pipe, ["prose", "code", "mix"], [2048], seeds=1, continuation=1)
    exact, rounded = decisions(model, contexts, False), decisions(model, contexts, True)
    heads = sum(a.numel() for a in exact)
    flips = sum(int((a != b).sum()) for a, b in zip(exact, rounded, strict=True))
    kept = sum(int(a.sum()) for a in exact)
    print(f"heads {heads}, fits accepted with float32 targets {kept}, decisions changed by bf16 targets {flips}")


if __name__ == "__main__":
    main()
