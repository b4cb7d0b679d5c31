"""Run settings of the harnesses: dataclass defaults < YAML file < command-line flags (the one YAML loader)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

# The directory holding the ``kvcompress`` package: a source checkout's root (site-packages once installed).
CHECKOUT_ROOT = Path(__file__).resolve().parents[1]


def load_yaml(path: Path | None, default: Path, config_cls: type, flag: str = "--config") -> dict[str, Any]:
    """The YAML mapping at ``path`` (or ``default``, which may be absent), keys checked against ``config_cls``.

    Hyphens in keys read as underscores; a relative path missing from the current directory is also looked
    up in the source checkout holding this package (``configs/...`` from anywhere inside a clone). Every problem
    (no such file, not YAML, not a mapping, unknown keys) is a one-line ``ValueError`` naming ``flag``.
    """
    explicit = path is not None
    path = path or default
    if not path.is_absolute() and not path.exists() and (CHECKOUT_ROOT / path).exists():
        path = CHECKOUT_ROOT / path
    if not path.exists():
        if explicit:
            raise ValueError(f"{flag}: {path} does not exist")
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{flag}: {path} is not a readable YAML file ({first})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag}: {path}: expected a mapping of settings, got {type(data).__name__}")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = set(data) - {f.name for f in fields(config_cls)}
    if unknown:
        raise ValueError(f"{flag}: {path}: unknown keys {sorted(unknown)}")
    return data
