"""The RULER-style tasks as examples of the LongBench harness (``kvcompress eval --benchmark ruler``)."""

from __future__ import annotations

from kvcompress.longbench.config import RULER_EXAMPLES, Config, UsageError, ruler_length
from kvcompress.longbench.data import Example
from kvcompress.ruler.generator import generate


def load_tokenizer(model: str | None):
    """The tokenizer of ``model`` (None: the embedded model), without loading the model."""
    from transformers import AutoTokenizer

    from kvcompress.models import resolve_model_name

    return AutoTokenizer.from_pretrained(resolve_model_name(model))


def load_ruler_task(task: str, cfg: Config, tokenizer=None) -> list[Example]:
    """``--limit`` (default ``RULER_EXAMPLES``) generated examples of ``task`` at the run's length and seed."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
    try:
        drawn = generate(task, tokenizer, ruler_length(cfg), cfg.limit or RULER_EXAMPLES, cfg.seed)
    except ValueError as err:
        raise UsageError(f"--length: {err}") from None
    return [
        Example(
            task=task,
            index=e.index,
            key=e.key,
            context=e.context,
            question="",
            answer_prefix=e.answer_prefix,
            answers=[s for strings in e.answers for s in strings],
            all_classes=None,
            length=e.tokens,
            questions=e.questions,
            expected=e.answers,
        )
        for e in drawn
    ]
