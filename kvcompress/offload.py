"""Full cache layers parked in host memory while a prefill waits for the repeat pass that runs after it.

A press whose repeat pass needs every layer's prefill before it starts (``balanced()``: its pieces come from every
layer's key novelty) would hold every layer's full cache through the rest of the prefill, where the prefill's own
activations peak: the no-press prefill's peak, above SnapKV's, which compresses each layer as it goes. On CUDA each
such layer is instead copied to pinned host memory right after its prefill, on a side stream (the copy overlaps the
next layers' compute), and its device rows are freed; after the prefill the pass brings the layers back one at a
time, the next one's copy in flight while the current one runs, and compresses each before the next (the device holds
at most two full layers). The host holds the full cache meanwhile (torch's pinned-memory cache may round each
block up to a power of two, and keeps the blocks for the next prefill); a layer for which no pinned host memory
can be had stays on the device. On the CPU nothing is parked (the cache already lives in host memory) unless asked,
as the tests ask, to check that a round trip leaves the cache as it was.
"""

from __future__ import annotations

import torch
from transformers.utils import logging as hf_logging

logger = hf_logging.get_logger(__name__)


class ParkedLayers:
    """Cache layers whose ``keys``/``values`` ``[b, h_kv, n, d]`` wait in host memory (module docstring).

    :meth:`park` copies a layer out and leaves it empty (0 rows); :meth:`prefetch` starts the copy back;
    :meth:`restore` puts the rows back into the layer. On CUDA the copies run on one side stream, ordered against the
    compute stream both ways (the stream waits, and ``record_stream`` keeps each device tensor alive until its copy
    has run), so no call makes the host wait for the device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.arriving: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def wanted(device: torch.device) -> bool:
        """Whether layers on ``device`` are parked: on CUDA only."""
        return device.type == "cuda"

    def park(self, layer, layer_idx: int) -> None:
        """Copy ``layer``'s rows to host memory (pinned, asynchronous on CUDA) and free them on the device."""
        tensors = (layer.keys, layer.values)
        if self.stream is None:
            self.host[layer_idx] = tuple(tensor.clone() for tensor in tensors)
        else:
            try:
                host = [torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True) for tensor in tensors]
            except RuntimeError as error:  # no pinned memory left: this layer stays on the device
                logger.warning_once(f"kvcompress: a cache layer stays on the device (no pinned host memory: {error})")
                return
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the rows are written
            with torch.cuda.stream(self.stream):
                for copy, tensor in zip(host, tensors, strict=True):
                    copy.copy_(tensor, non_blocking=True)
            for tensor in tensors:  # the allocator reuses these rows only once the copy has run
                tensor.record_stream(self.stream)
            self.host[layer_idx] = tuple(host)
        layer.keys, layer.values = (tensor.new_empty(*tensor.shape[:-2], 0, tensor.shape[-1]) for tensor in tensors)

    def prefetch(self, layer_idx: int) -> None:
        """Start copying a parked layer back to the device (nothing if it is not parked or already coming)."""
        if layer_idx not in self.host:
            return
        tensors = self.host.pop(layer_idx)
        if self.stream is None:
            self.arriving[layer_idx] = tensors
            return
        with torch.cuda.stream(self.stream):
            self.arriving[layer_idx] = tuple(tensor.to(self.device, non_blocking=True) for tensor in tensors)

    def restore(self, layer, layer_idx: int) -> None:
        """Put a parked layer's rows back into ``layer``, ready for the compute stream (nothing if not parked)."""
        self.prefetch(layer_idx)
        if layer_idx not in self.arriving:
            return
        tensors = self.arriving.pop(layer_idx)
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)  # the copy back has run before anything reads the rows
            for tensor in tensors:
                tensor.record_stream(current)
        layer.keys, layer.values = tensors

    def restore_all(self, cache) -> None:
        """Put every parked layer of ``cache`` back."""
        for layer_idx in sorted({*self.host, *self.arriving}):
            self.restore(cache.layers[layer_idx], layer_idx)
