"""What differs between the transformers versions kvcompress supports (4.57 and 5.0-5.2), in one place.

Cache layers: 4.57's have no ``is_initialized`` before their first update in every class (4.56 none at all), its
sliding layers no ``_sliding_window_tensor``, and ``StaticLayer.lazy_initialization`` takes the keys only (5.x: keys
and values). The test suite runs a subset under 4.57 (``scripts/test_compat.sh``).
"""

from __future__ import annotations

import inspect

import torch


def layer_initialized(layer: object) -> bool:
    """Whether a cache layer holds its tensors (``is_initialized`` where the version has it)."""
    flag = getattr(layer, "is_initialized", None)
    if flag is not None:
        return bool(flag)
    keys = getattr(layer, "keys", None)
    return isinstance(keys, torch.Tensor) and keys.numel() > 0


def lazy_initialize(layer: object, keys: torch.Tensor, values: torch.Tensor) -> None:
    """``layer.lazy_initialization`` with the keys and values (5.x) or the keys alone (4.57)."""
    if len(inspect.signature(layer.lazy_initialization).parameters) >= 2:
        layer.lazy_initialization(keys, values)
    else:
        layer.lazy_initialization(keys)
