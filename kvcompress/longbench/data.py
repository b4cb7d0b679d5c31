"""The examples: rows from --data-dir, the offline suite or the Hub, as pipeline inputs; selection; truncation."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from kvcompress.longbench import offline_suite
from kvcompress.longbench.config import Config, UsageError, one_line
from kvcompress.longbench.tasks import split_prompt


@dataclass
class Example:
    """One example as the pipeline takes it: the compressed context part, the question part, the answer prefix."""

    task: str
    index: int  # position in the task's dataset
    key: str  # resume key: _id, or "#index"
    context: str  # the part of the prompt that is compressed (before the chat template)
    question: str  # the rest of the prompt, not compressed
    answer_prefix: str
    answers: list[str]
    all_classes: list[str] | None
    length: int  # LongBench's `length` field (words), for the length buckets
    questions: tuple[str, ...] = ()  # RULER: several questions on one compressed context (then `question` is "")
    expected: tuple[tuple[str, ...], ...] = ()  # RULER: the strings expected in the answer to each question


def _rows_from_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as handle:
        for n, line in enumerate(handle, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise UsageError(f"data: {path}:{n}: not JSON ({err.msg})") from None
    return rows


def _rows_from_hub(dataset: str, task: str) -> list[dict]:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        data = datasets.load_dataset(dataset, data_dir=f"{task}_e", split="test")
    except Exception as first:
        try:  # config-style repositories (e.g. THUDM/LongBench with datasets < 4)
            data = datasets.load_dataset(dataset, f"{task}_e", split="test")
        except Exception:
            raise UsageError(
                f"--dataset: cannot load {dataset} ({task}_e): {one_line(first, 200)}; without the Hub, or for "
                "THUDM/LongBench (a loading script, which datasets >= 4 refuses), pass --data-dir with LongBench's "
                "jsonl files (THUDM's data.zip)"
            ) from None
    return [dict(row) for row in data]


def load_task(task: str, cfg: Config) -> list[Example]:
    """Every example of ``task`` (RULER generator, --data-dir, offline suite or the Hub) as pipeline inputs."""
    if cfg.benchmark == "ruler":
        from kvcompress.ruler.harness import load_ruler_task

        return load_ruler_task(task, cfg)
    if cfg.data_dir is not None:
        candidates = [Path(cfg.data_dir) / f"{task}.jsonl", Path(cfg.data_dir) / f"{task}_e.jsonl"]
        path = next((p for p in candidates if p.exists()), None)
        if path is None:
            raise UsageError(f"--data-dir: neither {task}.jsonl nor {task}_e.jsonl in {cfg.data_dir}")
        rows, source = _rows_from_jsonl(path), str(path)
    elif task in offline_suite.TASKS:
        path = offline_suite.ensure_suite()[task]
        rows, source = _rows_from_jsonl(path), str(path)
    else:
        rows, source = _rows_from_hub(cfg.dataset, task), f"{cfg.dataset}/{task}_e"
    if not rows:
        raise UsageError(f"data: {source} holds no examples")
    ids = [row.get("_id") for row in rows]
    unique_ids = all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids)
    examples = []
    for index, row in enumerate(rows):
        missing = [c for c in ("context", "answers") if c not in row]
        if "question" not in row and "input" not in row:
            missing.append("input")
        if missing:
            raise UsageError(f"data: {source}: example {index} lacks column(s) {', '.join(missing)}")
        answers = row["answers"]
        if isinstance(answers, str):
            answers = [answers]
        if "question" in row and "answer_prefix" in row:  # kvpress's processed copy: template already applied
            context, question, prefix = row["context"], row["question"], row["answer_prefix"] or ""
        else:
            context, question, prefix = split_prompt(task, row["context"], row.get("input") or "")
        length = row.get("length")
        examples.append(
            Example(
                task=task,
                index=index,
                key=ids[index] if unique_ids else f"#{index}",
                context=context,
                question=question,
                answer_prefix=prefix,
                answers=[str(a) for a in answers],
                all_classes=list(row["all_classes"]) if row.get("all_classes") is not None else None,
                length=int(length) if length is not None else len(str(row["context"]).split()),
            )
        )
    return examples


def select(examples: list[Example], cfg: Config) -> list[Example]:
    """``--fraction`` (seeded draw, dataset order kept), then ``--limit`` (first N)."""
    if cfg.fraction is not None and cfg.fraction < 1:
        count = max(1, round(cfg.fraction * len(examples)))
        chosen = sorted(random.Random(cfg.seed).sample(range(len(examples)), count))
        examples = [examples[i] for i in chosen]
    if cfg.limit is not None:
        examples = examples[: cfg.limit]
    return examples


def truncate_middle(tokenizer, example: Example, max_length: int | None) -> tuple[str, int, bool]:
    """(context, prompt tokens, truncated): LongBench's middle truncation of the whole prompt to ``max_length``."""
    ids = tokenizer.encode(example.context, add_special_tokens=False)
    tail = len(tokenizer.encode(example.question + example.answer_prefix, add_special_tokens=False))
    if max_length is None or len(ids) + tail <= max_length:
        return example.context, len(ids) + tail, False
    head = max_length // 2
    keep_tail = max_length - head - tail
    if keep_tail < 0:  # a question longer than half the budget: keep it whole, cut the context's end
        head, keep_tail = max(0, max_length - tail), 0
    kept = tokenizer.decode(ids[:head], skip_special_tokens=True)
    if keep_tail:
        kept += tokenizer.decode(ids[len(ids) - keep_tail :], skip_special_tokens=True)
    return kept, head + keep_tail + tail, True
