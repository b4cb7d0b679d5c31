"""Two RULER-style runs compared on the contexts they share: each setting's average and the difference with a
95% paired bootstrap interval (contexts resampled within each task, both settings the same draw), then the same for
each task alone.

    python -m eval.ruler_paired RUN_A METHOD_A RUN_B METHOD_B
    python -m eval.ruler_paired RUN_A_SEED0,RUN_A_SEED1 METHOD_A RUN_B_SEED0,RUN_B_SEED1 METHOD_B   # pooled

A run is a ``kvcompress eval --benchmark ruler`` output directory; its ``run.json`` says how its contexts were made
(model, length, seed, tasks), and contexts are paired by their key (which hashes the context), so runs of
different ``--limit`` pair on the contexts both have. Comma-separated runs of one setting (e.g. one per ``--seed``)
are pooled: their contexts join each task's sample, and the interval resamples the pooled contexts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcompress.longbench.cli import parse_config
from kvcompress.longbench.config import UsageError, task_list
from kvcompress.longbench.data import load_task, select
from kvcompress.ruler.scoring import example_score, paired_difference
from kvcompress.ruler.tasks import TASKS


def example_scores(run_dir: str, method: str, answers: dict | None = None) -> dict[str, dict[str, float]]:
    """task -> context key -> the context's RULER score x 100 of ``method`` in a run directory. ``answers``: a dict
    the caller keeps across calls, which then remembers each (context settings, task)'s expected answers, so that
    runs made with the same settings rebuild their contexts once (the tokenizer and generator take seconds)."""
    run = Path(run_dir)
    if not (run / "run.json").is_file():
        raise ValueError(f"{run_dir}: not a run directory (no run.json)")
    try:
        settings = json.loads((run / "run.json").read_text())["settings"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{run_dir}: its run.json holds no run settings") from None
    if settings.get("benchmark", "ruler") != "ruler":
        raise ValueError(f"{run_dir}: not a RULER-style run (benchmark {settings.get('benchmark')!r})")
    if not (run / "predictions" / method).is_dir():
        ran = sorted(path.name for path in (run / "predictions").glob("*") if path.is_dir())
        raise ValueError(f"{run_dir}: no predictions of {method!r} (it has {', '.join(ran) or 'none'})")
    argv = ["--benchmark", "ruler"]  # a setting the run left at its default (None) stays at the default
    for flag, key in (("--length", "length"), ("--seed", "seed"), ("--model", "model")):
        argv += [flag, str(settings[key])] if settings.get(key) is not None else []
    tasks = ["--tasks", *settings["tasks"]] if settings.get("tasks") else []
    answers = {} if answers is None else answers
    scores: dict[str, dict[str, float]] = {}
    for task in task_list(parse_config([*argv, *tasks, "--methods", method])):
        path = run / "predictions" / method / f"{task}.jsonl"
        if not path.exists():
            raise ValueError(f"{run_dir}: no predictions of {method!r} for {task} ({path})")
        rows = {}
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by an interrupted run, as the harness skips it
            rows.setdefault(row["key"], row)  # the first row of a key, as the harness keeps it
        # run.json holds the last run's --limit; an earlier run in the same directory may have predicted more
        limit = settings.get("limit") and max(settings["limit"], len(rows))
        context = (task, *argv, limit)
        if context not in answers:
            limited = ["--limit", str(limit)] if limit else []
            cfg = parse_config([*argv, "--tasks", task, "--methods", method, *limited])
            answers[context] = {example.key: example.expected for example in select(load_task(task, cfg), cfg)}
        expected = answers[context]
        unknown = sorted(set(rows) - set(expected))
        if unknown:
            raise ValueError(f"{run_dir}: {task} predictions of contexts its settings do not make, e.g. {unknown[0]}")
        metric = TASKS[task].metric
        scores[task] = {key: 100 * example_score(metric, r["prediction"], expected[key]) for key, r in rows.items()}
    return scores


def pooled_scores(run_dirs: list[str], method: str, answers: dict | None = None) -> dict[str, dict[str, float]]:
    """:func:`example_scores` of several runs of one setting, each task's contexts joined; a context scored by two
    of the runs (the same seed twice) is an error, not a double count. ``answers``: as :func:`example_scores`'s."""
    pooled: dict[str, dict[str, float]] = {}
    answers = {} if answers is None else answers
    for run_dir in run_dirs:
        for task, scores in example_scores(run_dir, method, answers).items():
            twice = sorted(set(pooled.get(task, {})) & set(scores))
            if twice:
                raise ValueError(
                    f"runs: {run_dir} scores {len(twice)} {task} context(s) an earlier run scored, e.g. {twice[0]}"
                )
            pooled.setdefault(task, {}).update(scores)
    return pooled


def compare(first: dict[str, dict[str, float]], second: dict[str, dict[str, float]]) -> dict:
    """The paired difference over the tasks and contexts both runs scored (``left_out``: the tasks only one run
    scored, which the difference leaves out; ``per_task``: each task's own paired difference, for goals set per
    task family)."""
    tasks = sorted(set(first) & set(second))
    shared = {task: sorted(set(first[task]) & set(second[task])) for task in tasks}
    if not tasks or not all(shared.values()):
        raise ValueError(f"runs: no shared contexts in some task ({ {t: len(k) for t, k in shared.items()} })")
    a = {task: [first[task][key] for key in keys] for task, keys in shared.items()}
    b = {task: [second[task][key] for key in keys] for task, keys in shared.items()}
    left_out = sorted(set(first) ^ set(second))
    per_task = {task: paired_difference({task: a[task]}, {task: b[task]}) for task in tasks}
    return paired_difference(a, b) | {"contexts": {task: len(keys) for task, keys in shared.items()},
                                      "left_out": left_out, "per_task": per_task}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.ruler_paired", description=__doc__.split("\n\n")[0])
    p.add_argument("run_a", help="first run directory (or several of one setting, comma-separated, pooled)")
    p.add_argument("method_a", help="its method (registry name, as in its predictions/)")
    p.add_argument("run_b", help="second run directory (or several, comma-separated)")
    p.add_argument("method_b", help="its method")
    args = p.parse_args(argv)
    try:
        first = pooled_scores(args.run_a.split(","), args.method_a)
        result = compare(first, pooled_scores(args.run_b.split(","), args.method_b))
    except (ValueError, OSError, UsageError) as error:
        raise SystemExit(f"error: {error}") from None
    contexts = ", ".join(f"{task} {n}" for task, n in result["contexts"].items())
    print(
        f"{args.method_a} ({args.run_a}) {result['first']:.2f} - {args.method_b} ({args.run_b}) {result['second']:.2f}"
        f" = {result['difference']:+.2f} [95% paired interval {result['low']:+.2f}, {result['high']:+.2f}];"
        f" contexts: {contexts}" + (f"; tasks only one run scored, left out: {', '.join(result['left_out'])}"
                                    if result["left_out"] else "")
    )
    for task, each in result["per_task"].items():
        print(f"  {task}: {each['first']:.2f} - {each['second']:.2f} = {each['difference']:+.2f} "
              f"[{each['low']:+.2f}, {each['high']:+.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
