"""The prefill call's side of :class:`kvcompress.weighted_press.WeightedSubsetPress`: what the decoder's pre-hook
(and a multimodal wrapper's) reads from the call before any layer runs, its padding mask, token ids and position
ids, and the refusals that must come before the prefill writes the cache.

A mixin: its methods read and set the press's state (``_repeating``, ``_wrapper_call``, ``_images``,
``_attention_mask``, ``_position_ids``, ``_call``, ``_stream``, ``_parked``, ``_finite``, ``_positions``, ``_rows``,
``_restore``, ``_windows``) and call its ``plan`` and ``reference_sources``.
"""

from __future__ import annotations

import sys

import torch
from transformers import DynamicCache

from kvcompress.cache import check_cache, empty_cache_restorer
from kvcompress.padding import real_token_rows
from kvcompress.press_guards import refuse_a_repeat_pass, refuse_an_assisted_prefill, refuse_other_presses


class PrefillCallHooks:
    def _before_wrapper(self, wrapper: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Pre-hook of a multimodal model around the decoder (``Gemma3Model``: ``forward(input_ids, pixel_values,
        attention_mask, ...)``): its 2D padding mask, which the decoder receives only as a mapping of 4D masks, and
        its token ids, which the decoder receives only as embeddings."""
        if not self._repeating:

            def argument(name: str, index: int):
                return kwargs.get(name, args[index] if len(args) > index else None)

            images = argument("pixel_values", 1) is not None
            # A text-only call's token ids are the decoder's (a repeat pass reads them again); an image's are not.
            self._wrapper_call = (argument("attention_mask", 2), None if images else argument("input_ids", 0), images)

    def _before_forward(self, decoder: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Decoder pre-hook: remember the call's padding mask, decoder and token ids (the repeat pass's calls are
        ours), and refuse what the layers' hooks could only refuse halfway through the prefill."""
        if not self._repeating:

            def argument(name: str, index: int):  # the decoder's forward(input_ids, attention_mask, ...)
                return kwargs.get(name, args[index] if len(args) > index else None)

            mask, ids = argument("attention_mask", 1), argument("input_ids", 0)
            wrapper_mask, wrapper_ids, self._images = self._wrapper_call
            if isinstance(mask, dict):  # a multimodal wrapper's call: the mask and token ids it was given
                mask, ids = wrapper_mask, ids if ids is not None else wrapper_ids
            self._wrapper_call = (None, None, False)
            self._attention_mask = mask
            self._position_ids = argument("position_ids", 2)  # the repeat pass continues them
            self._call, self._stream = (decoder, ids), None
            self._parked = None
            # A static-shape pipeline may write a new prefill's positions into the last call's buffer: read again.
            self._finite, self._positions, self._rows, self._restore = [], (None, None, False), None, None
            self._refuse_before_the_prefill(argument("inputs_embeds", 4), argument("past_key_values", 3))
            if self._chunks is not None:
                inputs = ids if ids is not None else argument("inputs_embeds", 4)
                self._begin_chunk(argument("past_key_values", 3), inputs, mask, ids, self._position_ids)

    def _refuse_before_the_prefill(self, inputs_embeds: torch.Tensor | None, cache) -> None:
        """Raise, before any layer writes the cache, for a call this press would compress but refuse in a layer's
        hook or after the prefill: a cache it cannot compress, another press entered inside this one's block, a
        batch row of padding only, a repeat pass without token ids, a padded repeat pass over sliding-window
        layers. One host read of the mask per prefill (none for decode steps). Remembers the empty cache, put back
        if the prefill's layers turn out to hold NaN or Inf (:meth:`_finish_prefill`)."""
        input_ids = self._call[1]
        tokens = input_ids if input_ids is not None else inputs_embeds
        if tokens is None or tokens.shape[1] < 2 or self.plan(tokens.shape[1]) is None:
            return
        if cache is not None and cache.get_seq_length() > 0:
            return  # not a prefill: nothing is compressed
        if cache is not None:
            check_cache(cache)  # here, not in a layer's hook: a refused cache stays as it was
        refuse_other_presses(self, self._call[0])  # a press entered inside this one's block
        refuse_an_assisted_prefill(self)
        rows = real_token_rows(self._attention_mask, tokens.shape[0], tokens.shape[1], tokens.device)
        self._rows = (tokens.shape[1], rows)  # the layers' hooks take them from here (one host read per prefill)
        if isinstance(cache, DynamicCache):
            self._restore = empty_cache_restorer(cache)
        if "repeat" in self.reference_sources():
            refuse_a_repeat_pass(self, input_ids, cache, rows is not None, self._windows, self._images)

    def _undo_a_failed_prefill(self, decoder: torch.nn.Module, args: tuple, kwargs: dict, output) -> None:
        """Decoder forward hook that also runs when the call raised (``always_call``; last of the press's hooks, so
        a prefill that went through has cleared ``_restore`` by then): a prefill that failed in a layer or in its
        compression leaves no cache half written (some layers compressed, some exact, some empty); the cache is put
        back as it was before the call, whether or not the caller catches the error inside the press's block."""
        if self._restore is not None and not self._repeating and sys.exc_info()[0] is not None:
            restore, self._restore = self._restore, None
            restore()

    def _real_rows(self, batch: int, n: int, device: torch.device) -> list[torch.Tensor] | None:
        """:func:`real_token_rows` of this prefill on ``device``: those the decoder pre-hook read, else read now."""
        if self._rows is None or self._rows[0] != n:
            return real_token_rows(self._attention_mask, batch, n, device)
        rows = self._rows[1]
        return None if rows is None else [index.to(device) for index in rows]
