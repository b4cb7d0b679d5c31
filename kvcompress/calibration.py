"""Which layers of a model read facts back, and which it needs whole: the calibration behind
``CompressKVPress(retrieval_layers="auto", full_layers="auto")``.

In most layers the default press's query-free priors (novelty, induction) can be switched off without losing a fact
asked after the context; in a model's retrieval layers (the retrieval heads of Wu et al., "Retrieval Head
Mechanistically Explains Long-Context Factuality", arXiv 2404.15574) they cannot. On SmolLM2-135M-Instruct,
layer 18 alone: without the priors there, no needle is found (docs/BENCHMARKS.md, "The worst continuation
context"). Those layers must hold both the facts and the text a continuation copies, so the press gives them more
rows (``retrieval_rows``), shared between the priors and the window's attention (``retrieval_prior_share``).
A few other layers the answers need uncompressed, and which ones depends on the context's length: per scanned length,
:func:`choose_full` keeps the fewest layers that together recover ``full_cover`` of the uncompressed cache's answer
gain, and a context takes the choice of the scanned length nearest its own (:func:`layers_at`).

The scans that measure both (``kvcompress calibrate``) are in :mod:`kvcompress.calibration_scan`; this module holds
what the press reads. A calibration is a JSON file (:class:`Calibration`); ``kvcompress calibrate`` writes one into
:func:`user_directory`, and the press's ``"auto"`` looks a model up there, then among the calibrations shipped in
``kvcompress/calibrations/``, by the model's name and shape (:func:`model_identity`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
        both = sorted({x for layers in self.full_layers.values() for x in layers} & set(self.retrieval_layers))
        if both:  # what from_json refuses: never file a calibration that cannot be read back
            raise ValueError(f"full_layers: layers {both} are retrieval_layers too (a layer is widened or kept whole)")

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
            if not isinstance(shape, dict) or not all(isinstance(v, int) for v in shape.values()):
                raise ValueError(f"shape must map names to integers, got {shape!r}")
            if not isinstance(drops, list) or not all(d is None or isinstance(d, (int, float)) for d in drops):
                raise ValueError(f"drops must be a list of numbers (null for a sliding-window layer), got {drops!r}")
            full = {tokens: tuple(value) for tokens, value in by_length.items()}
            # the constructor refuses a layer both widened and kept whole
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


def choose_full(
    gains: dict, share: float = FULL_SHARE, most: int = FULL_MOST, cover: float = FULL_COVER,
    retrieval: tuple[int, ...] = (),
) -> dict[int, tuple[int, ...]]:
    """From :func:`kvcompress.calibration_scan.full_layer_gains` per length (``{length: {"whole": .., "layers":
    [..]}}``), per length the layers kept whole there: the largest shares of the uncompressed cache's gain first, each
    at least ``share``, until they add up to ``cover`` or ``most`` are taken (none where that gain is not positive).
    The ``retrieval`` layers are never chosen: the press widens them instead, and a layer cannot be both."""
    chosen = {}
    for tokens, g in gains.items():
        gained = enumerate(g["layers"]) if g["whole"] > 0 else ()
        shares = {x: gain / g["whole"] for x, gain in gained if gain is not None and x not in retrieval}
        taken: list[int] = []
        for layer in sorted((x for x in shares if shares[x] >= share), key=lambda x: -shares[x])[:most]:
            if sum(shares[x] for x in taken) >= cover:
                break
            taken.append(layer)
        chosen[int(tokens)] = tuple(taken)
    return chosen


def pool_tasks(by_task: dict[str, dict]) -> dict:
    """One task's :func:`kvcompress.calibration_scan.full_layer_gains` at a length as they are; several tasks' as
    ``{"whole": 1.0, "layers": [..], "tasks": by_task}``: each layer's share of its task's uncompressed-cache gain,
    averaged over the tasks where that gain is positive (each task weighs alike, as in the RULER-style average; a task
    the press loses nothing on has no share to give), ``"whole"`` 0.0 where no task has one."""
    if len(by_task) == 1:
        return next(iter(by_task.values()))
    losing = [g for g in by_task.values() if g["whole"] > 0]
    layers = next(iter(by_task.values()))["layers"]
    shares = [
        None if layer is None else (round(sum(g["layers"][x] / g["whole"] for g in losing) / len(losing), 4)
                                    if losing else 0.0)  # fmt: skip
        for x, layer in enumerate(layers)
    ]
    return {"whole": 1.0 if losing else 0.0, "layers": shares, "tasks": by_task}


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
