"""Seeded real-text contexts with two planted facts each, tokenised exactly as kvpress's pipeline does.

Three kinds of text, all shipped with the running CPython (offline):

* ``prose``: ``pydoc_data.topics``, the topics concatenated in sorted-name order;
* ``code``: the standard library's public top-level modules (``sysconfig.get_paths()["stdlib"]/*.py``
  without a leading underscore), in sorted order, whole files until ``CODE_CHARS`` characters;
* ``mix``: alternating blocks of about ``MIX_BLOCK_TOKENS`` tokens of prose and code (cut after a newline).

Each kind's token stream is cut into slots of ``max(lengths) + continuation + SLACK`` tokens; the contexts of
one kind take distinct slots (a seeded permutation), so they never overlap, nor do those of different seeds
(:func:`slot_order`) while the text has free slots. A context's own random draws
(its offset inside the slot, its two keys and codes) come from ``Random(f"{seed}:{kind}:{length}:{s}")``.
Two facts ("Remember this: the passcode for the blue vault is 4821.") are planted as lines at the depths that cycle
through ``depths`` across contexts; the text (facts included) is ``length`` tokens once the chat template's
prefix is subtracted. The continuation is the source's true next tokens after the slice.
"""

from __future__ import annotations

import bisect
import functools
import pydoc_data.topics
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

KINDS = ("prose", "code", "mix")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
CODE_CHARS = 800_000
MIX_BLOCK_TOKENS = 300
SLACK = 64  # spare source tokens per slot: room for the offset draw and the length adjustment
# Chosen with the full cache of the embedded SmolLM2-135M-Instruct, the weakest model the study runs: of the thirteen
# phrasings tried, this pair was answered best on the default 12 contexts (14 of 24 trials; "Based on the text
# above, what is the passcode for the {key}?" alone: 12 of 24; "The passcode for the {key} is {code}." with "What
# is the passcode for the {key}? Answer with the number only.": 3 of 12 on the 2k contexts).
NEEDLE = "Remember this: the passcode for the {key} is {code}."
QUESTION = "Based on the text above, what is the passcode for the {key}? Answer with the number only."
COLOURS = ("blue", "red", "green", "silver", "golden", "black", "white", "orange", "purple", "yellow")
THINGS = ("vault", "locker", "safe", "gate", "door", "chest", "cabinet", "archive")


@dataclass(frozen=True)
class Corpus:
    """One kind's token stream: ``ids`` and, for each document (topic, file or block), its name and first token."""

    ids: list[int]
    names: list[str]
    starts: list[int]

    def source_at(self, offset: int) -> str:
        """Name of the document holding token ``offset``."""
        return self.names[bisect.bisect_right(self.starts, offset) - 1]


@dataclass(frozen=True)
class Needle:
    """A planted fact: ``key`` (e.g. "blue vault"), its 4-digit ``code`` and requested ``depth`` in [0, 1]."""

    key: str
    code: int
    depth: float

    @property
    def sentence(self) -> str:
        return NEEDLE.format(key=self.key, code=self.code)

    @property
    def question(self) -> str:
        return QUESTION.format(key=self.key)


@dataclass
class Context:
    """A chat-templated context with its questions and true continuation (token tensors ``[1, n]`` int64)."""

    kind: str
    length: int  # requested text tokens (facts included, chat template excluded)
    seed: int
    start: int  # first source token of the slice in the kind's stream
    source: str  # the document that slice starts in
    needles: tuple[Needle, ...]
    text: str = field(repr=False)  # the context text given to the pipeline (facts planted)
    ids: torch.Tensor  # [1, n] context_ids of kvpress's pipeline.preprocess
    questions: list[torch.Tensor] = field(repr=False)  # [1, q] each: question + the rest of the chat template
    continuation: torch.Tensor = field(repr=False)  # [1, c] the source's next tokens

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.length}-s{self.seed}"

    def describe(self) -> dict:
        """JSON-ready description (what the outputs record, and what resuming compares)."""
        return dict(
            name=self.name,
            kind=self.kind,
            length=self.length,
            seed=self.seed,
            start=self.start,
            source=self.source,
            tokens=self.ids.shape[1],
            continuation=self.continuation.shape[1],
            needles=[dict(key=n.key, code=n.code, depth=n.depth) for n in self.needles],
        )


@functools.lru_cache(maxsize=8)
def _newline_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokens whose text ends with a newline."""
    vocab = tokenizer.get_vocab()
    return frozenset(i for token, i in vocab.items() if tokenizer.convert_tokens_to_string([token]).endswith("\n"))


def _documents(kind: str) -> list[tuple[str, str]]:
    """``(name, text)`` of the prose topics or the code files, in their fixed order."""
    if kind == "prose":
        topics = pydoc_data.topics.topics
        return [(name, topics[name] + "\n\n") for name in sorted(topics)]
    files = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if not p.name.startswith("_"))
    documents, chars = [], 0
    for path in files:
        if chars >= CODE_CHARS:
            break
        text = path.read_text(encoding="utf-8") + "\n\n"
        documents.append((path.name, text))
        chars += len(text)
    return documents


def _blocks(ids: list[int], size: int, newlines: frozenset[int]) -> list[tuple[int, int]]:
    """``(start, end)`` spans of at least ``size`` tokens, each ending after a newline token where one is near."""
    spans, start, n = [], 0, len(ids)
    while start < n:
        end = min(start + size, n)
        limit = min(end + size // 4, n)
        while end < limit and ids[end - 1] not in newlines:
            end += 1
        spans.append((start, end))
        start = end
    return spans


@functools.lru_cache(maxsize=8)
def load_corpus(tokenizer, kind: str) -> Corpus:
    """The token stream of ``kind`` (one of ``KINDS``) under ``tokenizer`` (cached per tokenizer and kind)."""
    if kind not in KINDS:
        raise ValueError(f"kinds: unknown kind {kind!r}; choose from {list(KINDS)}")
    if kind == "mix":
        prose, code = load_corpus(tokenizer, "prose"), load_corpus(tokenizer, "code")
        newlines = _newline_ids(tokenizer)
        ids, names, starts = [], [], []
        pairs = zip(
            _blocks(prose.ids, MIX_BLOCK_TOKENS, newlines), _blocks(code.ids, MIX_BLOCK_TOKENS, newlines), strict=False
        )
        for prose_span, code_span in pairs:
            for label, corpus, (a, b) in (("prose", prose, prose_span), ("code", code, code_span)):
                starts.append(len(ids))
                names.append(f"{label}:{corpus.source_at(a)}")
                ids.extend(corpus.ids[a:b])
        return Corpus(ids, names, starts)
    documents = _documents(kind)
    encoded = tokenizer([text for _, text in documents], add_special_tokens=False)["input_ids"]
    ids, starts = [], []
    for piece in encoded:
        starts.append(len(ids))
        ids.extend(piece)
    return Corpus(ids, [name for name, _ in documents], starts)


def _align(piece: list[int], cut: int, newlines: frozenset[int]) -> int:
    """The position nearest ``cut`` (within 1/64 of the piece, at most 32 tokens) that follows a newline token,
    else ``cut``."""
    for delta in range(min(32, len(piece) // 64) + 1):
        for pos in (cut - delta, cut + delta):
            if 0 < pos <= len(piece) and piece[pos - 1] in newlines:
                return pos
    return cut


def _render(tokenizer, piece: list[int], needles: tuple[Needle, ...], newlines: frozenset[int]) -> str:
    """The text of ``piece`` with each needle's sentence as a line at its depth."""
    cuts = sorted((_align(piece, round(n.depth * len(piece)), newlines), n.sentence) for n in needles)
    parts, previous = [], 0
    for cut, sentence in cuts:
        parts.append(tokenizer.decode(piece[previous:cut]))
        aligned = cut == 0 or piece[cut - 1] in newlines
        parts.append(f"{sentence}\n" if aligned else f"\n{sentence}\n")
        previous = cut
    parts.append(tokenizer.decode(piece[previous:]))
    return "".join(parts)


def _draw_needles(rng: random.Random, depths: tuple[float, float], text: str) -> tuple[Needle, ...]:
    """Two facts with distinct colours, things and codes; no code already occurs in ``text``."""
    colours, things = rng.sample(COLOURS, 2), rng.sample(THINGS, 2)
    codes: list[int] = []
    while len(codes) < 2:
        code = rng.randrange(1000, 10000)
        if code not in codes and str(code) not in text:
            codes.append(code)
    return tuple(Needle(f"{c} {t}", code, d) for c, t, code, d in zip(colours, things, codes, depths, strict=True))


def check_settings(kinds: list[str], lengths: list[int], seeds: int, continuation: int, depths: list[float]) -> None:
    """Raise ValueError naming the parameter on a bad context setting."""
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"kinds: unknown kind {kind!r}; choose from {list(KINDS)}")
    if not kinds or len(set(kinds)) != len(kinds):
        raise ValueError(f"kinds: a non-empty list of distinct kinds from {list(KINDS)}, got {kinds!r}")
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 64 for n in lengths):
        raise ValueError(f"lengths: a non-empty list of ints >= 64 (text tokens), got {lengths!r}")
    for name, value, low in (("seeds", seeds, 1), ("continuation_tokens", continuation, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: must be an int >= {low}, got {value!r}")
    if not depths or any(not isinstance(d, (int, float)) or not 0 < d < 1 for d in depths):
        raise ValueError(f"depths: a non-empty list of numbers in (0, 1), got {depths!r}")


def slot_order(seed: int, kind: str, slots: int, count: int) -> list[int]:
    """The ``count`` slices (of ``slots``) a study with ``seed`` takes from a kind's text: a seeded draw, where a
    slice an earlier seed (``0 .. seed - 1``, same count) took is replaced by a free one, so that each seed's
    contexts are fresh text (independent draws shared one slice between seeds 0 and 1: two near-equal contexts).
    Seed 0's draw, and a later seed's slices no earlier seed took, are those of the plain draw."""
    taken: set[int] = set()
    for drawn in range(seed + 1):  # each seed's slices, the earlier seeds' first (one pass, not a recursion per seed)
        order = random.Random(f"{drawn}:{kind}").sample(range(slots), count)
        free = [slot for slot in range(slots) if slot not in taken and slot not in order]
        rng = random.Random(f"{drawn}:{kind}:free")
        order = [free.pop(rng.randrange(len(free))) if slot in taken and free else slot for slot in order]
        taken.update(order)
    return order


def build_contexts(
    pipe,
    kinds: list[str],
    lengths: list[int],
    seeds: int,
    continuation: int,
    depths: list[float] = DEPTHS,
    seed: int = 0,
) -> list[Context]:
    """Every (kind, length, context seed) context, in that nesting order, for the kvpress pipeline ``pipe``.

    Context ``i`` plants its facts at ``depths[2i % D]`` and ``depths[(2i + 1) % D]``; ``seed`` shifts every
    draw. Raises ValueError when a kind's text cannot hold ``len(lengths) * seeds`` disjoint slices.
    """
    check_settings(kinds, lengths, seeds, continuation, list(depths))
    tokenizer = pipe.tokenizer
    newlines = _newline_ids(tokenizer)
    prefix = pipe.preprocess("", [""], answer_prefix="", max_context_length=10**9)["context_ids"].shape[1]
    span = max(lengths) + continuation + SLACK
    contexts: list[Context] = []
    for kind in kinds:
        corpus = load_corpus(tokenizer, kind)
        slots = len(corpus.ids) // span
        wanted = [(length, s) for length in lengths for s in range(seeds)]
        if slots < len(wanted):
            raise ValueError(
                f"lengths: the {kind} text ({len(corpus.ids)} tokens) holds {slots} disjoint slices of {span} tokens, "
                f"{len(wanted)} asked (fewer lengths x seeds, or shorter lengths)"
            )
        order = slot_order(seed, kind, slots, len(wanted))
        for slot, (length, s) in zip(order, wanted, strict=True):
            index = len(contexts)
            rng = random.Random(f"{seed}:{kind}:{length}:{s}")
            start = slot * span + rng.randrange(SLACK // 2)
            pair = (depths[2 * index % len(depths)], depths[(2 * index + 1) % len(depths)])
            needles = _draw_needles(rng, pair, tokenizer.decode(corpus.ids[start : start + span]))
            contexts.append(_fit(pipe, corpus, kind, length, s, start, needles, continuation, prefix, newlines))
    return contexts


def _fit(
    pipe,
    corpus: Corpus,
    kind: str,
    length: int,
    seed: int,
    start: int,
    needles: tuple[Needle, ...],
    continuation: int,
    prefix: int,
    newlines: frozenset[int],
) -> Context:
    """Choose the number of source tokens so that the templated text is ``length`` tokens (or the nearest found)."""
    questions = [n.question for n in needles]
    source = length - sum(len(pipe.tokenizer.encode(n.sentence)) + 1 for n in needles)
    best = None
    for _ in range(8):
        text = _render(pipe.tokenizer, corpus.ids[start : start + source], needles, newlines)
        inputs = pipe.preprocess(text, questions, answer_prefix="", max_context_length=10**9)
        excess = inputs["context_ids"].shape[1] - prefix - length
        if best is None or abs(excess) < abs(best[0]):
            best = (excess, source, text, inputs)
        if excess == 0:
            break
        source -= excess
    _, source, text, inputs = best
    tail = corpus.ids[start + source : start + source + continuation]
    return Context(
        kind=kind,
        length=length,
        seed=seed,
        start=start,
        source=corpus.source_at(start),
        needles=needles,
        text=text,
        ids=inputs["context_ids"],
        questions=list(inputs["questions_ids"]),
        continuation=torch.tensor([tail]),
    )
