"""The one method registry: a name -> its table label and its press at published defaults.

Every harness (LongBench, the fidelity study, speed) builds presses here, so a name means the same press
everywhere. ``exact`` is the full cache (no press). kvpress's presses are built lazily: importing this
module does not import kvpress.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from kvcompress._checks import check_bool, check_compression_ratio, check_int_range, check_number, one_line


@dataclass(frozen=True)
class Method:
    label: str  # the row label of result tables
    build: Callable[[float, int], Any]  # (compression_ratio, seed) -> press; None for the full cache


# CompressKVPress's named settings (classmethods), registered as compresskv_<name>
PRESETS = ("paper", "kvzip", "thorough", "balanced")


def _ours(name: str) -> Callable[[float, int], Any]:
    def build(ratio: float, seed: int):
        from kvcompress import CompressKVPress, UniformPress

        preset = name.removeprefix("compresskv_")
        if preset in PRESETS:
            return getattr(CompressKVPress, preset)(compression_ratio=ratio, seed=seed)
        if name == "compresskv_window":
            return CompressKVPress(compression_ratio=ratio, seed=seed, reference=("window",))
        cls = CompressKVPress if name == "compresskv" else UniformPress
        return cls(compression_ratio=ratio, seed=seed)

    return build


def _kvpress(cls_name: str, **defaults: Any) -> Callable[[float, int], Any]:
    def build(ratio: float, seed: int):
        import kvpress

        return getattr(kvpress, cls_name)(compression_ratio=ratio, **defaults)

    return build


@functools.cache
def _checked_pyramidkv() -> type:
    """kvpress's ``PyramidKVPress``, refusing a prefill whose layers it would leave of different lengths, before that
    prefill writes anything: transformers (5.2) builds one attention mask for all of a cache's layers, so the next
    forward, the question's, failed deep inside sdpa ("The size of tensor a (287) must match the size of tensor b
    (295)"). The budgets are kvpress's own (``get_layer_budget`` for every layer index), read in a pre-hook of the
    first attention layer. Where they meet their floor (e.g. 25% kept of 1k-token contexts), every layer keeps one
    length: it runs."""
    import kvpress
    from kvpress.presses.base_press import is_prefilling

    @dataclass
    class PyramidKVPress(kvpress.PyramidKVPress):
        def refuse_ragged_layers(self, module, args, kwargs):
            q_len = kwargs["hidden_states"].shape[1]
            if self.compression_ratio == 0 or not is_prefilling(kwargs["cache_position"], q_len):
                return
            layers = range(module.config.num_hidden_layers)
            kept = {self.get_layer_budget(SimpleNamespace(config=module.config, layer_idx=i), q_len) for i in layers}
            if len(kept) > 1:
                raise ValueError(
                    f"pyramidkv: kvpress's PyramidKVPress would keep {min(kept)} to {max(kept)} rows per layer of a "
                    f"{q_len}-token context at compression_ratio={self.compression_ratio}, and transformers' "
                    "attention takes one mask length for every layer, so the next forward would fail inside sdpa; "
                    "choose another method or a ratio at which its layers keep one length (the cache is untouched)"
                )

        @contextmanager
        def __call__(self, model):
            language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
            first = language_model.layers[0].self_attn
            check = first.register_forward_pre_hook(self.refuse_ragged_layers, with_kwargs=True)
            try:
                with super().__call__(model):
                    yield
            finally:
                check.remove()

    return PyramidKVPress


def _pyramidkv(ratio: float, seed: int):
    return _checked_pyramidkv()(compression_ratio=ratio, window_size=64, kernel_size=5, beta=20)


def _adakv(ratio: float, seed: int):
    import kvpress

    return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5))


METHODS: dict[str, Method] = {
    "exact": Method("Exact", lambda ratio, seed: None),
    "compresskv": Method("CompressKV", _ours("compresskv")),
    "compresskv_paper": Method("CompressKV (paper)", _ours("compresskv_paper")),
    "compresskv_thorough": Method("CompressKV (thorough)", _ours("compresskv_thorough")),
    "compresskv_balanced": Method("CompressKV (balanced)", _ours("compresskv_balanced")),
    "compresskv_window": Method("CompressKV (window only)", _ours("compresskv_window")),
    "compresskv_kvzip": Method("KVzip", _ours("compresskv_kvzip")),  # KVzip's max scoring in CompressKVPress
    "uniform": Method("Uniform", _ours("uniform")),
    "snapkv": Method("SnapKV", _kvpress("SnapKVPress", window_size=64, kernel_size=5)),
    "streamingllm": Method("StreamingLLM", _kvpress("StreamingLLMPress", n_sink=4)),
    "expected_attention": Method("ExpectedAttention", _kvpress("ExpectedAttentionPress")),
    "keydiff": Method("KeyDiff", _kvpress("KeyDiffPress")),
    "tova": Method("TOVA", _kvpress("TOVAPress")),
    "pyramidkv": Method("PyramidKV", _pyramidkv),
    "compactor": Method("Compactor", _kvpress("CompactorPress")),
    "knorm": Method("Knorm", _kvpress("KnormPress")),
    "adakv": Method("AdaKV", _adakv),
    "kvzip": Method("KVzip (kvpress, masks only)", _kvpress("KVzipPress")),
}


def make_press(name: str, compression_ratio: float, seed: int = 0, **options: Any):
    """The press ``name`` removing ``compression_ratio`` of the context (None for ``exact``); ``options`` replace
    single fields of its dataclass (ours check them, kvpress's are checked by :func:`check_kvpress_option`; a
    ValueError naming the field). ``seed`` seeds our randomised presses."""
    if name not in METHODS:
        raise ValueError(f"method: unknown method {name!r}; choose from {', '.join(METHODS)}")
    compression_ratio = check_compression_ratio(compression_ratio)  # kvpress's presses only assert it
    press = METHODS[name].build(compression_ratio, seed)
    if press is None:
        if options:
            raise ValueError(f"method: {name} has no press and takes no options, got {sorted(options)}")
        return None
    if not options:
        return press
    fields = {f.name for f in dataclasses.fields(press) if f.init and not f.name.startswith("_")}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"{unknown[0]}: {name} has no option {unknown[0]!r}; its options: {', '.join(sorted(fields))}")
    from kvcompress.weighted_press import WeightedSubsetPress

    if not isinstance(press, WeightedSubsetPress):  # ours check every field they take; kvpress's check few
        options = {field: check_kvpress_option(field, value, getattr(press, field)) for field, value in options.items()}
    try:
        return dataclasses.replace(press, **options)
    except AssertionError as err:  # kvpress's own checks (AdaKV's inner press, ...): a bare assert
        given = ", ".join(f"{field}={value!r}" for field, value in options.items())
        raise ValueError(f"{name}: kvpress refused the options {given}: {one_line(err)}") from None


# The fields of kvpress's presses (and of PyramidKV's subclass above) that make_press checks, kvpress asserting few of
# them and most not at all (window_size=0 or an even kernel_size failed inside the prefill with a shape error,
# n_sink=-1 ran): field -> (low, high), an int where the default is one. Any other field is checked against its
# default's kind: True or False for a bool, an int >= 0 for an int, a finite number >= 0 for a float.
KVPRESS_RANGES: dict[str, tuple[float, float | None]] = {
    "window_size": (1, None),  # SnapKV's, PyramidKV's observation window
    "kernel_size": (1, None),  # their score pooling, odd
    "n_sink": (0, None),  # StreamingLLM's, ExpectedAttention's, KVzip's sink tokens
    "n_future_positions": (1, None),  # ExpectedAttention
    "sink_size_start": (0, None),  # Compactor's protected tokens at either end
    "sink_size_end": (0, None),
    "chunk_size": (1, None),  # Compactor's, KVzip's chunks
    "sketch_dimension": (1, None),  # Compactor
    "beta": (1, None),  # PyramidKV's pyramid
    "alpha_safeguard": (0, 1),  # AdaKV's share of the budget spread evenly over the heads
    "epsilon": (0, None),  # ExpectedAttention
    "blending": (0, None),  # Compactor's weight of the leverage scores (None: the compression ratio)
}


def check_kvpress_option(field: str, value: Any, default: Any) -> Any:
    """``value`` for the field ``field`` of a kvpress press whose default is ``default`` (a plain int or float where
    it is a number); a ValueError naming the field and its range (:data:`KVPRESS_RANGES`)."""
    if isinstance(default, bool):
        return check_bool(field, value)
    if field in KVPRESS_RANGES and default is None:  # an optional number (Compactor's blending)
        if value is None:
            return None
    elif not isinstance(default, (int, float)):
        return value  # a field of another kind (AdaKV's wrapped press): kvpress's own checks
    low, high = KVPRESS_RANGES.get(field, (0, None))
    if isinstance(default, int):
        value = check_int_range(field, value, int(low), None if high is None else int(high))
        if field == "kernel_size" and value % 2 == 0:  # an even pooling window is one score longer than the keys
            raise ValueError(f"{field}: must be an odd int >= 1, got {value!r}")
        return value
    check_number(field, value, low, high)
    return float(value)


def press_settings(press, model=None) -> dict[str, Any]:
    """What a press computes with, as JSON (``{}`` for no press): its dataclass fields (``repr`` of a value JSON cannot
    hold, such as a wrapped press), and for one whose retrieval layers come from the model's calibration
    (``retrieval_layers="auto"``) the layers it finds for ``model`` (``active_retrieval_layers``). Two runs whose
    settings differ ran different presses, even under one method name (a default changed between versions)."""
    if press is None:
        return {}

    def plain(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (tuple, list)):
            return [plain(item) for item in value]
        return repr(value)

    settings = {f.name: plain(getattr(press, f.name)) for f in dataclasses.fields(press) if f.init}
    if settings.get("full_layers") != "auto":
        settings.pop("full_layers_by_length", None)  # it only reads the calibration's choice
    auto = [name for name in ("retrieval_layers", "full_layers") if getattr(press, name, None) == "auto"]
    if auto and model is not None:
        from kvcompress.window import layer_windows

        press.check_model(model, layer_windows(model))
        from kvcompress.calibration import full_layers_json

        for name in auto:
            active = getattr(press, f"active_{name}")
            settings[f"active_{name}"] = full_layers_json(active) if name == "full_layers" else list(active)
    return settings


# Press fields added after runs recorded their settings, with the value that computes what those runs did: a run
# recorded without the field is the same press where the field holds that value.
ADDED_FIELDS: dict[str, Any] = {"full_layers": [], "full_layers_by_length": False}


def press_change(before: dict[str, Any] | None, now: dict[str, Any], layers_before: list[int]) -> str:
    """How the :func:`press_settings` ``now`` differ from those earlier results were made with, for an error line
    (``""`` if they do not): ``before``, their first differing fields; where the settings were not recorded (None),
    only the retrieval layers then, ``layers_before`` (none before calibrations); a field added since
    (``ADDED_FIELDS``) is unchanged where it holds the value that computes what the earlier press did."""
    if before is None:
        layers = now.get("active_retrieval_layers")
        return f"retrieval layers {layers_before} there, {layers} now" if layers not in (None, layers_before) else ""
    before = {**{key: value for key, value in ADDED_FIELDS.items() if key in now}, **before}
    keys = [key for key in sorted(set(before) | set(now)) if before.get(key, "-") != now.get(key, "-")]
    return "; ".join(f"{key}: {before.get(key, '-')!r} there, {now.get(key, '-')!r} now" for key in keys[:3])


def parse_press_option(item: str, method: str | None = None) -> tuple[str, str, Any]:
    """``"compresskv.window_size=128"`` -> ``("compresskv", "window_size", 128)`` (the value read as YAML);
    with ``method`` given, ``"window_size=128"`` names a field of that method. ValueError naming ``--press-option``."""
    import yaml

    target, sep, value = item.partition("=")
    name_method, dot, name = target.rpartition(".")
    if not dot and method is not None:
        name_method = method
    if not (sep and name_method and name):
        raise ValueError(f"--press-option: expected METHOD.FIELD=VALUE, got {item!r}")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"--press-option: {item!r}: the value {value!r} is not valid YAML ({problem})") from None
    return name_method.strip(), name.strip(), parsed
