"""The study loop: every (context, press, kept fraction), appended to ``runs.jsonl`` as it finishes, resumable.

A run directory is tied to its settings (``settings.json``: the model identity, the context list with its
needles, continuation length, seed, answer length, needle phrasing); rerunning into it with the same settings
skips the (context, press, kept) rows already in ``runs.jsonl``, and with other settings is refused. The
press list and kept fractions may change between runs into one directory (rows are added). Runs made in
parallel into separate directories with the same settings can be merged by concatenating their
``runs.jsonl`` (a repeated row counts once) and reported with ``run=False``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvcompress.fidelity.contexts import DEPTHS, NEEDLE, QUESTION, Context, build_contexts
from kvcompress.fidelity.measure import exact_reference, exact_row, measure, prefill
from kvcompress.fidelity.specs import PressSpec, check_specs, make_press
from kvcompress.registry import press_change, press_settings

DEFAULT_PRESSES = (
    "compresskv",
    "compresskv_paper",
    "snapkv",
    "streamingllm",
    "expected_attention",
    "keydiff",
    "tova",
    "pyramidkv",
    "compactor",
    "adakv",
    "kvzip",
)
EXACT = PressSpec("exact", "exact")


@dataclass
class StudyConfig:
    """Settings of a fidelity study (the CLI's YAML keys and flags, besides model loading)."""

    presses: list[str] = field(default_factory=lambda: list(DEFAULT_PRESSES))
    kept: list[float] = field(default_factory=lambda: [0.5, 0.25, 0.1])
    kinds: list[str] = field(default_factory=lambda: ["prose", "code", "mix"])
    lengths: list[int] = field(default_factory=lambda: [2048, 4096])
    seeds: int = 2  # contexts per (kind, length)
    depths: list[float] = field(default_factory=lambda: list(DEPTHS))
    continuation_tokens: int = 128
    max_new_tokens: int = 24
    seed: int = 0
    resamples: int = 2000  # bootstrap resamples over contexts
    contexts: list[str] | None = None  # names of the contexts to run now (None: all); the others are skipped
    output_dir: str = "results/fidelity"


def row_key(row: dict) -> tuple[str, str, float]:
    return row["context"], row["press"], float(row["kept"])


def read_runs(path: Path, repair: bool = True) -> list[dict]:
    """The rows of ``runs.jsonl`` (none if absent), the first of any repeated (context, press, kept) only; a
    line cut short by an interrupted run is skipped, and dropped from the file with ``repair`` (the study, which
    appends next; a reader of another run's file passes False)."""
    if not path.exists():
        return []
    rows: dict[tuple[str, str, float], dict] = {}
    good = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        good.append(line)
        rows.setdefault(row_key(row), row)
    text = "".join(line + "\n" for line in good)
    if repair and text != path.read_text():
        path.write_text(text)
    return list(rows.values())


def check_settings_file(path: Path, settings: dict) -> None:
    """Write ``settings`` to ``path``, or, if it exists, refuse (ValueError, one line) settings that differ."""
    if path.exists():
        old = json.loads(path.read_text())
        for key in sorted(set(old) | set(settings)):
            if key in settings and key not in old:
                continue  # a settings.json from before that key (the device): not a different setting
            if old.get(key) != settings.get(key):
                what = "the context list" if key == "contexts" else f"{old.get(key)!r} there, {settings.get(key)!r} now"
                raise ValueError(
                    f"output_dir: {path.parent} holds a run with other settings ({key}: {what}); "
                    "use another --output-dir or the same settings"
                )
        return
    path.write_text(json.dumps(settings, indent=1) + "\n")


def study_settings(cfg: StudyConfig, contexts: list[Context], identity: dict) -> dict:
    """What a run directory is tied to (``identity``: the model, its dtype and device, from the caller)."""
    return dict(
        identity,
        seed=cfg.seed,
        continuation_tokens=cfg.continuation_tokens,
        max_new_tokens=cfg.max_new_tokens,
        needle=NEEDLE,
        question=QUESTION,
        contexts=[ctx.describe() for ctx in contexts],
    )


def press_records(model, specs: list[PressSpec]) -> dict[str, dict]:
    """Each planned press's :func:`kvcompress.registry.press_settings` by label, the exact cache's included (it runs
    whether or not ``specs`` names it); the kept fraction is left out: rows hold it."""
    records = {}
    for label, spec in {spec.label: spec for spec in [EXACT, *specs]}.items():  # a label named twice: once
        settings = press_settings(make_press(spec, 0.5) if spec.name != "exact" else None, model)
        settings.pop("compression_ratio", None)
        records[label] = settings
    return records


def check_presses(runs: Path, rows: list[dict], records: dict[str, dict]) -> None:
    """Refuse (ValueError, one line) to add rows of a press whose earlier rows in ``runs`` were measured with another
    press under the same label (a changed default, a calibration filed since): one table would mix them. Rows from
    before the settings were recorded are compared on their retrieval layers (none before calibrations)."""
    for row in rows:
        label, now = row["press"], records.get(row["press"])
        if now is None or "error" in row:
            continue
        change = press_change(row.get("press_settings"), now, row.get("retrieval_layers", []))
        if change:
            raise ValueError(
                f"output_dir: {runs.parent} holds {label} rows measured with another press ({change}); "
                "use another --output-dir"
            )


def planned(specs: list[PressSpec], kept: list[float]) -> list[tuple[PressSpec, float]]:
    """``(spec, kept)`` pairs of a run: the exact cache once at kept 1, then every press at every fraction."""
    return [(EXACT, 1.0)] + [(spec, float(k)) for spec in specs if spec.name != "exact" for k in kept]


def run_study(
    pipe, cfg: StudyConfig, identity: dict, log: Callable[[str], None] = print, run: bool = True
) -> tuple[list[Context], list[dict]]:
    """Run (or resume) the study in ``cfg.output_dir`` with the kvpress pipeline ``pipe``.

    Returns the contexts and every row of ``runs.jsonl``. A press that raises is recorded with its ``error``
    (one line) and the study goes on. ``run=False``: only check the settings and read the rows already there.
    """
    specs = check_specs(cfg.presses, cfg.kept)
    contexts = build_contexts(
        pipe, cfg.kinds, cfg.lengths, cfg.seeds, cfg.continuation_tokens, cfg.depths, seed=cfg.seed
    )
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_settings_file(out / "settings.json", study_settings(cfg, contexts, identity))
    runs = out / "runs.jsonl"
    earlier = read_runs(runs)
    done = {row_key(row) for row in earlier}
    plan = planned(specs, cfg.kept)
    names = [ctx.name for ctx in contexts]
    unknown = sorted(set(cfg.contexts or ()) - set(names))
    if unknown:
        raise ValueError(f"contexts: unknown context names {unknown}; this study's contexts are {names}")
    if not run:
        return contexts, earlier
    records = press_records(pipe.model, specs)
    check_presses(runs, earlier, records)
    prefill(pipe.model, None, contexts[0].ids[:, :64])  # warm-up: the first timed prefill is not a cold one
    with open(runs, "a") as handle:
        for index, ctx in enumerate(contexts):
            if cfg.contexts is not None and ctx.name not in cfg.contexts:
                continue
            todo = [(spec, kept) for spec, kept in plan if (ctx.name, spec.label, kept) not in done]
            head = f"[context {index + 1}/{len(contexts)}] {ctx.name}"
            if not todo:
                log(f"{head}: all {len(plan)} rows already in {runs}")
                continue
            start = time.perf_counter()
            ref = exact_reference(pipe, ctx, cfg.max_new_tokens)
            log(f"{head}: {ctx.ids.shape[1]} tokens, exact pass {time.perf_counter() - start:.1f} s")
            for spec, kept in todo:
                start = time.perf_counter()
                if spec is EXACT:
                    row = exact_row(ref, ctx)
                else:
                    try:
                        press = make_press(spec, kept, seed=cfg.seed + index)
                        row = measure(pipe, press, ctx, ref, kept, cfg.max_new_tokens)
                    except Exception as exc:  # a press that cannot run here is a result, not a crash
                        row = dict(error=" ".join(f"{type(exc).__name__}: {exc}".split()))
                seconds = time.perf_counter() - start
                row = dict(context=ctx.name, kind=ctx.kind, length=ctx.length, press=spec.label, kept=kept,
                           seconds=seconds, **row)  # fmt: skip
                row["press_settings"] = records[spec.label]
                handle.write(json.dumps(row) + "\n")
                handle.flush()
                status = row["error"] if "error" in row else f"KL={row['kl']:.4f} needle={row['needle_hits']}"
                log(f"  {head} {spec.label:<24} kept={kept:<5g} {status} {seconds:.1f} s")
    return contexts, read_runs(runs)
