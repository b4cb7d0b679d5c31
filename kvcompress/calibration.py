"""Which layers of a model read facts back: the calibration behind ``CompressKVPress(retrieval_layers="auto")``.

In most layers the default press's query-free priors (novelty, induction) can be switched off without losing a fact
asked after the context; in a model's retrieval layers (the retrieval heads of Wu et al., "Retrieval Head
Mechanistically Explains Long-Context Factuality", arXiv 2404.15574) they cannot. On SmolLM2-135M-Instruct,
layer 18 alone: without the priors there, no needle is found (docs/BENCHMARKS.md, "The worst continuation
context"). Those layers must hold both the facts and the text a continuation copies, so the press gives them more
rows (``retrieval_rows``), shared between the priors and the window's attention (``retrieval_prior_share``).

The scan (:func:`layer_drops`): per RULER-style ``niah_single`` context, one prefill under the default press and one
with the priors off in every layer. A press compresses each layer from that layer's own keys and queries (the
prefill's hidden states never see a compressed cache), so the default's cache with layer ``l`` taken from the second
is exactly the cache of the default with the priors off in layer ``l`` alone. Each layer's score is the log-prob of
the needle's digits (teacher-forced after the question) lost against the default: one prefill pair per context and
one short forward per layer, instead of one RULER run per layer. :func:`choose` keeps the layers that lose at least
``threshold`` nats.

The second scan (:func:`full_layer_gains`, optional: ``kvcompress calibrate --full-lengths``) finds the layers the
answers need whole (``CompressKVPress(full_layers="auto")``): per RULER-style context of a multi-fact task (``qa`` by
default), one prefill under the calibrated press and one uncompressed; each layer's score is the log-prob the expected
answers gain when the press's cache takes that one layer from the uncompressed one (the same exact swap). At each
scanned length, the fewest layers that together recover ``full_cover`` of the whole uncompressed cache's gain are kept
whole, each recovering at least ``full_share`` of it, at most ``full_most`` (:func:`choose_full`), and a context is
compressed with the choice of the scanned length nearest its own (:func:`layers_at`): the layer that leads depends on
the length. On the embedded model the qa and multi-key answers lost at 2048 tokens are mostly layer 7's, at 1024
tokens layers 23's and 7's (``docs/BENCHMARKS.md``, "What the full layer 7 brings back" and "The layers kept whole
by context length").

A calibration is a JSON file (:class:`Calibration`); ``kvcompress calibrate`` writes one into
:func:`user_directory`, and the press's ``"auto"`` looks a model up there, then among the calibrations shipped in
``kvcompress/calibrations/``, by the model's name and shape (:func:`model_identity`).
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

SHIPPED = Path(__file__).parent / "calibrations"
THRESHOLD = 2.0  # nats of the needle's log-prob lost with the priors off in one layer: a retrieval layer
FULL_SHARE = 0.25  # of the uncompressed cache's answer log-prob gain one layer recovers at a length: kept whole
FULL_COVER = 0.75  # ... until the layers kept whole there recover this share of it together
FULL_MOST = 2  # ... and at most this many
FORMAT = 1


class CalibrationError(ValueError):
    """A calibration file that is not one; ``from_calibration`` as :class:`kvcompress.press_guards.LayerChoiceError`'s
    (what ``kvcompress serve`` reads to blame ``--model``, not a flag)."""

    from_calibration = True


@dataclass(frozen=True)
class Calibration:
    """A model's retrieval layers and the scan that found them.

    ``model``: the name it is looked up by (the last part of ``config.name_or_path``); ``shape``: its layer count,
    hidden size and attention heads (a model of the same name with another shape does not match); ``drops``: per
    layer, the mean needle log-prob (nats) lost with the priors off there (None for a sliding-window layer);
    ``settings``: how the scan ran (task, length, contexts, fraction kept, seed, threshold). ``full_layers``: per
    scanned context length, the layers kept whole for contexts nearest that length (``{0: layers}``: the same at
    every length, what a JSON list holds; ``{}`` if the second scan did not run); ``full_gains``: per scanned length,
    the uncompressed cache's answer log-prob gain (``"whole"``) and each layer's (``"layers"``, None for a
    sliding-window layer); ``full_settings``: how that scan ran."""

    model: str
    shape: dict
    retrieval_layers: tuple[int, ...]
    drops: tuple[float | None, ...]
    settings: dict
    full_layers: dict[int, tuple[int, ...]] = field(default_factory=dict)
    full_gains: dict = field(default_factory=dict)
    full_settings: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.full_layers, (tuple, list)):  # the same layers at every length
            object.__setattr__(self, "full_layers", {0: tuple(self.full_layers)} if self.full_layers else {})
        lengths = set(self.full_layers)
        if not all(isinstance(n, int) and n >= 0 for n in lengths) or (0 in lengths and len(lengths) > 1):
            raise ValueError(f"full_layers: context lengths > 0 (or 0 alone: every length), got {sorted(lengths)}")

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self), "full_layers": full_layers_json(self.full_layers)},
                          indent=1) + "\n"  # fmt: skip

    @classmethod
    def from_json(cls, text: str, source: str = "calibration") -> Calibration:
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
            layers, shape, drops = data["retrieval_layers"], data["shape"], data["drops"]
            full = data.get("full_layers", [])  # absent from calibrations filed before the full-layer scan
            if isinstance(full, dict):  # per scanned length (since the layers kept whole depend on it)
                if not all(isinstance(k, str) and k.isdigit() and int(k) > 0 for k in full):
                    raise ValueError(f"full_layers must map context lengths to layer lists, got {full!r}")
                by_length = {int(tokens): value for tokens, value in full.items()}
            else:  # a list: the same layers at every length
                by_length = {0: full} if full != [] else {}
            lists = [("retrieval_layers", layers)] + [("full_layers", value) for value in by_length.values()]
            for name, value in lists:
                if not isinstance(value, list) or not all(isinstance(x, int) and x >= 0 for x in value):
                    raise ValueError(f"{name} must be a list of layer indices, got {value!r}")
                if len(set(value)) != len(value):
                    raise ValueError(f"{name} must name distinct layers, got {value!r}")
                if name == "full_layers" and (both := sorted(set(layers) & set(value))):
                    raise ValueError(f"layers {both} are in both retrieval_layers and full_layers")
            if not isinstance(shape, dict) or not all(isinstance(v, int) for v in shape.values()):
                raise ValueError(f"shape must map names to integers, got {shape!r}")
            if not isinstance(drops, list) or not all(d is None or isinstance(d, (int, float)) for d in drops):
                raise ValueError(f"drops must be a list of numbers (null for a sliding-window layer), got {drops!r}")
            full = {tokens: tuple(value) for tokens, value in by_length.items()}
            return cls(str(data["model"]), dict(shape), tuple(layers), tuple(drops), dict(data["settings"]),
                       full, dict(data.get("full_gains", {})), dict(data.get("full_settings", {})))  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CalibrationError(f"calibration: {source} is not a kvcompress calibration ({err})") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        return cls.from_json(Path(path).read_text(), str(path))

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path


def model_identity(model) -> tuple[str, dict]:
    """``(name, shape)`` a calibration is filed under: the last part of ``config.name_or_path`` (lower case; ""
    for a model built from a config) and the layer count, hidden size, attention and key-value heads."""
    config = model.config
    config = getattr(config, "text_config", None) or config
    name = Path(str(getattr(model.config, "name_or_path", "") or "")).name.lower()
    shape = {
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "heads": config.num_attention_heads,
        "kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    }
    return name, shape


def user_directory() -> Path:
    """Where ``kvcompress calibrate`` files calibrations: ``$KVCOMPRESS_CALIBRATIONS``, else the model cache's
    ``calibrations/``."""
    from kvcompress.models import cache_root

    return Path(os.environ.get("KVCOMPRESS_CALIBRATIONS") or cache_root() / "calibrations")


def file_name(name: str) -> str:
    return f"{name or 'unnamed'}.json"


def find(model) -> Calibration | None:
    """The calibration of ``model`` (same name and shape) in :func:`user_directory`, else the shipped ones; None if
    neither has one (a model built from a config has no name, so none)."""
    name, shape = model_identity(model)
    if not name:
        return None
    for directory in (user_directory(), SHIPPED):
        path = directory / file_name(name)
        if path.is_file():
            found = Calibration.load(path)
            if found.model == name and found.shape == shape:
                return found
    return None


def choose(drops: tuple[float | None, ...], threshold: float = THRESHOLD) -> tuple[int, ...]:
    """The layers whose needle log-prob drop is at least ``threshold`` nats, most affected first; if that would be
    every full-attention layer, none (the press needs layers left to give up rows)."""
    full = [i for i, d in enumerate(drops) if d is not None]
    chosen = sorted((i for i in full if drops[i] >= threshold), key=lambda i: -drops[i])
    return tuple(chosen) if len(chosen) < len(full) else ()


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


def choose_full(
    gains: dict, share: float = FULL_SHARE, most: int = FULL_MOST, cover: float = FULL_COVER
) -> dict[int, tuple[int, ...]]:
    """From :func:`full_layer_gains` per length (``{length: {"whole": .., "layers": [..]}}``), per length the layers
    kept whole there: the largest shares of the uncompressed cache's gain first, each at least ``share``, until they
    add up to ``cover`` or ``most`` are taken (none where that gain is not positive)."""
    chosen = {}
    for tokens, g in gains.items():
        gained = enumerate(g["layers"]) if g["whole"] > 0 else ()
        shares = {x: gain / g["whole"] for x, gain in gained if gain is not None}
        taken: list[int] = []
        for layer in sorted((x for x in shares if shares[x] >= share), key=lambda x: -shares[x])[:most]:
            if sum(shares[x] for x in taken) >= cover:
                break
            taken.append(layer)
        chosen[int(tokens)] = tuple(taken)
    return chosen


def layers_at(by_length: dict[int, tuple[int, ...]], tokens: int) -> tuple[int, ...]:
    """The layers of ``by_length`` (:attr:`Calibration.full_layers`) for an n-token context: those of the scanned
    length nearest ``tokens`` on a log scale (a tie: the longer), of key 0 (every length) alone, none for ``{}``."""
    if len(by_length) <= 1:
        return next(iter(by_length.values()), ())
    return by_length[min(by_length, key=lambda length: (abs(math.log(tokens / length)), -length))]


def full_layers_json(by_length: dict[int, tuple[int, ...]]) -> list[int] | dict[str, list[int]]:
    """``by_length`` as a calibration file holds it: a list where the same layers hold at every length (key 0, or
    none), else ``{"1024": [..], ..}``."""
    if set(by_length) <= {0}:
        return list(by_length.get(0, ()))
    return {str(tokens): list(layers) for tokens, layers in by_length.items()}


def describe_full(by_length: dict[int, tuple[int, ...]]) -> str:
    """``[7]`` (every length), ``[23, 7] near 1024 tokens, [7] near 2048`` (per length) or ``none``."""
    if set(by_length) <= {0}:
        return str(list(by_length.get(0, ()))) if by_length.get(0) else "none"
    parts = [f"{list(layers)} near {tokens}" for tokens, layers in sorted(by_length.items())]
    return parts[0] + " tokens" + "".join(", " + part for part in parts[1:])


def calibrate(model, tokenizer, kept: float = 0.25, length: int = 1024, contexts: int = 8, seed: int = 0,
              threshold: float = THRESHOLD, progress=None, full_lengths: tuple[int, ...] = (), full_task: str = "qa",
              full_kept: float = 0.5, full_share: float = FULL_SHARE, full_most: int = FULL_MOST,
              full_cover: float = FULL_COVER) -> Calibration:  # fmt: skip
    """Scan ``model`` (:func:`layer_drops`) and :func:`choose` its retrieval layers; with ``full_lengths``, then scan
    the press with those layers at each length (:func:`full_layer_gains`, ``full_kept`` kept) and
    :func:`choose_full` the layers kept whole."""
    from kvcompress.presses import CompressKVPress

    drops = layer_drops(model, tokenizer, kept, length, contexts, seed, progress)
    name, shape = model_identity(model)
    settings = {"task": "niah_single", "length": length, "contexts": contexts, "kept": kept,
                "seed": seed, "threshold": threshold}  # fmt: skip
    retrieval = choose(drops, threshold)
    gains, full_settings = {}, {}
    if full_lengths:
        press = CompressKVPress(compression_ratio=1 - full_kept, seed=seed, retrieval_layers=retrieval, full_layers=())
        for tokens in full_lengths:
            gains[str(tokens)] = full_layer_gains(model, tokenizer, press, full_task, tokens, contexts, seed, progress)
        full_settings = {"task": full_task, "lengths": list(full_lengths), "contexts": contexts, "kept": full_kept,
                         "seed": seed, "share": full_share, "most": full_most, "cover": full_cover}  # fmt: skip
    full = choose_full(gains, full_share, full_most, full_cover)
    return Calibration(name, shape, retrieval, drops, settings, full, gains, full_settings)


def main(argv: list[str]) -> int:
    """``kvcompress calibrate``: scan a model, print each layer's drop, file the calibration; exit 2 on bad flags."""
    import argparse
    import sys

    from kvcompress.ruler.tasks import TASKS

    p = argparse.ArgumentParser(
        prog="kvcompress calibrate",
        description="Find the layers of a model that read facts back (CompressKVPress(retrieval_layers='auto') "
                    "gives them more rows) and file them for that model.")  # fmt: skip
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
    p.add_argument("--full-task", default="qa", choices=sorted(TASKS),
                   help="RULER-style task of that scan (default qa: facts asked about a document)")
    p.add_argument("--full-ratio", type=float, default=0.5, help="KEPT fraction of that scan (default 0.5)")
    p.add_argument("--full-share", type=float, default=FULL_SHARE,
                   help="a layer kept whole recovers at least this share of the uncompressed cache's answer log-prob "
                        f"gain at its length (default {FULL_SHARE})")  # fmt: skip
    p.add_argument("--full-cover", type=float, default=FULL_COVER,
                   help="at each length, layers are kept whole until together they recover this share of that gain "
                        f"(default {FULL_COVER})")  # fmt: skip
    p.add_argument("--full-most", type=int, default=FULL_MOST,
                   help=f"at most this many layers kept whole at a length (default {FULL_MOST})")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="default auto: cuda if torch sees a GPU")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="model weights and cache (default auto: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
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

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    try:
        model, tokenizer = load_model(args.model, dtype=getattr(torch, dtype), device=device)
    except (OSError, ValueError, ImportError) as err:
        print(f"kvcompress calibrate: error: --model: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    try:
        found = calibrate(model, tokenizer, args.ratio, args.length, args.contexts, args.seed, args.threshold,
                          progress=lambda i, n: print(f"context {i}/{n}", file=sys.stderr, flush=True),
                          full_lengths=tuple(args.full_lengths), full_task=args.full_task, full_kept=args.full_ratio,
                          full_share=args.full_share, full_most=args.full_most, full_cover=args.full_cover)  # fmt: skip
    except ValueError as err:  # a length too short for the task
        print(f"kvcompress calibrate: error: {err}", file=sys.stderr)
        return 2
    print("layer  needle log-prob lost (nats) with the priors off there")
    for layer, drop in enumerate(found.drops):
        mark = "  <- retrieval layer" if layer in found.retrieval_layers else ""
        print(f"{layer:5d}  {'sliding window' if drop is None else f'{drop:.3f}'}{mark}")
    for tokens, gains in found.full_gains.items():
        print(f"\n{tokens} tokens, {found.full_settings['task']}: the uncompressed cache gains {gains['whole']:+.3f} "
              "nats per answer; each layer kept whole:")  # fmt: skip
        for layer, gain in enumerate(gains["layers"]):
            mark = "  <- kept whole" if layer in found.full_layers.get(int(tokens), ()) else ""
            print(f"{layer:5d}  {'sliding window' if gain is None else f'{gain:+.3f}'}{mark}")
    path = found.save(args.output or user_directory() / file_name(found.model))
    kept_whole = f", layers kept whole {describe_full(found.full_layers)}" if found.full_settings else ""
    print(f"retrieval layers {list(found.retrieval_layers)}{kept_whole} filed in {path}")
    return 0
