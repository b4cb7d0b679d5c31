"""A static compressed cache: the compressed context plus preallocated rows for new tokens, for compiled decode.

:class:`StaticWeightedCache` holds, per compressed layer, fixed-size buffers ``[b, h_kv, r + max_new_tokens, d]``:
the ``r`` rows of the compressed context (weights ``w``, filler mask, clip range as in
:class:`kvcompress.cache.WeightedLayer`) followed by ``max_new_tokens`` empty rows. A decode step writes its rows in
place at ``cache_position - position_offset`` and updates the clip range in place; which rows a query sees comes
from device tensors (the filler mask, the model's mask over the new rows, and a causal offset read on the device),
so no Python value changes per step: ``torch.compile(fullgraph=True)`` traces one graph for every step, and
``mode="reduce-overhead"`` replays it as a CUDA graph. Attention runs ``torch.ops.kvcompress.weighted_attention_rows``
(:mod:`kvcompress.ops`). Full-attention layers that were not compressed become transformers ``StaticLayer``s and
sliding-window layers rings of their window (:class:`kvcompress.static_layers.StaticWindowLayer`: no host counter,
unlike transformers' ``StaticSlidingWindowLayer``, which recompiles every step under ``fullgraph=True``).

Two ways to get one::

    static = StaticWeightedCache.from_compressed(cache, max_new_tokens=256)   # after any kvcompress press
    pipe(context, question=q, press=press, cache=StaticWeightedCache(max_new_tokens=256))  # made static by the press

Capacity: ``max_new_tokens`` rows past the tokens held at conversion. Writing past them raises (a ``ValueError`` in
eager CPU runs; a device-side assertion with the same message on CUDA or inside a compiled graph): the cache never
grows silently and never drops a token. ``cache.remaining()`` says how many rows are left; ``crop`` (or kvpress's
pipeline cutting the rows back between questions) frees them again.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, StaticLayer

from kvcompress._checks import check_int_range
from kvcompress.cache import WeightedDynamicCache, WeightedLayer
from kvcompress.hf_compat import layer_initialized
from kvcompress.static_layers import StaticWeightedLayer, StaticWindowLayer, static_full_layer
from kvcompress.window import WindowLayer

__all__ = ["StaticWeightedCache", "StaticWeightedLayer", "StaticWindowLayer"]


MAX_ROWS = 2**31 - 1  # rows a static layer can index (int32 positions in the kernels)


class StaticWeightedCache(WeightedDynamicCache):
    """A compressed cache with preallocated rows for ``max_new_tokens`` new tokens (module docstring).

    Built empty (``StaticWeightedCache(max_new_tokens)``), it behaves like a DynamicCache until a kvcompress press
    has compressed the prefill, which then calls :meth:`freeze`; or converted with :meth:`from_compressed`.
    ``is_compileable`` once frozen: ``generate`` then compiles its decode steps (on CUDA, or anywhere with a
    ``CompileConfig``) and they run with no host sync and no allocation in the cache.
    """

    def __init__(self, max_new_tokens: int):
        check_int_range("max_new_tokens", max_new_tokens, 1, MAX_ROWS)
        super().__init__()
        self.max_new_tokens = max_new_tokens

    @classmethod
    def from_compressed(cls, cache: WeightedDynamicCache, max_new_tokens: int) -> StaticWeightedCache:
        """A static copy of a compressed cache (the rows it holds now, plus ``max_new_tokens`` free rows per
        layer); ``cache`` is left as it was."""
        if not isinstance(cache, WeightedDynamicCache) or not cache.layers:
            raise ValueError(
                f"cache: from_compressed takes a cache a kvcompress press has compressed, got {type(cache).__name__}"
            )
        if any(getattr(layer, "is_compileable", False) for layer in cache.layers):
            raise ValueError(
                "cache: from_compressed copies a dynamic compressed cache; this one is already static (it would share "
                "its buffers and keep its own capacity): crop it back to reuse it, or convert the dynamic cache again"
            )
        static = cls(max_new_tokens)
        static.layers = list(cache.layers)
        static.freeze()
        return static

    def freeze(self) -> None:
        """Replace every layer by its static form, in place (idempotent); all of them or, if their buffers do not fit
        in memory (``ValueError`` naming ``max_new_tokens``), none."""
        frozen = list(self.layers)
        try:
            for index, layer in enumerate(frozen):
                if getattr(layer, "is_compileable", False):
                    continue
                if isinstance(layer, WeightedLayer):
                    frozen[index] = StaticWeightedLayer(layer, self.max_new_tokens)
                elif isinstance(layer, WindowLayer) or getattr(layer, "sliding_window", None) is not None:
                    frozen[index] = StaticWindowLayer(layer, layer.sliding_window, self.max_new_tokens)
                elif isinstance(layer, DynamicLayer) and layer_initialized(layer):
                    frozen[index] = static_full_layer(layer, self.max_new_tokens)
        except (MemoryError, RuntimeError) as err:  # torch.OutOfMemoryError, or the CPU allocator's RuntimeError
            if not isinstance(err, MemoryError) and "alloc" not in str(err) and "out of memory" not in str(err):
                raise
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ValueError(f"max_new_tokens: {self.max_new_tokens} preallocated rows per layer do not fit in "
                             f"memory ({first[:200]})") from None
        self.layers[:] = frozen

    def remaining(self) -> int:
        """New tokens that still fit (the smallest over layers; one device read); ``max_new_tokens`` before a
        prefill. ValueError if a prefill wrote it and it was never made static (no press compressed that prefill:
        a context within the press's budget, or ``compression_ratio=0``): it then grows as a DynamicCache."""
        free = [
            layer.capacity - layer.get_seq_length() for layer in self.layers if isinstance(layer, StaticWeightedLayer)
        ]
        if not free and any(layer_initialized(layer) for layer in self.layers):
            raise ValueError("cache: this StaticWeightedCache was never made static (no kvcompress press compressed "
                             "its prefill), so it has no row limit: it grows as a DynamicCache")
        return min(free) if free else self.max_new_tokens

    def _reference_layer(self):
        return next((layer for layer in self.layers if not isinstance(layer, (WindowLayer, StaticWindowLayer))), None)

    def _sync_windows(self, cache_position: torch.Tensor | None) -> None:
        """Nothing per step: static window layers go back to the end of the context on ``crop`` or when the
        pipeline cuts the layers back (their keys setter), never by reading a count from the device (``generate``
        builds the masks eagerly every step; a read there would be a host sync per step)."""
        if not any(isinstance(layer, StaticWindowLayer) for layer in self.layers):
            super()._sync_windows(cache_position)

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        if layer_idx is None:
            reference = self._reference_layer()
            if isinstance(reference, StaticLayer):  # uncompressed: StaticLayer counts its non-zero rows
                return int(reference.get_seq_length())
        return super().get_seq_length(layer_idx)
