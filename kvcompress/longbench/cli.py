"""The command line of the LongBench harness (``kvcompress eval``, ``python eval/longbench.py``): flags, the run.

Settings: Config's defaults < YAML (``--config``; the embedded run's ``offline_default.yaml`` when neither
``--model`` nor ``--config`` is given) < flags. See the package docstring for the protocol and decisions.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from kvcompress import registry
from kvcompress._checks import existing_folder, unmakeable_folder
from kvcompress.config import load_yaml
from kvcompress.longbench.config import (
    DEFAULT_METHODS,
    EMBEDDED_LABEL,
    METHODS,
    OFFLINE_CONFIG,
    RESULTS_DIR,
    RULER_EXAMPLES,
    RULER_RESULTS_DIR,
    Config,
    Interrupted,
    UsageError,
    make_press,
    one_line,
    output_dir,
    prediction_settings,
    ruler_tasks,
    task_list,
    validate,
)
from kvcompress.longbench.data import load_task, select
from kvcompress.longbench.predict import (
    load_pipeline,
    log,
    merge_shards,
    pending,
    predict,
    process_rank,
    wait_for_processes,
)
from kvcompress.longbench.report import write_tables
from kvcompress.longbench.scoring import check_metric_packages
from kvcompress.longbench.tasks import ALL_TASKS, DEFAULT_DATASET, LONGBENCH_TASKS
from kvcompress.registry import press_change, press_settings

DESCRIPTION = """\
LongBench-E with KV-cache compression (the WildCat paper's Table 4 protocol): predictions, scores, tables, a plot.

Each example goes through kvpress's pipeline: the context is prefilled under the method's press inside the
chat template, the question and answer prefix are not compressed, greedy decoding of LongBench's answer
length + 20 tokens, LongBench's metric per task x 100, Average = unweighted mean over the tasks.
"""


def _embedded_run() -> Config:
    """The settings of a run without --model and --config: the embedded run's YAML over Config's defaults."""
    return Config(**load_yaml(None, OFFLINE_CONFIG, Config))


def _default_run() -> str:
    """What a run without --model and --config does, read from the embedded run's YAML."""
    cfg = _embedded_run()
    label = EMBEDDED_LABEL if cfg.model is None else cfg.model
    return (
        f"default run (no --model, no --config): the settings of {OFFLINE_CONFIG.name}, shipped with the package:\n"
        f"  {label} (embedded, offline) on the offline suite ({', '.join(cfg.tasks or [])}),\n"
        f"  methods {', '.join(cfg.methods)},\n"
        f"  cache kept at {cfg.ratio:g}, the {cfg.limit} shortest examples per task, {cfg.device}, {cfg.dtype},"
        f" {cfg.threads} thread(s);\n"
        f"  outputs in ./{RESULTS_DIR}/{label}_{cfg.ratio:g}/ under the current directory: results.md (printed),\n"
        "  scores.json, scores.csv, scores.png, predictions/, run.json, run.log.\n"
        "With --model (no --config): the 13 LongBench-E tasks from the Hub, the defaults above.\n"
        "Rerunning a command resumes it. Exit status: 0 complete, 1 incomplete (tables marked partial),\n"
        "2 bad input (one 'error: ...' line), 130 interrupted."
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage wall
        raise UsageError(message)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """Every flag of the harness, with what it does and its default (flags override the YAML)."""
    embedded, built_in = _embedded_run(), Config()  # every default below is read from these, never restated
    p = _Parser(
        prog=prog, description=DESCRIPTION, epilog=_default_run(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config",
        type=Path,
        help=f"YAML with Config's keys, e.g. configs/longbench_e_qwen2.5_7b.yaml (default: none; without --model "
        f"the package's {OFFLINE_CONFIG.name})",
    )
    p.add_argument(
        "--benchmark",
        choices=("longbench", "ruler"),
        help="longbench (default) or ruler: RULER-style synthetic tasks generated offline (kvcompress.ruler)",
    )
    p.add_argument("--length", type=int, help="ruler: context length in tokens of the model's tokenizer (default 4096)")
    p.add_argument("--model", help="local dir or Hub id; bare Qwen names resolve to Qwen/ (default: embedded SmolLM2)")
    p.add_argument(
        "--methods",
        nargs="+",
        help=f"from {list(METHODS)} (default: {' '.join(embedded.methods)}; with --model: {' '.join(DEFAULT_METHODS)})",
    )
    p.add_argument("--ratio", type=float, help=f"KEPT fraction of the cache, in (0, 1] (default {built_in.ratio:g})")
    p.add_argument(
        "--tasks",
        nargs="+",
        help=f"from {list(ALL_TASKS)} (default: {' '.join(embedded.tasks or [])}; with --model: the "
        f"{len(LONGBENCH_TASKS)} LongBench-E tasks); with --benchmark ruler from {list(ruler_tasks())} (default: all)",
    )
    p.add_argument("--dataset", help=f"Hub id or local dir with <task>_e data dirs (default {DEFAULT_DATASET})")
    p.add_argument(
        "--data-dir", help="local dir with <task>.jsonl or <task>_e.jsonl, LongBench columns (default: none)"
    )
    p.add_argument(
        "--limit",
        type=int,
        help=f"the first N examples of each task, in the data's order (the offline suite's: shortest first; default: "
        f"{embedded.limit} in the embedded run; with --model: all; with --benchmark ruler: {RULER_EXAMPLES} contexts)",
    )
    p.add_argument(
        "--fraction", type=float, help="a seeded fraction of each task, in (0, 1], before --limit (default: all)"
    )
    p.add_argument("--seed", type=int, help=f"seed of the presses and of --fraction (default {built_in.seed})")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        help=f"default {embedded.device} in the embedded run; with --model: {built_in.device} (cuda:LOCAL_RANK "
        "if a GPU)",
    )
    p.add_argument(
        "--device-map", choices=("auto",), help="spread the model over the GPUs, accelerate (default: one device)"
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        help=f"default {embedded.dtype} in the embedded run; with --model: {built_in.dtype} (float32 on CPU, the "
        "checkpoint's dtype on GPU)",
    )
    p.add_argument(
        "--attn-implementation",
        choices=("auto", "sdpa", "eager", "flash_attention_2"),
        help=f"prefill attention (default {embedded.attn_implementation} in the embedded run; with --model: "
        f"{built_in.attn_implementation}: flash_attention_2 on CUDA where flash_attn imports, else sdpa)",
    )
    p.add_argument(
        "--max-context-length", type=int, help="LongBench middle truncation of the prompt (tokens) (default: none)"
    )
    p.add_argument(
        "--max-new-tokens", type=int, help="override LongBench's length + 20 (smoke runs only) (default: length + 20)"
    )
    p.add_argument(
        "--threads", type=int, help=f"torch CPU threads (default {embedded.threads} in the embedded run; else torch's)"
    )
    p.add_argument("--output-dir", help=f"default ./{RESULTS_DIR}/<model>_<ratio>[_<press options>]; with --benchmark "
                   f"ruler ./{RULER_RESULTS_DIR}/<model>_<length>_<ratio>[...]")  # fmt: skip
    p.add_argument(
        "--score-only", action="store_true", default=None, help="no model: rescore what exists (default: off)"
    )
    p.add_argument(
        "--press-option",
        action="append",
        metavar="METHOD.FIELD=VALUE",
        help="a press setting other than the default, e.g. compresskv.window_size=128 (repeatable; default: none)",
    )
    return p


def parse_press_options(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["compresskv.window_size=128", ...]`` -> ``{"compresskv": {"window_size": 128}}`` (values as YAML)."""
    options: dict[str, dict[str, Any]] = {}
    for item in items:
        try:
            method, name, value = registry.parse_press_option(item)
        except ValueError as err:
            raise UsageError(str(err)) from None
        options.setdefault(method, {})[name] = value
    return options


def parse_config(argv: Sequence[str] | None = None) -> Config:
    """Built-in defaults < YAML (``--config``; the package's offline_default.yaml without --model) < flags."""
    args = vars(build_parser().parse_args(argv))
    path = args.pop("config")
    flag_options = parse_press_options(args.pop("press_option") or [])
    try:  # the embedded run's YAML is the default only without --model
        values = {} if path is None and args.get("model") is not None else load_yaml(path, OFFLINE_CONFIG, Config)
    except yaml.YAMLError as err:
        raise UsageError(f"--config: {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    except (TypeError, ValueError, OSError) as err:
        raise UsageError(str(err) if str(err).startswith("--config") else f"--config: {err}") from None
    if path is None and args.get("benchmark") == "ruler":  # the offline suite's tasks and example count do not apply
        values = {k: v for k, v in values.items() if k not in ("tasks", "limit")}
    values.update({k: v for k, v in args.items() if v is not None})
    options = values.get("press_options") or {}
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise UsageError(f"--config: press_options must map a method to {{field: value}}, got {options!r}")
    values["press_options"] = {m: {**options.get(m, {}), **flag_options.get(m, {})} for m in {*options, *flag_options}}
    return validate(Config(**values))


def _check_run_dir(out: Path, cfg: Config) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output-dir: {out} exists and is not a directory")
    folder = existing_folder(out.parent)  # it must be a folder: the rest is made when the first result is written
    if not folder.is_dir():
        raise UsageError(f"--output-dir: {folder} is a file, not a folder")
    problem = unmakeable_folder(existing_folder(out))
    if problem:  # found now, not when the first result is written after the model has loaded
        raise UsageError(f"--output-dir: {out} cannot be created or written: {problem}")
    if cfg.score_only and not any(out.glob("predictions/*/*.jsonl")):
        raise UsageError(f"--score-only: no predictions in {out} to score")
    path = out / "run.json"
    if not path.exists():
        return
    try:
        previous = json.loads(path.read_text(encoding="utf-8")).get("prediction_settings", {})
    except (json.JSONDecodeError, OSError):
        return
    for key, value in prediction_settings(cfg).items():
        if key == "dtype" and "device" not in previous:
            continue  # a run.json older than the resolved dtype: it stored the flag ("auto") as given
        if key in previous and previous[key] != value:
            raise UsageError(
                f"--output-dir: {out} holds predictions made with {key}={previous[key]!r} (this run: {value!r}); "
                "use another --output-dir"
            )


def _previous_run(out: Path) -> dict:
    try:
        return json.loads((out / "run.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


def _presses(out: Path, cfg: Config, model) -> dict[str, dict]:
    """Each method's :func:`kvcompress.registry.press_settings` (the earlier runs' for the methods not in this one);
    UsageError if a method's earlier predictions in ``out`` were made with another press (a changed default, a
    calibration filed since): they would be mixed in one table. A run.json from before the settings were recorded
    is compared on its retrieval layers alone (``calibrations``; none before calibrations)."""
    previous = _previous_run(out)
    before, layers = previous.get("presses"), previous.get("calibrations", {})
    found = dict(before or {})
    for method in cfg.methods:
        press = make_press(method, cfg.ratio, cfg.seed, cfg.press_options.get(method))
        try:  # settings that depend on the model's layers (retrieval_layers, full_layers) are checked here
            found[method] = settings = press_settings(press, model)
        except ValueError as err:
            where = "--model" if getattr(err, "from_calibration", False) else "--press-option"
            raise UsageError(f"{where}: {method}: {one_line(err)}") from None
        if not any((out / "predictions" / method).glob("*.jsonl")):
            continue
        change = press_change((before or {}).get(method), settings, layers.get(method, []))
        if change:
            raise UsageError(
                f"--output-dir: {out} holds {method} predictions made with another press ({change}); "
                "use another --output-dir"
            )
    return found


def _history(path: Path) -> list[dict]:
    """The earlier runs' entries of ``run.json`` (a run.json from before the history: its one run)."""
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return []
    return previous.get("history") or [{key: previous.get(key) for key in ("command", "settings")}]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvcompress")
    except PackageNotFoundError:
        return "unknown"


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
    check_metric_packages(task_list(cfg))
    plan = {task: select(load_task(task, cfg), cfg) for task in task_list(cfg)}
    work = [] if cfg.score_only else pending(cfg, plan, out, rank, world)
    todo = sum(len(w[2]) for w in work)
    pipe = load_pipeline(cfg, local_rank) if todo else None  # nothing to predict: no model
    presses = _presses(out, cfg, pipe.model) if pipe is not None else _previous_run(out).get("presses", {})
    out.mkdir(parents=True, exist_ok=True)
    for handler in [h for h in log.handlers if isinstance(h, logging.FileHandler)]:
        log.removeHandler(handler)
    _setup_logging(out, rank)
    since = time.time()
    if rank == 0:
        run_info = {
            "prediction_settings": prediction_settings(cfg),
            "presses": presses,  # method -> its press's settings (press_settings), checked when a run resumes
            "settings": asdict(cfg),
            "command": list(command) if command is not None else sys.argv,
            "processes": world,
        }
        run_info["history"] = _history(out / "run.json") + [  # every run into this directory, the first one first
            {key: run_info[key] for key in ("command", "settings")} | {"kvcompress": _version(), "at": time.time()}
        ]
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
        print(f"error: {type(err).__name__}: {one_line(err)} (traceback in {out / 'error.log'})", file=sys.stderr)
        status = 1
    if world > 1 and rank != 0:
        return status
    if world > 1 and status == 0:  # only once every process is done: a running process still appends
        merge_shards(cfg, plan, out)
    complete = write_tables(cfg, plan, out)
    return status or (0 if complete else 1)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``argv`` without the program name; None: ``sys.argv[1:]``): the exit status."""
    try:
        cfg = parse_config(argv)
        return run(cfg, None if argv is None else [Path(sys.argv[0]).name, *argv])
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # before any prediction (data or model loading)
        print("interrupted", file=sys.stderr, flush=True)
        return 130

