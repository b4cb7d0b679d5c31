"""The repeat pass's side of :class:`kvcompress.weighted_press.WeightedSubsetPress`: which pieces of the context it
re-reads, the pass streamed layer by layer (a decoder-layer hook), the whole-model pass after the prefill (a decoder
hook), and the recording of the repeat queries while either runs (the mechanics of a pass over the model:
:mod:`kvcompress.reference`).

A mixin: its methods read the press's state (``_pending``, ``_repeating``, ``_snapshot``, ``_stream``, ``_parked``,
``_call``, ``_position_ids``, ``_windows``), its ``repeat_chunk`` field, ``_compress_layer`` and
``_compress_beside`` (a layer's compression, on the side stream with ``overlap_compression``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvcompress.hf_attention import handing_over_context_rows
from kvcompress.offload import ParkedLayers
from kvcompress.padding import row_view_cache
from kvcompress.reference import (
    LayerReference,
    record_repeat,
    repeat_context,
    repeat_through_layer,
    restore_layer,
    snapshot_layers,
)


class RepeatPassHooks:
    """The repeat pass's hooks and choices (module docstring); presses without a ``"repeat"`` source never call
    them."""

    def repeat_samples(self) -> int:
        """Repeat-pass queries kept per layer for a fit (subclasses with a fit override it)."""
        return 0

    def repeat_reads_references(self) -> bool:
        """Whether :meth:`repeat_positions` reads the waiting layers' references (the repeat then waits for them
        all instead of streaming layer by layer)."""
        return False

    def repeat_positions(self, n: int, device: torch.device, references: list[LayerReference]) -> torch.Tensor | None:
        """Positions of an n-token context the repeat pass re-reads, in order; None: all of them.
        ``references``: what each waiting layer's prefill recorded for this context."""
        return None

    def _record_repeat(self, module: torch.nn.Module, kwargs: dict, cache) -> None:
        """Attention hook while a repeat pass runs: a waiting layer records its repeat queries, and every layer is
        restored from the snapshot (the repeated tokens' rows go)."""
        pending = self._pending.get(module.layer_idx)
        if pending is not None and self.scores_layer(module.layer_idx, pending["tokens"]):
            keys = cache.layers[module.layer_idx].keys[:, :, : pending["tokens"]]
            samples, total = self.repeat_samples(), pending["repeat_tokens"]
            record_repeat(module, kwargs, keys, pending["reference"], samples, total)
        restore_layer(cache, module.layer_idx, self._snapshot)

    def _streamable(self, state: dict) -> bool:
        """Whether this prefill's repeat pass can run layer by layer (``reference.repeat_through_layer``): one
        unpadded row read from token ids, a decoder with its own embedding and rotary tables, no sliding window."""
        decoder, input_ids = self._call
        return (
            state["rows"] is None
            and input_ids is not None
            and all(window is None for window in self._windows)
            and hasattr(decoder, "rotary_emb")
            and hasattr(decoder, "embed_tokens")
        )

    def _embedded_chunks(
        self, decoder: torch.nn.Module, input_ids: torch.Tensor, references: list[LayerReference]
    ) -> list[torch.Tensor]:
        """The embeddings of the repeated tokens (:meth:`repeat_positions` of the context ``input_ids [b, n]``,
        given the waiting layers' ``references``), in chunks."""
        pieces = self.repeat_positions(input_ids.shape[1], input_ids.device, references)
        ids = input_ids if pieces is None else input_ids[:, pieces]
        with torch.no_grad():
            return [decoder.embed_tokens(chunk) for chunk in ids.split(self.repeat_chunk, dim=1)]

    def _stream_start(self, layer_idx: int, state: dict) -> list[torch.Tensor] | bool:
        """The repeated tokens' embeddings, in chunks, when this prefill's repeat pass can be streamed through each
        layer right after its prefill; else False."""
        if layer_idx != 0 or self.repeat_reads_references() or not self._streamable(state):
            return False
        return self._embedded_chunks(*self._call, [])

    @torch.no_grad()  # the press's work runs outside autograd (WeightedSubsetPress's docstring)
    def _repeat_streamed(self, layer: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Decoder-layer hook, after a layer's prefill: stream the repeat pass through it and compress it."""
        layer_idx = layer.self_attn.layer_idx
        if self._repeating or layer_idx not in self._pending:
            return
        state = self._pending[layer_idx]
        cache = kwargs["past_key_values"]
        if self._stream is None:
            self._stream = self._stream_start(layer_idx, state)
        if self._stream is False:
            self._park(cache, layer_idx, state)
            return
        self._repeat_through(self._call[0], cache, state, self._stream, self._position_shift(None, state["tokens"]))
        self._compress_beside(cache, self._pending.pop(layer_idx))

    def _position_shift(self, row: tuple[int, torch.Tensor] | None, tokens: int) -> torch.Tensor | None:
        """How far past its count of context tokens the prefill placed each batch row's last real token: ``[b]``
        int64 for an unpadded batch, ``[1]`` for padded row ``(b, index)`` (its real tokens' positions ``index``
        among the ``tokens``); the repeat pass adds it to its positions, so the repeated tokens sit where they
        would have followed the context in the prefill. None where it is 0 by construction (no position ids, no
        padding). On the device: no host read."""
        position_ids = self._position_ids
        if row is None:
            return None if position_ids is None else position_ids[:, -1] + 1 - tokens
        b, index = row
        last = index[-1:]
        if position_ids is not None:
            row_positions = position_ids[b if position_ids.shape[0] > 1 else 0, -tokens:]
            last = row_positions.index_select(0, last.to(position_ids.device))
        return last + 1 - len(index)

    def _park(self, cache, layer_idx: int, state: dict) -> None:
        """After a layer's prefill, when the repeat pass will run layer by layer after the prefill: the layer's full
        cache waits in host memory until then (:mod:`kvcompress.offload`; on CUDA)."""
        if self._parked is None:
            device = cache.layers[layer_idx].keys.device
            wanted = self.repeat_reads_references() and self._streamable(state) and ParkedLayers.wanted(device)
            self._parked = ParkedLayers(device) if wanted else False
        if self._parked:
            self._parked.park(cache.layers[layer_idx], layer_idx)

    @contextmanager
    def _reading_again(self, references: dict[int, LayerReference], cache, repeat_tokens: int) -> Iterator[None]:
        """While a repeat pass of ``repeat_tokens`` tokens runs over ``cache``: the layers of ``references`` record
        their queries into them (the attention hooks read ``_pending``) and every layer is restored from a
        snapshot as soon as its attention has run."""
        saved = self._pending
        self._pending = {
            i: dict(reference=reference, tokens=cache.layers[i].keys.shape[-2], repeat_tokens=repeat_tokens)
            for i, reference in references.items()
        }
        self._repeating, self._snapshot = True, snapshot_layers(cache)
        try:
            with handing_over_context_rows():
                yield
        finally:
            self._pending, self._repeating, self._snapshot = saved, False, []

    @torch.no_grad()  # the press's work runs outside autograd (WeightedSubsetPress's docstring)
    def _after_prefill(self, decoder: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Decoder forward hook: after a prefill whose layers wait for the repeat pass, run it and compress."""
        if self._repeating:
            return
        self._stream = None  # a streamed pass is over: its hidden states go
        if not self._pending:
            return
        cache = kwargs.get("past_key_values") or getattr(output, "past_key_values", None)
        input_ids = self._call[1]
        pending, self._pending = self._pending, {}
        assert input_ids is not None, "refused before the prefill (WeightedSubsetPress._refuse_before_the_prefill)"
        parked, self._parked = self._parked, None
        if list(pending) == list(range(len(decoder.layers))) and self._streamable(next(iter(pending.values()))):
            self._repeat_layer_by_layer(decoder, cache, pending, parked or None)
            return
        if parked:
            parked.restore_all(cache)
        first = next(iter(pending.values()))
        rows, tokens = first["rows"] or [None], first["tokens"]
        for b, index in enumerate(rows):  # a padded batch: each row re-reads its own real tokens, as if alone
            row_cache = cache if index is None else row_view_cache(cache, b, index)
            row_ids = input_ids if index is None else input_ids[b : b + 1, index.to(input_ids.device)]
            shift = self._position_shift(None if index is None else (b, index), tokens)
            row_references = {i: state["references"][b] for i, state in pending.items()}
            self._repeat_whole_model(decoder, row_cache, row_ids, row_references, shift)
        for state in pending.values():
            self._compress_layer(cache, state)

    def _repeat_whole_model(
        self, decoder: torch.nn.Module, cache, input_ids: torch.Tensor, references: dict[int, LayerReference],
        shift: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """The whole-model repeat pass over one unpadded context ``input_ids [1, n]`` (its :meth:`repeat_positions`,
        given the waiting layers' ``references``), every layer of ``references`` recording its queries."""
        pieces = self.repeat_positions(input_ids.shape[1], input_ids.device, list(references.values()))
        input_ids = input_ids if pieces is None else input_ids[:, pieces]
        with self._reading_again(references, cache, input_ids.shape[1]):
            repeat_context(decoder, input_ids, cache, self.repeat_chunk, self._snapshot, shift)

    def _repeat_layer_by_layer(
        self, decoder: torch.nn.Module, cache, pending: dict[int, dict], parked: ParkedLayers | None
    ) -> None:
        """The repeat pass after the prefill, one layer at a time: every chunk through a layer, then that layer
        compressed (its full cache freed) before the next; the same cache as the whole-model pass, whose chunks go
        through every layer in turn while every layer holds its full cache. ``parked``: the layers waiting in host
        memory, each brought back when its turn comes (the next one's copy started meanwhile)."""
        hidden = self._embedded_chunks(*self._call, [state["references"][0] for state in pending.values()])
        for layer_idx, state in pending.items():
            if parked is not None:
                parked.restore(cache.layers[layer_idx], layer_idx)
                parked.prefetch(layer_idx + 1)
            self._repeat_through(decoder, cache, state, hidden, self._position_shift(None, state["tokens"]))
            self._compress_beside(cache, state)

    def _repeat_through(
        self, decoder: torch.nn.Module, cache, state: dict, hidden: list[torch.Tensor], shift: torch.Tensor | None
    ) -> None:
        """The repeat pass through one waiting layer (``state``: what its prefill recorded), its queries recorded
        into its reference: the repeated tokens' ``hidden`` states entering it become its outputs, in place."""
        layer_idx = state["module"].layer_idx
        repeat_tokens = sum(chunk.shape[1] for chunk in hidden)
        with self._reading_again({layer_idx: state["references"][0]}, cache, repeat_tokens):
            repeat_through_layer(decoder.layers[layer_idx], decoder, hidden, cache, layer_idx, shift)
