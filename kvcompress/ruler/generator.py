"""Examples of the RULER-style tasks at a target token length, drawn from a seed with the model's tokenizer.

An example's random draws come from ``random.Random(f"{seed}:{task}:{length}:{index}")`` alone, so the same
seed, length and tokenizer give the same examples on every run and machine, and example ``i`` does not depend
on how many are generated. The haystack size is the largest for which the context plus its longest question
stay within ``length`` tokens of the tokenizer (no special tokens, no chat template), found by bisection.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from kvcompress.ruler.tasks import TASKS, Draw

DEFAULT_LENGTH = 4096
MAX_UNITS = 1 << 16  # bisection's upper bound on haystack units


@dataclass(frozen=True)
class RulerExample:
    """One context with its questions: ``answers[i]`` are the strings expected in the answer to ``questions[i]``;
    ``tokens``: the context's tokens plus its longest question's (within the target length)."""

    task: str
    index: int
    key: str
    context: str
    questions: tuple[str, ...]
    answers: tuple[tuple[str, ...], ...]
    answer_prefix: str
    tokens: int


def _count(tokenizer, draw: Draw) -> int:
    context = len(tokenizer.encode(draw.context, add_special_tokens=False))
    return context + max(len(tokenizer.encode(q, add_special_tokens=False)) for q in draw.questions)


def generate_example(task: str, tokenizer, length: int, seed: int, index: int) -> RulerExample:
    """Example ``index`` of ``task`` at ``length`` tokens; ValueError if even the smallest haystack is longer."""
    if task not in TASKS:
        raise ValueError(f"task: unknown RULER task {task!r}; choose from {', '.join(TASKS)}")
    spec = TASKS[task]

    def draw(size: int) -> Draw:  # the same draws for every size: only the haystack grows
        return spec.build(random.Random(f"{seed}:{task}:{length}:{index}"), size)

    low, high = 1, 64
    if _count(tokenizer, draw(low)) > length:
        raise ValueError(f"length: {length} tokens cannot hold a {task} example; use a larger length")
    while high < MAX_UNITS and _count(tokenizer, draw(high)) <= length:
        low, high = high, high * 2
    while high - low > 1:  # invariant: draw(low) fits, draw(high) does not (or high is the bound)
        middle = (low + high) // 2
        low, high = (middle, high) if _count(tokenizer, draw(middle)) <= length else (low, middle)
    best = draw(low)
    digest = hashlib.sha1(f"{best.context}|{best.questions}".encode()).hexdigest()[:12]
    return RulerExample(
        task=task,
        index=index,
        key=f"{task}-{index:03d}-{digest}",
        context=best.context,
        questions=best.questions,
        answers=best.answers,
        answer_prefix=spec.answer_prefix,
        tokens=_count(tokenizer, best),
    )


def generate(
    task: str, tokenizer, length: int = DEFAULT_LENGTH, examples: int = 8, seed: int = 0
) -> list[RulerExample]:
    """``examples`` examples of ``task`` at ``length`` tokens (see :func:`generate_example`)."""
    return [generate_example(task, tokenizer, length, seed, i) for i in range(examples)]
