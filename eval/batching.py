"""Batch 1 against batch B on CPU: the same contexts and questions, compressed and answered one at a time or as
one left-padded batch (what ``model.generate`` does with several prompts).

    python -m eval.batching --batch 4          # 4 contexts as one padded batch
    python -m eval.batching --batch 1          # the same 4 contexts, one at a time

Prints one JSON line: contexts, generated tokens, seconds of compression + generation (model loading
excluded) and tokens/s. Contexts: ``--contexts`` passages of ``pydoc_data.topics`` (always present offline)
of different lengths (``--length`` tokens for the first, then shorter), the embedded SmolLM2-135M-Instruct,
greedy decoding of ``--new-tokens`` tokens, ``--method`` from the registry at ``--ratio`` kept.
"""

from __future__ import annotations

import argparse
import json
import pydoc_data.topics
import time

import torch
from transformers import DynamicCache

from kvcompress.models import load_model
from kvcompress.padding import pad_rows
from kvcompress.registry import make_press


def contexts_and_question(tokenizer, count: int, length: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    text = " ".join(pydoc_data.topics.topics.values())
    ids = tokenizer(text[: 12 * length * count], return_tensors="pt").input_ids
    sizes = [max(32, length - i * length // (2 * count)) for i in range(count)]  # rows of different lengths
    starts = [sum(sizes[:i]) for i in range(count)]
    question = tokenizer(" In one sentence, the text above explains", return_tensors="pt").input_ids
    return [ids[:, s : s + n] for s, n in zip(starts, sizes, strict=True)], question


@torch.no_grad()
def answer_batch(model, press, contexts: list[torch.Tensor], question: torch.Tensor, new_tokens: int, pad_id: int):
    """Compress the padded contexts under ``press``, then generate; returns the generated ids ``[b, new_tokens]``."""
    ids, mask = pad_rows(contexts, "left", pad_id)
    cache = DynamicCache()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    if press is None:
        model.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
    else:
        with press(model):
            model.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
    questions = question.expand(len(contexts), -1)
    full, full_mask = torch.cat([ids, questions], 1), torch.cat([mask, torch.ones_like(questions)], 1)
    out = model.generate(
        full,
        attention_mask=full_mask,
        past_key_values=cache,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return out[:, full.shape[1] :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4, help="contexts per padded batch (1: one at a time)")
    parser.add_argument("--contexts", type=int, default=4, help="contexts in all (default 4)")
    parser.add_argument("--length", type=int, default=1024, help="tokens of the longest context (default 1024)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated per context")
    parser.add_argument("--method", default="compresskv", help="registry method (default compresskv)")
    parser.add_argument("--ratio", type=float, default=0.25, help="kept fraction of each context (default 0.25)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    args = parser.parse_args(argv)
    for name in ("batch", "contexts", "length", "new_tokens", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be an int >= 1, got {getattr(args, name)}")
    if not 0 < args.ratio <= 1:
        parser.error(f"--ratio: must be a kept fraction in (0, 1], got {args.ratio}")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    contexts, question = contexts_and_question(tokenizer, args.contexts, args.length)
    start, generated = time.perf_counter(), 0
    for first in range(0, len(contexts), args.batch):
        press = make_press(args.method, 1 - args.ratio, seed=0)
        out = answer_batch(model, press, contexts[first : first + args.batch], question, args.new_tokens, 0)
        generated += out.numel()
    seconds = time.perf_counter() - start
    result = dict(batch=args.batch, contexts=len(contexts), lengths=[c.shape[1] for c in contexts], method=args.method,
                  ratio=args.ratio, generated_tokens=generated, seconds=round(seconds, 3),
                  tokens_per_s=round(generated / seconds, 3))  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
