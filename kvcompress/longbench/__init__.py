"""LongBench-E with KV-cache compression (the paper's Table 4 protocol): predictions, scores, tables, a plot.

Modules: ``tasks`` (the tasks, LongBench's templates, the prompt split), ``offline_suite`` (the embedded
suite's builder; its data ships in ``data/offline_suite/``), ``data`` (loading, selection, middle
truncation), ``config`` (settings, checks, run identity), ``predict`` (the prediction run, resume,
process shards), ``metrics`` (LongBench's metrics), ``scoring``, ``report`` (tables, plot), ``cli``.

From any directory, after ``pip install`` (``kvcompress eval`` = ``python eval/longbench.py`` in a clone)::

    kvcompress eval                                                   # embedded offline run
    kvcompress eval --benchmark ruler --length 4096                   # RULER-style tasks (kvcompress.ruler)
    kvcompress eval --model Qwen/Qwen2.5-7B-Instruct --ratio 0.25
    kvcompress eval --config configs/longbench_e_qwen2.5_7b.yaml      # Table 4 (the YAML is in a clone)
    accelerate launch --multi_gpu --num_processes 4 eval/longbench.py --config ...   # 4 processes, 1 GPU each
    torchrun --nproc_per_node 2 eval/longbench.py ...                 # several CPU processes

Protocol (kvpress's LongBench evaluation, as in the paper): every example goes through kvpress's
``kv-press-text-generation`` pipeline: the context part of LongBench's prompt (``dataset2prompt``, up to
and including the context) is wrapped in the chat template and prefilled under the press; the rest of
the prompt (the question) and the answer prefix ("Answer:", "Summary:", "Next line of code:\\n", ...),
which kvpress puts after the assistant turn, are not compressed; greedy decoding of
``MAX_NEW_TOKENS[task] + 20`` tokens; LongBench's metric per task (``kvcompress.longbench.metrics``), x 100;
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
SmolLM2-135M-Instruct runs the offline suite (``offline_suite.py``; its files ship with the package in
``data/offline_suite/``, rebuilt there if missing), and with neither ``--model`` nor ``--config``, the
package's ``offline_default.yaml`` is read.

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

Outputs in ``--output-dir`` (default ``results/longbench/<model>_<ratio>`` under the current directory,
so ``bash scripts/main.sh``, which runs from the clone's root, writes into the clone's ``results/``):
``predictions/<method>/<task>.jsonl`` (one line per example, flushed as produced), ``scores.json``,
``scores.csv`` (one row per method, task and bucket), ``results.md`` (Table 4's layout: rows = methods,
columns = tasks + Average; then the bucket table, and the paper's Table 4 for reference on a
Qwen2.5-7B-Instruct run at 0.25; also printed), ``scores.png`` (bar chart), ``run.json`` and ``run.log``.
"""

from kvcompress.longbench.cli import build_parser, main, parse_config, parse_press_options, run
from kvcompress.longbench.config import (
    EMBEDDED_LABEL,
    METHODS,
    Config,
    UsageError,
    changed_press_options,
    make_press,
    model_label,
    output_dir,
    prediction_settings,
    validate,
)
from kvcompress.longbench.data import Example, load_task, select, truncate_middle
from kvcompress.longbench.report import markdown, write_tables
from kvcompress.longbench.scoring import collect, score_examples
from kvcompress.longbench.tasks import ALL_TASKS, ANSWER_PREFIXES, LONGBENCH_TASKS, PROMPTS, split_prompt

__all__ = [
    "ALL_TASKS",
    "ANSWER_PREFIXES",
    "EMBEDDED_LABEL",
    "LONGBENCH_TASKS",
    "METHODS",
    "PROMPTS",
    "Config",
    "Example",
    "UsageError",
    "build_parser",
    "changed_press_options",
    "collect",
    "load_task",
    "main",
    "make_press",
    "markdown",
    "model_label",
    "output_dir",
    "parse_config",
    "parse_press_options",
    "prediction_settings",
    "run",
    "score_examples",
    "select",
    "split_prompt",
    "truncate_middle",
    "validate",
    "write_tables",
]
