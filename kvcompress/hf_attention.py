"""transformers glue: the "kvcompress" attention function and its mask function.

Registered under one name with ``AttentionInterface`` and ``AttentionMaskInterface``. Over a
compressed cache layer (see :mod:`kvcompress.cache`) it runs weighted attention (Alg. 3); anywhere
else it hands the call to the stock sdpa function unchanged, so a never-compressed cache gives
exactly the sdpa result. The one exception is inside :func:`new_tokens_see_all_cached`, where the
repeat pass's chunks (new tokens after a full, unpadded cache) run a lower-right causal sdpa.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import kvcompress.ops  # noqa: F401  (registers torch.ops.kvcompress.weighted_attention_rows)
from kvcompress.attention import weighted_attention_unchecked
from kvcompress.cache import layer_of

ATTENTION_NAME = "kvcompress"

_NEW_TOKENS_SEE_ALL_CACHED: ContextVar[bool] = ContextVar("kvcompress_new_tokens_see_all_cached", default=False)


@contextmanager
def new_tokens_see_all_cached() -> Iterator[None]:
    """Inside: every call's new tokens see every cached row and each other causally (no padding, no window).

    Multi-token calls over uncompressed, full-attention layers then skip transformers' explicit mask for a
    lower-right causal sdpa: on CUDA its flash kernel with grouped-query heads, where the explicit mask
    forces a copy of the keys and values per query head and the slower masked kernel. Only a caller that
    knows the mask is exactly that may enter (the repeat pass: one unpadded row after its context).
    """
    token = _NEW_TOKENS_SEE_ALL_CACHED.set(True)
    try:
        yield
    finally:
        _NEW_TOKENS_SEE_ALL_CACHED.reset(token)


def _lower_right_causal_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    kwargs: dict,
) -> torch.Tensor | None:
    """sdpa of query ``[b, h_q, q, d]`` over key/value ``[b, h_kv, n, d]`` (n > q), query i seeing keys
    ``< n - q + i + 1``; ``[b, q, h_q, d]``. None where the stock path must run: a sliding window, one new
    token, or a CUDA call the flash kernel does not take (torch's lower-right fallbacks would copy or
    materialise what the stock path already does)."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    windowed = kwargs.get("sliding_window") is not None or getattr(module, "sliding_window", None) is not None
    if windowed or q_len < 2 or k_len <= q_len or query.device.type not in ("cpu", "cuda"):
        return None
    grouped = query.shape[1] != key.shape[1]
    if query.device.type == "cuda":
        params = torch.backends.cuda.SDPAParams(query, key, value, None, 0.0, False, grouped)
        if not torch.backends.cuda.can_use_flash_attention(params):
            return None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=causal_lower_right(q_len, k_len), scale=scaling, enable_gqa=grouped
    )
    return out.transpose(1, 2).contiguous()


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
        if _NEW_TOKENS_SEE_ALL_CACHED.get() and dropout == 0.0:
            out = _lower_right_causal_sdpa(module, query, key, value, scaling, kwargs)
            if out is not None:
                return out, None
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
