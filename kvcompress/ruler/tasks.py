"""The RULER-style tasks: how each one's context, questions and expected strings are drawn.

After RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?",
arXiv 2404.06654), rewritten for offline use and for questions asked AFTER the context is compressed: each
context holds the task's instruction and its haystack (the compressed part); the questions come after it,
uncompressed, several per context where the task allows (kvpress's pipeline answers a list of questions on
one compressed cache). A builder takes a seeded ``random.Random`` and a size (haystack units) and returns a
:class:`Draw`; :mod:`kvcompress.ruler.generator` picks the size that fills the target token length.

Haystacks: ``noise`` is RULER's repeated-sentence filler; ``essay`` is prose from CPython's
``pydoc_data.topics`` (always present offline), a stand-in for RULER's Paul Graham essays.
"""

from __future__ import annotations

import functools
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass

from kvcompress.longbench.offline_suite import _ADJ, _CITIES, _FIRST, _LAST, _NOUN, _topics

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NIAH_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
# The multi-needle tasks' haystack ("essay" as in RULER's multi-key/value/query variants is harder): the embedded
# 135M model answered 1 of 4 multi-key questions on essay text at 2k tokens with the full cache, 2 of 4 on noise.
HAYSTACK = "noise"
NEEDLE = "One of the special magic numbers for {key} is: {value}."
KEY_ADJECTIVES = (
    "ancient", "bitter", "brave", "calm", "clever", "curious", "dusty", "eager", "fancy", "gentle", "glossy",
    "happy", "hollow", "jolly", "lively", "lucky", "mellow", "nimble", "quiet", "rapid", "rusty", "shiny",
    "silent", "sleepy", "steady", "sturdy", "tender", "tidy", "vivid", "witty",
)  # fmt: skip
KEY_NOUNS = (
    "anchor", "badger", "banjo", "beacon", "cactus", "canyon", "comet", "falcon", "glacier", "harbor", "helmet",
    "island", "jackal", "kettle", "lantern", "magnet", "meadow", "nectar", "otter", "pebble", "pepper", "quartz",
    "raven", "saddle", "teapot", "tunnel", "violin", "walrus", "willow", "zephyr",
)  # fmt: skip


@dataclass(frozen=True)
class Draw:
    """One drawn example: the compressed ``context``, the ``questions`` asked after it, and for each question
    the strings expected in its answer."""

    context: str
    questions: tuple[str, ...]
    answers: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class RulerTask:
    """A task: its builder ``(rng, size) -> Draw``, the answer prefix (after the chat template's assistant
    turn, as kvpress does), RULER's metric (``"all"``: fraction of the expected strings found; ``"part"``: any
    of them found) and the answer length in tokens."""

    build: Callable[[random.Random, int], Draw]
    answer_prefix: str
    metric: str
    max_new_tokens: int


@functools.cache
def essay_sentences() -> tuple[str, ...]:
    """Sentences of CPython's pydoc topics (5 to 60 words, no code-like lines), in topic-name order."""
    found = []
    for _, words in _topics():
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(words)):
            n = len(sentence.split())
            if 5 <= n <= 60 and not re.search(r"[{}<>=|\\]|>>>|\.\.\.", sentence):
                found.append(sentence)
    return tuple(found)


@functools.cache
def word_pool() -> tuple[str, ...]:
    """Distinct lower-case alphabetic words (4 to 10 letters) of CPython's pydoc topics, sorted."""
    return tuple(sorted({w.lower() for _, words in _topics() for w in words if w.isalpha() and 4 <= len(w) <= 10}))


def haystack(rng: random.Random, kind: str, size: int) -> list[str]:
    """``size`` haystack units: copies of the noise block, or consecutive essay sentences from a seeded start."""
    if kind == "noise":
        return [NOISE] * size
    sentences = essay_sentences()
    start = rng.randrange(len(sentences))
    return [sentences[(start + i) % len(sentences)] for i in range(size)]


def plant(rng: random.Random, units: list[str], lines: list[str]) -> str:
    """Insert ``lines`` (in order) at distinct seeded positions between the units; the text joined by spaces."""
    spots = sorted(rng.sample(range(len(units) + 1), len(lines))) if len(units) + 1 >= len(lines) else []
    spots = spots or [len(units)] * len(lines)
    out = list(units)
    for offset, (spot, line) in enumerate(zip(spots, lines, strict=True)):
        out.insert(spot + offset, line)
    return " ".join(out)


def _keys(rng: random.Random, count: int) -> list[str]:
    return rng.sample([f"{a}-{n}" for a in KEY_ADJECTIVES for n in KEY_NOUNS], count)


def _distinct(rng: random.Random, count: int, draw: Callable[[random.Random], str]) -> list[str]:
    """``count`` distinct strings from ``draw``, in draw order (a list, never a set: set order varies by process)."""
    values: list[str] = []
    while len(values) < count:
        value = draw(rng)
        if value not in values:
            values.append(value)
    return values


def _numbers(rng: random.Random, count: int) -> list[str]:
    return _distinct(rng, count, lambda r: str(r.randrange(1_000_000, 10_000_000)))


def _niah_question(key: str) -> str:
    return f"What is the special magic number for {key} mentioned in the provided text?"


def niah_single(rng: random.Random, size: int) -> Draw:
    """One needle in the noise haystack (RULER's niah_single_1)."""
    (key,), (value,) = _keys(rng, 1), _numbers(rng, 1)
    text = plant(rng, haystack(rng, "noise", size), [NEEDLE.format(key=key, value=value)])
    return Draw(f"{NIAH_INSTRUCTION}\n{text}\n", (_niah_question(key),), ((value,),))


def niah_multikey(rng: random.Random, size: int, needles: int = 4, kind: str = HAYSTACK) -> Draw:
    """``needles`` needles with distinct keys in essay text; each key is asked once, the others are distractors."""
    keys, values = _keys(rng, needles), _numbers(rng, needles)
    lines = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values, strict=True)]
    text = plant(rng, haystack(rng, kind, size), lines)
    return Draw(f"{NIAH_INSTRUCTION}\n{text}\n", tuple(map(_niah_question, keys)), tuple((v,) for v in values))


def niah_multivalue(rng: random.Random, size: int, needles: int = 4, kind: str = HAYSTACK) -> Draw:
    """One key with ``needles`` values spread over essay text; all values are asked for."""
    (key,), values = _keys(rng, 1), _numbers(rng, needles)
    text = plant(rng, haystack(rng, kind, size), [NEEDLE.format(key=key, value=v) for v in values])
    question = f"What are all the special magic numbers for {key} mentioned in the provided text?"
    return Draw(f"{NIAH_INSTRUCTION}\n{text}\n", (question,), (tuple(values),))


def niah_multiquery(rng: random.Random, size: int, needles: int = 4, kind: str = HAYSTACK) -> Draw:
    """``needles`` needles with distinct keys in essay text; one question asks for all of their numbers."""
    keys, values = _keys(rng, needles), _numbers(rng, needles)
    lines = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values, strict=True)]
    text = plant(rng, haystack(rng, kind, size), lines)
    named = f"{', '.join(keys[:-1])} and {keys[-1]}"
    question = f"What are all the special magic numbers for {named} mentioned in the provided text?"
    return Draw(f"{NIAH_INSTRUCTION}\n{text}\n", (question,), (tuple(values),))


def variable_tracking(rng: random.Random, size: int, hops: int = 4) -> Draw:
    """A chain of ``hops`` + 1 variables (``VAR A = 12345``, ``VAR B = VAR A``, ...) in the noise haystack;
    the answer is every variable holding the value (RULER's vt, one chain)."""
    chain = _distinct(rng, hops + 1, lambda r: "".join(r.choice(string.ascii_uppercase) for _ in range(5)))
    value = str(rng.randrange(10_000, 100_000))
    lines = [f"VAR {chain[0]} = {value}."] + [f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, len(chain))]
    text = plant(rng, haystack(rng, "noise", size), lines)
    context = f"Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{text}\n"
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    return Draw(context, (question,), (tuple(chain),))


def common_words(rng: random.Random, size: int, common: int = 3, repeats: int = 12, rare_repeats: int = 2) -> Draw:
    """A numbered word list where ``common`` words appear ``repeats`` times and ``size`` others ``rare_repeats``
    times each; the answer is the common words (RULER's cwe, scaled for a small model)."""
    words = rng.sample(word_pool(), min(len(word_pool()), common + size))
    top, rare = words[:common], words[common:]
    listed = top * repeats + rare * rare_repeats
    rng.shuffle(listed)
    numbered = " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed))
    context = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        f"Memorize the ones that appear most often.\n{numbered}\n"
    )
    question = f"Question: What are the {common} most common words in the above list?"
    return Draw(context, (question,), (tuple(top),))


def frequent_words(rng: random.Random, size: int, vocabulary: int = 40, alpha: float = 2.0) -> Draw:
    """``size`` coded words drawn from a Zipf law (exponent ``alpha``) over ``vocabulary`` random lower-case
    words, joined by " ... "; the answer is the three most frequent (RULER's fwe)."""
    letters = string.ascii_lowercase
    vocab = _distinct(rng, vocabulary, lambda r: "".join(r.choice(letters) for _ in range(r.randint(3, 5))))
    weights = [1 / (rank + 1) ** alpha for rank in range(vocabulary)]
    drawn = rng.choices(vocab, weights=weights, k=max(size, 10))
    ranked = sorted(vocab, key=drawn.count, reverse=True)
    if drawn.count(ranked[2]) == drawn.count(ranked[3]):  # a tie for third place: make the top three unambiguous
        drawn.append(ranked[2])
    top = ranked[:3]
    context = (
        "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        f"appeared coded words. {' ... '.join(drawn)}\n"
    )
    question = (
        "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
        "frequently appeared words in the above coded text?"
    )
    return Draw(context, (question,), (tuple(top),))


def qa_facts(rng: random.Random, size: int, facts: int = 4) -> Draw:
    """``facts`` invented facts ("The Copperleaf project is maintained by Ada Moreau, who works in Lisbon.")
    planted in essay text; each fact is asked about once (maintainer or city), scored by any-match."""
    projects = rng.sample([a + n for a in _ADJ for n in _NOUN], facts)
    people = rng.sample([f"{f} {last}" for f in _FIRST for last in _LAST], facts)
    cities = rng.sample(_CITIES, facts)
    facts_ = zip(projects, people, cities, strict=True)
    lines = [f"The {p} project is maintained by {m}, who works in {c}." for p, m, c in facts_]
    text = plant(rng, haystack(rng, "essay", size), lines)
    questions, answers = [], []
    for project, person, city in zip(projects, people, cities, strict=True):
        if rng.random() < 0.5:
            questions.append(f"Question: Who maintains the {project} project?")
            answers.append((person,))
        else:
            questions.append(f"Question: In which city does the maintainer of the {project} project work?")
            answers.append((city,))
    context = f"Answer the questions based on the given text.\n\n{text}\n"
    return Draw(context, tuple(questions), tuple(answers))


TASKS: dict[str, RulerTask] = {
    "niah_single": RulerTask(niah_single, "Answer: The special magic number is", "all", 16),
    "niah_multikey": RulerTask(niah_multikey, "Answer: The special magic number is", "all", 16),
    "niah_multivalue": RulerTask(niah_multivalue, "Answer: The special magic numbers are", "all", 48),
    "niah_multiquery": RulerTask(niah_multiquery, "Answer: The special magic numbers are", "all", 48),
    "vt": RulerTask(variable_tracking, "Answer: The variables assigned that value are:", "all", 30),
    "cwe": RulerTask(common_words, "Answer: The most common words in the list are:", "all", 24),
    "fwe": RulerTask(frequent_words, "Answer: The three most frequently appeared words are:", "all", 24),
    "qa": RulerTask(qa_facts, "Answer:", "part", 16),
}
