"""One layer's compressed cache, assembled after a press has planned and scored it: the exact sink and window rows
around the weighted middle (:meth:`~kvcompress.weighted_press.WeightedSubsetPress.compress_middle`), each batch row
on its own real tokens when the batch is padded (:func:`kvcompress.padding.stack_rows`), the clip range of all the
context's values, installed in the cache as a :class:`~kvcompress.cache.WeightedLayer`.

A mixin of :class:`~kvcompress.weighted_press.WeightedSubsetPress`: it calls the press's ``compress_middle`` and
appends to its ``_finite`` flags (read once after the prefill).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcompress.cache import WeightedLayer, install_compressed_layer
from kvcompress.padding import stack_rows

if TYPE_CHECKING:
    from kvcompress.weighted_press import RowPlan


class CompressedLayerRows:
    def _compress_rows(
        self, module: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor, plan: RowPlan, reference
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of an unpadded context ``[b, h_kv, n, d]``: ``(K, V, w)`` with ``plan.rows`` rows per head."""
        n = keys.shape[-2]
        start, end = plan.sink, n - plan.window
        middle_keys, middle_values, middle_weights = self.compress_middle(
            module, keys, values, start, end, plan.middle, reference
        )
        ones = middle_weights.new_ones(*middle_weights.shape[:2], 1)
        return (
            torch.cat([keys[:, :, :start], middle_keys, keys[:, :, end:]], dim=2),
            torch.cat([values[:, :, :start], middle_values, values[:, :, end:]], dim=2),
            torch.cat([ones.expand(-1, -1, start), middle_weights, ones.expand(-1, -1, plan.window)], dim=2),
        )

    def _compress_layer(self, cache, state: dict, flags: list | None = None) -> None:
        """Compress one layer of ``cache`` (``state``: what its prefill recorded), appending its compressed values'
        finite flag to ``flags`` (the press's ``_finite`` when None)."""
        module, rows, plans = state["module"], state["rows"], state["plans"]
        layer = cache.layers[module.layer_idx]
        keys, values = layer.keys, layer.values
        if rows is None:
            compressed_keys, compressed_values, weights = self._compress_rows(
                module, keys, values, plans[0], state["references"][0]
            )
            value_min, value_max, valid = values.amin(2).float(), values.amax(2).float(), None
        else:
            parts, lows, highs = [], [], []
            for b, (index, plan) in enumerate(zip(rows, plans, strict=True)):
                row_keys, row_values = keys[b : b + 1, :, index], values[b : b + 1, :, index]
                lows.append(row_values.amin(2))
                highs.append(row_values.amax(2))
                if plan is None:  # this row removes nothing (or can keep no row): all its real tokens stay
                    ones = torch.ones(1, keys.shape[1], len(index), device=keys.device)
                    parts.append((row_keys, row_values, ones))
                else:
                    parts.append(self._compress_rows(module, row_keys, row_values, plan, state["references"][b]))
            compressed_keys, compressed_values, weights, valid = stack_rows(parts)
            value_min, value_max = torch.cat(lows).float(), torch.cat(highs).float()
        # Weighted values (w v, a Nystrom fit) can outgrow a 16-bit dtype where the prefill's values did not: read
        # with the prefill's own flags after it (one sync), the cache put back as before the call if one is not finite
        finite = torch.isfinite(compressed_values).all() & torch.isfinite(weights).all()
        (self._finite if flags is None else flags).append((module.layer_idx, ("compressed values",), finite.reshape(1)))
        compressed = WeightedLayer(
            keys=compressed_keys,
            values=compressed_values,
            row_weights=weights,
            value_min=value_min,
            value_max=value_max,
            tokens=state["tokens"],
            row_valid=valid,
        )
        install_compressed_layer(cache, module.layer_idx, compressed)
