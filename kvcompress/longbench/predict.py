"""The prediction run: the model in kvpress's pipeline, one jsonl line per prediction (resume), process shards."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvcompress.longbench.config import EMBEDDED_LABEL, Config, Interrupted, UsageError, make_press, one_line
from kvcompress.longbench.data import Example, truncate_middle
from kvcompress.longbench.tasks import max_new_tokens

log = logging.getLogger("kvcompress.longbench")
UNLIMITED_CONTEXT = 10**12  # disables the kvpress pipeline's own (head) truncation


def prediction_path(out: Path, method: str, task: str, rank: int = 0, world: int = 1) -> Path:
    """Where (method, task)'s predictions are appended: ``<task>.jsonl``, or this process's shard."""
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
        raise UsageError(f"--model: cannot load {name!r}: {one_line(err)}") from None
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
                asked = {"questions": list(example.questions)} if example.questions else {"question": example.question}
                result = pipe(
                    context,
                    **asked,
                    answer_prefix=example.answer_prefix,
                    press=make_press(method, cfg.ratio, cfg.seed, cfg.press_options.get(method)),
                    max_new_tokens=cfg.max_new_tokens or max_new_tokens(task),
                    max_context_length=UNLIMITED_CONTEXT,
                )
                answer = result["answers"] if example.questions else result["answer"]  # RULER: one per question
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


