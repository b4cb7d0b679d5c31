"""transformers glue: the "kvcompress" attention function and its mask function.

Registered under one name with ``AttentionInterface`` and ``AttentionMaskInterface``. Over a
compressed cache layer (see :mod:`kvcompress.cache`) it runs weighted attention (Alg. 3); anywhere
else it hands the call to the stock sdpa function unchanged, so a never-compressed cache gives
exactly the sdpa result.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import kvcompress.ops  # noqa: F401  (registers torch.ops.kvcompress.weighted_attention_rows)
from kvcompress.attention import weighted_attention_unchecked
from kvcompress.cache import layer_of

ATTENTION_NAME = "kvcompress"


def kvcompress_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query ``[b, h_q, q, d]``, key/value ``[b, h_kv, n, d]``.

    Returns ``([b, q, h_q, d], None)`` like the stock functions. On a compressed layer the new tokens
    are the last ``q`` rows, causal among themselves; they see every earlier real row: filler rows of the
    compressed context and padded later tokens (from ``attention_mask``, built in token space) are masked.
    """
    layer = layer_of(key)
    if layer is None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if getattr(layer, "is_sliding", False):  # a static window layer: stock sdpa under its ring's mask
        mask = layer.window_mask(attention_mask)
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return sdpa(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if getattr(layer, "is_compileable", False):  # a static layer: visibility on the device, one custom op
        key_mask, offset, v_min, v_max = layer.attention_inputs(attention_mask)
        out = torch.ops.kvcompress.weighted_attention_rows(
            query, key, value, layer.row_weights, key_mask, offset, v_min, v_max, scaling
        )
        return out.transpose(1, 2).contiguous(), None
    rows, q_len = key.shape[-2], query.shape[-2]
    key_mask = layer.key_mask(rows, attention_mask)
    v_min, v_max = layer.value_range(value, key_mask)
    out = weighted_attention_unchecked(
        query,
        key,
        value,
        layer.weights_for(rows),
        scaling=scaling,
        v_min=v_min,
        v_max=v_max,
        causal_offset=rows - q_len,
        key_mask=key_mask,
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register the attention and mask functions under ``ATTENTION_NAME`` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvcompress_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def use_weighted_attention(model: PreTrainedModel) -> None:
    """Switch ``model`` (and its text sub-model) to the kvcompress attention; it stays switched."""
    register()
    config = getattr(model.config, "text_config", None) or model.config
    if config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation({"text_config": ATTENTION_NAME} if config is not model.config else ATTENTION_NAME)
