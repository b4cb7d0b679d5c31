"""transformers glue: the "kvcompress" attention function and its mask function.

Registered under one name with ``AttentionInterface`` and ``AttentionMaskInterface``. Over a
compressed cache layer (see :mod:`kvcompress.cache`) it runs weighted attention (Alg. 3); anywhere
else it hands the call to the stock sdpa function unchanged, so a never-compressed cache gives
exactly the sdpa result. The one exception is inside :func:`new_tokens_see_all_cached`, where the
repeat pass's chunks (new tokens after a full, unpadded cache) run a lower-right causal sdpa; on CUDA, while the
pass records (:func:`handing_over_context_rows`), as two calls of sdpa's own fused kernel split at the context's
end, whose context log-sum-exp the attention mass reuses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.nn.attention import SDPBackend
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging as hf_logging

import kvcompress.ops  # noqa: F401  (registers torch.ops.kvcompress.weighted_attention_rows)
from kvcompress.attention import (
    merge_partial_attentions,
    weighted_attention_probabilities,
    weighted_attention_unchecked,
)
from kvcompress.cache import ATTENTION_NAME, layer_of

logger = hf_logging.get_logger(__name__)

try:  # transformers' collector of output_attentions / output_hidden_states (a private name: absent, no warning)
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - another transformers version
    _active_collector = None


def _attentions_requested() -> bool:
    """Whether the running forward collects attention weights (``output_attentions=True``)."""
    collected = _active_collector.get() if _active_collector is not None else None
    return isinstance(collected, dict) and "attentions" in collected

_NEW_TOKENS_SEE_ALL_CACHED: ContextVar[bool] = ContextVar("kvcompress_new_tokens_see_all_cached", default=False)
# While a repeat pass records: [layer_idx, lse, output] over the context of the last chunk attention split at the
# context's end (or []).
_CONTEXT_ROWS: ContextVar[list | None] = ContextVar("kvcompress_context_rows", default=None)


class PrefillRows(NamedTuple):
    """What one layer's prefill attention call hands over: its post-RoPE queries ``[b, h_q, n, d]``, their causal
    log-sum-exp ``[b, h_q, n]`` (float32, natural log) and the attention outputs ``[b, h_q, t, d_v]`` of its last
    ``t`` rows (the query's dtype; None when none were asked for)."""

    queries: torch.Tensor
    lse: torch.Tensor
    last_outputs: torch.Tensor | None


@dataclass
class _PrefillSlot:
    """The handed-over rows by layer index, and how many last rows' outputs each call keeps. ``unpadded``: the caller
    (a context read in chunks, :mod:`kvcompress.context_chunks`) checked that every row of its calls is a real token,
    so their masks are plain causal (lower-right) and are not read, and calls after cached rows hand over too."""

    output_rows: int
    layers: dict = field(default_factory=dict)
    unpadded: bool = False


# While a press wants the prefill's rows: where its prefill calls hand them over (one layer's at a time).
_PREFILL_ROWS: ContextVar[_PrefillSlot | None] = ContextVar("kvcompress_prefill_rows", default=None)


@contextmanager
def new_tokens_see_all_cached() -> Iterator[None]:
    """Inside: every call's new tokens see every cached row and each other causally (no padding, no window).

    Multi-token calls over uncompressed, full-attention layers then skip transformers' explicit mask for a
    lower-right causal sdpa: on CUDA a fused kernel with grouped-query heads, where the explicit mask
    forces a copy of the keys and values per query head and the slower masked kernel. Only a caller that
    knows the mask is exactly that may enter (the repeat pass: one unpadded row after its context).
    """
    token = _NEW_TOKENS_SEE_ALL_CACHED.set(True)
    try:
        yield
    finally:
        _NEW_TOKENS_SEE_ALL_CACHED.reset(token)


@contextmanager
def handing_over_context_rows() -> Iterator[None]:
    """Inside (a repeat pass that scores its chunks' queries): where the chunks' attention can return its row
    log-sum-exp (on CUDA), it runs as two attentions merged, over the context and over the chunk's own keys,
    and hands the context part's log-sum-exp and output to :func:`take_context_rows`: the attention mass of those
    queries over the context then needs no pass of its own for the normaliser (:func:`kvcompress.selection.
    attention_mass`, ``row_lse``), nor the fit for its repeat queries' exact outputs."""
    token = _CONTEXT_ROWS.set([])
    try:
        yield
    finally:
        _CONTEXT_ROWS.reset(token)


def take_context_rows(layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``[b, h_q, q]`` float32 log-sum-exp and the ``[b, h_q, q, d]`` output (query dtype) over the context keys
    of layer ``layer_idx``'s last chunk attention, if it handed them over (once); else None."""
    slot = _CONTEXT_ROWS.get()
    if not slot or slot[0] != layer_idx:
        return None
    rows = slot[1], slot[2]
    slot.clear()
    return rows


def _fused_attention_with_lse(query, key, value, causal: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused CUDA attention the public sdpa would run on these tensors (grouped-query heads taken as they are),
    called through its private operator so that it also returns the row log-sum-exp: cuDNN where sdpa picks it
    (torch >= 2.11 on Hopper and newer: faster than flash at long contexts), else flash. Output ``[b, h_q, q, d]``,
    log-sum-exp ``[b, h_q, q]`` float32 (natural log). ``causal`` needs as many keys as queries: cuDNN aligns its
    causal mask top-left, flash bottom-right, and only the square case is the same for both."""
    if causal and query.shape[-2] != key.shape[-2]:
        raise ValueError(f"causal: needs as many keys as queries, got {key.shape[-2]} keys for {query.shape[-2]}")
    choice = torch._fused_sdp_choice(query, key, value, None, 0.0, causal, scale=scaling, enable_gqa=True)
    if choice == SDPBackend.CUDNN_ATTENTION.value:
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            query, key, value, None, True, 0.0, causal, False, scale=scaling
        )
        return out[0], out[1].reshape(query.shape[:-1])
    out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, False, scale=scaling)
    return out[0], out[1]


def _cpu_attention_with_lse(query, key, value, causal: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash attention (grouped-query heads taken as they are) with its row log-sum-exp: output
    ``[b, h_q, q, d]``, log-sum-exp ``[b, h_q, q]`` (natural log). ``causal``: top-left, so square calls only."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scaling)


def split_at_context(
    query, key, value, scaling: float, attend
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lower-right causal attention of ``q`` new queries over ``k_len`` keys (the last ``q`` their own) as two
    attentions merged by their log-sum-exps, FlashDecoding's split: over the ``k_len - q`` context keys (all
    visible) and over the queries' own keys (causal). ``attend(q, k, v, causal, scaling) -> (out, lse)``. Returns
    the output ``[b, h_q, q, d]`` (query dtype), its ``[b, h_q, q]`` float32 log-sum-exp over all ``k_len`` keys, and
    the context part's ``[b, h_q, q]`` float32 log-sum-exp and ``[b, h_q, q, d]`` output (``attend``'s dtype)."""
    context = key.shape[-2] - query.shape[-2]
    out_context, lse_context = attend(query, key[:, :, :context], value[:, :, :context], False, scaling)
    out_own, lse_own = attend(query, key[:, :, context:], value[:, :, context:], True, scaling)
    wide = torch.promote_types(query.dtype, torch.float32)  # the merge in float32 at least
    lse = torch.stack((lse_context, lse_own)).to(wide)
    lse, out = merge_partial_attentions(lse, torch.stack((out_context, out_own)).to(wide))
    return out.to(query.dtype), lse.float(), lse_context.float(), out_context


@contextmanager
def handing_over_prefill_rows(output_rows: int = 0, unpadded: bool = False) -> Iterator[_PrefillSlot]:
    """Inside (a press whose prior reads every prefill query, ``"induction"``): an unpadded causal prefill call runs
    an attention that also returns its row log-sum-exp (the fused kernel sdpa itself picks: cuDNN or flash on CUDA,
    flash on CPU) and hands the call's post-RoPE queries, that log-sum-exp and a copy of its last ``output_rows``
    rows' outputs to :func:`take_prefill_rows`, so the prior needs neither a query projection nor an attention pass
    of its own (nor the fit, for the window's queries: their exact outputs), and the prefill runs the kernel a
    no-press prefill runs (writing its log-sum-exp too: 12.6 against 11.4 ms a layer at 32k on an H200).
    ``unpadded``: see :class:`_PrefillSlot` (the slot is yielded: its caller may switch it per call)."""
    slot = _PrefillSlot(output_rows, unpadded=unpadded)
    token = _PREFILL_ROWS.set(slot)
    try:
        yield slot
    finally:
        _PREFILL_ROWS.reset(token)


def take_prefill_rows(layer_idx: int) -> PrefillRows | None:
    """Layer ``layer_idx``'s last prefill call's :class:`PrefillRows`, if it handed them over (once); else None."""
    slot = _PREFILL_ROWS.get()
    return None if slot is None else slot.layers.pop(layer_idx, None)


def _windowed(module: torch.nn.Module, kwargs: dict) -> bool:
    """Whether this attention call is a sliding-window layer's (the stock path then runs, under its window)."""
    return kwargs.get("sliding_window") is not None or getattr(module, "sliding_window", None) is not None


def _resolved_scaling(query: torch.Tensor, scaling: float | None) -> float:
    """The call's softmax scaling: transformers passes the module's; None means ``d ** -0.5`` (sdpa's default)."""
    return query.shape[-1] ** -0.5 if scaling is None else scaling


def _causal_prefill_with_lse(module, query, key, value, attention_mask, scaling, kwargs, slot: _PrefillSlot):
    """The causal attention of a prefill call with no cache before it (as many keys as queries, no padding mask, no
    window), its rows handed over in ``slot``; ``[b, q, h_q, d]``, or None where the stock path runs."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    if (attention_mask is not None and not slot.unpadded) or _windowed(module, kwargs) or q_len < 2:
        return None
    if k_len != q_len and not (slot.unpadded and k_len > q_len):
        return None
    scaling = _resolved_scaling(query, scaling)
    attend = {"cuda": _fused_attention_with_lse, "cpu": _cpu_attention_with_lse}.get(query.device.type)
    if attend is None:
        return None
    try:
        if k_len == q_len:
            out, lse = attend(query, key, value, True, scaling)
        else:  # a later chunk of a context: over the cached rows and its own, merged (FlashDecoding's split)
            out, lse = split_at_context(query, key, value, scaling, attend)[:2]
    except (RuntimeError, TypeError) as error:  # a fused operator this torch build lacks or refuses
        logger.warning_once(f"kvcompress: the prefill's attention hands no log-sum-exp over ({error})")
        return None
    slot.layers.clear()  # the layer's hook takes its rows right after this call: never hold more than one layer's
    tail = out[:, :, -slot.output_rows :].clone() if slot.output_rows else None  # a copy: not the whole output
    slot.layers[getattr(module, "layer_idx", None)] = PrefillRows(query, lse.float(), tail)
    return out.transpose(1, 2).contiguous()


def _split_wanted(query: torch.Tensor) -> bool:
    """Whether a chunk attention on ``query``'s device hands its context log-sum-exp over: on CUDA, where the mass
    kernel would otherwise run a first pass for it."""
    return query.device.type == "cuda"


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
    if _windowed(module, kwargs) or q_len < 2 or k_len <= q_len or query.device.type not in ("cpu", "cuda"):
        return None
    grouped = query.shape[1] != key.shape[1]
    if query.device.type == "cuda":
        params = torch.backends.cuda.SDPAParams(query, key, value, None, 0.0, False, grouped)
        if not torch.backends.cuda.can_use_flash_attention(params):
            return None
    slot = _CONTEXT_ROWS.get()
    if slot is not None and _split_wanted(query):
        try:
            attend, resolved = _fused_attention_with_lse, _resolved_scaling(query, scaling)
            out, _, lse, out_context = split_at_context(query, key, value, resolved, attend)
        except (RuntimeError, TypeError) as error:  # a fused operator this torch build lacks or refuses
            logger.warning_once(f"kvcompress: the repeat chunks' attention hands no log-sum-exp over ({error})")
        else:
            slot[:] = [getattr(module, "layer_idx", None), lse, out_context]
            return out.transpose(1, 2).contiguous()
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
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers attention function: query ``[b, h_q, q, d]``, key/value ``[b, h_kv, n, d]``; the stock functions'
    parameter order (``dropout`` sixth: kvpress's attention patch, which wraps every registered function when
    kvpress is imported, passes it by position).

    Returns ``([b, q, h_q, d], weights)``: ``weights`` None unless the forward collects attentions
    (``output_attentions=True``, outside compiled code), then ``[b, h_q, q, keys]``: eager attention's softmax on an
    ordinary layer, each query's distribution over the weighted rows on a compressed one
    (:func:`~kvcompress.attention.weighted_attention_probabilities`). On a compressed layer the new tokens
    are the last ``q`` rows, causal among themselves; they see every earlier real row: filler rows of the
    compressed context and padded later tokens (from ``attention_mask``, built in token space) are masked.
    """
    asked = kwargs.pop("output_attentions", False)  # we answer it: stock sdpa would only warn
    weights_wanted = not torch.compiler.is_compiling() and (asked or _attentions_requested())
    layer = layer_of(key)
    if layer is None:
        out = None
        prefill_rows = _PREFILL_ROWS.get()
        if prefill_rows is not None and dropout == 0.0:
            out = _causal_prefill_with_lse(module, query, key, value, attention_mask, scaling, kwargs, prefill_rows)
        if _NEW_TOKENS_SEE_ALL_CACHED.get():  # a repeat pass's chunk: the press's reading, not the caller's layers
            weights_wanted = False
            if out is None and dropout == 0.0:
                out = _lower_right_causal_sdpa(module, query, key, value, scaling, kwargs)
        if out is None:
            out = ALL_ATTENTION_FUNCTIONS["sdpa"](
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )[0]
        return out, _softmax_weights(query, key, attention_mask, scaling) if weights_wanted else None
    if getattr(layer, "is_sliding", False):  # a static window layer: stock sdpa under its ring's mask
        mask = layer.window_mask(attention_mask)
        out = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, scaling=scaling, dropout=dropout,
                                              **kwargs)[0]  # fmt: skip
        return out, _softmax_weights(query, key, mask, scaling) if weights_wanted else None
    scaling = _resolved_scaling(query, scaling)
    if getattr(layer, "is_compileable", False):  # a static layer: visibility on the device, one custom op
        key_mask, offset, v_min, v_max = layer.attention_inputs(attention_mask)
        weights = layer.row_weights
        out = torch.ops.kvcompress.weighted_attention_rows(
            query, key, value, weights, key_mask, offset, v_min, v_max, scaling
        )
    else:
        rows, q_len = key.shape[-2], query.shape[-2]
        key_mask = layer.key_mask(rows, attention_mask)
        offsets = layer.row_offsets  # a decode batch's per-row causal offsets on CUDA; else None
        offset = rows - q_len if offsets is None else offsets
        v_min, v_max, fold_from = layer.clip_range(rows)
        weights = layer.weights_for(rows)
        out = weighted_attention_unchecked(
            query, key, value, weights, scaling=scaling, v_min=v_min, v_max=v_max, causal_offset=offset,
            key_mask=key_mask, fold_from=fold_from,
        )  # fmt: skip
        layer.folded(rows)
    shares = None
    if weights_wanted:
        shares = weighted_attention_probabilities(query, key, weights, scaling=scaling, causal_offset=offset,
                                                  key_mask=key_mask)  # fmt: skip
    return out.transpose(1, 2).contiguous(), shares


def _softmax_weights(query, key, attention_mask, scaling) -> torch.Tensor:
    """``output_attentions``' weights of an ordinary (unweighted) call, as transformers' eager attention gives them:
    the softmax (float32, cast to the query's dtype) of the scaled logits under ``attention_mask`` (sdpa's 4D mask,
    bool or additive float; None: causal, lower-right, as sdpa runs it), ``[b, h_q, q, keys]``."""
    scaling = _resolved_scaling(query, scaling)
    keys = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
    logits = (query @ keys.transpose(-1, -2)).float() * scaling
    q_len, k_len = query.shape[-2], key.shape[-2]
    if attention_mask is None:
        rows = torch.arange(q_len, device=query.device)[:, None]
        attention_mask = torch.arange(k_len, device=query.device) <= rows + (k_len - q_len)
    if attention_mask.dtype == torch.bool:  # eager's float masks: a row of padding only is uniform, not NaN
        logits = logits.masked_fill(~attention_mask, torch.finfo(torch.float32).min)
    else:
        logits = logits + attention_mask.float()
    return torch.softmax(logits, -1).to(query.dtype)


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
