"""The run's settings: the Config dataclass, its checks, the presses it names, and what identifies a run."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvcompress import registry
from kvcompress._checks import model_path_problem, one_line  # noqa: F401 - one_line re-exported for the CLI
from kvcompress.longbench import offline_suite
from kvcompress.longbench.tasks import ALL_TASKS, DEFAULT_DATASET, LONGBENCH_TASKS

OFFLINE_CONFIG = Path(__file__).resolve().parent / "offline_default.yaml"  # the embedded run's settings
EMBEDDED_LABEL = "SmolLM2-135M-Instruct"
RESULTS_DIR = Path("results") / "longbench"  # default outputs: under the current directory
RULER_RESULTS_DIR = Path("results") / "ruler"
BENCHMARKS = ("longbench", "ruler")
RULER_EXAMPLES = 8  # contexts per RULER task without --limit

METHODS: dict[str, str] = {  # name -> row label (kvcompress.registry's presses this harness offers)
    name: registry.METHODS[name].label
    for name in (
        "exact",
        "compresskv",
        "compresskv_thorough",
        "compresskv_balanced",
        "compresskv_paper",
        "compresskv_window",
        "compresskv_kvzip",
        "snapkv",
        "streamingllm",
        "uniform",
        "pyramidkv",
        "expected_attention",
        "keydiff",
        "tova",
        "compactor",
        "knorm",
    )  # every press of the registry that shrinks the cache (kvpress's AdaKV and KVzip only mask it)
}
DEFAULT_METHODS = ["exact", "compresskv", "snapkv", "streamingllm", "uniform"]


class UsageError(Exception):
    """Bad input: reported as one ``error: ...`` line on stderr, exit status 2."""


class Interrupted(Exception):
    """Predictions stopped before every requested example was done (interrupt, failure of a process)."""


@dataclass
class Config:
    """Every setting of a run (YAML keys; flags with hyphens). None means the default described by ``--help``."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct on the offline suite
    benchmark: str = "longbench"  # or "ruler": the RULER-style synthetic tasks (kvcompress.ruler)
    length: int | None = None  # RULER context length in tokens (None: kvcompress.ruler.DEFAULT_LENGTH)
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    ratio: float = 0.25  # KEPT fraction of the context cache
    tasks: list[str] | None = None  # None: the offline suite without --model, else the 13 LongBench-E tasks
    dataset: str = DEFAULT_DATASET
    data_dir: str | None = None
    limit: int | None = None
    fraction: float | None = None
    seed: int = 0
    device: str = "auto"
    device_map: str | None = None
    dtype: str = "auto"
    attn_implementation: str = "auto"
    max_context_length: int | None = None
    max_new_tokens: int | None = None  # None: the protocol's MAX_NEW_TOKENS[task] + 20 (set only for smoke runs)
    threads: int | None = None
    output_dir: str | None = None
    score_only: bool = False
    press_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # method -> press field -> value



def validate(cfg: Config) -> Config:
    """Check every setting (from YAML or flags); UsageError on the first bad one."""

    def names(value, what: str) -> list[str]:
        if isinstance(value, str):
            value = value.replace(",", " ").split()
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise UsageError(f"{what}: expected a non-empty list of names, got {value!r}")
        return list(dict.fromkeys(value))

    if cfg.benchmark not in BENCHMARKS:
        raise UsageError(f"--benchmark: must be one of {', '.join(BENCHMARKS)}, got {cfg.benchmark!r}")
    ruler = cfg.benchmark == "ruler"
    if cfg.length is not None and not ruler:
        raise UsageError("--length: only with --benchmark ruler (LongBench truncates with --max-context-length)")
    if ruler and cfg.data_dir is not None:
        raise UsageError("--data-dir: not with --benchmark ruler (its contexts are generated from --length and --seed)")
    if ruler and cfg.dataset != DEFAULT_DATASET:
        raise UsageError("--dataset: not with --benchmark ruler (its contexts are generated from --length and --seed)")
    cfg.methods = names(cfg.methods, "--methods")
    unknown = [m for m in cfg.methods if m not in METHODS]
    if unknown:
        raise UsageError(f"--methods: unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    if cfg.tasks is not None:
        cfg.tasks = names(cfg.tasks, "--tasks")
        known = tuple(ruler_tasks()) if ruler else ALL_TASKS
        unknown = [t for t in cfg.tasks if (t if ruler else t.removesuffix("_e")) not in known]
        if unknown:
            raise UsageError(f"--tasks: unknown task {unknown[0]!r}; choose from {', '.join(known)}")
        cfg.tasks = list(dict.fromkeys(t if ruler else t.removesuffix("_e") for t in cfg.tasks))
    ratio = cfg.ratio
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise UsageError(f"--ratio: the kept fraction must be in (0, 1], got {ratio!r}")
    cfg.ratio = float(ratio)
    for name in ("limit", "max_context_length", "max_new_tokens", "threads", "length"):
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(f"--{name.replace('_', '-')}: must be an integer >= 1, got {value!r}")
    if cfg.fraction is not None and (
        isinstance(cfg.fraction, bool) or not isinstance(cfg.fraction, (int, float)) or not 0 < cfg.fraction <= 1
    ):
        raise UsageError(f"--fraction: must be in (0, 1], got {cfg.fraction!r}")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int):
        raise UsageError(f"--seed: must be an integer, got {cfg.seed!r}")
    for name, allowed in (
        ("device", ("auto", "cpu", "cuda")),
        ("dtype", ("auto", "float32", "bfloat16", "float16")),
        ("attn_implementation", ("auto", "sdpa", "eager", "flash_attention_2")),
    ):
        value = getattr(cfg, name)
        if value not in allowed:
            raise UsageError(f"--{name.replace('_', '-')}: must be one of {', '.join(allowed)}, got {value!r}")
    if cfg.device_map not in (None, "auto"):
        raise UsageError(f"--device-map: only 'auto' is supported, got {cfg.device_map!r}")
    if cfg.device_map == "auto" and cfg.device == "cpu":
        raise UsageError("--device-map: auto spreads the model over the GPUs, which --device cpu excludes; drop one")
    if cfg.data_dir is not None and not Path(cfg.data_dir).is_dir():
        raise UsageError(f"--data-dir: {cfg.data_dir} is not a directory")
    check_press_options(cfg)
    if cfg.model is not None and not isinstance(cfg.model, str):
        raise UsageError(f"--model: expected a name or path, got {cfg.model!r}")
    problem = model_path_problem(cfg.model)
    if problem:
        raise UsageError(f"--model: {problem}")
    return cfg


def check_press_options(cfg: Config) -> None:
    """Every press option names a method that runs, with a press, and one of that press's fields, with a valid
    value."""
    for method, options in sorted(cfg.press_options.items()):
        if method not in METHODS or method == "exact":
            pressed = [m for m in METHODS if m != "exact"]
            raise UsageError(f"--press-option: {method!r} has no press; choose from {', '.join(pressed)}")
        if method not in cfg.methods:  # it would change nothing run, yet name the run (its settings, --output-dir)
            raise UsageError(f"--press-option: {method} is not among --methods ({', '.join(cfg.methods)})")
        if not options:
            continue
        press = make_press(method, cfg.ratio, cfg.seed)
        settable = [f.name for f in fields(press) if f.init and not f.name.startswith("_")
                    and f.name not in FIXED_PRESS_FIELDS]  # fmt: skip
        for name in options:
            if name not in settable:
                raise UsageError(f"--press-option: {method} has no setting {name!r}; choose from {', '.join(settable)}")
        try:  # the registry checks every value (kvpress's presses by its table of their fields' ranges)
            make_press(method, cfg.ratio, cfg.seed, options)
        except (TypeError, ValueError, AssertionError) as err:
            raise UsageError(f"--press-option: {method}: {one_line(err)}") from None


FIXED_PRESS_FIELDS = ("compression_ratio", "press")  # set by --ratio; kvpress's wrapped inner press


def make_press(method: str, ratio: float, seed: int, options: dict[str, Any] | None = None):
    """The press of ``method`` keeping ``ratio`` of the cache (None for exact); ``options`` override its fields."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}")
    options = dict(options or {})
    return registry.make_press(method, 1.0 - ratio, options.pop("seed", seed), **options)  # a seed option wins


def ruler_tasks() -> dict:
    """The RULER-style tasks (imported on use: the LongBench path does not need them)."""
    from kvcompress.ruler import TASKS

    return TASKS


def ruler_length(cfg: Config) -> int:
    """The RULER context length of the run, in tokens."""
    from kvcompress.ruler import DEFAULT_LENGTH

    return cfg.length or DEFAULT_LENGTH


def model_label(cfg: Config) -> str:
    """The model's short name (its directory or Hub name without the organisation)."""
    return EMBEDDED_LABEL if cfg.model is None else Path(cfg.model.rstrip("/")).name


def output_dir(cfg: Config) -> Path:
    """``--output-dir``, else ``results/longbench/<model>_<ratio>[_<press options>]`` under the current directory."""
    if cfg.output_dir:
        return Path(cfg.output_dir)
    changed = changed_press_options(cfg)
    suffix = "".join(f"_{m}.{k}={v}" for m, o in changed.items() for k, v in sorted(o.items()))
    if cfg.benchmark == "ruler":
        return RULER_RESULTS_DIR / f"{model_label(cfg)}_{ruler_length(cfg)}_{cfg.ratio:g}{suffix}"
    return RESULTS_DIR / f"{model_label(cfg)}_{cfg.ratio:g}{suffix}"


def task_list(cfg: Config) -> list[str]:
    """``--tasks``, else the offline suite without ``--model``, else the 13 LongBench-E tasks."""
    if cfg.tasks is not None:
        return cfg.tasks
    if cfg.benchmark == "ruler":
        return list(ruler_tasks())
    return list(offline_suite.TASKS) if cfg.model is None else list(LONGBENCH_TASKS)


def data_source(cfg: Config) -> str:
    """Where the examples come from: the RULER generator, --data-dir, the offline suite or --dataset."""
    if cfg.benchmark == "ruler":
        return f"ruler:length={ruler_length(cfg)}"
    if cfg.data_dir:
        return f"data_dir={Path(cfg.data_dir).resolve()}"
    if all(t in offline_suite.TASKS for t in task_list(cfg)):
        return "offline_suite"
    return f"dataset={cfg.dataset}"


def changed_press_options(cfg: Config) -> dict[str, dict[str, Any]]:
    """The press fields set away from their defaults, by method (methods without changes left out)."""
    return {m: cfg.press_options[m] for m in sorted(cfg.press_options) if cfg.press_options[m]}


def prediction_settings(cfg: Config) -> dict[str, Any]:
    """What changes a prediction: a resumed run must agree on all of it. The device and dtype as they resolve on
    this machine (``auto``: CUDA where torch sees it; a float32 model on CPU, the checkpoint's dtype on CUDA)."""
    import torch

    device = "cuda" if cfg.device != "cpu" and (cfg.device_map or torch.cuda.is_available()) else "cpu"
    dtype = cfg.dtype if cfg.dtype != "auto" else ("checkpoint" if device == "cuda" else "float32")
    return {
        "model": cfg.model or EMBEDDED_LABEL,
        "ratio": cfg.ratio,
        "device": device,
        "dtype": dtype,
        "attn_implementation": cfg.attn_implementation,
        "seed": cfg.seed,
        "data": data_source(cfg),
        "max_context_length": cfg.max_context_length,
        "max_new_tokens": cfg.max_new_tokens,
        "press_options": changed_press_options(cfg),
    }

