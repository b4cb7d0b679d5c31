"""Real-model fidelity of KV-cache presses: KL, top-1, planted facts, layer errors, bytes, prefill time.

A thin CLI over :mod:`kvcompress.fidelity` (every decision is documented there): seeded prose / code / mix
contexts from CPython's own texts with two planted facts each, every press at every kept fraction prefilled
once per context as kvpress's pipeline does, means with 95% bootstrap intervals over contexts.

Run from the repository root: ``python -m eval.fidelity`` (defaults in ``configs/fidelity.yaml``; flags
override the YAML, same keys). Outputs in ``--output-dir``: ``runs.jsonl`` (appended as rows finish; rerun the
same command to resume), ``summary.csv``, ``summary.json``, ``layer_errors.csv``, ``fidelity.md``,
``fidelity_kl.png``. ``--report-only``: no prefill, the outputs from the rows already in ``runs.jsonl``
(the presses and fractions asked that have rows; parallel run directories merge by concatenating their
``runs.jsonl``). Press specs: ``NAME`` or ``NAME[field=value,...]``, e.g. ``compresskv[window_size=128]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from eval.config import load_yaml
from kvcompress._checks import check_int_range, model_path_problem, one_line
from kvcompress.fidelity.contexts import check_settings
from kvcompress.fidelity.report import environment, summarize, write_outputs
from kvcompress.fidelity.specs import check_specs
from kvcompress.fidelity.study import StudyConfig, planned, run_study

DEFAULT_CONFIG = Path("configs/fidelity.yaml")
LIST_TYPES = {"presses": str, "kept": float, "kinds": str, "lengths": int, "depths": float, "contexts": str}
STR_KEYS = ("model", "device", "dtype", "output_dir")
HELP = {
    "presses": "press specs NAME or NAME[field=value,...] (default: every press of configs/fidelity.yaml)",
    "kept": "kept fractions of the context cache (default 0.5 0.25 0.1; compression_ratio = 1 - kept)",
    "kinds": "context kinds: prose (pydoc_data.topics), code (stdlib sources), mix (default all three)",
    "lengths": "text tokens per context (default 2048 4096)",
    "seeds": "contexts per (kind, length) (default 2: 12 contexts, 24 needle trials)",
    "depths": "planted-fact depths, cycled over contexts (default 0.1 0.3 0.5 0.7 0.9)",
    "continuation_tokens": "teacher-forced continuation tokens for KL, top-1 and layer errors (default 128)",
    "max_new_tokens": "answer length of each needle question (default 24)",
    "seed": "seed of the contexts, needles and randomised presses (default 0)",
    "resamples": "bootstrap resamples over contexts for the 95%% intervals (default 2000)",
    "contexts": "names of the contexts to run now, e.g. prose-2048-s0 (default all)",
    "output_dir": "where runs.jsonl and the reports go (default results/fidelity)",
    "model": "local model directory or Hub name (default: the embedded SmolLM2-135M-Instruct, offline)",
    "device": "torch device (default cpu)",
    "dtype": "float32, bfloat16 or float16 (default float32)",
    "threads": "torch CPU threads (default: torch's choice)",
    "report_only": "no prefill: write the reports from the rows already in runs.jsonl",
}


@dataclass
class Config(StudyConfig):
    """The study's settings plus model loading."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct (offline)
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None  # torch threads (None: torch's default)
    report_only: bool = False  # no prefill: the outputs from the rows already in runs.jsonl


def parse_config(argv: list[str] | None = None) -> Config:
    """Built-in defaults < YAML config (``--config``, default configs/fidelity.yaml) < command-line flags."""
    parser = argparse.ArgumentParser(
        prog="python -m eval.fidelity",
        description=__doc__.split("\n\n")[0] + " Default run: every press of configs/fidelity.yaml at kept "
        "0.5, 0.25 and 0.1 on 12 contexts, the embedded model on CPU, outputs in results/fidelity/."
    )
    parser.add_argument("--config", type=Path, default=None, help=f"YAML with the same keys (default {DEFAULT_CONFIG})")
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.name in LIST_TYPES:
            parser.add_argument(flag, nargs="+", type=LIST_TYPES[f.name], help=HELP[f.name])
        elif f.type in (bool, "bool"):
            parser.add_argument(flag, action="store_true", default=None, help=HELP[f.name])
        else:
            parser.add_argument(flag, type=str if f.name in STR_KEYS else int, help=HELP[f.name])
    args = vars(parser.parse_args(argv))
    values = load_yaml(args.pop("config"), DEFAULT_CONFIG, Config)
    values.update({k: v for k, v in args.items() if v is not None})
    for key in LIST_TYPES:  # a YAML scalar where a list belongs would be read item by item (a string)
        if values.get(key) is not None and not isinstance(values[key], list):
            raise ValueError(f"{key}: expected a list, got {values[key]!r}")
    return Config(**values)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
        specs = check_specs(cfg.presses, cfg.kept)  # before any model work
        check_settings(cfg.kinds, cfg.lengths, cfg.seeds, cfg.continuation_tokens, cfg.depths)
        check_int_range("resamples", cfg.resamples, 1)  # before the study, not in its summary
        if cfg.threads is not None:
            check_int_range("threads", cfg.threads, 1)
        if cfg.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: float32, bfloat16 or float16, got {cfg.dtype!r}")
        dtype = getattr(torch, cfg.dtype)
        try:
            torch.device(cfg.device)
        except RuntimeError:
            raise ValueError(f"device: a torch device such as cpu, cuda or cuda:1, got {cfg.device!r}") from None
        problem = model_path_problem(cfg.model)
        if problem:
            raise ValueError(f"model: {problem}")
        out = Path(cfg.output_dir)
        if out.exists() and not out.is_dir():
            raise ValueError(f"output_dir: {out} exists and is not a folder")
        if cfg.report_only and not (out / "runs.jsonl").is_file():
            raise ValueError(f"report_only: no runs.jsonl in {out} to report")
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"fidelity: {exc}") from None
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)

    import kvpress  # noqa: F401  (registers the kv-press-text-generation pipeline)
    from transformers import pipeline

    from kvcompress.models import EMBEDDED_MODEL, load_model

    start = time.perf_counter()
    try:
        model, tokenizer = load_model(cfg.model, dtype=dtype, device=cfg.device)
    except (OSError, ValueError, RuntimeError, AssertionError) as exc:  # no such model; a device torch cannot use
        raise SystemExit(f"fidelity: model: {one_line(exc)}") from None
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    identity = dict(model=cfg.model or EMBEDDED_MODEL, dtype=cfg.dtype, device=cfg.device)
    try:
        contexts, rows = run_study(pipe, cfg, identity, run=not cfg.report_only)
    except (ValueError, OSError) as exc:  # OSError: an output_dir that cannot be made
        raise SystemExit(f"fidelity: {exc}") from None
    plan = [(spec.label, kept) for spec, kept in planned(specs, cfg.kept)]
    if cfg.report_only:
        present = {(row["press"], row["kept"]) for row in rows}
        plan = [key for key in plan if key in present]
    rows = [row for row in rows if (row["press"], row["kept"]) in plan]  # earlier runs may have had more presses
    table = summarize(rows, plan, [c.name for c in contexts], cfg.resamples, cfg.seed)
    meta = dict(
        config=asdict(cfg),
        contexts=[c.describe() for c in contexts],
        environment=environment(model),
        failed={f"{e['press']} kept={e['kept']:g}": e["error"] for e in table if e["error"]},
        seconds=time.perf_counter() - start,
    )
    print(write_outputs(Path(cfg.output_dir), table, rows, meta, len(contexts)))
    print(
        f"{len(contexts)} contexts, {time.perf_counter() - start:.0f} s; outputs in {cfg.output_dir}", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
