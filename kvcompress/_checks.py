"""Argument checks shared by the public functions: each error names the parameter and its range."""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import tempfile
from pathlib import Path
from typing import Any

import torch


def check_float_tensor(name: str, x: object, min_dim: int = 0, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x):
        kind = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name}: must be a floating-point torch.Tensor, got {kind}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: must have {ndim} dims, got shape {tuple(x.shape)}")
    if x.dim() < min_dim:
        raise ValueError(f"{name}: must have at least {min_dim} dims, got shape {tuple(x.shape)}")
    return x


def _is_number(value: object) -> bool:
    """A real number that is not a bool: Python's or a numpy scalar (``numbers.Real``)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def plain_scalars(obj: Any) -> None:
    """Replace numpy scalars in a dataclass's fields by the Python numbers they hold (``np.float32(0.5)`` -> 0.5),
    so the checks, the arithmetic and the settings written as JSON see plain ints and floats."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, numbers.Number) and not isinstance(value, (bool, int, float)) and hasattr(value, "item"):
            setattr(obj, f.name, value.item())


def check_int_range(name: str, value: object, low: int, high: int | None = None) -> int:
    bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low or (
        high is not None and value > high
    ):  # fmt: skip
        raise ValueError(f"{name}: must be an int {bound}, got {value!r}")
    return int(value)


def check_layer_list(name: str, value: object) -> tuple[int, ...] | str:
    """``"auto"``, or distinct layer indices (a list or tuple of ints >= 0) as a tuple."""
    if value == "auto":
        return "auto"
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
        raise ValueError(f"{name}: must be a list of layer indices or 'auto', got {value!r}")
    layers = tuple(check_int_range(name, layer, 0) for layer in value)
    if len(set(layers)) != len(layers):
        raise ValueError(f"{name}: must be distinct layer indices, got {layers!r}")
    return layers


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is True or False (a truthy string such as "no" is not), else a one-line ValueError."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: must be True or False, got {value!r}")
    return value


def check_compression_ratio(value: object) -> float:
    """A press's ``compression_ratio``: the fraction of the context removed, in [0, 1)."""
    if not _is_number(value) or not 0 <= value < 1:  # NaN fails too
        raise ValueError(f"compression_ratio: must be a number in [0, 1) (the fraction removed), got {value!r}")
    return float(value)


def check_number(name: str, value: Any, low: float, high: float | None = None, low_open: bool = False) -> None:
    bad = not _is_number(value) or not math.isfinite(value)
    bad = bad or (value <= low if low_open else value < low) or (high is not None and value > high)
    if bad:
        bounds = (
            f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}{']' if high is not None else ')'}"
        )
        raise ValueError(f"{name}: must be a number in {bounds}, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_positive(name: str, value: object) -> float:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
    return float(value)


def check_finite(name: str, x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name}: contains NaN or Inf")


def as_finite_float64(name: str, x: float | torch.Tensor) -> torch.Tensor:
    """``x`` (a number or a real tensor) as a float64 tensor; a ValueError naming ``name`` if it is neither, or is
    not finite."""
    if isinstance(x, bool) or not isinstance(x, (int, float, torch.Tensor)):
        raise ValueError(f"{name}: must be a number or a real torch.Tensor, got {type(x).__name__}")
    if isinstance(x, torch.Tensor) and (x.is_complex() or x.dtype == torch.bool):
        raise ValueError(f"{name}: must be a real torch.Tensor, got {x.dtype}")
    t = torch.as_tensor(x, dtype=torch.float64)
    check_finite(name, t)
    return t


def check_fold_from(
    fold_from: object, batch: int, n: int, device: torch.device, v_min: object, v_max: object, read_indices: bool
) -> None:
    """Weighted attention's ``fold_from``: None, an int in ``[0, n]``, or a ``[batch]`` int64 tensor on ``device``
    (``read_indices``: each in ``[0, n)``, one host read), with both clip bounds given."""
    if isinstance(fold_from, torch.Tensor):
        if fold_from.dtype != torch.int64 or fold_from.shape != (batch,) or fold_from.device != device:
            raise ValueError(f"fold_from: a tensor must be int64 of shape ({batch},) on {device}, got "
                             f"{fold_from.dtype} {tuple(fold_from.shape)} on {fold_from.device}")  # fmt: skip
        if read_indices and bool(((fold_from < 0) | (fold_from >= n)).any()):  # the kernel would read out of bounds
            raise ValueError(f"fold_from: every index must be in [0, {n - 1}] (a row of the cache)")
    elif fold_from is not None:
        check_int_range("fold_from", fold_from, 0, n)
    if fold_from is not None and (v_min is None or v_max is None):
        raise ValueError("fold_from: needs both v_min and v_max (the running range it folds rows into)")


def int_flag(low: int, high: int | None = None):
    """An argparse ``type``: an int in ``[low, high]`` (argparse's one-line error names the flag)."""

    def parse(text: str) -> int:
        try:
            return check_int_range("value", int(text), low, high)
        except ValueError:
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be an int {bound}, got {text!r}") from None

    return parse


def number_flag(low: float, high: float = math.inf, *, low_open: bool = False):
    """An argparse ``type``: a finite number in ``[low, high]`` (``(low, high]`` with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value > high or (value <= low if low_open else value < low):
            bound = f"{'(' if low_open else '['}{low}, {high}{']' if math.isfinite(high) else ')'}"
            raise argparse.ArgumentTypeError(f"must be a finite number in {bound}, got {text!r}")
        return value

    return parse


BACKENDS = ("auto", "torch", "triton")


def check_backend(backend: object, choices: tuple[str, ...] = BACKENDS) -> str:
    if backend not in choices:
        raise ValueError(f"backend: must be one of {', '.join(map(repr, choices))}, got {backend!r}")
    return backend


def one_line(err: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (whitespace collapsed, cut at ``limit`` characters; its type if empty)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def model_path_problem(name: str | None) -> str | None:
    """Why ``--model`` ``name`` cannot be a local model (a path that does not exist, a folder without config.json),
    before transformers reads it as a Hub name and says something else; None when it may load."""
    if name is None:
        return None
    path = Path(name).expanduser()
    if path.exists():
        return None if (path / "config.json").exists() else f"{name} is not a model directory (no config.json)"
    return f"{name} does not exist" if name.startswith(("/", ".", "~")) else None


def existing_folder(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where making ``path``'s folders would start; a file there means
    they cannot be made)."""
    while not path.exists():
        path = path.parent
    return path


def unmakeable_folder(folder: Path) -> str | None:
    """Why no folder can be made in the existing folder ``folder`` (one made there and removed finds out: ``os.access``
    says yes to root even where nothing can be made, such as /proc), or None."""
    try:
        tempfile.TemporaryDirectory(dir=folder, prefix=".kvcompress-").cleanup()
    except OSError as err:
        return f"no folder can be made in {folder} ({err.strerror or type(err).__name__})"
    return None
