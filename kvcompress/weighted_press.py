"""The frame every kvcompress press shares: budget, protected tokens, hooks, padded batches, the repeat pass.

Each press keeps the first ``sink_size`` and last ``window_size`` context tokens exactly (weight 1) and replaces
the middle by a weighted subset, per batch row and KV head. The compressed layer
(:class:`kvcompress.cache.WeightedLayer`) carries the weights, and the model is switched to the "kvcompress"
attention, which runs weighted attention (Alg. 3) over such layers and stock sdpa everywhere else. The switch
outlives the ``with press(model)`` block on purpose: the question and the answer are computed after it.

A layer is compressed right after its prefill, as in kvpress. A press that reads the context a second time
(``reference`` with ``"repeat"``) streams that pass: right after a decoder layer's prefill the repeated tokens go
through that layer alone, chunk by chunk, and the layer is compressed before the next one runs, so only one layer
holds its full cache at a time. When the pieces it re-reads are chosen from every layer's prefill (``balanced()``),
the pass runs after the prefill, still layer by layer, each layer compressed before the next is read; on CUDA each
layer's full cache waits in pinned host memory from its prefill to its turn (:mod:`kvcompress.offload`), so the
device holds one or two full layers at a time there too. Where the repeat cannot run layer by layer (padded
batches, sliding-window layers, ``inputs_embeds``) every layer keeps its full cache until the prefill forward has
returned, the whole-model repeat pass runs, and all layers are compressed before the forward call gives control
back.

Padded batches: the 2D ``attention_mask`` of the prefill call says which tokens are real. Each row is then
compressed on its own real tokens (its budget, sink and window from its true length; pads never selected),
exactly as if it ran alone, and rows that keep fewer rows than the longest are filled with masked ``w = 0``
rows (see :mod:`kvcompress.padding`).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from kvpress.presses.base_press import BasePress, is_prefilling
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from kvcompress._checks import check_bool, check_compression_ratio, check_int_range, plain_scalars
from kvcompress.cache import WeightedLayer, check_cache
from kvcompress.compressed_layer import CompressedLayerRows
from kvcompress.compression_stream import CompressionStream, SideStreamCompression
from kvcompress.context_chunks import ChunkedReference, ContextChunkHooks
from kvcompress.hf_attention import handing_over_prefill_rows, take_prefill_rows, use_weighted_attention
from kvcompress.padding import row_kwargs
from kvcompress.prefill_call import PrefillCallHooks
from kvcompress.press_guards import (
    check_supported_model,
    refuse_a_second_press,
    refuse_a_wrapper,
    refuse_non_finite_layers,
)
from kvcompress.reference import LayerReference
from kvcompress.repeat_hooks import RepeatPassHooks
from kvcompress.window import layer_windows, trim_to_windows

logger = hf_logging.get_logger(__name__)

@dataclass(frozen=True)
class RowPlan:
    """How one row's ``tokens``-token context is compressed: exact first ``sink`` and last ``window`` tokens,
    ``middle`` rows for the rest; ``sink + window + middle`` is the row's budget."""

    tokens: int
    sink: int
    window: int
    middle: int

    @property
    def rows(self) -> int:
        return self.sink + self.window + self.middle


def split_budget(tokens: int, budget: int, sink: int, window: int) -> RowPlan:
    """``budget`` rows of a ``tokens``-token context: exact ``sink`` first and ``window`` last tokens, the rest middle
    rows; where they do not leave a middle row (a short context, or a layer paying for wider ones), the protected
    tokens shrink to half the budget, in proportion."""
    if sink + window >= budget:
        protected = budget // 2
        # Rounded up: without its first token (the attention sink; StreamingLLM, arXiv 2309.17453) a short
        # prompt's attention lands on whatever the middle kept, and a prior that drops small-value rows
        # (novelty_value_norm) makes the answers degenerate.
        sink = -(-protected * sink // (sink + window))
        window = protected - sink
    return RowPlan(tokens, sink, window, budget - sink - window)


@dataclass
class WeightedSubsetPress(
    SideStreamCompression, RepeatPassHooks, PrefillCallHooks, ContextChunkHooks, CompressedLayerRows, BasePress
):
    """Shared frame: protected sink/window tokens, a weighted middle, the budget of kvpress's ScorerPress.

    After compression each head holds exactly ``int(n * (1 - compression_ratio))`` rows of an n-token
    context, protected tokens included. When that budget cannot hold ``sink_size + window_size`` protected
    tokens plus a middle, both shrink in proportion to half the budget (the sink rounded up, so a press with a
    sink keeps the first token, the attention sink, whenever it keeps any protected row) and the middle gets the
    other half.
    A context that needs no removal, or whose budget is 0, is left untouched. Subclasses implement
    :meth:`compress_middle`, and :meth:`record_reference` / :meth:`reference_sources` when they need
    reference queries (the repeat pass's hooks: :class:`kvcompress.repeat_hooks.RepeatPassHooks`).
    ``overlap_compression`` (CUDA): each layer's selection and fit run on a second stream beside the next layer's
    prefill, or its repeat pass where that runs layer by layer (:mod:`kvcompress.compression_stream`); the same
    cache, each layer's full cache held until the next layer's compression starts. Off by default until measured
    on a GPU.
    The press's hooks run outside autograd: its rows are chosen and fitted, not differentiated, so a prefill run
    with gradients on keeps no graph of the compression (the model's own forward keeps its graph, and later decode
    steps theirs); a graph through the selection's in-place updates outlived its cache, each prefill's with it.
    """

    compression_ratio: float = 0.0
    sink_size: int = 32
    window_size: int = 32
    seed: int | None = None
    overlap_compression: bool = False
    _pending: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _repeating: bool = field(default=False, init=False, repr=False, compare=False)
    _entered: bool = field(default=False, init=False, repr=False, compare=False)
    _snapshot: list = field(default_factory=list, init=False, repr=False, compare=False)
    _attention_mask: Any = field(default=None, init=False, repr=False, compare=False)
    _wrapper_call: tuple = field(default=(None, None, False), init=False, repr=False, compare=False)  # _before_wrapper
    _images: bool = field(default=False, init=False, repr=False, compare=False)  # this prefill has image features
    _windows: list = field(default_factory=list, init=False, repr=False, compare=False)
    _prefilled: bool = field(default=False, init=False, repr=False, compare=False)
    _call: tuple = field(default=(None, None), init=False, repr=False, compare=False)  # (decoder, input_ids)
    _stream: Any = field(default=None, init=False, repr=False, compare=False)  # None: undecided; False: whole pass
    _parked: Any = field(default=None, init=False, repr=False, compare=False)  # None: undecided; False: not parked
    _finite: list = field(default_factory=list, init=False, repr=False, compare=False)  # (layer, names, bools)
    _positions: tuple = field(default=(None, None, False), init=False, repr=False, compare=False)  # _prefilling's
    _rows: Any = field(default=None, init=False, repr=False, compare=False)  # (n, real_token_rows) of this prefill
    _restore: Any = field(default=None, init=False, repr=False, compare=False)  # puts the cache back as before it
    _side: CompressionStream = field(default_factory=CompressionStream, init=False, repr=False, compare=False)
    _deferred: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # layer -> (cache, state)
    _chunks: Any = field(default=None, init=False, repr=False, compare=False)  # a ContextChunks while entered

    def __post_init__(self) -> None:
        plain_scalars(self)
        check_compression_ratio(self.compression_ratio)
        check_int_range("sink_size", self.sink_size, 0)
        check_int_range("window_size", self.window_size, 0)
        if self.seed is not None:
            check_int_range("seed", self.seed, -(2**63), 2**63 - 1)
        check_bool("overlap_compression", self.overlap_compression)

    def post_init_from_model(self, model: PreTrainedModel) -> None:
        # Called by another press (a wrapper: ComposedPress, PrefillDecodingPress, ...) outside our own `with`:
        # refused. A direct call (kvpress's idiom: post_init_from_model(model), then `with press(model)`) is not.
        refuse_a_wrapper(self, sys._getframe(1).f_locals.get("self"))
        check_supported_model(self, model)
        use_weighted_attention(model)
        self._windows = layer_windows(model)
        self.check_model(model, self._windows)
        if self._windows and all(window is not None for window in self._windows):
            logger.warning_once(
                f"{type(self).__name__}: every layer of this model uses a sliding window: nothing is compressed "
                "(each layer keeps its last sliding_window - 1 tokens, as without a press)"
            )

    def check_model(self, model: PreTrainedModel, windows: list[int | None]) -> None:
        """Check (and resolve) the press's per-layer settings against the model's layers (``windows``: each layer's
        sliding window, None for a full-attention layer); none here."""

    def budget(self, n: int) -> int:
        """Rows kept per head for an n-token context (kvpress ScorerPress's count; the same in every layer unless
        :meth:`layer_plan` moves rows between layers)."""
        return int(n * (1 - self.compression_ratio))

    def plan(self, n: int) -> RowPlan | None:
        """The split of an n-token context's budget; None when nothing is removed or no row can be kept."""
        budget = self.budget(n)
        if budget >= n or budget < 1:
            return None
        return split_budget(n, budget, self.sink_size, self.window_size)

    def layer_plan(self, plan: RowPlan | None, layer_idx: int) -> RowPlan | None:
        """Layer ``layer_idx``'s split of a context whose uniform split is ``plan``: ``plan`` itself here."""
        return plan

    def layer_seed(self, layer_idx: int) -> int | None:
        return None if self.seed is None else self.seed * 1_000_003 + layer_idx

    def reference_sources(self) -> tuple[str, ...]:
        """Reference-query sources this press reads (see :mod:`kvcompress.reference`); none by default."""
        return ()

    def scores_layer(self, layer_idx: int, tokens: int) -> bool:
        """Whether layer ``layer_idx`` of a ``tokens``-token context chooses its rows from reference scores (else
        it keeps them all, and no repeat-pass query is recorded for it)."""
        return True

    def prefill_output_rows(self) -> int:
        """How many of the context's last rows' attention outputs :meth:`record_reference` reads from the prefill's
        own attention call, where that call hands its rows over (:func:`kvcompress.hf_attention.take_prefill_rows`)."""
        return 0

    def reads_values(self) -> bool:
        """Whether :meth:`record_reference` reads the context's values (else it is handed None: a padded batch's
        rows then copy no values)."""
        return False

    def record_reference(
        self,
        module: torch.nn.Module,
        kwargs: dict,
        keys: torch.Tensor,
        values: torch.Tensor | None,
        chunked: ChunkedReference | None = None,
    ) -> LayerReference:
        """What :meth:`compress_middle` needs from this layer's prefill call (hook ``kwargs``; the context's keys and
        values ``[b, h_kv, n, d]``, values None unless :meth:`reads_values`). ``chunked``: the last call of a context
        read in several (:meth:`context_in_chunks`), what the earlier calls left for this layer."""
        return LayerReference()

    def compress_middle(
        self,
        module: torch.nn.Module,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        end: int,
        rows: int,
        reference: LayerReference,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replace context rows ``[start, end)`` of keys/values ``[b, h_kv, n, d]`` by ``rows`` weighted rows:
        ``(K [b, h_kv, rows, d], V [b, h_kv, rows, d_v], w [b, h_kv, rows])``."""
        raise NotImplementedError

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError(
            f"{type(self).__name__} stores per-row weights with the cache; it cannot run through kvpress's "
            "compress() protocol (e.g. inside ComposedPress, AdaKVPress or another press's wrapper). Use it on its own."
        )

    @contextmanager
    def __call__(self, model: PreTrainedModel):
        self.__post_init__()  # fields set after construction are checked too (kvpress's benchmarks set the ratio)
        refuse_a_second_press(self, model)
        self._pending, self._repeating, self._entered = {}, False, True
        try:
            with super().__call__(model):
                decoder = model.model.language_model if hasattr(model.model, "language_model") else model.model
                hooks = [decoder.register_forward_pre_hook(self._before_forward, with_kwargs=True)]
                if decoder is not model.model:  # a multimodal wrapper hands its decoder a mapping of 4D masks
                    hooks.append(model.model.register_forward_pre_hook(self._before_wrapper, with_kwargs=True))
                if "repeat" in self.reference_sources():
                    hooks.append(decoder.register_forward_hook(self._after_prefill, with_kwargs=True))
                    streamed = self._repeat_streamed
                    hooks += [layer.register_forward_hook(streamed, with_kwargs=True) for layer in decoder.layers]
                elif self.overlap_compression:
                    overlapped = self._compress_beside_next_layer
                    hooks += [layer.register_forward_hook(overlapped) for layer in decoder.layers]
                hooks.append(decoder.register_forward_hook(self._finish_prefill, with_kwargs=True))
                hooks.append(decoder.register_forward_hook(self._undo_a_failed_prefill, with_kwargs=True,
                                                           always_call=True))  # fmt: skip
                wants_rows = "induction" in self.reference_sources()
                try:
                    with handing_over_prefill_rows(self.prefill_output_rows()) if wants_rows else nullcontext():
                        yield
                finally:
                    for hook in hooks:
                        hook.remove()
        finally:
            self._deferred.clear()
            self._side.join()
            self._pending, self._repeating, self._entered, self._attention_mask = {}, False, False, None
            self._wrapper_call, self._images = (None, None, False), False
            self._position_ids = None
            self._prefilled, self._call, self._stream, self._parked = False, (None, None), None, None
            self._finite, self._positions, self._rows, self._restore = [], (None, None, False), None, None

    @torch.no_grad()  # the press's work runs outside autograd (WeightedSubsetPress's docstring)
    def _finish_prefill(self, decoder: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Decoder forward hook, after any repeat pass: sliding layers cut to their window
        (:mod:`kvcompress.window`), and a :class:`kvcompress.static_cache.StaticWeightedCache` made static."""
        self._compress_deferred()
        self._side.join()  # the compressed layers are read from here on
        if self._repeating:
            return
        if self._chunks is not None and self._chunks.call is not None:
            self._chunks.end_call()
            if self._chunks.compressing and not self._chunks.defer_compression:  # a repeat pass, after the last call
                self._chunks.compress_next(None)
        restore, self._restore = self._restore, None  # this call went through: nothing for _undo_a_failed_prefill
        if not self._prefilled:
            return
        self._prefilled = False
        flags, self._finite = self._finite, []
        try:
            refuse_non_finite_layers(flags, getattr(decoder, "dtype", None))
            cache = kwargs.get("past_key_values") or getattr(output, "past_key_values", None)
            if cache is None:
                return
            trim_to_windows(cache, self._windows, self._attention_mask)
            from kvcompress.static_cache import StaticWeightedCache

            if isinstance(cache, StaticWeightedCache):
                cache.freeze()
        except BaseException:
            if restore is not None:
                restore()  # no layer keeps rows compressed from NaN or Inf, nor a cache half made static
            raise

    def _prefilling(self, cache_position: torch.Tensor, n: int) -> bool:
        """kvpress's ``is_prefilling``, read once per decoder call: its layers share one ``cache_position`` tensor,
        and reading a device tensor makes the host wait for the GPU (each layer's read would wait for that layer's
        forward, and the press's kernels would then be launched behind an idle GPU)."""
        if self._positions[0] is not cache_position or self._positions[1] != n:  # reset by every decoder call
            self._positions = (cache_position, n, is_prefilling(cache_position, n))
        return self._positions[2]

    @torch.no_grad()  # the press's work runs outside autograd (WeightedSubsetPress's docstring)
    def forward_hook(self, module: torch.nn.Module, input: list, kwargs: dict, output: list) -> list:
        n = kwargs["hidden_states"].shape[1]
        chunks = None if self._repeating or self._chunks is None or self._chunks.call is None else self._chunks
        if chunks is None and not self._repeating and self.plan(n) is not None:
            if self._prefilling(kwargs["cache_position"], n):
                self._prefilled = True  # a prefill this press compresses: sliding layers are cut after it
        window = self._windows[module.layer_idx] if module.layer_idx < len(self._windows) else None
        if getattr(module, "is_sliding", False) or window is not None:
            return output  # sliding layers stay exact (cut to their window after the prefill)
        hidden_states, cache = kwargs["hidden_states"], kwargs["past_key_values"]
        if self._repeating:
            self._record_repeat(module, kwargs, cache)
            return output
        if chunks is not None:
            self._read_chunk(module, kwargs, cache, chunks)
            if chunks.last_call:
                self._compress_prefill(module, kwargs, cache, None, chunks.reference(module.layer_idx))
            return output
        if not self._prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            return output  # only the prefill is compressed
        check_cache(cache)
        layer = cache.layers[module.layer_idx]
        batch, _, n, _ = layer.keys.shape
        if n != hidden_states.shape[1] or isinstance(layer, WeightedLayer):
            raise ValueError(
                f"press: layer {module.layer_idx} holds {n} rows after a {hidden_states.shape[1]}-token prefill: "
                f"another press changed it before {type(self).__name__}, which runs alone (not nested or composed)"
            )
        self._compress_prefill(module, kwargs, cache, self._real_rows(batch, n, layer.keys.device))
        return output

    def _compress_prefill(self, module: torch.nn.Module, kwargs: dict, cache, rows, chunked=None) -> None:
        """Compress layer ``module`` of a prefill's ``cache`` (``rows``: each batch row's real tokens, None when
        unpadded; ``chunked``: the last call of a context read in chunks, a :class:`ChunkedReference`)."""
        layer = cache.layers[module.layer_idx]
        batch, _, n, _ = layer.keys.shape
        plans = [self.plan(n)] * batch if rows is None else [self.plan(len(index)) for index in rows]
        plans = [self.layer_plan(plan, module.layer_idx) for plan in plans]
        if all(plan is None for plan in plans):
            if self.budget(n) < 1:
                logger.warning_once(f"{type(self).__name__}: a {n}-token context keeps 0 rows; left uncompressed")
            return
        finite = torch.stack([torch.isfinite(layer.keys).all(), torch.isfinite(layer.values).all()])
        self._finite.append((module.layer_idx, ("keys", "values"), finite))  # read after the prefill
        wanted = self.reads_values()
        if rows is None:
            values = layer.values if wanted else None
            extra = {} if chunked is None else {"chunked": chunked}  # an override without the argument still serves
            references = [self.record_reference(module, kwargs, layer.keys, values, **extra)]
        else:
            references = [
                self.record_reference(
                    module, row_kwargs(kwargs, b, index), layer.keys[b : b + 1, :, index],
                    layer.values[b : b + 1, :, index] if wanted else None,
                )  # fmt: skip
                for b, index in enumerate(rows)
            ]
        take_prefill_rows(module.layer_idx)  # what the prefill's attention handed over and no recording took goes now
        state = dict(module=module, references=references, plans=plans, rows=rows, tokens=n)
        if chunked is not None and self._chunks.defers:  # compressed by the reading's compress_next()
            self._chunks.waiting.append((cache, state))
        elif "repeat" in self.reference_sources():
            self._pending[module.layer_idx] = state
        elif self.overlap_compression:  # compressed after this decoder layer, beside the next one
            self._deferred[module.layer_idx] = (cache, state)
        else:
            self._compress_layer(cache, state)
