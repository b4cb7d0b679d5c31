"""The scans behind ``kvcompress calibrate``: a model's retrieval layers and the layers it needs whole.

The first scan (:func:`layer_drops`): per RULER-style ``niah_single`` context, one prefill under the default press and
one with the priors off in every layer. A press compresses each layer from that layer's own keys and queries (the
prefill's hidden states never see a compressed cache), so the default's cache with layer ``l`` taken from the second is
exactly the cache of the default with the priors off in layer ``l`` alone. Each layer's score is the log-prob of the
needle's digits (teacher-forced after the question) lost against the default: one prefill pair per context and one short
forward per layer, instead of one RULER run per layer. :func:`kvcompress.calibration.choose` keeps the layers that lose
at least ``threshold`` nats.

The second scan (:func:`full_layer_gains`, optional: ``kvcompress calibrate --full-lengths``) finds the layers the
answers need whole (``CompressKVPress(full_layers="auto")``): per RULER-style context of a multi-fact task (``qa`` by
default; several tasks are pooled by :func:`kvcompress.calibration.pool_tasks`), one prefill under the calibrated press
and one uncompressed; each layer's score is the log-prob the expected
answers gain when the press's cache takes that one layer from the uncompressed one (the same exact swap). At each
scanned length, the fewest layers that together recover ``full_cover`` of the whole uncompressed cache's gain are kept
whole, each recovering at least ``full_share`` of it, at most ``full_most``
(:func:`kvcompress.calibration.choose_full`), and a context is compressed with the choice of the scanned length nearest
its own (:func:`kvcompress.calibration.layers_at`): the layer that leads depends on the length. On the embedded model
the qa and multi-key answers lost at 2048 tokens are mostly layer 7's, at 1024 tokens layers 23's and 7's
(``docs/BENCHMARKS.md``, "What the full layer 7 brings back" and "The layers kept whole by context length").

:func:`calibrate` runs both and returns the :class:`kvcompress.calibration.Calibration` that :func:`main` files.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import torch

from kvcompress._checks import existing_folder, model_path_problem, one_line, unmakeable_folder
from kvcompress.calibration import (
    FULL_COVER,
    FULL_MOST,
    FULL_SHARE,
    THRESHOLD,
    Calibration,
    choose,
    choose_full,
    describe_full,
    file_name,
    model_identity,
    pool_tasks,
    user_directory,
)


def _with_layer(cache, index: int, layer):
    """A shallow copy of ``cache`` with layer ``index`` replaced by ``layer``; ``cache`` unchanged."""
    swapped = copy.copy(cache)
    swapped.layers = list(cache.layers)
    swapped.layers[index] = layer
    return swapped


def _answer_logprob(model, cache, context_len: int, question: torch.Tensor, answer: torch.Tensor) -> float:
    """Log-prob of ``answer [1, a]`` teacher-forced after ``question [1, q]`` on a copy of ``cache``."""
    ids = torch.cat([question, answer], dim=1).to(model.device)
    positions = torch.arange(context_len, context_len + ids.shape[1], device=model.device)[None]
    keep = answer.shape[1] + 1  # the logits that predict the answer (the vocabulary projection dominates the cost)
    logits = model(input_ids=ids, past_key_values=copy.deepcopy(cache), position_ids=positions, logits_to_keep=keep)
    logp = torch.log_softmax(logits.logits[0, :-1].float(), dim=-1)
    return logp.gather(-1, answer[0].to(model.device)[:, None]).sum().item()


@torch.no_grad()
def layer_drops(model, tokenizer, kept: float = 0.25, length: int = 1024, contexts: int = 8, seed: int = 0,
                progress=None) -> tuple[float | None, ...]:  # fmt: skip
    """Per layer, the mean needle log-prob (nats) the uniform default press (no retrieval layers, whatever the model's
    calibration) loses with the priors off there (see the module
    docstring), ``kept`` of each context kept; None for a sliding-window layer. ``contexts`` ``niah_single`` contexts
    of ``length`` tokens."""
    import kvpress  # noqa: F401  (registers the pipeline)
    from transformers import pipeline

    from kvcompress.fidelity.measure import prefill
    from kvcompress.presses import CompressKVPress
    from kvcompress.ruler.generator import generate
    from kvcompress.window import layer_windows

    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    # uniform (no retrieval layer, no layer kept whole, whatever the model's calibration): what is scanned
    default = CompressKVPress(compression_ratio=1 - kept, seed=seed, retrieval_layers=(), full_layers=())
    plain = replace(default, novelty_share=0.0, induction_share=0.0)
    windows = layer_windows(model) or [None] * model.config.num_hidden_layers
    totals = [0.0] * len(windows)
    asked = 0
    for example in generate("niah_single", tokenizer, length, contexts, seed):
        inputs = pipe.preprocess(example.context, list(example.questions), example.answer_prefix, 1 << 30)
        ids = inputs["context_ids"]
        with_priors, _ = prefill(model, default, ids)
        without, _ = prefill(model, plain, ids)
        for question, expected in zip(inputs["questions_ids"], example.answers, strict=True):
            answer = tokenizer.encode(" " + expected[0], return_tensors="pt", add_special_tokens=False)
            base = _answer_logprob(model, with_priors, ids.shape[1], question, answer)
            for layer, window in enumerate(windows):
                if window is None:
                    mixed = _with_layer(with_priors, layer, without.layers[layer])
                    totals[layer] += base - _answer_logprob(model, mixed, ids.shape[1], question, answer)
            asked += 1
        if progress is not None:
            progress(example.index + 1, contexts)
    return tuple(None if w is not None else round(t / asked, 4) for t, w in zip(totals, windows, strict=True))


@torch.no_grad()
def full_layer_gains(model, tokenizer, press, task: str = "qa", length: int = 2048, contexts: int = 8, seed: int = 0,
                     progress=None) -> dict:  # fmt: skip
    """``{"whole": g, "layers": [g_0, ...]}``: the mean log-prob (nats per expected answer) the answers of
    ``contexts`` RULER-style ``task`` contexts of ``length`` tokens gain over ``press``'s cache when it is replaced by
    the uncompressed cache (``whole``), or when only layer ``l`` is (``layers[l]``; None for a sliding-window layer).
    As in :func:`layer_drops` each layer is compressed from its own keys and queries, so the cache with layer ``l``
    swapped is exactly ``press`` with ``l`` kept whole, before the other layers pay for it."""
    import kvpress  # noqa: F401  (registers the pipeline)
    from transformers import pipeline

    from kvcompress.cache import WeightedLayer
    from kvcompress.fidelity.measure import prefill
    from kvcompress.ruler.generator import generate
    from kvcompress.window import layer_windows

    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    windows = layer_windows(model) or [None] * model.config.num_hidden_layers
    whole, totals, asked = 0.0, [0.0] * len(windows), 0
    for example in generate(task, tokenizer, length, contexts, seed):
        inputs = pipe.preprocess(example.context, list(example.questions), example.answer_prefix, 1 << 30)
        ids = inputs["context_ids"]
        n = ids.shape[1]
        compressed, _ = prefill(model, press, ids)
        exact, _ = prefill(model, None, ids)
        kept_whole = {
            index: WeightedLayer(layer.keys, layer.values, torch.ones(layer.keys.shape[:3]), layer.values.amin(2),
                                 layer.values.amax(2), n)  # fmt: skip
            for index, (layer, window) in enumerate(zip(exact.layers, windows, strict=True))
            if window is None
        }
        for question, expected in zip(inputs["questions_ids"], example.answers, strict=True):
            for text in expected:
                answer = tokenizer.encode(" " + text, return_tensors="pt", add_special_tokens=False)
                base = _answer_logprob(model, compressed, n, question, answer)
                whole += _answer_logprob(model, exact, n, question, answer) - base
                for index, layer in kept_whole.items():
                    swapped = _with_layer(compressed, index, layer)
                    totals[index] += _answer_logprob(model, swapped, n, question, answer) - base
                asked += 1
        if progress is not None:
            progress(example.index + 1, contexts)
    layers = [None if w is not None else round(t / asked, 4) for t, w in zip(totals, windows, strict=True)]
    return {"whole": round(whole / asked, 4), "layers": layers}


def calibrate(model, tokenizer, kept: float = 0.25, length: int = 1024, contexts: int = 8, seed: int = 0,
              threshold: float = THRESHOLD, progress=None, full_lengths: tuple[int, ...] = (),
              full_task: str | tuple[str, ...] = "qa", full_kept: float = 0.5, full_share: float = FULL_SHARE,
              full_most: int = FULL_MOST, full_cover: float = FULL_COVER) -> Calibration:  # fmt: skip
    """Scan ``model`` (:func:`layer_drops`) and :func:`choose` its retrieval layers; with ``full_lengths``, then scan
    the press with those layers at each length on each ``full_task`` (:func:`full_layer_gains`, ``full_kept`` kept),
    pool the tasks (:func:`kvcompress.calibration.pool_tasks`) and :func:`choose_full` the layers kept whole."""
    from kvcompress.presses import CompressKVPress

    drops = layer_drops(model, tokenizer, kept, length, contexts, seed, progress)
    name, shape = model_identity(model)
    settings = {"task": "niah_single", "length": length, "contexts": contexts, "kept": kept,
                "seed": seed, "threshold": threshold}  # fmt: skip
    retrieval = choose(drops, threshold)
    gains, full_settings = {}, {}
    if full_lengths:
        press = CompressKVPress(compression_ratio=1 - full_kept, seed=seed, retrieval_layers=retrieval, full_layers=())
        tasks = tuple(dict.fromkeys((full_task,) if isinstance(full_task, str) else full_task))  # each once
        for tokens in full_lengths:
            scanned = {task: full_layer_gains(model, tokenizer, press, task, tokens, contexts, seed, progress)
                       for task in tasks}  # fmt: skip
            gains[str(tokens)] = pool_tasks(scanned)
        full_settings = {"task": tasks[0] if len(tasks) == 1 else list(tasks), "lengths": list(full_lengths),
                         "contexts": contexts, "kept": full_kept, "seed": seed, "share": full_share,
                         "most": full_most, "cover": full_cover}  # fmt: skip
    full = choose_full(gains, full_share, full_most, full_cover, retrieval)
    return Calibration(name, shape, retrieval, drops, settings, full, gains, full_settings)


def unwritable(path: Path) -> str | None:
    """Why a file cannot be written at ``path`` (its folder made if missing), or None. A folder made in the nearest
    existing one and removed finds out (``os.access`` says yes to root even where nothing can be made, such as
    /proc, and the scan ran for minutes before the file could not be filed)."""
    if path.is_dir():
        return f"{path} is a directory; name a file (e.g. {path / 'model.json'})"
    folder = existing_folder(path.parent)
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    problem = unmakeable_folder(folder)
    return None if problem is None else f"{path} cannot be created: {problem}"


def main(argv: list[str]) -> int:
    """``kvcompress calibrate``: scan a model, print each layer's drop, file the calibration; exit 2 on bad flags."""
    import argparse
    import sys

    from kvcompress.ruler.tasks import TASKS

    p = argparse.ArgumentParser(
        prog="kvcompress calibrate",
        description="Find the layers of a model that read facts back (CompressKVPress(retrieval_layers='auto') "
                    "gives them more rows) and, with --full-lengths, those its answers need whole at each context "
                    "length (full_layers='auto'); file them for that model.")  # fmt: skip
    p.add_argument("--model", help="local model directory or Hub name (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--output", help=f"the calibration file (default: {user_directory()}/<model name>.json, where "
                                    "retrieval_layers='auto' looks first)")  # fmt: skip
    p.add_argument("--ratio", type=float, default=0.25, help="KEPT fraction the scan compresses to (default 0.25)")
    p.add_argument("--length", type=int, default=1024, help="tokens per scanned context (default 1024)")
    p.add_argument("--contexts", type=int, default=8, help="niah_single contexts scanned (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the contexts (default 0)")
    p.add_argument("--threshold", type=float, default=THRESHOLD,
                   help=f"nats of the needle's log-prob lost that make a retrieval layer (default {THRESHOLD})")
    p.add_argument("--full-lengths", type=int, nargs="+", default=[], metavar="TOKENS",
                   help="also scan for the layers the answers need whole (CompressKVPress(full_layers='auto')) at "
                        "these context lengths (e.g. 1024 2048, up to the longest your contexts reach; one short "
                        "forward per layer and expected answer); default: no such scan")  # fmt: skip
    p.add_argument("--full-task", nargs="+", default=None, choices=sorted(TASKS), metavar="TASK",
                   help="RULER-style tasks of that scan (default qa: facts asked about a document); with several, "
                        "each layer's share of each task's gain, averaged over the tasks. Choices: "
                        + ", ".join(sorted(TASKS)))  # fmt: skip
    p.add_argument("--full-ratio", type=float, default=None, help="KEPT fraction of that scan (default 0.5)")
    p.add_argument("--full-share", type=float, default=None,
                   help="a layer kept whole recovers at least this share of the uncompressed cache's answer log-prob "
                        f"gain at its length (default {FULL_SHARE})")  # fmt: skip
    p.add_argument("--full-cover", type=float, default=None,
                   help="at each length, layers are kept whole until together they recover this share of that gain "
                        f"(default {FULL_COVER})")  # fmt: skip
    p.add_argument("--full-most", type=int, default=None,
                   help=f"at most this many layers kept whole at a length (default {FULL_MOST})")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="default auto: cuda if torch sees a GPU")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="model weights and cache (default auto: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    scan = {"--full-task": ("full_task", ["qa"]), "--full-ratio": ("full_ratio", 0.5),
            "--full-share": ("full_share", FULL_SHARE), "--full-cover": ("full_cover", FULL_COVER),
            "--full-most": ("full_most", FULL_MOST)}  # fmt: skip
    for flag, (name, default) in scan.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif not args.full_lengths:
            p.error(f"{flag}: sets the scan for layers kept whole, which runs only with --full-lengths")
    if not 0 < args.ratio < 1:
        p.error(f"--ratio: must be in (0, 1), got {args.ratio}")
    if not 0 < args.full_ratio < 1:
        p.error(f"--full-ratio: must be in (0, 1), got {args.full_ratio}")
    for name, value in (("--full-share", args.full_share), ("--full-cover", args.full_cover)):
        if not 0 < value <= 1:
            p.error(f"{name}: must be in (0, 1], got {value}")
    if not args.threshold > 0:
        p.error(f"--threshold: must be > 0, got {args.threshold}")
    checked = [("--length", args.length, 64), ("--contexts", args.contexts, 1), ("--full-most", args.full_most, 1)]
    for name, value, low in checked + [("--full-lengths", value, 64) for value in args.full_lengths]:
        if value < low:
            p.error(f"{name}: must be an integer >= {low}, got {value}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads: must be an integer >= 1, got {args.threads}")

    from kvcompress.models import load_model, resolve_device_dtype

    try:
        device, dtype = resolve_device_dtype(args.device, args.dtype)
    except ValueError as err:
        p.error(str(err))
    problem = model_path_problem(args.model)
    if problem:
        p.error(f"--model: {problem}")
    output = Path(args.output) if args.output else None
    # Before the scan (minutes to hours), not after; without --output, the folder calibrations are filed in.
    problem = unwritable(output if output is not None else user_directory() / "calibration.json")
    if problem:
        where = "" if output is not None else f" (not given: {user_directory()}, $KVCOMPRESS_CALIBRATIONS)"
        p.error(f"--output{where}: {problem}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        model, tokenizer = load_model(args.model, dtype=getattr(torch, dtype), device=device)
    except (OSError, ValueError, ImportError) as err:  # ImportError: a package the model needs (protobuf, gguf)
        print(f"kvcompress calibrate: error: --model: {one_line(err).removeprefix('model: ')}", file=sys.stderr)
        return 2
    try:
        found = calibrate(model, tokenizer, args.ratio, args.length, args.contexts, args.seed, args.threshold,
                          progress=lambda i, n: print(f"context {i}/{n}", file=sys.stderr, flush=True),
                          full_lengths=tuple(args.full_lengths), full_task=tuple(args.full_task),
                          full_kept=args.full_ratio,
                          full_share=args.full_share, full_most=args.full_most, full_cover=args.full_cover)  # fmt: skip
    except ValueError as err:  # a length too short for the task
        print(f"kvcompress calibrate: error: {err}", file=sys.stderr)
        return 2
    try:
        path, status = found.save(output or user_directory() / file_name(found.model)), 0  # filed first: a long scan
    except OSError as err:  # the table below still shows what was found
        path, status = f"nowhere ({type(err).__name__}: {err}; --output names another file)", 1
    print("layer  needle log-prob lost (nats) with the priors off there")
    for layer, drop in enumerate(found.drops):
        mark = "  <- retrieval layer" if layer in found.retrieval_layers else ""
        print(f"{layer:5d}  {'sliding window' if drop is None else f'{drop:.3f}'}{mark}")
    for tokens, gains in found.full_gains.items():
        pooled = "tasks" in gains
        by_task = gains["tasks"] if pooled else {found.full_settings["task"]: gains}
        wholes = ", ".join(f"{g['whole']:+.3f} on {task}" for task, g in by_task.items())
        rows = " (nats per task, then its mean share of the gain)" if pooled else ""
        print(f"\n{tokens} tokens: the uncompressed cache gains {wholes} (nats per answer); "
              f"each layer kept whole{rows}:")
        for layer, gain in enumerate(gains["layers"]):
            mark = "  <- kept whole" if layer in found.full_layers.get(int(tokens), ()) else ""
            columns = [g["layers"][layer] for g in by_task.values()] + ([gain] if pooled else [])
            shown = "sliding window" if gain is None else "  ".join(f"{g:+.3f}" for g in columns)
            print(f"{layer:5d}  {shown}{mark}")
    kept_whole = f", layers kept whole {describe_full(found.full_layers)}" if found.full_settings else ""
    print(f"retrieval layers {list(found.retrieval_layers)}{kept_whole} filed in {path}")
    return status
