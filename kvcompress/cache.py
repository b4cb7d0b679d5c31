"""Compressed cache layers: the weighted-coreset state lives with the cache, never with the model.

After compression, layer ``i`` of a ``DynamicCache`` holds the ``r`` rows of the compressed context
(protected tokens and coreset) followed by the rows of every later token. :class:`WeightedLayer` keeps,
for the compressed context only, the row weights ``w [b, h_kv, r]`` (float32; 1 on protected rows) and
the value range ``[v_min, v_max]`` of the whole original context ``[b, h_kv, d]``; later rows have
weight 1 and widen the range as they arrive (docs/ARCHITECTURE.md, "Contracts").
Because every later row is implicit, trimming the cache by slicing its keys/values (what the kvpress
pipeline does between questions) keeps the state consistent.

The attention function finds the state through the key tensor it receives: ``update`` tags the
returned keys with their layer. A cache that was never compressed carries no tag and runs stock sdpa.

Lengths: a compressed cache represents more tokens than it holds rows. ``cache.get_seq_length()``
(no layer index: what ``model.forward`` and ``generate`` use to continue positions) and ``cache.crop``
count tokens; ``cache.get_seq_length(layer_idx)`` counts the rows that layer holds (what kvpress's
pipeline slices to).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

_TAG = "_kvcompress_layer"


class WeightedLayer(DynamicLayer):
    """A DynamicLayer whose first ``row_weights.shape[-1]`` rows are a compressed, weighted context."""

    is_sliding = False

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        row_weights: torch.Tensor,
        value_min: torch.Tensor,
        value_max: torch.Tensor,
        tokens: int,
    ):
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.keys, self.values = keys, values
        self.is_initialized = True
        self.row_weights = row_weights.float()  # [b, h_kv, r]
        self.value_min, self.value_max = value_min, value_max  # [b, h_kv, d_v]
        self.position_offset = tokens - keys.shape[-2]  # tokens represented minus rows held

    @property
    def context_rows(self) -> int:
        return self.row_weights.shape[-1]

    def update(self, key_states, value_states, cache_kwargs=None):
        keys, values = super().update(key_states, value_states, cache_kwargs)
        setattr(keys, _TAG, self)
        return keys, values

    def weights_for(self, rows: int) -> torch.Tensor:
        """Weights of the first ``rows`` cached rows: the coreset's, then 1 for later tokens."""
        if rows < self.context_rows:
            raise RuntimeError(
                f"kvcompress: the cache was cut to {rows} rows, inside its {self.context_rows}-row compressed "
                "context; crop a compressed cache only back to the end of its context or later"
            )
        extra = self.row_weights.new_ones(*self.row_weights.shape[:2], rows - self.context_rows)
        return torch.cat([self.row_weights, extra], dim=-1)

    def value_range(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[v_min, v_max]`` over the compressed context and every row after it in ``values``."""
        later = values[:, :, self.context_rows :]
        if later.shape[-2] == 0:
            return self.value_min, self.value_max
        return (
            torch.minimum(self.value_min, later.amin(-2).to(self.value_min.dtype)),
            torch.maximum(self.value_max, later.amax(-2).to(self.value_max.dtype)),
        )


def layer_of(keys: torch.Tensor) -> WeightedLayer | None:
    """The compressed layer whose ``update`` returned ``keys``, or None for an ordinary cache."""
    return getattr(keys, _TAG, None)


class WeightedDynamicCache(DynamicCache):
    """A DynamicCache with at least one compressed layer (see the module docstring for lengths)."""

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        if layer_idx is not None:
            return super().get_seq_length(layer_idx)
        if not self.layers:
            return 0
        first = self.layers[0]
        return first.get_seq_length() + getattr(first, "position_offset", 0)

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (counted like ``get_seq_length()``); negative: drop from the end."""
        for layer in self.layers:
            if not isinstance(layer, WeightedLayer) or max_length < 0:
                layer.crop(max_length)
                continue
            rows, context = max_length - layer.position_offset, layer.context_rows + layer.position_offset
            if rows < layer.context_rows:
                raise ValueError(
                    f"max_length: a compressed cache can be cropped back to its {context}-token context or later, "
                    f"got {max_length}"
                )
            layer.crop(rows)


def check_cache(cache: object) -> None:
    """Raise ValueError unless ``cache`` is a transformers DynamicCache kvcompress can compress (not offloaded)."""
    if not isinstance(cache, DynamicCache) or getattr(cache, "offloading", False):
        raise ValueError(
            f"past_key_values: kvcompress compresses a transformers DynamicCache (not offloaded), got "
            f"{type(cache).__name__}"
        )


def install_compressed_layer(cache: DynamicCache, layer_idx: int, layer: WeightedLayer) -> None:
    """Replace layer ``layer_idx`` of ``cache`` by its compressed version, in place."""
    check_cache(cache)
    if type(cache) is DynamicCache:
        cache.__class__ = WeightedDynamicCache
    cache.layers[layer_idx] = layer
    setattr(layer.keys, _TAG, layer)
