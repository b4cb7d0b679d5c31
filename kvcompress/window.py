"""Sliding-window layers (Gemma 3's local layers, Mistral-style windows) kept at their window after a press.

Such a layer's queries never see past their ``sliding_window`` tokens, so holding more is waste: a cache built
without the model's config (kvpress's pipeline and our server build ``DynamicCache()``) keeps the whole context
in every layer. After the prefill our presses replace each sliding layer, whatever its class, by a
:class:`WindowLayer` holding the last ``sliding_window - 1`` tokens (transformers' own rule, what
``DynamicCache(config=...)`` holds), and it stays at that size while decoding.

Rewinding: kvpress's pipeline answers several questions on one context by cutting every layer back to its
length before the answer (``layer.keys = layer.keys[:, :, :length]``, a no-op view on a window layer). A
window layer cannot be cut back (older tokens were dropped), so it keeps its rows at the end of the context
(``context_keys``; shared with ``keys`` until the first new token) and restores them when its keys are
reassigned that way from outside, on ``crop`` to the end of the context, or when the cache's token count says
the cache was cut back there (see :class:`kvcompress.cache.WeightedDynamicCache`); any other rewind raises
``ValueError``.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from kvcompress.cache import BatchRowOps
from kvcompress.hf_compat import layer_initialized


def layer_windows(model: PreTrainedModel) -> list[int | None]:
    """Per decoder layer, its sliding window in tokens, or None for a full-attention layer (transformers' rule:
    the layers ``DynamicCache(config=model.config)`` builds as sliding)."""
    layers = DynamicCache(config=model.config).layers
    return [layer.sliding_window if isinstance(layer, DynamicSlidingWindowLayer) else None for layer in layers]


def window_crop_refused(tokens: int, held: int, context_tokens: int) -> ValueError:
    """The error of a window layer (holding ``held`` tokens) asked to go back to ``tokens`` tokens."""
    return ValueError(
        f"max_length: a sliding-window layer after a press can go back only to the end of its {context_tokens}-token "
        f"context (it holds {held} tokens), got {tokens}"
    )


def window_crop_target(max_length: int, held: int, context_tokens: int) -> int | None:
    """The tokens a window layer holding ``held`` goes back to for ``crop(max_length)`` (negative: from the end;
    None: nothing to cut), or :func:`window_crop_refused`'s error: it can go back only to the end of its context."""
    tokens = held + max_length if max_length < 0 else max_length
    if tokens >= held:
        return None
    if tokens != context_tokens:
        raise window_crop_refused(tokens, held, context_tokens)
    return tokens


class WindowLayer(BatchRowOps, DynamicSlidingWindowLayer):
    """A sliding-window layer after a press: at most ``sliding_window - 1`` rows, ``cumulative_length`` tokens.
    ``real [b, >= rows]``: the prefill's padding mask (1 = real token) aligned to the end of ``keys``."""

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        sliding_window: int,
        tokens: int,
        real: torch.Tensor | None = None,
    ):
        super().__init__(sliding_window)
        keep = min(sliding_window - 1, keys.shape[-2])
        self.dtype, self.device = keys.dtype, keys.device
        # Copies: a view would keep the whole prefill's rows alive.
        self.keys = keys[:, :, keys.shape[-2] - keep :].clone()
        self.values = values[:, :, values.shape[-2] - keep :].clone()
        # [b, keep] bool, False on padding among the kept rows (None: all real); a static cache reads it.
        self.context_real = None if real is None else real[:, real.shape[-1] - keep :]
        self.is_initialized = True
        if hasattr(self, "_sliding_window_tensor"):  # transformers 5.x (hf_compat)
            self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)
        self.cumulative_length = self.context_tokens = tokens
        self.context_keys, self.context_values = self.keys, self.values

    def _assign(self, name: str, new: torch.Tensor | None) -> None:
        """kvpress's pipeline cuts every layer back after an answer (``keys[:, :, :length]``, a same-shape view
        here, of the current tensor or of the one the previous assignment just replaced): the only point a window
        layer can go back to is the end of its context, so such an assignment from outside restores it."""
        old = self.__dict__.get(name)
        outside = not self.__dict__.get("_updating", False) and old is not None and new is not None
        seen = {old.data_ptr()} | self.__dict__.get("_dropped", set()) if outside else set()
        if outside and new is not old and new.data_ptr() in seen and new.shape[-2] >= old.shape[-2]:
            self.rewind(self.context_tokens)
            return
        self.__dict__[name] = new

    keys = property(lambda self: self.__dict__.get("_keys"), lambda self, new: self._assign("_keys", new))
    values = property(lambda self: self.__dict__.get("_values"), lambda self, new: self._assign("_values", new))

    def update(self, key_states, value_states, cache_kwargs=None):
        self._updating, self._dropped = True, set()
        try:
            return super().update(key_states, value_states, cache_kwargs)
        finally:
            self._updating = False

    def check_crop(self, max_length: int) -> None:
        """Raise the ``ValueError`` :meth:`crop` would raise, changing nothing."""
        window_crop_target(max_length, self.cumulative_length, self.context_tokens)

    def rewind(self, tokens: int) -> None:
        """Make the layer stand for the first ``tokens`` tokens: a no-op at its current count, a restore at the
        end of its context; ``ValueError`` elsewhere."""
        if tokens == self.cumulative_length:
            return
        if tokens != self.context_tokens:
            raise window_crop_refused(tokens, self.cumulative_length, self.context_tokens)
        self._dropped = {self.keys.data_ptr(), self.values.data_ptr()}
        self.__dict__["_keys"], self.__dict__["_values"] = self.context_keys, self.context_values
        self.cumulative_length = self.context_tokens

    def crop(self, max_length: int) -> None:
        tokens = window_crop_target(max_length, self.cumulative_length, self.context_tokens)
        if tokens is not None:
            self.rewind(tokens)

    def _take_batch_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (int64 ``[b']``) of the rows held, the context's rows to rewind to and the
        context's padding mask (a tensor shared by two of them stays shared)."""
        taken: dict[int, torch.Tensor] = {}

        def take(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            if id(tensor) not in taken:
                taken[id(tensor)] = tensor.index_select(0, index.to(tensor.device))
            return taken[id(tensor)]

        self.__dict__["_keys"], self.__dict__["_values"] = take(self.keys), take(self.values)
        self.context_keys, self.context_values = take(self.context_keys), take(self.context_values)
        self.context_real = take(self.context_real)


def trim_to_windows(
    cache: DynamicCache, windows: list[int | None], attention_mask: torch.Tensor | None = None
) -> None:
    """Replace every sliding layer of ``cache`` (``windows[i]`` not None) by a :class:`WindowLayer`, in place.
    Layers already trimmed are left as they are. ``attention_mask``: the prefill's 2D padding mask, or None."""
    from kvcompress.cache import WeightedDynamicCache

    for index, window in enumerate(windows):
        if window is None or index >= len(cache.layers) or isinstance(cache.layers[index], WindowLayer):
            continue
        layer = cache.layers[index]
        if not layer_initialized(layer) or layer.keys is None or layer.keys.dim() != 4:
            continue
        tokens = layer.cumulative_length if isinstance(layer, DynamicSlidingWindowLayer) else layer.keys.shape[-2]
        real = None
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            real = attention_mask.to(device=layer.keys.device, dtype=torch.bool)
        cache.layers[index] = WindowLayer(layer.keys, layer.values, window, tokens, real)
        if type(cache) is DynamicCache:
            cache.__class__ = WeightedDynamicCache
