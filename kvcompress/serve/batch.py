"""The decode batch: every active session's cache rows in one padded cache, one token per row per step.

Layout, per model layer: buffers ``keys [B, h_kv, C, d]``, ``values [B, h_kv, C, d_v]``, ``weights [B, h_kv, C]``
(float32) and the clip range ``v_min / v_max [B, h_kv, d_v]``. Batch row ``b`` holds session ``b``'s rows
contiguously from row 0: its context (compressed rows with their Nystrom weights, or exact rows with weight 1), its
question, then every generated token (weight 1); rows from ``lengths[b]`` on are unused (zero keys and values,
weight 1, so a step writes no weight) and masked by ``key_mask`` (on CUDA bounded instead by each row's causal
offset, so the kernel does not even read them: :attr:`BatchLayer.row_offsets`). So sessions of different
compressed lengths and different numbers of generated tokens share one rectangular batch, and a row sees exactly the
rows it sees alone: weighted attention (Alg. 3 of WildCat) with a masked key is the same sum without that key. A
sliding-window layer holds a session's last tokens in order, one row each, so its mask also hides the rows more than
``window - 1`` before the new one.

Positions are per row: a compressed context of ``n`` tokens holds ``r < n`` rows, so the token position that RoPE
needs (``n + question + generated``) is not the row index; the step passes explicit ``position_ids [B, 1]`` and a
4D mask, so transformers derives neither from the cache.

A step appends one row per session in place (``index_put`` at each row's own length) and attends over the first
``max(lengths) + 1`` rows. The rows held per batch row live in one :class:`RowCounts` shared by the layers, on the
host and on the device, advanced once per step: the step's only host-to-device copy is made before its first kernel
(a blocking copy in each layer would wait for the layers queued before it). The capacity ``C`` is reserved up front
for every session's whole answer (question + ``max_tokens``), so a step never reallocates; the batch is rebuilt
only when a session joins or leaves. Each layer has its own capacity (its widest session's rows, plus the answer):
a press that gives some layers more rows (``CompressKVPress(retrieval_layers=...)``) costs the batch what it costs
the sessions, not the widest layer's rows in every layer. Built ``static`` (for the compiled steps of
:func:`~kvcompress.serve.step.compiled_forward`), a batch attends its whole capacity every step, each row bounded by
its own length on the device (mask, causal offset and clip-range fold: :meth:`BatchLayer.attention_inputs`), so no
step changes a shape or a Python value the graph reads: one graph serves every step, and with the batch and capacity
sizes symbolic, every later batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvcompress.cache import TaggedLayer, WeightedLayer, tag_layer


@dataclass
class RowSource:
    """One session's rows of one layer, batch row 1: keys ``[1, h, n, d]``, values, weights ``[1, h, n]``, range;
    ``window``: the layer's sliding window (its rows are then the session's last tokens, in order), or None."""

    keys: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor
    v_min: torch.Tensor
    v_max: torch.Tensor
    window: int | None = None


def session_rows(cache: Cache) -> list[RowSource]:
    """Per layer, the rows of a single session's cache (batch 1) with their weights and clip range.

    A compressed layer (:class:`~kvcompress.cache.WeightedLayer`) gives its coreset weights and the range of its
    context and later rows; an ordinary layer gives weight 1 and an infinite range (no clipping: its weighted
    attention is ordinary attention)."""
    out = []
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        if keys.shape[0] != 1:
            raise ValueError(f"cache: a session's cache must have batch size 1, got {keys.shape[0]}")
        rows = keys.shape[-2]
        if isinstance(layer, WeightedLayer):
            weights = layer.weights_for(rows)
            v_min, v_max = layer.value_range(values)
        else:
            weights = torch.ones(1, keys.shape[1], rows, dtype=torch.float32, device=keys.device)
            shape = (1, values.shape[1], values.shape[-1])
            v_min = torch.full(shape, -math.inf, device=keys.device, dtype=torch.float32)
            v_max = torch.full(shape, math.inf, device=keys.device, dtype=torch.float32)
        out.append(RowSource(keys, values, weights.float(), v_min, v_max, getattr(layer, "sliding_window", None)))
    return out


class RowCounts:
    """Rows held per batch row, shared by every layer that holds the same counts (usually all): a host list (shapes
    are decided on the host) and its device copy, advanced together once per step. A layer that copied its counts
    to the device itself would wait, at each layer, for every kernel queued before it (a blocking host-to-device
    copy): the host could no longer run ahead of the GPU."""

    def __init__(self, lengths: list[int], device: torch.device, capacity: int | None = None):
        self.host = list(lengths)
        self.capacity = capacity  # static batches: every step attends the whole capacity (one shape for every step)
        self.static = capacity is not None  # what compiled code reads (the capacity itself would be compiled in)
        self.tensor = torch.tensor(lengths, device=device)  # [B] int64, copied once per batch build
        self.batch_index = torch.arange(len(lengths), device=device)
        self.width = 0  # rows attended in the open step (0: no step open)
        self.visible: torch.Tensor | None = None  # [B, width] bool: the rows each batch row sees in the open step
        self.mask: torch.Tensor | None = None  # ``visible``, or None when every batch row holds as many rows
        self._windowed: dict[int, torch.Tensor] = {}  # window -> ``visible`` cut to it (sliding-window layers)

    def begin_step(self) -> None:
        self.width = max(self.host) + 1 if self.capacity is None else self.capacity
        self.visible = torch.arange(self.width, device=self.tensor.device) <= self.tensor[:, None]
        self.mask = self.visible if min(self.host) + 1 < self.width else None
        if self.static:
            mark_dynamic(self.visible, 0, 1)
        self._windowed = {}

    def windowed(self, window: int) -> torch.Tensor:
        """``[B, width]`` bool: the rows a sliding-window layer's new token sees in the open step, its own and the
        ``window - 1`` before it (such a layer holds each session's last tokens in order, one row per token)."""
        if window not in self._windowed:
            rows = torch.arange(self.visible.shape[-1], device=self.tensor.device)  # a size, not an int: compiles
            self._windowed[window] = self.visible & (rows > self.tensor[:, None] - window)
        return self._windowed[window]

    def end_step(self, appended: bool = True) -> None:
        """Close the step; ``appended``: every layer wrote its row (False after a failed forward: the rows written
        stay past the counts, unused and masked, as before the step)."""
        if appended:
            self.host = [n + 1 for n in self.host]
            self.tensor += 1
        self.width, self.visible, self.mask, self._windowed = 0, None, None, {}


class BatchLayer(TaggedLayer, DynamicLayer):
    """One layer of the decode batch (see the module docstring); tagged so the kvcompress attention runs weighted
    attention over it with :meth:`key_mask`, :meth:`weights_for` and :meth:`clip_range`."""

    is_sliding = False

    def __init__(self, keys, values, weights, v_min, v_max, counts: RowCounts, window: int | None = None,
                 per_row_offsets: bool | None = None):
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.keys, self.values, self.weights = keys, values, weights
        self.value_min, self.value_max = v_min, v_max
        self.counts, self.window = counts, window
        self.is_initialized = True
        self.per_row_offsets = keys.is_cuda if per_row_offsets is None else per_row_offsets
        if self.is_compileable:  # the attention finds the layer from its keys: the same buffer every step
            tag_layer(self.keys, self)

    @property
    def is_compileable(self) -> bool:
        """A static batch (:func:`build` with ``static=True``): every step attends the whole capacity, visibility and
        the clip range on the device (:meth:`attention_inputs`), so one compiled graph serves every step."""
        return self.counts.static

    @property
    def row_weights(self) -> torch.Tensor:
        return self.weights

    @property
    def row_offsets(self) -> torch.Tensor | None:
        """On CUDA, each batch row's causal offset (``[B]`` int64, the index of its new row, read by the Triton
        kernel, which then reads no key past a row's own rows, however long the longest row); None elsewhere, where
        the PyTorch path masks with the step's one shared mask (fewer operators than each row's causal bound)."""
        return self.counts.tensor if self.per_row_offsets else None

    @property
    def lengths(self) -> list[int]:
        """Rows held per batch row (before the open step's row)."""
        return self.counts.host

    def update(self, key_states, value_states, cache_kwargs=None):
        counts = self.counts
        batch, _, new, _ = key_states.shape
        if new != 1 or batch != counts.tensor.shape[0]:  # not len(host): a compiled step would specialise on it
            raise ValueError(f"key_states: a decode step appends one row per session ([{len(counts.host)}, h, 1, d]), "
                             f"got {tuple(key_states.shape)}")
        if counts.visible is None:
            raise RuntimeError("kvcompress: a decode batch advances one step at a time: run it through decode_step")
        where = counts.tensor
        self.keys[counts.batch_index, :, where] = key_states[:, :, 0]
        self.values[counts.batch_index, :, where] = value_states[:, :, 0]  # the clip range folds it in: clip_range
        if self.is_compileable:
            return self.keys, self.values
        keys, values = self.keys[:, :, : counts.width], self.values[:, :, : counts.width]
        tag_layer(keys, self)
        return keys, values

    def attention_inputs(self, attention_mask=None) -> tuple[torch.Tensor, ...]:
        """A static batch's ``(key_mask [B, C], causal_offset [B], v_min, v_max)`` for the custom attention op
        (:mod:`kvcompress.ops`): each row's own rows (its sliding window's on such a layer) and its new row as its
        causal offset; the clip range widened in place by each row's new value (folding a row twice changes
        nothing, so a step run again after a failure needs no bookkeeping)."""
        counts = self.counts
        new = self.values[counts.batch_index, :, counts.tensor].to(self.value_min.dtype)  # [B, h, d_v]
        self.value_min.copy_(torch.minimum(self.value_min, new))
        self.value_max.copy_(torch.maximum(self.value_max, new))
        key_mask = counts.visible if self.window is None else counts.windowed(self.window)
        return key_mask, counts.tensor, self.value_min, self.value_max

    def key_mask(self, rows: int, attention_mask=None) -> torch.Tensor | None:
        """``[B, rows]`` bool: each batch row's own rows (None when every row is that long, or on CUDA, where
        :attr:`row_offsets` bound them); on a sliding-window layer, only the last ``window`` of them (the new token's
        own window)."""
        if self.window is not None and max(self.counts.host) + 1 > self.window:
            return self.counts.windowed(self.window)
        return None if self.per_row_offsets else self.counts.mask

    def weights_for(self, rows: int) -> torch.Tensor:
        return self.weights[:, :, :rows]

    def clip_range(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The clip range and the row each batch row appended this step (at its own length: ``fold_from`` as a
        tensor), which the attention call folds in place (inside the Triton kernel on a GPU). Folding a row twice
        changes nothing, so a step run again after a failure needs no bookkeeping."""
        return self.value_min, self.value_max, self.counts.tensor

    def folded(self, rows: int) -> None:
        pass

    def get_seq_length(self) -> int:
        return max(self.counts.host, default=0)

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.get_seq_length() + cache_position.shape[0], 0


class DecodeBatch(Cache):
    """The padded cache of the active sessions (a transformers ``Cache`` of :class:`BatchLayer`)."""

    def __init__(self, layers: list[BatchLayer]):
        super().__init__(layers=layers)

    @property
    def size(self) -> int:
        return len(self.layers[0].lengths) if self.layers else 0

    @property
    def capacities(self) -> tuple[int, ...]:
        """Rows each layer can hold per batch row."""
        return tuple(layer.keys.shape[-2] for layer in self.layers)

    @property
    def capacity(self) -> int:
        """The widest layer's capacity."""
        return max(self.capacities, default=0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers
                   for t in (layer.keys, layer.values, layer.weights, layer.value_min, layer.value_max))

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.layers[layer_idx or 0].get_seq_length() if self.layers else 0

    def row_counts(self) -> list[RowCounts]:
        """The distinct row counts of the layers (one unless layers hold different numbers of rows)."""
        return list({id(layer.counts): layer.counts for layer in self.layers}.values())


def row_bytes(cache: Cache) -> int:
    """Bytes one more row costs in a decode batch built from sessions like ``cache`` (all layers: K, V, weight)."""
    total = 0
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        total += keys.shape[1] * (keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size() + 4)
    return total


def batch_bytes(rows: int, capacities: Sequence[int], per_row: int, per_session: int) -> int:
    """Bytes of a decode batch of ``rows`` sessions, ``capacities`` rows each in each layer (one value: every layer);
    ``per_row``: a row's bytes in every layer together (the layers alike: each its share), ``per_session``: the clip
    ranges."""
    if not capacities:
        return 0
    return rows * (sum(capacities) * per_row // len(capacities) + per_session)


def build(kept: DecodeBatch | None, keep: list[int], new: list[list[RowSource]], capacity: int | Sequence[int],
          static: bool = False, per_row_offsets: bool | None = None) -> DecodeBatch | None:
    """A new decode batch: rows ``keep`` of ``kept`` (in that order), then the sessions ``new`` (each one list of
    :class:`RowSource` per layer), every row with room for ``capacity`` rows (per layer, or one for every layer).
    None when no session is left.
    ``static``: every step attends the whole capacity (:attr:`BatchLayer.is_compileable`), for compiled steps.
    ``per_row_offsets``: eager steps bound each row by its own causal offset instead of the step's shared mask
    (:attr:`BatchLayer.row_offsets`; default: on CUDA)."""
    if not keep and not new:
        return None
    count = (len(kept.layers) if kept is not None else len(new[0]))
    capacities = [capacity] * count if isinstance(capacity, int) else list(capacity)
    if len(capacities) != count:
        raise ValueError(f"capacity: {len(capacities)} capacities for a model of {count} layers")
    for i, room in enumerate(capacities):  # before anything is written: a static batch is rebuilt in its own buffers
        longest = max((session[i].keys.shape[-2] for session in new), default=0)
        if longest > room:
            raise ValueError(f"capacity: {room} rows cannot hold a session of {longest} rows (layer {i})")
    layers: list[BatchLayer] = []
    # One RowCounts per distinct lengths, and apart for sliding-window layers whatever their lengths: which layers
    # share one is then the model's structure, not the sessions' (a compiled step's graph depends on it)
    shared: dict[tuple, RowCounts] = {}
    index = None  # rows of ``kept`` to keep, on its device
    for i, capacity in enumerate(capacities):
        old = kept.layers[i] if kept is not None and keep else None
        sources = [sess[i] for sess in new]
        ref = old if old is not None else sources[0]
        ref_keys, ref_values = ref.keys, ref.values
        heads, d_k, d_v = ref_keys.shape[1], ref_keys.shape[-1], ref_values.shape[-1]
        batch = len(keep) + len(sources)
        reuse = static and old is not None and old.is_compileable and (old.keys.shape[0], old.keys.shape[2]) == (
            batch, capacity)
        if reuse:  # the same shape: the same buffers (a CUDA graph replays on them; new ones make it re-record)
            keys, values, weights, v_min, v_max = old.keys, old.values, old.weights, old.value_min, old.value_max
        else:
            keys = ref_keys.new_zeros(batch, heads, capacity, d_k)
            values = ref_values.new_zeros(batch, heads, capacity, d_v)
            # Weight 1 past every session's rows: a step's new row needs no write (rows past a count are masked)
            weights = torch.ones(batch, heads, capacity, dtype=torch.float32, device=keys.device)
            v_min = torch.empty(batch, heads, d_v, dtype=ref.v_min.dtype if old is None else old.value_min.dtype,
                                device=keys.device)
            v_max = torch.empty_like(v_min)
        lengths = []
        if old is not None:
            if index is None:  # the same rows of every layer: one host-to-device copy (a sync), not one a layer
                index = torch.tensor(keep, device=keys.device)
            span = min(old.keys.shape[-2], capacity)  # the selected rows are copied out before they are written
            keys[: len(keep), :, :span] = old.keys.index_select(0, index)[:, :, :span]
            values[: len(keep), :, :span] = old.values.index_select(0, index)[:, :, :span]
            weights[: len(keep), :, :span] = old.weights.index_select(0, index)[:, :, :span]
            v_min[: len(keep)], v_max[: len(keep)] = old.value_min[index], old.value_max[index]
            lengths += [old.lengths[b] for b in keep]
        for j, src in enumerate(sources, start=len(keep)):
            n = src.keys.shape[-2]
            keys[j, :, :n], values[j, :, :n], weights[j, :, :n] = src.keys[0], src.values[0], src.weights[0]
            if reuse:  # the row held another session: zeros and weight 1 past this one's rows, as in new buffers
                keys[j, :, n:], values[j, :, n:], weights[j, :, n:] = 0, 0, 1
            v_min[j], v_max[j] = src.v_min[0], src.v_max[0]
            lengths.append(n)
        window = old.window if old is not None else ref.window
        key = (tuple(lengths), window is None, capacity if static else None)
        counts = shared.get(key)
        if counts is None:
            counts = shared[key] = RowCounts(lengths, keys.device, capacity if static else None)
        if static:  # CUDA graphs replay in place; a rebuilt batch's new buffers are re-recorded, not recompiled
            for tensor in (keys, values, weights, v_min, v_max):
                torch._dynamo.mark_static_address(tensor, guard=False)
            for tensor in (keys, values, weights):
                mark_dynamic(tensor, 0, 2)
            for tensor in (v_min, v_max, counts.tensor, counts.batch_index):
                mark_dynamic(tensor, 0)
        layers.append(BatchLayer(keys, values, weights, v_min, v_max, counts, window, per_row_offsets))
    return DecodeBatch(layers)


STATIC_CAPACITY_STEP = 256  # a static batch's capacity, rounded up: few distinct shapes, so buffers are reused


def batch_capacity(rows: int, static: bool) -> int:
    """The capacity a batch whose longest session reserves ``rows`` rows gets: ``rows``, or for a static batch
    ``rows`` rounded up to a multiple of :data:`STATIC_CAPACITY_STEP` (each distinct shape is a CUDA graph to
    record, and a rebuild of the same shape keeps its buffers: :func:`build`)."""
    return rows if not static else -(-rows // STATIC_CAPACITY_STEP) * STATIC_CAPACITY_STEP


def mark_dynamic(tensor: torch.Tensor, *dims: int) -> torch.Tensor:
    """Compile ``dims`` (batch size, capacity) as symbolic sizes from the first graph on, and only those: the heads
    and head dims stay constants, so no size of one batch can coincide with them and specialise the graph."""
    for dim in dims:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return tensor
