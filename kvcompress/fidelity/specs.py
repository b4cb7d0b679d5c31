"""Press specs: ``NAME`` or ``NAME[field=value,...]`` -> a press object at a kept fraction.

Values are parsed with ``yaml.safe_load`` (``window_size=128``, ``weighted=true``); the spec string is the
press's label in every output. Fields replace the named press's dataclass fields (the kept fraction and
the seed are the study's); the press validates their values. kvpress baselines run at their published
defaults unless a field says otherwise.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvcompress.registry import METHODS
from kvcompress.registry import make_press as registry_press

NAMES = tuple(METHODS)  # every name of kvcompress.registry
RESERVED = ("compression_ratio", "seed")  # set by the study: 1 - kept, and the context's seed
_SPEC = re.compile(r"\s*([A-Za-z_]\w*)\s*(?:\[(.*)\])?\s*", re.DOTALL)


@dataclass(frozen=True)
class PressSpec:
    """A parsed spec: ``label`` (the spec string), press ``name`` and field overrides."""

    label: str
    name: str
    fields: dict[str, Any] = field(default_factory=dict)


def _error(spec: str, message: str) -> ValueError:
    return ValueError(" ".join(f"presses: spec {spec!r}: {message}".split()))


def parse_spec(spec: str) -> PressSpec:
    """Parse ``NAME`` or ``NAME[field=value,...]``; ValueError (one line) on a bad spec or unknown name."""
    if not isinstance(spec, str):
        raise _error(str(spec), f"expected a string NAME or NAME[field=value,...] with NAME one of {', '.join(NAMES)}")
    match = _SPEC.fullmatch(spec)
    if match is None:
        raise _error(spec, f"write NAME or NAME[field=value,...] with NAME one of {', '.join(NAMES)}")
    name, body = match.groups()
    if name not in NAMES:
        raise _error(spec, f"unknown press {name!r}; accepted names: {', '.join(NAMES)}")
    fields: dict[str, Any] = {}
    for item in re.split(r",(?![^\[]*\])", body or ""):  # commas inside a [list] value belong to it
        if not item.strip():
            continue
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key.isidentifier():
            raise _error(spec, f"bad field {item.strip()!r}; write field=value")
        if key in fields:
            raise _error(spec, f"field {key!r} given twice")
        fields[key] = yaml.safe_load(value)
    if fields and name == "exact":
        raise _error(spec, "exact takes no fields")
    return PressSpec(spec.strip(), name, fields)


def settable_fields(press) -> list[str]:
    """Dataclass fields of ``press`` a spec may set: public, with a default, not reserved."""
    return sorted(
        f.name
        for f in dataclasses.fields(press)
        if f.init
        and not f.name.startswith("_")
        and f.name not in RESERVED
        and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
    )


def make_press(spec: PressSpec, kept: float, seed: int = 0):
    """The press of ``spec`` keeping ``kept`` of the context cache (``compression_ratio = 1 - kept``); None: exact.

    ``seed`` seeds our randomised presses (compresskv*, uniform). ValueError (one line) on an unknown field
    or a value the press rejects.
    """
    if spec.name == "exact":
        return None
    if isinstance(kept, bool) or not isinstance(kept, (int, float)) or not 0 < kept <= 1:
        raise ValueError(f"kept: fractions of the cache kept must be in (0, 1], got {kept!r}")
    try:
        press = registry_press(spec.name, 1.0 - kept, seed)
        if spec.fields:
            allowed = settable_fields(press)
            unknown = sorted(set(spec.fields) - set(allowed))
            if unknown:
                raise _error(
                    spec.label,
                    f"unknown field(s) {', '.join(unknown)} of {type(press).__name__}; "
                    f"accepted fields: {', '.join(allowed) or 'none'}",
                )
            press = dataclasses.replace(press, **spec.fields)
    except ValueError as exc:
        if str(exc).startswith("presses: spec"):
            raise
        raise _error(spec.label, str(exc)) from exc
    except (TypeError, AssertionError) as exc:
        raise _error(spec.label, f"{type(exc).__name__}: {exc}") from exc
    return press


def check_specs(specs: list[str], kept: list[float]) -> list[PressSpec]:
    """Parse every spec and build its press at every kept fraction (no model needed); ValueError on a bad one."""
    if not specs:
        raise ValueError(f"presses: give at least one press spec; accepted names: {', '.join(NAMES)}")
    if not kept:
        raise ValueError("kept: give at least one kept fraction in (0, 1]")
    parsed = [parse_spec(spec) for spec in specs]
    labels = [p.label for p in parsed]
    if len(set(labels)) != len(labels):
        raise ValueError(f"presses: each spec at most once, got {labels}")
    for spec in parsed:
        for fraction in kept:
            make_press(spec, fraction)
    return parsed
