"""A small offline long-context suite in LongBench's jsonl format, built from text every CPython ships.

Four tasks, each a LongBench task in miniature (same columns: ``input``, ``context``, ``answers``,
``length``, ``all_classes``, ``dataset``, ``language``, ``_id``):

* ``py_retrieval`` (like passage_retrieval_en): numbered paragraphs from distinct ``pydoc_data.topics``
  entries and an "abstract" (two consecutive sentences copied from one paragraph); answer
  "Paragraph N"; LongBench's retrieval metric.
* ``py_count`` (like passage_count): paragraphs from distinct topics, some repeated, shuffled; answer the
  number of distinct paragraphs; LongBench's count metric.
* ``py_qa`` (a planted-fact QA): topic text with 4 planted facts ("The Copperleaf project is maintained
  by Ada Moreau, who works in Lisbon."); the question asks for the maintainer or the city of one
  project; qa_f1.
* ``py_code`` (like lcc): a stretch of a stdlib source file (``json``, ``email``, ``http``, ``urllib``,
  ``logging``, ...) ending right before a one-line statement; answer that line (indentation stripped);
  code_sim.

Contexts run from about 1k to 4k SmolLM2 tokens (targets 1000 to 3600 at 1.5 tokens per prose word and 3.8
characters per code token, measured on SmolLM2's tokenizer), in increasing order within each file, so
``--limit N`` takes the N shortest. ``length`` is the context's word count, as in LongBench-E (so every
example here falls in the "0-4k" bucket). Everything is drawn from ``random.Random(seed)``; the texts are the
running CPython's, so a build on another Python version differs: the committed files, shipped with the
package in ``kvcompress/longbench/data/offline_suite/``, are the reference (``manifest.json`` records the
Python that built them).

Build: ``python -m eval.offline_suite [--output-dir DIR] [--examples 6] [--seed 0]`` (default DIR: the
package's copy).
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import importlib
import json
import platform
import pydoc_data.topics
import random
import re
from dataclasses import dataclass
from pathlib import Path

from kvcompress.longbench.metrics import SKIPPED_LINE_MARKS

DEFAULT_DIR = Path(__file__).resolve().parent / "data" / "offline_suite"
PROSE_TOKENS_PER_WORD = 1.5
CODE_CHARS_PER_TOKEN = 3.8
CODE_PACKAGES = ("json", "email", "http", "urllib", "logging", "importlib", "concurrent.futures", "xml.dom", "asyncio")


@dataclass(frozen=True)
class OfflineTask:
    """How a task is prompted and scored: LongBench-style template, answer prefix, metric, answer length."""

    template: str  # with {context} and {input}, LongBench's dataset2prompt style (answer prefix included)
    answer_prefix: str  # the template's tail that kvpress puts after the chat template's assistant turn
    metric: str  # one of LongBench's metric functions
    max_new_tokens: int  # LongBench-style generation length (the CLI adds 20, as for the real tasks)


TASKS: dict[str, OfflineTask] = {
    "py_retrieval": OfflineTask(
        "Here are some paragraphs from the Python documentation, along with an abstract. Please determine which "
        "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter "
        'the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", '
        '"Paragraph 2", etc.\n\nThe answer is: ',
        "The answer is: ",
        "retrieval_score",
        32,
    ),
    "py_count": OfflineTask(
        "There are some paragraphs below taken from the Python documentation. Some of them may be duplicates. "
        "Please carefully read these paragraphs and determine how many unique paragraphs there are after removing "
        "duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease "
        "enter the final count of unique paragraphs after removing duplicates. The output format should only "
        "contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
        "The final answer is: ",
        "count_score",
        32,
    ),
    "py_qa": OfflineTask(
        "Answer the question based on the given passages. Only give me the answer and do not output any other "
        "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. "
        "Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
        "Answer:",
        "qa_f1_score",
        32,
    ),
    "py_code": OfflineTask(
        "Please complete the code given below. \n{context}Next line of code:\n",
        "Next line of code:\n",
        "code_sim_score",
        64,
    ),
}

_FIRST = ("Ada", "Boris", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Keiko", "Luca")
_LAST = ("Moreau", "Okafor", "Lindqvist", "Tanaka", "Castillo", "Novak", "Haddad", "Brennan", "Ivanova", "Silva")
_CITIES = ("Lisbon", "Nairobi", "Helsinki", "Osaka", "Montreal", "Krakow", "Valparaiso", "Tbilisi", "Adelaide")
_ADJ = ("Copper", "Silver", "Amber", "Cobalt", "Crimson", "Ivory", "Jade", "Onyx", "Scarlet", "Violet", "Golden")
_NOUN = ("leaf", "fin", "stone", "wing", "brook", "field", "spire", "crest", "harbor", "lantern", "meadow")


@functools.cache
def _topics() -> list[tuple[str, list[str]]]:
    """(name, words) of every pydoc topic with at least 80 words, whitespace collapsed, in name order."""
    topics = []
    for name in sorted(pydoc_data.topics.topics):
        words = pydoc_data.topics.topics[name].split()
        if len(words) >= 80:
            topics.append((name, words))
    return topics


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 5]


def _chunk(rng: random.Random, words: list[str], size: int) -> str:
    start = rng.randrange(0, max(1, len(words) - size))
    return " ".join(words[start : start + size])


def _record(task: str, seed: int, index: int, context: str, question: str, answers: list[str]) -> dict:
    digest = hashlib.sha1(f"{task}|{seed}|{index}|{context}|{question}".encode()).hexdigest()[:16]
    return {
        "input": question,
        "context": context,
        "answers": answers,
        "length": len(context.split()),
        "all_classes": None,
        "dataset": task,
        "language": "en",
        "_id": f"{task}-{index:03d}-{digest}",
    }


def _topic_passages(rng: random.Random, target_tokens: int, min_words: int, max_words: int) -> list[str]:
    """Chunks of ``min_words``-``max_words`` words from distinct topics, in random order, until ~``target_tokens``."""
    topics = _topics()
    words_left = int(target_tokens / PROSE_TOKENS_PER_WORD)
    passages = []
    for _, words in rng.sample(topics, len(topics)):
        if words_left <= 0:
            break
        size = min(rng.randrange(min_words, max_words), len(words))
        passages.append(_chunk(rng, words, size))
        words_left -= size + 2
    return passages


def make_retrieval(rng: random.Random, target_tokens: int) -> tuple[str, str, list[str]]:
    """Numbered paragraphs from distinct topics; the abstract is two consecutive sentences of one of them."""
    paragraphs = _topic_passages(rng, target_tokens, 90, 200)
    order = list(range(len(paragraphs)))
    rng.shuffle(order)
    for target in order:  # the first paragraph whose abstract occurs nowhere else
        sentences = _sentences(paragraphs[target])
        if len(sentences) < 3:
            continue
        i = rng.randrange(1, len(sentences) - 1)
        abstract = " ".join(sentences[i : i + 2])
        if sum(abstract in p for p in paragraphs) == 1:
            break
    else:  # no paragraph had usable sentences: a verbatim 30-word span instead
        target = order[0]
        abstract = _chunk(rng, paragraphs[target].split(), 30)
    context = "\n\n".join(f"Paragraph {i + 1}: {p}" for i, p in enumerate(paragraphs))
    return context, abstract, [f"Paragraph {target + 1}"]


def make_count(rng: random.Random, target_tokens: int) -> tuple[str, str, list[str]]:
    """Paragraphs from distinct topics, some repeated, shuffled; the answer is the number of distinct ones."""
    topics = _topics()
    words_total = int(target_tokens / PROSE_TOKENS_PER_WORD)
    size = rng.randrange(60, 110)
    slots = max(3, words_total // (size + 3))
    unique = rng.randint(max(2, slots // 3), max(2, slots - max(1, slots // 4)))
    distinct = [_chunk(rng, words, size) for _, words in rng.sample(topics, unique)]
    assert len(set(distinct)) == unique
    listed = distinct + [rng.choice(distinct) for _ in range(slots - unique)]
    rng.shuffle(listed)
    context = "\n\n".join(f"Paragraph {i + 1}: {p}" for i, p in enumerate(listed))
    return context, "", [str(unique)]


def make_qa(rng: random.Random, target_tokens: int) -> tuple[str, str, list[str]]:
    """Topic text with 4 planted facts about invented projects; one of them is asked about."""
    passages = _topic_passages(rng, target_tokens, 120, 260)
    projects = rng.sample([a + n for a in _ADJ for n in _NOUN], 4)
    people = rng.sample([f"{f} {last}" for f in _FIRST for last in _LAST], 4)
    cities = rng.sample(_CITIES, 4)
    for project, person, city in zip(projects, people, cities, strict=True):
        fact = f"The {project} project is maintained by {person}, who works in {city}."
        passages.insert(rng.randrange(1, len(passages)), fact)  # never before the first passage
    asked = rng.randrange(4)
    if rng.random() < 0.5:
        question, answer = f"Who maintains the {projects[asked]} project?", people[asked]
    else:
        question, answer = f"In which city does the maintainer of the {projects[asked]} project work?", cities[asked]
    context = "\n\n".join(f"Passage {i + 1}:\n{p}" for i, p in enumerate(passages))
    return context, question, [answer]


@functools.cache
def _code_sources() -> list[tuple[str, str, list[int]]]:
    """(module path, source, line numbers of one-line statements) of the stdlib packages in CODE_PACKAGES."""
    sources = []
    for package in CODE_PACKAGES:
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.glob("*.py")):
            text = path.read_text(encoding="utf-8")
            lines = text.splitlines()
            targets = sorted(
                {
                    node.lineno
                    for node in ast.walk(ast.parse(text))
                    if isinstance(node, ast.stmt)
                    and node.end_lineno == node.lineno
                    and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
                    and len(lines[node.lineno - 1].strip()) >= 12
                }
            )
            if len(text) > 20_000 and targets:
                sources.append((f"{package}/{path.name}", text, targets))
    return sources


def make_code(rng: random.Random, target_tokens: int) -> tuple[str, str, list[str]]:
    """The lines of a stdlib file before a one-line statement; the answer is that statement."""
    chars = int(target_tokens * CODE_CHARS_PER_TOKEN)
    while True:
        _, text, targets = rng.choice(_code_sources())
        lines = text.splitlines(keepends=True)
        offsets = [0]
        for line in lines:
            offsets.append(offsets[-1] + len(line))
        usable = [n for n in targets if offsets[n - 1] >= chars]
        if usable:
            break
    target = rng.choice(usable)  # 1-based line number
    for _ in range(1000):  # a line the metric skips ("#", "//", "`": a comment to code_sim_score) never scores: draw
        if not any(mark in lines[target - 1] for mark in SKIPPED_LINE_MARKS):  # again (the shipped examples drew none)
            break
        target = rng.choice(usable)
    end = offsets[target - 1]
    first = next(i for i in range(target) if end - offsets[i] <= chars)
    context = "".join(lines[first : target - 1])
    return context, "", [lines[target - 1].strip()]


BUILDERS = {"py_retrieval": make_retrieval, "py_count": make_count, "py_qa": make_qa, "py_code": make_code}


def build_task(
    task: str, examples: int = 6, seed: int = 0, min_tokens: int = 1000, max_tokens: int = 3600
) -> list[dict]:
    """``examples`` records of ``task``, contexts from ``min_tokens`` to ``max_tokens`` in increasing order."""
    rng = random.Random(f"{task}:{seed}")
    records = []
    for i in range(examples):
        target = min_tokens + (max_tokens - min_tokens) * i // max(1, examples - 1)
        context, question, answers = BUILDERS[task](rng, target)
        records.append(_record(task, seed, i, context, question, answers))
    return records


def build_suite(output_dir: Path = DEFAULT_DIR, examples: int = 6, seed: int = 0) -> dict[str, Path]:
    """Write ``<task>.jsonl`` for every offline task and a ``manifest.json``; returns task -> path."""
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for task in TASKS:
        path = output_dir / f"{task}.jsonl"
        staging = path.with_suffix(".jsonl.tmp")
        with open(staging, "w", encoding="utf-8") as handle:
            for record in build_task(task, examples, seed):
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        staging.replace(path)
        paths[task] = path
    manifest = {"python": platform.python_version(), "seed": seed, "examples": examples, "tasks": list(TASKS)}
    (output_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return paths


def ensure_suite(output_dir: Path = DEFAULT_DIR) -> dict[str, Path]:
    """The suite's files under ``output_dir``, built first (with the defaults) if any is missing."""
    paths = {task: output_dir / f"{task}.jsonl" for task in TASKS}
    if not all(p.exists() for p in paths.values()):
        return build_suite(output_dir)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--examples", type=int, default=6, help="examples per task")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for task, path in build_suite(args.output_dir, args.examples, args.seed).items():
        print(f"{task}: {path} ({path.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
