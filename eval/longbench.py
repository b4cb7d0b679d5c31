"""LongBench-E with KV-cache compression (the paper's Table 4 protocol): predictions, scores, tables, a plot.

Run from the repository root::

    python eval/longbench.py --model Qwen/Qwen2.5-7B-Instruct --ratio 0.25   # or: python -m eval.longbench
    python eval/longbench.py --config configs/longbench_e_qwen2.5_7b.yaml     # Table 4
    python eval/longbench.py                                                  # embedded offline run
    accelerate launch --multi_gpu --num_processes 4 eval/longbench.py --config ...   # 4 processes, 1 GPU each
    torchrun --nproc_per_node 2 eval/longbench.py ...                         # several CPU processes

Protocol (kvpress's LongBench evaluation, as in the paper): every example goes through kvpress's
``kv-press-text-generation`` pipeline: the context part of LongBench's prompt (``dataset2prompt``, up to
and including the context) is wrapped in the chat template and prefilled under the press; the rest of
the prompt (the question) and the answer prefix ("Answer:", "Summary:", "Next line of code:\\n", ...),
which kvpress puts after the assistant turn, are not compressed; greedy decoding of
``MAX_NEW_TOKENS[task] + 20`` tokens; LongBench's metric per task (``eval.longbench_metrics``), x 100;
Average = unweighted mean over the tasks. Methods: ``exact`` (no press), ``compresskv``
(``CompressKVPress(compression_ratio=1 - ratio, seed=seed)``: the library's default),
``compresskv_paper`` (``CompressKVPress.paper(...)``: the WildCat paper's binned RPNys, 12 pivots per bin,
first/last 32 tokens kept), ``uniform`` (``UniformPress``), and kvpress's ``snapkv`` (window 64, kernel 5),
``streamingllm`` (4 sinks), ``pyramidkv`` (window 64, kernel 5, beta 20). ``--ratio`` is the KEPT
fraction (0.25 keeps a quarter of the cache: ``compression_ratio = 0.75``). ``--press-option
compresskv.window_size=128`` (repeatable; ``press_options`` in the YAML) changes one field of a method's
press; the changed settings are part of the run's identity and printed under the table.

Data: ``--dataset`` (default ``Xnhyacinth/LongBench``, kvpress's preprocessed copy; data dir ``<task>_e``;
a local directory laid out like that repository works the same way; for a config-style repository such
as ``THUDM/LongBench`` the config ``<task>_e`` is tried next; THUDM's repository is a loading script, which
``datasets`` >= 4 refuses, and scripts are never run with ``trust_remote_code`` here) through
``datasets.load_dataset``, or
``--data-dir`` holding ``<task>.jsonl`` or ``<task>_e.jsonl`` per task (e.g. the extracted ``data/`` of
THUDM's data.zip). Rows either carry LongBench's raw columns (``input``, ``context``, ``answers``,
``length``, ``all_classes``, ``_id``), then LongBench's template is applied here, or kvpress's processed
columns (``context``, ``question``, ``answer_prefix``), used as they are. Without ``--model`` the embedded
SmolLM2-135M-Instruct runs the offline suite of ``eval/offline_suite.py`` (built under
``data/offline_suite/`` if missing), and with neither ``--model`` nor ``--config``,
``configs/offline_default.yaml`` is read.

Decisions where the issue is silent:

* ``--max-context-length`` (LongBench's middle truncation) counts the tokens of the prompt without the
  chat template (LongBench truncates before templating): the first ``max // 2`` prompt tokens are kept
  and the last ones up to ``max`` in total, the question and answer prefix included (they end the
  prompt). Unset: no truncation (kvpress's evaluation default; its own head truncation is disabled).
* ``--fraction`` draws ``round(F * n)`` examples (at least 1) with ``random.Random(seed)``, kept in dataset
  order; ``--limit`` then keeps the first N. Both select by dataset index, so a resumed run with a
  larger limit reuses the predictions already made.
* Resume: predictions are keyed by ``_id`` (by dataset index where ids are absent or repeated). The
  output directory's ``run.json`` records what changes predictions (model, ratio, dtype, seed, data
  source, max context length, ``--max-new-tokens``); a rerun into it with different values is refused.
  A half-written last line (killed process) is dropped.
* Multi-process (``accelerate launch``, ``torchrun`` or any launcher setting RANK / WORLD_SIZE / LOCAL_RANK;
  accelerate's own CPU multi-process mode needs MPI, ``torchrun`` does not): examples
  are dealt round-robin over the processes (one model per process, on ``cuda:LOCAL_RANK``), each
  appends to ``<task>.rank<R>.jsonl``; process 0 then polls until every requested prediction exists
  (no collective barrier, so uneven shards cannot time out), merges them into ``<task>.jsonl`` and
  writes the tables. A process that fails leaves ``.rank<R>.failed``; process 0 then writes partial
  tables.
* Length buckets use the dataset's ``length`` field (words), LongBench-E's ``< 4000``, ``4000-8000``,
  ``>= 8000``; the bucket table averages each bucket over the tasks with examples in it.
* Completeness: tables are written at the end, and also after an interrupt, a failure or with
  ``--score-only`` (no model; rescore what exists); any (method, task) with fewer predictions than
  requested is marked "(partial k/n)" in ``results.md``, ``"complete": false`` in ``scores.json`` and
  ``complete=False`` in ``scores.csv``, its Average too, and the title says "partial". Exit status: 0
  complete, 1 incomplete, 2 bad input, 130 interrupted.
* Nothing left to predict (a finished run repeated): the model is not loaded, the tables are rewritten.
  ``--max-new-tokens`` overrides the protocol's answer length, for smoke runs only.
* ``--dtype auto``: float32 on CPU, the checkpoint's dtype on GPU. ``--attn-implementation auto``:
  flash_attention_2 on CUDA where ``flash_attn`` imports, else sdpa. The model's attention
  implementation is restored before every example (CompressKV and Uniform switch it to their weighted
  attention). ``--threads`` sets torch's CPU threads (oversubscribed cores slow CPU runs a lot).

Outputs in ``--output-dir`` (default ``results/longbench/<model>_<ratio>``): ``predictions/<method>/
<task>.jsonl`` (one line per example, flushed as produced), ``scores.json``, ``scores.csv`` (one row per
method, task and bucket), ``results.md`` (Table 4's layout: rows = methods, columns = tasks + Average;
then the bucket table, and the paper's Table 4 for reference on a Qwen2.5-7B-Instruct run at 0.25; also
printed), ``scores.png`` (bar chart), ``run.json`` and ``run.log``.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import random
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

if __name__ == "__main__" and not __package__:  # run as a script: make `eval` and `kvcompress` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval import longbench_metrics as metrics  # noqa: E402
from eval import offline_suite  # noqa: E402
from eval.config import REPO_ROOT, load_yaml  # noqa: E402
from kvcompress import registry  # noqa: E402

log = logging.getLogger("kvcompress.longbench")

OFFLINE_CONFIG = Path("configs/offline_default.yaml")
DEFAULT_DATASET = "Xnhyacinth/LongBench"
EMBEDDED_LABEL = "SmolLM2-135M-Instruct"
EXTRA_NEW_TOKENS = 20  # the paper's protocol: LongBench's length + 20
UNLIMITED_CONTEXT = 10**12  # disables the kvpress pipeline's own (head) truncation

# The 13 LongBench-E tasks in Table 4's column order, with the paper's column names.
LONGBENCH_TASKS: dict[str, str] = {
    "qasper": "qasper",
    "multifieldqa_en": "multifield",
    "hotpotqa": "hotpot",
    "2wikimqa": "2wiki",
    "gov_report": "gov",
    "multi_news": "multinews",
    "trec": "trec",
    "triviaqa": "trivia",
    "samsum": "samsum",
    "passage_count": "p.count",
    "passage_retrieval_en": "p.ret",
    "lcc": "lcc",
    "repobench-p": "repo-p",
}

# LongBench's prompt templates (config/dataset2prompt.json) for those tasks, and the tail of each that
# kvpress's evaluation moves after the chat template's assistant turn (the answer prefix).
PROMPTS: dict[str, str] = {
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using "
    "a single phrase or sentence if possible. If the question cannot be answered based on the information in the "
    'article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". '
    "Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as "
    "concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based "
    'on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", '
    '"no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
    "question based on the above text, only give me the answer and do not output any other words.\n\n"
    "Question: {input}\nAnswer:",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
    "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
    "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
    "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}"
    "\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n"
    "{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other "
    "words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n"
    "{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
    "carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. "
    "In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
    "count of unique paragraphs after removing duplicates. The output format should only contain the number, such "
    "as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
    "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the "
    'number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", '
    "etc.\n\nThe answer is: ",
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
ANSWER_PREFIXES: dict[str, str] = {
    "qasper": "Answer:",
    "multifieldqa_en": "Answer:",
    "hotpotqa": "Answer:",
    "2wikimqa": "Answer:",
    "gov_report": "Summary:",
    "multi_news": "Summary:",
    "trec": "Type:",
    "triviaqa": "Answer:",
    "samsum": "Summary:",
    "passage_count": "The final answer is: ",
    "passage_retrieval_en": "The answer is: ",
    "lcc": "Next line of code:\n",
    "repobench-p": "Next line of code:\n",
}
for _task, _spec in offline_suite.TASKS.items():
    PROMPTS[_task] = _spec.template
    ANSWER_PREFIXES[_task] = _spec.answer_prefix

# Offline tasks: metric functions of eval.longbench_metrics (it scores only the 13 LongBench-E tasks).
OFFLINE_METRICS: dict[str, str] = {task: spec.metric for task, spec in offline_suite.TASKS.items()}
ALL_TASKS: tuple[str, ...] = (*LONGBENCH_TASKS, *offline_suite.TASKS)
COLUMN_NAMES: dict[str, str] = {**LONGBENCH_TASKS, **{t: t for t in offline_suite.TASKS}}

METHODS: dict[str, str] = {  # name -> row label (kvcompress.registry's presses this harness offers)
    name: registry.METHODS[name].label
    for name in ("exact", "compresskv", "compresskv_paper", "snapkv", "streamingllm", "uniform", "pyramidkv")
}
DEFAULT_METHODS = ["exact", "compresskv", "snapkv", "streamingllm", "uniform"]

# The paper's Table 4 (Qwen2.5-7B-Instruct, cache kept at 25%), in LONGBENCH_TASKS order, then the average.
PAPER_TABLE4: dict[str, list[float]] = {
    "Exact": [43.76, 50.08, 56.43, 43.71, 34.16, 24.32, 64.00, 87.53, 38.56, 14.67, 99.67, 69.96, 62.17, 53.00],
    "StreamingLLM": [23.17, 25.49, 26.45, 20.89, 29.65, 22.25, 52.33, 75.17, 35.79, 12.50, 24.83, 68.48, 56.22, 36.40],
    "PyramidKV": [21.59, 29.96, 39.38, 30.24, 27.12, 21.13, 43.33, 86.77, 38.27, 15.88, 61.06, 67.40, 59.20, 41.64],
    "BalanceKV": [29.50, 36.57, 37.89, 23.71, 30.27, 21.98, 55.00, 73.83, 34.56, 12.67, 71.67, 65.48, 62.57, 42.75],
    "Uniform": [26.91, 37.51, 38.46, 25.93, 30.02, 21.86, 54.33, 81.71, 35.37, 15.33, 63.44, 64.84, 61.34, 42.85],
    "SnapKV": [25.52, 30.13, 44.36, 31.80, 29.70, 22.10, 49.33, 88.32, 37.15, 16.67, 89.06, 69.16, 56.33, 45.36],
    "CompressKV": [33.23, 38.13, 43.43, 33.37, 30.30, 22.26, 54.33, 86.15, 35.38, 14.33, 98.00, 64.85, 60.43, 47.25],
}
BUCKETS = ("0-4k", "4-8k", "8k+")


class UsageError(Exception):
    """Bad input: reported as one ``error: ...`` line on stderr, exit status 2."""


class Interrupted(Exception):
    """Predictions stopped before every requested example was done (interrupt, failure of a process)."""


@dataclass
class Config:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct on the offline suite
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    ratio: float = 0.25  # KEPT fraction of the context cache
    tasks: list[str] | None = None  # None: the offline suite without --model, else the 13 LongBench-E tasks
    dataset: str = DEFAULT_DATASET
    data_dir: str | None = None
    limit: int | None = None
    fraction: float | None = None
    seed: int = 0
    device: str = "auto"
    device_map: str | None = None
    dtype: str = "auto"
    attn_implementation: str = "auto"
    max_context_length: int | None = None
    max_new_tokens: int | None = None  # None: the protocol's MAX_NEW_TOKENS[task] + 20 (set only for smoke runs)
    threads: int | None = None
    output_dir: str | None = None
    score_only: bool = False
    press_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # method -> press field -> value


@dataclass
class Example:
    task: str
    index: int  # position in the task's dataset
    key: str  # resume key: _id, or "#index"
    context: str  # the part of the prompt that is compressed (before the chat template)
    question: str  # the rest of the prompt, not compressed
    answer_prefix: str
    answers: list[str]
    all_classes: list[str] | None
    length: int


# ----------------------------------------------------------------------------------------------- config


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage wall
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, help="YAML with Config's keys (flags override)")
    p.add_argument("--model", help="local dir or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--methods", nargs="+", help=f"from {list(METHODS)} (default {DEFAULT_METHODS})")
    p.add_argument("--ratio", type=float, help="KEPT fraction of the cache, in (0, 1] (default 0.25)")
    p.add_argument("--tasks", nargs="+", help=f"from {list(ALL_TASKS)}")
    p.add_argument("--dataset", help=f"Hub id or local dir with <task>_e data dirs (default {DEFAULT_DATASET})")
    p.add_argument("--data-dir", help="local dir with <task>.jsonl or <task>_e.jsonl (LongBench columns)")
    p.add_argument("--limit", type=int, help="first N examples of each task")
    p.add_argument("--fraction", type=float, help="a seeded fraction of each task (before --limit)")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--device-map", choices=("auto",), help="spread the model over the GPUs (accelerate)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--attn-implementation", choices=("auto", "sdpa", "eager", "flash_attention_2"))
    p.add_argument("--max-context-length", type=int, help="LongBench middle truncation of the prompt (tokens)")
    p.add_argument("--max-new-tokens", type=int, help="override LongBench's length + 20 (smoke runs only)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--output-dir", help="default results/longbench/<model>_<ratio>")
    p.add_argument("--score-only", action="store_true", default=None, help="no model: rescore what exists")
    p.add_argument(
        "--press-option",
        action="append",
        metavar="METHOD.FIELD=VALUE",
        help="a press setting other than the default, e.g. compresskv.window_size=128 (repeatable)",
    )
    return p


def parse_press_options(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["compresskv.window_size=128", ...]`` -> ``{"compresskv": {"window_size": 128}}`` (values as YAML)."""
    options: dict[str, dict[str, Any]] = {}
    for item in items:
        target, sep, value = item.partition("=")
        method, dot, name = target.partition(".")
        if not (sep and dot and method and name):
            raise UsageError(f"--press-option: expected METHOD.FIELD=VALUE, got {item!r}")
        options.setdefault(method, {})[name] = yaml.safe_load(value)
    return options


def parse_config(argv: Sequence[str] | None = None) -> Config:
    """Built-in defaults < YAML (``--config``; configs/offline_default.yaml without --model) < flags."""
    args = vars(build_parser().parse_args(argv))
    path = args.pop("config")
    flag_options = parse_press_options(args.pop("press_option") or [])
    try:  # the embedded run's YAML is the default only without --model
        values = {} if path is None and args.get("model") is not None else load_yaml(path, OFFLINE_CONFIG, Config)
    except yaml.YAMLError as err:
        raise UsageError(f"--config: {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    except (TypeError, ValueError, OSError) as err:
        raise UsageError(str(err) if str(err).startswith("--config") else f"--config: {err}") from None
    values.update({k: v for k, v in args.items() if v is not None})
    options = values.get("press_options") or {}
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise UsageError(f"--config: press_options must map a method to {{field: value}}, got {options!r}")
    values["press_options"] = {m: {**options.get(m, {}), **flag_options.get(m, {})} for m in {*options, *flag_options}}
    return validate(Config(**values))


def validate(cfg: Config) -> Config:
    """Check every setting (from YAML or flags); UsageError on the first bad one."""

    def names(value, what: str) -> list[str]:
        if isinstance(value, str):
            value = value.replace(",", " ").split()
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise UsageError(f"{what}: expected a non-empty list of names, got {value!r}")
        return list(dict.fromkeys(value))

    cfg.methods = names(cfg.methods, "--methods")
    unknown = [m for m in cfg.methods if m not in METHODS]
    if unknown:
        raise UsageError(f"--methods: unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    if cfg.tasks is not None:
        cfg.tasks = names(cfg.tasks, "--tasks")
        unknown = [t for t in cfg.tasks if t.removesuffix("_e") not in ALL_TASKS]
        if unknown:
            raise UsageError(f"--tasks: unknown task {unknown[0]!r}; choose from {', '.join(ALL_TASKS)}")
        cfg.tasks = list(dict.fromkeys(t.removesuffix("_e") for t in cfg.tasks))
    ratio = cfg.ratio
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise UsageError(f"--ratio: the kept fraction must be in (0, 1], got {ratio!r}")
    cfg.ratio = float(ratio)
    for name in ("limit", "max_context_length", "max_new_tokens", "threads"):
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(f"--{name.replace('_', '-')}: must be an integer >= 1, got {value!r}")
    if cfg.fraction is not None and (
        isinstance(cfg.fraction, bool) or not isinstance(cfg.fraction, (int, float)) or not 0 < cfg.fraction <= 1
    ):
        raise UsageError(f"--fraction: must be in (0, 1], got {cfg.fraction!r}")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int):
        raise UsageError(f"--seed: must be an integer, got {cfg.seed!r}")
    for name, allowed in (
        ("device", ("auto", "cpu", "cuda")),
        ("dtype", ("auto", "float32", "bfloat16", "float16")),
        ("attn_implementation", ("auto", "sdpa", "eager", "flash_attention_2")),
    ):
        value = getattr(cfg, name)
        if value not in allowed:
            raise UsageError(f"--{name.replace('_', '-')}: must be one of {', '.join(allowed)}, got {value!r}")
    if cfg.device_map not in (None, "auto"):
        raise UsageError(f"--device-map: only 'auto' is supported, got {cfg.device_map!r}")
    if cfg.data_dir is not None and not Path(cfg.data_dir).is_dir():
        raise UsageError(f"--data-dir: {cfg.data_dir} is not a directory")
    check_press_options(cfg)
    if cfg.model is not None and not isinstance(cfg.model, str):
        raise UsageError(f"--model: expected a name or path, got {cfg.model!r}")
    if cfg.model is not None and Path(cfg.model).expanduser().exists():
        if not (Path(cfg.model).expanduser() / "config.json").exists():
            raise UsageError(f"--model: {cfg.model} is not a model directory (no config.json)")
    elif cfg.model is not None and cfg.model.startswith(("/", ".", "~")):
        raise UsageError(f"--model: {cfg.model} does not exist")
    return cfg


def check_press_options(cfg: Config) -> None:
    """Every press option names a method with a press and one of that press's fields, with a valid value."""
    for method, options in sorted(cfg.press_options.items()):
        if method not in METHODS or method == "exact":
            pressed = [m for m in METHODS if m != "exact"]
            raise UsageError(f"--press-option: {method!r} has no press; choose from {', '.join(pressed)}")
        if not options:
            continue
        press = make_press(method, cfg.ratio, cfg.seed)
        settable = [f.name for f in fields(press) if f.name not in FIXED_PRESS_FIELDS]
        for name in options:
            if name not in settable:
                raise UsageError(f"--press-option: {method} has no setting {name!r}; choose from {', '.join(settable)}")
            default, value = getattr(press, name), options[name]
            if isinstance(default, (int, float)) and not isinstance(default, bool):  # kvpress checks none of these
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                if not number or value < 0 or (isinstance(default, int) and not isinstance(value, int)):
                    kind = "an integer" if isinstance(default, int) else "a number"
                    raise UsageError(f"--press-option: {method}.{name}: must be {kind} >= 0, got {value!r}")
        try:
            make_press(method, cfg.ratio, cfg.seed, options)
        except (TypeError, ValueError, AssertionError) as err:
            raise UsageError(f"--press-option: {method}: {_one_line(err)}") from None


def model_label(cfg: Config) -> str:
    return EMBEDDED_LABEL if cfg.model is None else Path(cfg.model.rstrip("/")).name


def output_dir(cfg: Config) -> Path:
    if cfg.output_dir:
        return Path(cfg.output_dir)
    changed = changed_press_options(cfg)
    suffix = "".join(f"_{m}.{k}={v}" for m, o in changed.items() for k, v in sorted(o.items()))
    return REPO_ROOT / "results" / "longbench" / f"{model_label(cfg)}_{cfg.ratio:g}{suffix}"


def task_list(cfg: Config) -> list[str]:
    if cfg.tasks is not None:
        return cfg.tasks
    return list(offline_suite.TASKS) if cfg.model is None else list(LONGBENCH_TASKS)


def data_source(cfg: Config) -> str:
    """Where the examples come from: --data-dir, the offline suite or --dataset."""
    if cfg.data_dir:
        return f"data_dir={Path(cfg.data_dir).resolve()}"
    if all(t in offline_suite.TASKS for t in task_list(cfg)):
        return "offline_suite"
    return f"dataset={cfg.dataset}"


def changed_press_options(cfg: Config) -> dict[str, dict[str, Any]]:
    """The press fields set away from their defaults, by method (methods without changes left out)."""
    return {m: cfg.press_options[m] for m in sorted(cfg.press_options) if cfg.press_options[m]}


def prediction_settings(cfg: Config) -> dict[str, Any]:
    """What changes a prediction: a resumed run must agree on all of it."""
    return {
        "model": cfg.model or EMBEDDED_LABEL,
        "ratio": cfg.ratio,
        "dtype": cfg.dtype,
        "seed": cfg.seed,
        "data": data_source(cfg),
        "max_context_length": cfg.max_context_length,
        "max_new_tokens": cfg.max_new_tokens,
        "press_options": changed_press_options(cfg),
    }


# ------------------------------------------------------------------------------------------------- data


def split_prompt(task: str, context: str, question: str) -> tuple[str, str, str]:
    """LongBench's prompt of ``task`` as (compressed context part, question part, answer prefix)."""
    template, prefix = PROMPTS[task], ANSWER_PREFIXES[task]
    head, tail = template.split("{context}")
    tail = tail.replace("{input}", question)  # not str.format: contexts and inputs hold braces (code)
    rest = tail.removesuffix(prefix)  # trec/triviaqa/samsum inputs end with it; kvpress adds it in any case
    lead = len(rest) - len(rest.lstrip("\n"))  # separating newlines stay with the context, as in kvpress
    return head + context + rest[:lead], rest[lead:], prefix


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
                f"--dataset: cannot load {dataset} ({task}_e): {_one_line(first, 200)}; without the Hub, or for "
                "THUDM/LongBench (a loading script, which datasets >= 4 refuses), pass --data-dir with LongBench's "
                "jsonl files (THUDM's data.zip)"
            ) from None
    return [dict(row) for row in data]


def load_task(task: str, cfg: Config) -> list[Example]:
    """Every example of ``task`` from --data-dir, the offline suite or the Hub, as pipeline inputs."""
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


# ---------------------------------------------------------------------------------------- predictions


def prediction_path(out: Path, method: str, task: str, rank: int = 0, world: int = 1) -> Path:
    name = f"{task}.jsonl" if world == 1 else f"{task}.rank{rank}.jsonl"
    return out / "predictions" / method / name


def read_predictions(out: Path, method: str, task: str) -> dict[str, dict]:
    """Every prediction of (method, task): the merged file and any process shards, keyed by example key."""
    found: dict[str, dict] = {}
    folder = out / "predictions" / method
    if not folder.is_dir():
        return found
    paths = [folder / f"{task}.jsonl", *sorted(folder.glob(f"{task}.rank*.jsonl"))]
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill; it is dropped (and repaired before appending)
                continue
            found.setdefault(record["key"], record)
    return found


def _repair(path: Path) -> None:
    """Drop a half-written last line so that appended records start on their own line."""
    if path.exists() and path.stat().st_size:
        data = path.read_bytes()
        if not data.endswith(b"\n"):
            path.write_bytes(data[: data.rfind(b"\n") + 1])


FIXED_PRESS_FIELDS = ("compression_ratio", "press")  # set by --ratio; kvpress's wrapped inner press


def make_press(method: str, ratio: float, seed: int, options: dict[str, Any] | None = None):
    """The press of ``method`` keeping ``ratio`` of the cache (None for exact); ``options`` override its fields."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}")
    return registry.make_press(method, 1.0 - ratio, seed, **(options or {}))


def max_new_tokens(task: str) -> int:
    base = metrics.MAX_NEW_TOKENS.get(task)
    if base is None:
        base = offline_suite.TASKS[task].max_new_tokens
    return base + EXTRA_NEW_TOKENS


def process_rank() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the launcher's environment (accelerate / torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", os.environ.get("PROCESS_INDEX", "0")))
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("LOCAL_PROCESS_INDEX", str(rank))))
    return rank, world, local


def load_pipeline(cfg: Config, local_rank: int):
    """kvpress's pipeline around the model; UsageError if the model cannot be loaded."""
    import kvpress  # noqa: F401  (registers "kv-press-text-generation")
    import torch
    from huggingface_hub.utils import logging as hub_logging
    from transformers import pipeline
    from transformers.utils import logging as hf_logging

    from kvcompress.models import load_model

    hf_logging.set_verbosity_error()
    hub_logging.set_verbosity_error()  # no retry wall on stderr when the Hub is unreachable
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cuda = torch.cuda.is_available()
    if cfg.device == "cuda" and not cuda:
        raise UsageError("--device: cuda requested but torch sees no GPU")
    device = f"cuda:{local_rank}" if cfg.device != "cpu" and cuda else "cpu"
    dtype: Any = cfg.dtype
    if dtype == "auto":
        dtype = "auto" if device.startswith("cuda") else torch.float32
    else:
        dtype = getattr(torch, dtype)
    attn = cfg.attn_implementation
    flash = False
    if attn in ("auto", "flash_attention_2") and device.startswith("cuda"):
        try:
            import flash_attn  # noqa: F401

            flash = True
        except ImportError:
            pass
    if attn == "flash_attention_2" and not flash:
        raise UsageError("--attn-implementation: flash_attention_2 needs a GPU and the flash_attn package")
    if attn == "auto":
        attn = "flash_attention_2" if flash else "sdpa"
    name = cfg.model or EMBEDDED_LABEL
    tick = time.perf_counter()
    try:
        model, tokenizer = load_model(
            cfg.model, dtype=dtype, device=device, attn_implementation=attn, device_map=cfg.device_map
        )
    except Exception as err:
        raise UsageError(f"--model: cannot load {name!r}: {_one_line(err)}") from None
    where = cfg.device_map and f"device_map={cfg.device_map}" or device
    log.info(f"loaded {name} on {where} ({model.dtype}, {attn}) in {time.perf_counter() - tick:.0f} s")
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)


def _eta(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def pending(cfg: Config, plan: dict[str, list[Example]], out: Path, rank: int, world: int) -> list[tuple]:
    """(task, method, examples still to predict, size of this process's share) for every requested pair."""
    work = []
    for task, examples in plan.items():
        mine = examples[rank::world]  # round-robin: the split does not depend on what is done already
        for method in cfg.methods:
            done = read_predictions(out, method, task)
            work.append((task, method, [e for e in mine if e.key not in done], len(mine)))
    return work


def predict(pipe, cfg: Config, work: list[tuple], out: Path, rank: int, world: int) -> int:
    """Make the predictions of ``work`` (see :func:`pending`), one jsonl line each; returns how many."""
    import torch
    from tqdm import tqdm

    model, tokenizer = pipe.model, pipe.tokenizer
    attn = model.config._attn_implementation
    total = sum(len(todo) for *_, todo, _ in work)
    made, started = 0, time.perf_counter()
    prompts: dict[tuple[str, str], tuple[str, int, bool]] = {}
    for task, method, todo, share in work:
        if not todo:
            continue
        if any(key[0] != task for key in prompts):
            prompts.clear()  # truncated prompts are shared by the methods of one task only
        path = prediction_path(out, method, task, rank, world)
        path.parent.mkdir(parents=True, exist_ok=True)
        _repair(path)
        label, last_log, position = f"{method}/{task}", 0.0, share - len(todo)
        bar = tqdm(total=share, initial=share - len(todo), desc=label, disable=not sys.stderr.isatty(), leave=False)
        with open(path, "a", encoding="utf-8") as handle:
            for example in todo:
                if (task, example.key) not in prompts:
                    prompts[(task, example.key)] = truncate_middle(tokenizer, example, cfg.max_context_length)
                context, prompt_tokens, truncated = prompts[(task, example.key)]
                if model.config._attn_implementation != attn:
                    model.set_attn_implementation(attn)  # CompressKV / Uniform switched it to weighted attention
                tick = time.perf_counter()
                answer = pipe(
                    context,
                    question=example.question,
                    answer_prefix=example.answer_prefix,
                    press=make_press(method, cfg.ratio, cfg.seed, cfg.press_options.get(method)),
                    max_new_tokens=cfg.max_new_tokens or max_new_tokens(task),
                    max_context_length=UNLIMITED_CONTEXT,
                )["answer"]
                record = {
                    "key": example.key,
                    "index": example.index,
                    "task": task,
                    "method": method,
                    "prediction": answer,
                    "answers": example.answers,
                    "length": example.length,
                    "prompt_tokens": prompt_tokens,
                    "truncated": truncated,
                    "seconds": round(time.perf_counter() - tick, 3),
                }
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                handle.flush()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                made += 1
                position += 1
                bar.update()
                now = time.perf_counter()
                if now - last_log > 30 or made == total or example is todo[-1]:
                    rate = (now - started) / made
                    log.info(
                        f"[{label}] {position}/{share}  overall {made}/{total}  {rate:.1f} s/prediction  "
                        f"ETA {_eta(rate * (total - made))}"
                    )
                    last_log = now
        bar.close()
    return made


def wait_for_processes(cfg: Config, plan: dict[str, list[Example]], out: Path, world: int, since: float) -> None:
    """Process 0: poll until every requested prediction exists; Interrupted if another process failed."""
    last_log = 0.0
    while True:
        missing = sum(
            len({e.key for e in examples} - set(read_predictions(out, method, task)))
            for task, examples in plan.items()
            for method in cfg.methods
        )
        if missing == 0:
            return
        failed = [p.name for p in out.glob(".rank*.failed") if p.stat().st_mtime >= since]
        if failed:
            raise Interrupted(f"another process failed ({', '.join(sorted(failed))}); {missing} predictions missing")
        if time.monotonic() - last_log > 300:
            log.info(f"waiting for the other {world - 1} process(es): {missing} predictions missing")
            last_log = time.monotonic()
        time.sleep(15)


def merge_shards(cfg: Config, plan: dict[str, list[Example]], out: Path) -> None:
    """Fold the process shards of every requested (method, task) into ``<task>.jsonl``, in dataset order."""
    for task in plan:
        for method in cfg.methods:
            shards = sorted((out / "predictions" / method).glob(f"{task}.rank*.jsonl"))
            if not shards:
                continue
            records = sorted(read_predictions(out, method, task).values(), key=lambda r: r["index"])
            target = prediction_path(out, method, task)
            staging = target.with_suffix(".jsonl.tmp")
            staging.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
            staging.replace(target)
            for shard in shards:
                shard.unlink()


# -------------------------------------------------------------------------------------------- scoring


def _one_line(err: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (whitespace collapsed, cut at ``limit`` characters)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _nan_to_none(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def score_examples(task: str, examples: list[Example], predictions: list[str]) -> dict[str, Any]:
    """LongBench scores x 100 of one task: "overall", the buckets ("0-4k", "4-8k", "8k+", None if empty), sizes."""
    answers = [e.answers for e in examples]
    classes = [e.all_classes for e in examples]
    lengths = [e.length for e in examples]
    if task in metrics.TASK_METRICS:
        result = metrics.score_task(task, predictions, answers, classes, lengths=lengths)
        overall = result.get("overall", result.get("score"))
        scores = {"overall": overall, **{b: result.get(b) for b in BUCKETS}}
        sizes = {f"n_{b}": result.get(f"n_{b}") for b in BUCKETS}
    else:  # offline task: one of LongBench's metric functions, bucketed the LongBench-E way
        metric = getattr(metrics, OFFLINE_METRICS[task])
        values = [max(float(metric(p, gt)) for gt in a) for p, a in zip(predictions, answers, strict=True)]
        per_bucket: dict[str, list[float]] = {b: [] for b in BUCKETS}
        for value, length in zip(values, lengths, strict=True):
            per_bucket["0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"].append(value)
        scores = {"overall": round(100 * sum(values) / len(values), 2)}
        scores |= {b: round(100 * sum(v) / len(v), 2) if v else None for b, v in per_bucket.items()}
        sizes = {f"n_{b}": len(v) for b, v in per_bucket.items()}
    return {k: _nan_to_none(v) for k, v in scores.items()} | sizes


def collect(cfg: Config, plan: dict[str, list[Example]], out: Path) -> dict[str, Any]:
    """Scores of every requested (method, task) from the predictions on disk, with completeness."""
    results: dict[str, Any] = {}
    for method in cfg.methods:
        per_task: dict[str, Any] = {}
        for task, examples in plan.items():
            found = read_predictions(out, method, task)
            done = [e for e in examples if e.key in found]
            entry: dict[str, Any] = {"n": len(done), "n_expected": len(examples)}
            entry["complete"] = len(done) == len(examples)
            if done:
                entry |= score_examples(task, done, [found[e.key]["prediction"] for e in done])
            else:
                entry |= {"overall": None, **{b: None for b in BUCKETS}}
            per_task[task] = entry
        overall = [t["overall"] for t in per_task.values()]
        average = round(sum(overall) / len(overall), 2) if all(v is not None for v in overall) else None
        buckets = {}
        for b in BUCKETS:
            values = [t[b] for t in per_task.values() if t.get(b) is not None]
            buckets[b] = round(sum(values) / len(values), 2) if values else None
        results[method] = {
            "tasks": per_task,
            "average": average,
            "buckets": buckets,
            "complete": all(t["complete"] for t in per_task.values()),
        }
    return results


def _cell(entry: dict[str, Any], value: float | None) -> str:
    text = "–" if value is None else f"{value:.2f}"
    if not entry.get("complete", True):
        text += f" (partial {entry['n']}/{entry['n_expected']})" if "n" in entry else " (partial)"
    return text


def markdown(cfg: Config, plan: dict[str, list[Example]], results: dict[str, Any]) -> str:
    """results.md: Table 4's layout (rows = methods, columns = tasks + Average), then the length buckets."""
    complete = all(r["complete"] for r in results.values())
    suite = "Offline suite" if all(t in offline_suite.TASKS for t in plan) else "LongBench-E"
    title = f"# {suite}: {model_label(cfg)}, cache kept at {cfg.ratio:g} (compression_ratio {1 - cfg.ratio:g})"
    lines = [title + ("" if complete else " (partial)"), ""]
    if not complete:
        lines += [
            "**Partial results**: cells marked (partial k/n) hold k of the n requested examples; "
            "rerun the same command to finish.",
            "",
        ]
    columns = [COLUMN_NAMES[t] for t in plan]
    lines += ["| Method | " + " | ".join(columns) + " | Average |", "|---" * (len(columns) + 2) + "|"]
    for method, r in results.items():
        cells = [_cell(r["tasks"][t], r["tasks"][t]["overall"]) for t in plan]
        avg = _cell({"complete": r["complete"]}, r["average"])
        lines.append(f"| {METHODS[method]} | " + " | ".join(cells) + f" | {avg} |")
    sizes = ", ".join(f"{COLUMN_NAMES[t]} {len(e)}" for t, e in plan.items())
    changed = changed_press_options(cfg)
    settings = "; ".join(f"{METHODS[m]} {', '.join(f'{k}={v}' for k, v in o.items())}" for m, o in changed.items())
    lines += [
        "",
        f"LongBench metric per task x 100; Average = unweighted mean over the tasks. Examples per task: {sizes}.",
        *([f"Press settings other than the defaults: {settings}."] if changed else []),
        "",
        "## By length (LongBench-E buckets of the `length` field, words; mean over the tasks with examples there)",
        "",
        "| Method | " + " | ".join(BUCKETS) + " |",
        "|---" * (len(BUCKETS) + 1) + "|",
    ]
    for method, r in results.items():
        cells = [_cell({"complete": r["complete"]}, r["buckets"][b]) for b in BUCKETS]
        lines.append(f"| {METHODS[method]} | " + " | ".join(cells) + " |")
    if "qwen2.5-7b-instruct" in model_label(cfg).lower() and cfg.ratio == 0.25 and set(plan) <= set(LONGBENCH_TASKS):
        order = list(LONGBENCH_TASKS)
        lines += ["", "## Paper, Table 4 (reference; Average over the columns shown)", ""]
        lines += ["| Method | " + " | ".join(columns) + " | Average |", "|---" * (len(columns) + 2) + "|"]
        for name, row in PAPER_TABLE4.items():
            values = [row[order.index(t)] for t in plan]
            average = row[-1] if len(values) == len(order) else sum(values) / len(values)
            lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {average:.2f} |")
    return "\n".join(lines) + "\n"


def write_csv(path: Path, plan: dict[str, list[Example]], results: dict[str, Any]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "task", "bucket", "score", "n", "n_expected", "complete"])
        for method, r in results.items():
            for task in plan:
                t = r["tasks"][task]
                writer.writerow([method, task, "overall", t["overall"], t["n"], t["n_expected"], t["complete"]])
                for b in BUCKETS:
                    writer.writerow([method, task, b, t[b], t.get(f"n_{b}"), "", t["complete"]])
            writer.writerow([method, "average", "overall", r["average"], "", "", r["complete"]])
            for b in BUCKETS:
                writer.writerow([method, "average", b, r["buckets"][b], "", "", r["complete"]])


def plot(path: Path, cfg: Config, plan: dict[str, list[Example]], results: dict[str, Any]) -> None:
    """Grouped bars: tasks + Average on x, one bar per method; partial bars hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [*plan, "average"]
    width = 0.8 / max(1, len(results))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 * len(columns) + 2), 4.2))
    for i, (method, r) in enumerate(results.items()):
        xs, heights, hatches = [], [], []
        for j, column in enumerate(columns):
            entry = r if column == "average" else r["tasks"][column]
            value = r["average"] if column == "average" else entry["overall"]
            if value is not None:
                xs.append(j + (i - (len(results) - 1) / 2) * width)
                heights.append(value)
                hatches.append("" if entry["complete"] else "//")
        bars = ax.bar(xs, heights, width, label=METHODS[method])
        for bar, hatch in zip(bars, hatches, strict=True):
            bar.set_hatch(hatch)
    ax.set_xticks(range(len(columns)))
    ax.set_xticklabels([COLUMN_NAMES.get(c, "Average") for c in columns], rotation=30, ha="right")
    ax.set_ylabel("score (LongBench metric x 100)")
    complete = all(r["complete"] for r in results.values())
    ax.set_title(f"{model_label(cfg)}, cache kept at {cfg.ratio:g}" + ("" if complete else " (partial: hatched)"))
    ax.legend(fontsize=8, ncol=min(3, len(results)))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_tables(cfg: Config, plan: dict[str, list[Example]], out: Path) -> bool:
    """scores.json, scores.csv, results.md (also printed) and scores.png; returns whether all is complete."""
    results = collect(cfg, plan, out)
    complete = all(r["complete"] for r in results.values())
    payload = {
        "complete": complete,
        "model": cfg.model or EMBEDDED_LABEL,
        "ratio": cfg.ratio,
        "compression_ratio": round(1 - cfg.ratio, 6),
        "tasks": list(plan),
        "methods": list(cfg.methods),
        "results": results,
        "settings": asdict(cfg),
    }
    (out / "scores.json").write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    write_csv(out / "scores.csv", plan, results)
    text = markdown(cfg, plan, results)
    (out / "results.md").write_text(text, encoding="utf-8")
    plot(out / "scores.png", cfg, plan, results)
    print(text, flush=True)
    log.info(f"{'complete' if complete else 'PARTIAL'} results in {out}")
    return complete


# ----------------------------------------------------------------------------------------------- main


def _check_run_dir(out: Path, cfg: Config) -> None:
    path = out / "run.json"
    if not path.exists():
        return
    try:
        previous = json.loads(path.read_text(encoding="utf-8")).get("prediction_settings", {})
    except (json.JSONDecodeError, OSError):
        return
    for key, value in prediction_settings(cfg).items():
        if key in previous and previous[key] != value:
            raise UsageError(
                f"--output-dir: {out} holds predictions made with {key}={previous[key]!r} (this run: {value!r}); "
                "use another --output-dir"
            )


def _setup_logging(out: Path | None, rank: int) -> None:
    log.setLevel(logging.INFO)
    log.propagate = False
    formatter = logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
    if not log.handlers:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(formatter)
        log.addHandler(stream)
    if out is not None:
        handler = logging.FileHandler(out / ("run.log" if rank == 0 else f"run.rank{rank}.log"), encoding="utf-8")
        handler.setFormatter(formatter)
        log.addHandler(handler)


def run(cfg: Config, command: Sequence[str] | None = None) -> int:
    """Load data (and the model), predict what is missing, write the tables; returns the exit status."""
    rank, world, local_rank = process_rank()
    _setup_logging(None, rank)
    if cfg.score_only and rank != 0:
        return 0
    if world > 1 and cfg.device_map:
        raise UsageError("--device-map: not with several processes (each process holds its own model)")
    out = output_dir(cfg)
    _check_run_dir(out, cfg)
    plan = {task: select(load_task(task, cfg), cfg) for task in task_list(cfg)}
    work = [] if cfg.score_only else pending(cfg, plan, out, rank, world)
    todo = sum(len(w[2]) for w in work)
    pipe = load_pipeline(cfg, local_rank) if todo else None  # nothing to predict: no model
    out.mkdir(parents=True, exist_ok=True)
    for handler in [h for h in log.handlers if isinstance(h, logging.FileHandler)]:
        log.removeHandler(handler)
    _setup_logging(out, rank)
    since = time.time()
    if rank == 0:
        run_info = {
            "prediction_settings": prediction_settings(cfg),
            "settings": asdict(cfg),
            "command": list(command) if command is not None else sys.argv,
            "processes": world,
        }
        (out / "run.json").write_text(json.dumps(run_info, indent=1) + "\n", encoding="utf-8")
    failed_marker = out / f".rank{rank}.failed"
    failed_marker.unlink(missing_ok=True)
    status = 0
    try:
        if not cfg.score_only:
            log.info(f"process {rank} of {world}: {todo} predictions to make")
            if pipe is not None:
                predict(pipe, cfg, work, out, rank, world)
            if world > 1 and rank != 0:
                log.info(f"process {rank} done; process 0 writes the tables")
                return 0
            if world > 1:
                wait_for_processes(cfg, plan, out, world, since)
    except KeyboardInterrupt:
        log.error("interrupted: rerun the same command to resume")
        status = 130
    except Interrupted as err:
        log.error(f"error: {err}")
        status = 1
    except Exception as err:
        (out / "error.log").write_text(traceback.format_exc(), encoding="utf-8")
        if world > 1:
            failed_marker.write_text(str(err), encoding="utf-8")
        print(f"error: {type(err).__name__}: {_one_line(err)} (traceback in {out / 'error.log'})", file=sys.stderr)
        status = 1
    if world > 1 and rank != 0:
        return status
    if world > 1 and status == 0:  # only once every process is done: a running process still appends
        merge_shards(cfg, plan, out)
    complete = write_tables(cfg, plan, out)
    return status or (0 if complete else 1)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: returns the exit status (``error: ...`` on stderr for bad input)."""
    try:
        cfg = parse_config(argv)
        return run(cfg, None if argv is None else ["eval/longbench.py", *argv])
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # before any prediction (data or model loading)
        print("interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
