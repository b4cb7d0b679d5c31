"""Layers of :class:`kvcompress.static_cache.StaticWeightedCache`: fixed buffers whose per-step state lives in
device tensors updated in place (no Python value changes per decode step, no reallocation).

:class:`StaticWeightedLayer`: a compressed layer (context rows with weights, filler mask and clip range) plus
preallocated rows for new tokens. :class:`StaticWindowLayer`: a sliding-window layer as a ring of
``sliding_window`` rows. ``static_full_layer``: an uncompressed full-attention layer as a transformers
``StaticLayer``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, StaticLayer
from transformers.utils import is_torchdynamo_compiling

from kvcompress.cache import TaggedLayer, WeightedLayer, tag_layer
from kvcompress.hf_compat import lazy_initialize
from kvcompress.window import window_crop_refused, window_crop_target


def _static(*tensors: torch.Tensor) -> None:
    """Fixed addresses for compiled graphs and CUDA graphs (in-place updates of these are not graph breaks)."""
    if not is_torchdynamo_compiling():
        for tensor in tensors:
            torch._dynamo.mark_static_address(tensor)


def _check_batch(key_states: torch.Tensor, batch: int) -> None:
    """Raise unless ``key_states`` has the cache's ``batch`` rows (``generate`` expands the prompt, not the cache,
    for beam search and several sequences per prompt)."""
    if key_states.shape[0] != batch:
        raise ValueError(
            f"num_beams: a static compressed cache holds {batch} batch row(s) and gets {key_states.shape[0]}; it "
            "supports greedy and sampled decoding with num_beams=1 and num_return_sequences=1"
        )


def _check_capacity(slots: torch.Tensor, capacity: int, q: int) -> None:
    """Raise unless the new tokens' slots ``[q]`` (0 = the first row after the compressed context) lie in
    ``[0, capacity)``: a ``ValueError`` in eager CPU runs (one host read, free there), else a device-side assert."""
    message = (
        f"kvcompress: StaticWeightedCache is full: writing {q} new token(s) past its capacity of {capacity} new "
        "rows (max_new_tokens); build it with a larger max_new_tokens, or crop it back (cache.crop) first"
    )
    if slots.device.type == "cpu" and not is_torchdynamo_compiling():
        if int(slots[-1]) >= capacity:
            raise ValueError(message)
        if int(slots[0]) < 0:
            raise ValueError("cache_position: a static compressed cache cannot overwrite its compressed context")
    else:
        torch._assert_async((slots[-1] < capacity) & (slots[0] >= 0), message)


class StaticWeightedLayer(WeightedLayer):
    """A compressed layer in preallocated buffers (see the module docstring). ``keys``/``values`` are the whole
    buffers ``[b, h_kv, capacity, d]``; ``row_weights [b, h_kv, capacity]`` (1 after the compressed context)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, layer: WeightedLayer, max_new_tokens: int):
        rows = layer.keys.shape[-2]
        batch, heads, _, dim = layer.keys.shape
        capacity = rows + max_new_tokens
        keys = layer.keys.new_zeros(batch, heads, capacity, dim)
        values = layer.values.new_zeros(batch, heads, capacity, layer.values.shape[-1])
        keys[:, :, :rows], values[:, :, :rows] = layer.keys, layer.values
        weights = layer.weights_for(rows).new_ones(batch, heads, capacity)
        weights[..., : layer.context_rows] = layer.row_weights
        low, high = layer.value_range(layer.values)  # the context and any rows appended before conversion
        context_weights = weights[..., : layer.context_rows]
        super().__init__(keys, values, context_weights, low.clone(), high.clone(), 0, layer.row_valid)
        self.row_weights = weights
        self._context_rows = layer.context_rows
        self.position_offset = layer.position_offset
        self.capacity, self.max_cache_len, self.max_batch_size = capacity, capacity, batch
        self.base_min, self.base_max = layer.value_min, layer.value_max
        self._visible = torch.ones(batch, capacity, dtype=torch.bool, device=self.device)
        if layer.row_valid is not None:
            self._visible[:, : layer.context_rows] = layer.row_valid
        self._length = torch.full((1,), rows, dtype=torch.long, device=self.device)
        self._positions = torch.arange(capacity, dtype=torch.long, device=self.device)
        self._rows = self._length.clone()
        self._new_values = values[:, :, :0]
        _static(self._keys, self.values, self.row_weights, self._visible, self.value_min, self.value_max, self._length)
        tag_layer(self._keys, self)

    @property
    def context_rows(self) -> int:
        return self._context_rows if hasattr(self, "_context_rows") else self.row_weights.shape[-1]

    @property
    def keys(self) -> torch.Tensor:
        return self._keys

    @keys.setter
    def keys(self, new: torch.Tensor) -> None:
        old = getattr(self, "_keys", None)
        if old is None or new is None or new is old:
            self._keys = new
            return
        if new.data_ptr() == old.data_ptr() and new.stride() == old.stride() and new.shape[-2] < old.shape[-2]:
            self.crop(new.shape[-2])  # a prefix of the buffer: kvpress's pipeline cutting rows back
            return
        raise RuntimeError(
            "kvcompress: a static compressed cache layer keeps its buffers; cut it back with cache.crop(...) "
            "or by slicing its keys to a prefix"
        )

    @property
    def values(self) -> torch.Tensor:
        return self._values

    @values.setter
    def values(self, new: torch.Tensor) -> None:
        old = getattr(self, "_values", None)
        if old is None or new is None or new is old:
            self._values = new
        elif new.data_ptr() == old.data_ptr() and new.stride() == old.stride() and new.shape[-2] < old.shape[-2]:
            self.crop(new.shape[-2])
        else:
            raise RuntimeError("kvcompress: a static compressed cache layer keeps its buffers; see its keys setter")

    def get_seq_length(self) -> int:
        """Rows written (context included): one device read (eager use only; compiled steps never call it)."""
        return int(self._length.item())

    def get_max_cache_shape(self) -> int:
        return self.capacity + self.position_offset

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        """The model's mask covers only the preallocated rows after the compressed context (tokens
        ``[context tokens, context tokens + capacity - r)``): static sizes, so one compiled graph serves every step."""
        return self.capacity - self.context_rows, self.context_rows + self.position_offset

    def update(self, key_states, value_states, cache_kwargs=None):
        """Write the new rows in place at ``cache_position - position_offset`` (after the last written row when
        no ``cache_position`` is given)."""
        _check_batch(key_states, self.max_batch_size)
        positions = (cache_kwargs or {}).get("cache_position")
        q = key_states.shape[-2]
        if positions is None:
            rows = self._length + self._positions[:q]
        else:
            rows = positions.to(self.device) - self.position_offset
        self._check_rows(rows, q)
        self._keys.index_copy_(2, rows, key_states)
        self.values.index_copy_(2, rows, value_states)
        self._length.copy_(rows[-1:] + 1)
        self._rows, self._new_values = rows, value_states
        return self._keys, self.values

    def _check_rows(self, rows: torch.Tensor, q: int) -> None:
        _check_capacity(rows - self.context_rows, self.capacity - self.context_rows, q)

    def attention_inputs(self, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """``(key_mask [b, capacity], causal_offset [1], v_min, v_max)`` for this step's queries: the model's mask
        over the new rows (see :meth:`get_mask_sizes`) written into the filler mask, and the clip range widened
        in place by this step's real new rows."""
        later = self._visible[:, self.context_rows :]
        if attention_mask is None:
            later.fill_(True)
        else:
            if attention_mask.shape[-1] != later.shape[-1]:
                raise ValueError(
                    f"attention_mask: a static compressed cache needs the mask the model builds from it "
                    f"({later.shape[-1]} key columns), got {tuple(attention_mask.shape)}"
                )
            last = attention_mask[:, 0, -1]
            later.copy_(last if last.dtype == torch.bool else last == 0)
        real = self._visible.index_select(1, self._rows)[:, None, :, None]  # [b, 1, q, 1]
        new = self._new_values.to(self.value_min.dtype)
        self.value_min.copy_(torch.minimum(self.value_min, new.masked_fill(~real, float("inf")).amin(-2)))
        self.value_max.copy_(torch.maximum(self.value_max, new.masked_fill(~real, float("-inf")).amax(-2)))
        return self._visible, self._rows[:1], self.value_min, self.value_max

    def check_crop(self, max_length: int) -> int:
        """The rows :meth:`crop` keeps for ``max_length`` (negative: from the end), or the ``ValueError`` it raises."""
        if max_length < 0:
            max_length = self.get_seq_length() + max_length
        if not self.context_rows <= max_length <= self.capacity:
            raise ValueError(
                f"max_length: a static compressed layer keeps between {self.context_rows} and {self.capacity} rows, "
                f"got {max_length}"
            )
        return max_length

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` rows (>= the compressed context); the clip range restarts from the
        context's and covers the kept rows."""
        max_length = self.check_crop(max_length)
        self._length.fill_(max_length)
        low, high = self.base_min, self.base_max
        if max_length > self.context_rows:
            kept = self.values[:, :, self.context_rows : max_length].to(low.dtype)
            real = self._visible[:, None, self.context_rows : max_length, None]
            low = torch.minimum(low, kept.masked_fill(~real, float("inf")).amin(-2))
            high = torch.maximum(high, kept.masked_fill(~real, float("-inf")).amax(-2))
        self.value_min.copy_(low)
        self.value_max.copy_(high)

    def _take_batch_rows(self, index: torch.Tensor) -> None:
        """Beam search and the other batch operations (:class:`kvcompress.cache.BatchRowOps`) are refused: the
        buffers are fixed, one batch row."""
        raise ValueError("num_beams: a static compressed cache supports greedy and sampled decoding (num_beams=1)")


class StaticWindowLayer(TaggedLayer, CacheLayerMixin):
    """A sliding-window layer as a ring of ``sliding_window`` preallocated rows: token ``t`` lives in slot
    ``t % sliding_window``; which slot holds which token (``slot_tokens [W]``) and which hold real tokens
    (``slot_real [b, W]``) are device tensors updated in place, so decode steps need no host value (transformers'
    ``StaticSlidingWindowLayer`` keeps a Python counter that recompiles every step). Attention is stock sdpa with
    a mask built from those tensors (:meth:`window_mask`). It keeps its ring at the end of the context to restore
    it when the cache is cut back there (kvpress's pipeline between questions)."""

    is_compileable = True
    is_sliding = True

    def __init__(self, layer: DynamicLayer, sliding_window: int, max_new_tokens: int):
        super().__init__()
        tokens = getattr(layer, "cumulative_length", layer.keys.shape[-2])
        held = min(layer.keys.shape[-2], sliding_window - 1, tokens)
        batch, heads, _, dim = layer.keys.shape
        self.dtype, self.device = layer.keys.dtype, layer.keys.device
        self.sliding_window, self.context_tokens, self.max_new_tokens = sliding_window, tokens, max_new_tokens
        self.max_cache_len, self.max_batch_size = sliding_window, batch
        self.keys = layer.keys.new_zeros(batch, heads, sliding_window, dim)
        self.values = layer.values.new_zeros(batch, heads, sliding_window, layer.values.shape[-1])
        self.slot_tokens = torch.full((sliding_window,), -1, dtype=torch.long, device=self.device)
        self.slot_real = torch.zeros(batch, sliding_window, dtype=torch.bool, device=self.device)
        positions = torch.arange(tokens - held, tokens, device=self.device)
        slots = positions % sliding_window
        self.keys[:, :, slots] = layer.keys[:, :, layer.keys.shape[-2] - held :]
        self.values[:, :, slots] = layer.values[:, :, layer.values.shape[-2] - held :]
        self.slot_tokens[slots] = positions
        real = getattr(layer, "context_real", None)
        self.slot_real[:, slots] = True if real is None else real[:, real.shape[-1] - held :].to(self.device)
        self._length = torch.full((1,), tokens, dtype=torch.long, device=self.device)
        self._positions = self._length.clone()
        self.is_initialized = True
        self._context = [t.clone() for t in (self.keys, self.values, self.slot_tokens, self.slot_real)]
        _static(self.keys, self.values, self.slot_tokens, self.slot_real, self._length)
        tag_layer(self.keys, self)

    def _keep(self, name: str, new: torch.Tensor | None) -> None:
        """Assigning a view of the ring (kvpress's pipeline slicing every layer back after an answer) keeps the
        ring and restores it to the end of the context."""
        old = self.__dict__.get(name)
        if old is None or new is None or new is old:
            self.__dict__[name] = new
        elif new.data_ptr() != old.data_ptr():
            raise RuntimeError("kvcompress: a static window layer keeps its ring; cut the cache back with crop(...)")
        elif name == "_keys":
            self.rewind(self.context_tokens)  # the only point a window layer can go back to

    keys = property(lambda self: self.__dict__.get("_keys"), lambda self, new: self._keep("_keys", new))
    values = property(lambda self: self.__dict__.get("_values"), lambda self, new: self._keep("_values", new))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("kvcompress: a static window layer is built filled (StaticWeightedCache.freeze)")

    def get_seq_length(self) -> int:
        """Tokens seen (one device read: eager use only)."""
        return int(self._length.item())

    def get_max_cache_shape(self) -> int:
        return self.sliding_window

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        """The model's mask covers the new tokens' columns only (static sizes); :meth:`window_mask` reads which of
        this step's tokens are real from it."""
        return self.max_new_tokens, self.context_tokens

    def update(self, key_states, value_states, cache_kwargs=None):
        """One new token: written into its slot, then the ring is attended. Several: the ring as it was plus the
        new rows are attended (a new row may evict a slot an earlier new token still sees), then written."""
        _check_batch(key_states, self.max_batch_size)
        positions = (cache_kwargs or {}).get("cache_position")
        q = key_states.shape[-2]
        if positions is None:
            positions = self._length + torch.arange(q, device=self.device)
        positions = positions.to(self.device)
        _check_capacity(positions - self.context_tokens, self.max_new_tokens, q)
        self._positions = positions
        if q == 1:
            self._write(positions, key_states, value_states)
            self._attended = self.slot_tokens
            return self.keys, self.values
        keys, values = torch.cat([self.keys, key_states], 2), torch.cat([self.values, value_states], 2)
        self._attended = torch.cat([self.slot_tokens, positions])
        keep = slice(max(0, q - self.sliding_window), q)
        self._write(positions[keep], key_states[:, :, keep], value_states[:, :, keep])
        tag_layer(keys, self)
        return keys, values

    def _write(self, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        slots = positions % self.sliding_window
        self.keys.index_copy_(2, slots, keys)
        self.values.index_copy_(2, slots, values)
        self.slot_tokens.index_copy_(0, slots, positions)
        self._length.copy_(positions[-1:] + 1)

    def window_mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """``[b, 1, q, keys]`` bool for sdpa: key ``j`` (token ``t_j``) is visible to query ``p`` iff it is real and
        ``p - W < t_j <= p``. Real new tokens come from the model's mask (see :meth:`get_mask_sizes`)."""
        positions, attended = self._positions, self._attended
        batch, q = self.slot_real.shape[0], positions.shape[0]
        if attention_mask is None:
            real_new = torch.ones(batch, q, dtype=torch.bool, device=self.device)
        else:
            if attention_mask.shape[-1] != self.max_new_tokens:
                raise ValueError(
                    f"attention_mask: a static window layer needs the mask the model builds from it "
                    f"({self.max_new_tokens} key columns), got {tuple(attention_mask.shape)}"
                )
            # Each new token's own column in its own row (a token always sees itself unless it is padding): the
            # last row alone would not do, a sliding mask hides there the new tokens more than a window back.
            own = attention_mask[:, 0, torch.arange(q, device=positions.device), positions - self.context_tokens]
            real_new = own if own.dtype == torch.bool else own == 0
        if q == 1:
            real = self.slot_real.index_copy(1, positions % self.sliding_window, real_new)
            self.slot_real.copy_(real)
        else:
            real = torch.cat([self.slot_real, real_new], 1)
            keep = slice(max(0, q - self.sliding_window), q)
            self.slot_real.index_copy_(1, positions[keep] % self.sliding_window, real_new[:, keep])
        query = positions[:, None]
        visible = (attended[None, :] <= query) & (attended[None, :] > query - self.sliding_window)
        return (visible[None] & real[:, None, :])[:, None]

    def check_crop(self, max_length: int) -> None:
        """Raise the ``ValueError`` :meth:`crop` would raise, changing nothing (one device read)."""
        window_crop_target(max_length, self.get_seq_length(), self.context_tokens)

    def rewind(self, tokens: int) -> None:
        held = self.get_seq_length()
        if tokens == held:
            return
        if tokens != self.context_tokens:
            raise window_crop_refused(tokens, held, self.context_tokens)
        state = (self.keys, self.values, self.slot_tokens, self.slot_real)
        for tensor, saved in zip(state, self._context, strict=True):
            tensor.copy_(saved)
        self._length.fill_(self.context_tokens)

    def crop(self, max_length: int) -> None:
        tokens = window_crop_target(max_length, self.get_seq_length(), self.context_tokens)
        if tokens is not None:
            self.rewind(tokens)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("num_beams: a static compressed cache supports greedy and sampled decoding (num_beams=1)")


def static_full_layer(layer: DynamicLayer, max_new_tokens: int) -> StaticLayer:
    """An uncompressed full-attention layer as a transformers StaticLayer with ``max_new_tokens`` free rows."""
    rows = layer.keys.shape[-2]
    static = StaticLayer(max_cache_len=rows + max_new_tokens)
    lazy_initialize(static, layer.keys, layer.values)
    static.keys[:, :, :rows], static.values[:, :, :rows] = layer.keys, layer.values
    return static
