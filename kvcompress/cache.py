"""Compressed cache layers: the weighted-coreset state lives with the cache, never with the model.

After compression, layer ``i`` of a ``DynamicCache`` holds the ``r`` rows of the compressed context
(protected tokens and coreset) followed by the rows of every later token. :class:`WeightedLayer` keeps,
for the compressed context only, the row weights ``w [b, h_kv, r]`` (float32; 1 on protected rows) and
the value range ``[v_min, v_max]`` of the whole original context ``[b, h_kv, d]``; later rows have
weight 1 and widen the range as they arrive (docs/ARCHITECTURE.md, "Contracts").
Because every later row is implicit, trimming the cache by slicing its keys/values (what the kvpress
pipeline does between questions) keeps the state consistent.

The attention function finds the state through the key tensor it receives: ``update`` tags the
returned keys with their layer. A cache that was never compressed carries no tag and runs stock sdpa.

Lengths: a compressed cache represents more tokens than it holds rows. ``cache.get_seq_length()``
(no layer index: what ``model.forward`` and ``generate`` use to continue positions) and ``cache.crop``
count tokens; ``cache.get_seq_length(layer_idx)`` counts the rows that layer holds (what kvpress's
pipeline slices to).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, StaticCache

from kvcompress.attention import fold_value_range_

ATTENTION_NAME = "kvcompress"  # the attention a compressed cache needs (registered by kvcompress.hf_attention)

_TAG = "_kvcompress_layer"


class TaggedLayer:
    """A cache layer whose tensors name it (:func:`tag_layer`): copied (``copy.copy``, ``copy.deepcopy``) or pickled
    (``pickle``, ``torch.save``), those tensors go as aliases of their storage without the tag, keeping their other
    attributes (a static address mark, say), and the new layer tags them itself: a copy's keys name the copy."""

    def __getstate__(self) -> dict:
        state, tagged = dict(self.__dict__), []
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and _TAG in value.__dict__:
                alias = value.detach()
                alias.__dict__.update((key, item) for key, item in value.__dict__.items() if key != _TAG)
                state[name] = alias
                tagged.append(name)
        state["_tagged"] = tagged
        return state

    def __setstate__(self, state: dict) -> None:
        tagged = state.pop("_tagged", [])
        self.__dict__.update(state)
        for name in tagged:
            tag_layer(state[name], self)


class BatchRowOps:
    """transformers' batch operations (beam search's ``reorder_cache``, ``batch_repeat_interleave`` for
    ``num_return_sequences`` over a prefilled cache, ``batch_select_indices``) through one ``_take_batch_rows(index)``
    that moves every per-row tensor a layer holds, not only its keys and values."""

    def _take_batch_rows(self, index: torch.Tensor) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: batch row ``i`` becomes row ``beam_idx[i]``."""
        self._take_batch_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times in place."""
        self._take_batch_rows(torch.arange(self.keys.shape[0]).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` (integer indices or a boolean mask)."""
        self._take_batch_rows(torch.arange(self.keys.shape[0], device=self.keys.device)[indices])


class WeightedLayer(TaggedLayer, BatchRowOps, DynamicLayer):
    """A DynamicLayer whose first ``row_weights.shape[-1]`` rows are a compressed, weighted context.

    ``row_valid [b, r]`` (bool, None = all real): False on filler rows, which pad the compressed context of
    a batch row that kept fewer rows than the longest one (they also carry ``w = 0`` and zero keys/values).
    Rows may only be appended, or cut back by slicing to the end of the compressed context or later: any
    other removal (an eviction press running after ours) would leave the weights misaligned and is refused.
    """

    is_sliding = False
    row_offsets = None  # no per-row causal offsets (a decode batch has them): the new rows see every row before them

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        row_weights: torch.Tensor,
        value_min: torch.Tensor,
        value_max: torch.Tensor,
        tokens: int,
        row_valid: torch.Tensor | None = None,
    ):
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.row_weights = row_weights.float()  # [b, h_kv, r]
        self.row_valid = row_valid  # [b, r] bool or None
        self.keys, self.values = keys, values
        self.is_initialized = True
        self.value_min, self.value_max = value_min, value_max  # [b, h_kv, d_v]
        self.position_offset = tokens - keys.shape[-2]  # tokens represented minus rows held
        # Per-step state kept across steps (nothing recomputed over the whole cache per step): the weights and
        # key mask of every row in buffers that grow by doubling, and the clip range over the rows seen so far.
        self._weights_buf = self.row_weights
        self._mask_buf: torch.Tensor | None = None
        self._range = self._context_range()  # (v_min, v_max, rows covered), folded in place by the attention calls

    @property
    def keys(self) -> torch.Tensor:
        return self._keys

    @keys.setter
    def keys(self, new: torch.Tensor) -> None:
        old = getattr(self, "_keys", None)
        if old is not None and new is not None and old.dim() == new.dim() == 4 and new.shape[-2] < old.shape[-2]:
            prefix = new.data_ptr() == old.data_ptr() and new.stride() == old.stride()
            if not prefix or new.shape[-2] < self.context_rows:
                raise RuntimeError(
                    f"kvcompress: something removed rows of a compressed cache layer ({old.shape[-2]} -> "
                    f"{new.shape[-2]} rows; its first {self.context_rows} rows carry weights). Eviction presses "
                    "(ComposedPress, DecodingPress, PrefillDecodingPress, ...) cannot run on a kvcompress cache; "
                    "crop it only back to the end of its context (cache.crop) or use the press on its own"
                )
        if old is not None and new is not None and (new.shape[-2] < old.shape[-2] or new.shape[0] != old.shape[0]):
            self._range = self._context_range()  # rows were cut back: start again
        self._keys = new

    @property
    def context_rows(self) -> int:
        return self.row_weights.shape[-1]

    def update(self, key_states, value_states, cache_kwargs=None):
        keys, values = super().update(key_states, value_states, cache_kwargs)
        tag_layer(keys, self)
        return keys, values

    def _take_batch_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (int64 ``[b']``, repeats allowed) of every per-row tensor: the rows held, their
        weights and filler mask, the value range and the per-step buffers. Without this, transformers' batch
        operations would move the keys and values and leave the weights to other batch rows."""

        def take(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.index_select(0, index.to(tensor.device))

        low, high, covered = self._range
        self.row_weights, self.row_valid = take(self.row_weights), take(self.row_valid)
        self.value_min, self.value_max = take(self.value_min), take(self.value_max)
        self._weights_buf, self._mask_buf = take(self._weights_buf), take(self._mask_buf)
        self._keys, self.values = take(self._keys), take(self.values)  # no setter: the range below stays valid
        self._range = (take(low), take(high), covered)

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        """Masks of a compressed cache are built in token space (the tokens it stands for, then the new ones):
        their last columns are the rows after the compressed context (see :meth:`key_mask`)."""
        return self.get_seq_length() + self.position_offset + cache_position.shape[0], 0

    def weights_for(self, rows: int) -> torch.Tensor:
        """Weights of the first ``rows`` cached rows: the coreset's, then 1 for later tokens (a view of a buffer
        that grows by doubling: no concatenation per step)."""
        if rows < self.context_rows:
            raise RuntimeError(
                f"kvcompress: the cache was cut to {rows} rows, inside its {self.context_rows}-row compressed "
                "context; crop a compressed cache only back to the end of its context or later"
            )
        if rows > self._weights_buf.shape[-1]:
            capacity = max(rows, 2 * self._weights_buf.shape[-1])
            grown = self.row_weights.new_ones(*self.row_weights.shape[:2], capacity)
            grown[..., : self.context_rows] = self.row_weights
            self._weights_buf = grown
        return self._weights_buf.narrow(2, 0, rows)

    def key_mask(self, rows: int, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """``[b, rows]`` bool, False on filler rows and on padded later tokens; None when every row is real.

        ``attention_mask``: the model's 4D mask ``[b, 1, q, tokens + q]`` in token space (see
        :meth:`get_mask_sizes`; bool, or additive float with 0 = visible) or None. Its last query row shows
        which later tokens are padding (causality among the new rows is applied separately)."""
        later = rows - self.context_rows
        tail = None
        if attention_mask is not None and later > 0:  # no .all() test: it would sync the device every layer
            last = attention_mask[:, 0, -1, -later:]
            tail = last if last.dtype == torch.bool else last == 0
        if self.row_valid is None and tail is None:
            return None
        buf = self._mask_buf
        if buf is None or rows > buf.shape[-1]:  # context part written once; grows by doubling
            capacity = max(rows, 2 * self.context_rows)
            buf = torch.ones(self.row_weights.shape[0], capacity, dtype=torch.bool, device=self.device)
            if self.row_valid is not None:
                buf[:, : self.context_rows] = self.row_valid
            self._mask_buf = buf
        if tail is None:
            buf[:, self.context_rows : rows] = True
        else:
            buf[:, self.context_rows : rows] = tail.to(buf.device)
        return buf[:, :rows]

    def clip_range(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The running clip range for an attention call over the first ``rows`` rows: ``(v_min, v_max, fold_from)``,
        where the call folds rows ``[fold_from, rows)`` into ``v_min`` / ``v_max`` in place (weighted attention's
        ``fold_from``: on the GPU inside the kernel, no launch of its own) and then reports :meth:`folded`. Rows are
        only appended, or cut back, which the ``keys`` setter notices and which restarts from the context's range."""
        if rows < self._range[2]:
            self._range = self._context_range()
        return self._range

    def _context_range(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A running range that starts as the context's: the layer's own tensors (the attention calls fold rows into
        them in place), outside autograd (a running statistic, like a max pooled over steps)."""
        return self.value_min.detach().clone(), self.value_max.detach().clone(), self.context_rows

    def folded(self, rows: int) -> None:
        """The call after :meth:`clip_range` folded every row up to ``rows`` in (reported after it ran: a call that
        failed leaves them to the next one)."""
        low, high, covered = self._range
        self._range = (low, high, max(covered, rows))

    def value_range(
        self, values: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[v_min, v_max]`` over the compressed context and every real row after it in ``values`` (copies: the
        running range goes on changing in place)."""
        rows = values.shape[-2]
        low, high, fold_from = self.clip_range(rows)
        fold_value_range_(low, high, values, fold_from, key_mask)
        self.folded(rows)
        return low.clone(), high.clone()


def tag_layer(keys: torch.Tensor, layer: object) -> None:
    """Mark ``keys`` (what a cache layer's ``update`` returns) as belonging to ``layer``, so the kvcompress attention
    runs weighted attention over it with the layer's ``key_mask``, ``weights_for`` and ``clip_range``. By a weak
    reference (one that compiled code can read): the layer holds its keys, and a strong one back made every
    compressed cache a reference cycle, freed (its device memory too) only when Python's collector ran. A weak
    reference is neither copied nor pickled with its layer: tagged layers derive from :class:`TaggedLayer`."""
    setattr(keys, _TAG, weakref.ref(layer))


def layer_of(keys: torch.Tensor) -> WeightedLayer | None:
    """The compressed layer whose ``update`` returned ``keys``, or None for an ordinary cache."""
    ref = getattr(keys, _TAG, None)
    return None if ref is None else ref()


class WeightedDynamicCache(DynamicCache):
    """A DynamicCache with at least one compressed or window-trimmed layer (see the module docstring for lengths).

    Token counts come from the first layer that is not a sliding window (rows held plus the tokens its rows
    stand for); window layers (:class:`kvcompress.window.WindowLayer`) follow that count: when the other layers
    were cut back to the end of the context (kvpress's pipeline between questions), they restore their rows there
    before the next step's masks are built."""

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if layer_idx == 0 and not torch.compiler.is_compiling():  # once a forward, before a row is written
            refuse_other_attention(sys._getframe(1))
            held = getattr(self.layers[0], "keys", None) if self.layers else None
            if isinstance(held, torch.Tensor) and held.dim() == 4 and held.dtype != key_states.dtype:
                raise ValueError(
                    f"past_key_values: the cache holds {held.dtype} keys and values, the model computes "
                    f"{key_states.dtype}: load the model in the cache's dtype, or compress with the model as it is"
                )
        return super().update(key_states, value_states, layer_idx, cache_kwargs)

    def _reference_layer(self):
        from kvcompress.window import WindowLayer

        return next((layer for layer in self.layers if not isinstance(layer, WindowLayer)), None)

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        if layer_idx is not None:
            return super().get_seq_length(layer_idx)
        if not self.layers:
            return 0
        first = self._reference_layer() or self.layers[0]
        return first.get_seq_length() + getattr(first, "position_offset", 0)

    def _sync_windows(self, cache_position: torch.Tensor | None) -> None:
        """Rewind every window layer to the cache's token count (host ints; a device read only when every layer
        is a window layer). Runs where the masks are built, before any layer of the step is updated."""
        from kvcompress.window import WindowLayer

        windows = [layer for layer in self.layers if isinstance(layer, WindowLayer)]
        if not windows:
            return
        if self._reference_layer() is not None:
            tokens = self.get_seq_length()
        elif cache_position is not None and cache_position.numel():
            tokens = int(cache_position[0])
        else:
            return
        for layer in windows:
            layer.rewind(tokens)

    def get_mask_sizes(self, cache_position: torch.Tensor, layer_idx: int) -> tuple[int, int]:
        if getattr(self.layers[layer_idx] if layer_idx < len(self.layers) else None, "is_sliding", False):
            self._sync_windows(cache_position)
        return super().get_mask_sizes(cache_position, layer_idx)

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (counted like ``get_seq_length()``); negative: drop from the end.
        Every layer is checked before any is cut: a refused crop leaves the cache as it was."""
        if max_length < 0:  # the same crop counted from the end: the same checks (a compressed context stays whole)
            max_length = max(0, self.get_seq_length() + max_length)
        targets = []
        for layer in self.layers:
            target = max_length
            if isinstance(layer, WeightedLayer) and max_length >= 0:
                target, context = max_length - layer.position_offset, layer.context_rows + layer.position_offset
                if target < layer.context_rows:
                    raise ValueError(
                        f"max_length: a compressed cache can be cropped back to its {context}-token context or "
                        f"later, got {max_length}"
                    )
            if hasattr(layer, "check_crop"):  # layers that refuse some lengths (windows, static buffers)
                layer.check_crop(target)
            targets.append(target)
        for layer, target in zip(self.layers, targets, strict=True):
            layer.crop(target)

    def __repr__(self) -> str:
        kinds = ", ".join(f"{kind}: {count} layers, {rows} rows" for kind, (count, rows) in layer_kinds(self).items())
        return f"{type(self).__name__}(tokens={self.get_seq_length()}; {kinds})"


def refuse_other_attention(frame, depth: int = 3) -> None:
    """ValueError if the attention module that updates this cache (the first ``self`` that is a module with a
    config, in ``frame`` or up to ``depth`` frames above it) runs another attention than kvcompress's: stock
    attention reads the rows unweighted, and gives wrong tokens without an error (a cache unpickled onto a fresh
    model, or the model switched back with ``set_attn_implementation``)."""
    for _ in range(depth):
        if frame is None:
            return
        module = frame.f_locals.get("self")
        config = getattr(module, "config", None) if isinstance(module, torch.nn.Module) else None
        if config is not None:
            used = getattr(config, "_attn_implementation", None)
            if used is not None and used != ATTENTION_NAME:
                raise ValueError(
                    f"past_key_values: a kvcompress-compressed cache needs the model's attention to be "
                    f"{ATTENTION_NAME!r}, "
                    f"got {used!r}: call kvcompress.use_weighted_attention(model) first (a press sets it on the model "
                    "it runs on; a fresh model, or one switched back, has its own)"
                )
            return
        frame = frame.f_back


def layer_kind(layer: object) -> str:
    """``"compressed"`` (weighted rows), ``"window"`` (a sliding-window layer) or ``"full"`` (every token)."""
    if isinstance(getattr(layer, "row_weights", None), torch.Tensor):
        return "compressed"
    return "window" if getattr(layer, "is_sliding", False) else "full"


def layer_rows(layer: object) -> int:
    """Rows a layer's attention reads (its key tensor's length; preallocated rows of a static layer included)."""
    keys = getattr(layer, "keys", None)
    return keys.shape[-2] if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0


def layer_kinds(cache: DynamicCache) -> dict[str, tuple[int, int]]:
    """Per layer kind (see :func:`layer_kind`), ``(layers, rows summed over them)``."""
    kinds: dict[str, tuple[int, int]] = {}
    for layer in cache.layers:
        count, rows = kinds.get(layer_kind(layer), (0, 0))
        kinds[layer_kind(layer)] = (count + 1, rows + layer_rows(layer))
    return kinds


_STATE = ("keys", "values", "row_weights", "row_valid", "value_min", "value_max", "context_keys", "context_values")


def cache_bytes(cache: DynamicCache, by_kind: bool = False) -> int | dict[str, int]:
    """Bytes a cache holds: the storage behind every layer's keys and values and, on compressed layers, the row
    weights, the filler mask and the value range (filler rows included: they are held); on window layers the
    rows kept to rewind to the end of the context. ``by_kind``: a dict per layer kind (:func:`layer_kind`).

    Storage, not view size: a slice that keeps a larger buffer alive counts the whole buffer; a buffer shared by
    several tensors counts once.
    """
    storages: dict[tuple[str, int], tuple[str, int]] = {}
    for layer in cache.layers:
        for tensor in (getattr(layer, name, None) for name in _STATE):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                storages.setdefault((str(tensor.device), storage.data_ptr()), (layer_kind(layer), storage.nbytes()))
    if not by_kind:
        return sum(nbytes for _, nbytes in storages.values())
    kinds: dict[str, int] = {}
    for kind, nbytes in storages.values():
        kinds[kind] = kinds.get(kind, 0) + nbytes
    return kinds


def check_cache(cache: object) -> None:
    """Raise ValueError unless ``cache`` is a transformers DynamicCache kvcompress can compress (not offloaded)."""
    if not isinstance(cache, DynamicCache) or getattr(cache, "offloading", False):
        static = isinstance(cache, StaticCache)  # also what generate(..., cache_implementation="static") builds
        raise ValueError(
            f"past_key_values: kvcompress compresses a transformers DynamicCache (not offloaded), got "
            f"{type(cache).__name__}"
            + ("; for compiled decode steps pass kvcompress.StaticWeightedCache(max_new_tokens=...) as "
               "past_key_values instead (README, 'Compiled decode')" if static else "")
        )


def empty_cache_restorer(cache: DynamicCache) -> Callable[[], None]:
    """A function that puts ``cache``, which holds no token yet, back as it is now: its class, its layer objects
    and their attributes (a prefill only assigns new tensors to a dynamic layer's attributes, so a shallow copy of
    each layer's ``__dict__`` is its whole state). For a prefill whose cache turned out unusable after the fact."""
    kind, layers = type(cache), [(layer, dict(vars(layer))) for layer in cache.layers]

    def restore() -> None:
        for layer, state in layers:
            vars(layer).clear()
            vars(layer).update(state)
        cache.__class__ = kind
        cache.layers[:] = [layer for layer, _ in layers]

    return restore


def install_compressed_layer(cache: DynamicCache, layer_idx: int, layer: WeightedLayer) -> None:
    """Replace layer ``layer_idx`` of ``cache`` by its compressed version, in place."""
    check_cache(cache)
    if type(cache) is DynamicCache:
        cache.__class__ = WeightedDynamicCache
    cache.layers[layer_idx] = layer
    tag_layer(layer.keys, layer)
