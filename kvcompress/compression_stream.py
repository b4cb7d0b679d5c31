"""Each layer's compression on a second CUDA stream, beside the next layer's prefill.

A press compresses layer l after its prefill; nothing later in the prefill reads layer l, so its selection and
fit (a few ms of small kernels a layer at 32k tokens, mostly latency, not throughput) can run on a side stream
while layer l + 1's forward (tens of ms of large GEMMs and attention) runs on the main one. The press launches it
after layer l's MLP, the prefill's peak of memory, so that the compression's temporaries meet layer l + 1's
attention instead (where a repeat pass runs layer by layer: after layer l's pass, beside layer l + 1's). The side
stream starts after everything the main stream has queued (layer l's keys, values and references exist); the main
stream waits for it before it may read the result: when the next layer's compression is launched (at most one
layer in flight) and when the prefill forward returns (before any decode step).

Memory the two streams share, without ``record_stream``:

* read by the side stream, allocated on the main one (the layer's full keys and values, its references): the press
  holds them (``hold``) until the main stream has waited for the side stream, so the caching allocator cannot hand
  their blocks to a main-stream kernel that would run before the side stream is done reading them;
* allocated on the side stream, read by the main one (the compressed layer): each side batch starts after
  everything the main stream had queued, so a later side-stream allocation that reuses such a block (once it is
  freed) runs after every main-stream read issued before it.

Off a GPU there is no second stream: the compression runs inline, and :class:`CompressionStream` only holds and
releases (the bookkeeping the CUDA path runs, so it is tested on CPU too).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class CompressionStream:
    """The side stream of one press (created on first use, per device) and what it must keep alive."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._held: list[Any] = []

    @property
    def held(self) -> int:
        """How many layers' inputs are held for work the main stream has not waited for yet."""
        return len(self._held)

    @contextmanager
    def run(self, device: torch.device, hold: Any) -> Iterator[None]:
        """Inside: CUDA work goes to ``device``'s side stream, after all work queued so far on its current stream.
        ``hold`` (the objects that reach every main-stream tensor the work reads) is kept until :meth:`join`. The
        previous layer's work is joined first: at most one layer is in flight."""
        self.join()
        self._held.append(hold)
        if device.type != "cuda":
            yield
            return
        main = torch.cuda.current_stream(device)
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            yield

    def join(self) -> None:
        """Make each device's current stream wait for its side stream's work (no host wait), then release what was
        held for it."""
        if not self._held:
            return
        for device, side in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(side)
        self._held.clear()


class SideStreamCompression:
    """The press's side of ``overlap_compression`` (a mixin of :class:`kvcompress.weighted_press.WeightedSubsetPress`:
    it reads the press's ``overlap_compression``, ``_side`` (a :class:`CompressionStream`), ``_deferred`` (layer ->
    ``(cache, state)`` waiting for its decoder layer to finish) and ``_compress_layer``)."""

    @torch.no_grad()  # the press's work runs outside autograd (WeightedSubsetPress's docstring)
    def _compress_beside_next_layer(self, layer: torch.nn.Module, args: tuple, output: Any) -> None:
        """Decoder-layer hook (``overlap_compression``): compress this layer on the side stream, beside the next
        layer's prefill. Launched after the layer's MLP, not after its attention, so that the compression's
        temporaries meet the next layer's attention, not this layer's MLP (the prefill's peak)."""
        self._compress_deferred(layer.self_attn.layer_idx)

    def _compress_deferred(self, layer_idx: int | None = None) -> None:
        """Compress the layer waiting for it (every waiting layer when ``layer_idx`` is None) on the side stream."""
        for idx in list(self._deferred) if layer_idx is None else [layer_idx]:
            waiting = self._deferred.pop(idx, None)
            if waiting is not None:
                self._compress_beside(*waiting)

    def _compress_beside(self, cache, state: dict) -> None:
        """``_compress_layer``, on the side stream with ``overlap_compression`` (the layer's full cache and
        references held until the main stream waits for it), else right here."""
        if not self.overlap_compression:
            self._compress_layer(cache, state)
            return
        layer = cache.layers[state["module"].layer_idx]
        with self._side.run(layer.keys.device, hold=(state, layer)):
            self._compress_layer(cache, state)
