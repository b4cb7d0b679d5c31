"""Padded batches: which tokens of a row are real, one row's view of a prefill, and rows of unequal length.

A padded batch is compressed row by row on each row's real tokens, so a row gives what it gives alone.
Rows then keep different numbers of rows; the compressed context stays rectangular by filler rows at the
end of a shorter row (zero keys and values, ``w = 0``, masked by ``row_valid``), which no output sees.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicCache

SLIDING_PADDED_REPEAT = (
    "attention_mask: a padded batch with reference 'repeat' is not supported on a cache with sliding-window layers; "
    "use reference=('window',), compress one row at a time, or pass a DynamicCache() built without the model's config"
)


def real_token_rows(attention_mask: object, batch: int, n: int, device: torch.device) -> list[torch.Tensor] | None:
    """Per batch row, the positions ``[n_b]`` (int64) of its real tokens in a prefill of ``n`` tokens; None when
    no row is padded.

    ``attention_mask``: the 2D padding mask the model was called with (``[batch, >= n]``, 1 = real, its last
    ``n`` columns are this prefill's tokens), or None."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(
            f"attention_mask: kvcompress presses read padding from a 2D mask [batch, tokens] of 0/1, got {shape}"
        )
    if attention_mask.shape[0] != batch or attention_mask.shape[1] < n:
        raise ValueError(
            f"attention_mask: shape {tuple(attention_mask.shape)} must be [{batch}, >= {n}] for this {n}-token prefill"
        )
    real = attention_mask[:, -n:].to(device=device, dtype=torch.bool)
    if bool(real.all()):
        return None
    empty = (~real.any(-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask: batch rows {empty} have no real token (all padding)")
    return [row.nonzero().squeeze(1) for row in real]


def pad_rows(rows: list[torch.Tensor], side: str = "left", pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [b, width], attention_mask [b, width])`` of token rows ``[1, n_i]`` padded on ``side``
    (``"left"``, as ``generate`` pads, or ``"right"``) to the longest, ``pad_id`` in the pads."""
    if side not in ("left", "right"):
        raise ValueError(f"side: must be 'left' or 'right', got {side!r}")
    width = max(row.shape[1] for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        span = slice(width - row.shape[1], width) if side == "left" else slice(0, row.shape[1])
        ids[b, span], mask[b, span] = row[0], 1
    return ids, mask


def row_kwargs(kwargs: dict, row: int, index: torch.Tensor) -> dict:
    """An attention layer's hook ``kwargs`` as if batch row ``row`` had run alone on its tokens ``index``."""
    hidden = kwargs["hidden_states"]
    cos, sin = kwargs["position_embeddings"]

    def pick(x: torch.Tensor) -> torch.Tensor:
        return (x[row : row + 1] if x.shape[0] > 1 else x)[:, index.to(x.device)]

    return {**kwargs, "hidden_states": pick(hidden), "position_embeddings": (pick(cos), pick(sin))}


def row_view_cache(cache: DynamicCache, row: int, index: torch.Tensor) -> DynamicCache:
    """A DynamicCache holding batch row ``row``'s real rows ``index`` of every layer (copies of those rows)."""
    view = DynamicCache()
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise ValueError(SLIDING_PADDED_REPEAT)
        row_layer = copy.copy(layer)
        row_layer.keys, row_layer.values = layer.keys[row : row + 1, :, index], layer.values[row : row + 1, :, index]
        view.layers.append(row_layer)
    return view


def stack_rows(
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Batch rows ``(K [1, h, r_i, d], V [1, h, r_i, d_v], w [1, h, r_i])`` into one batch of ``max r_i`` rows.

    Returns ``(K, V, w, valid)``: shorter rows are filled at the end with zero keys/values and ``w = 0``;
    ``valid [b, r]`` is False on those filler rows (None when every row has the same count)."""
    rows = max(keys.shape[-2] for keys, _, _ in parts)
    valid = torch.zeros(len(parts), rows, dtype=torch.bool, device=parts[0][0].device)
    padded = []
    for b, (keys, values, weights) in enumerate(parts):
        fill = rows - keys.shape[-2]
        valid[b, : keys.shape[-2]] = True
        padded.append(
            (
                torch.nn.functional.pad(keys, (0, 0, 0, fill)),
                torch.nn.functional.pad(values, (0, 0, 0, fill)),
                torch.nn.functional.pad(weights.float(), (0, fill)),
            )
        )
    keys, values, weights = (torch.cat(column) for column in zip(*padded, strict=True))
    return keys, values, weights, None if bool(valid.all()) else valid
