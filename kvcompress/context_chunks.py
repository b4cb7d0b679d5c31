"""A context prefilled in several calls under a press, compressed after the last: the cache one call would make.

A long context need not run through the model in one forward: the forward's activations grow with its length (the
MLP's ``tokens x intermediate`` tensors), and a server's other answers wait for all of it. transformers reads a
prompt in chunks (``model.generate(..., prefill_chunk_size=C)``), but a press compresses the prefill it sees: a
kvpress press compresses the first chunk alone and keeps every later chunk whole.

``press.context_in_chunks(n)`` (:class:`ContextChunks`) tells a :class:`~kvcompress.weighted_press.
WeightedSubsetPress` that the next ``n`` tokens prefilled into an empty cache, in any number of calls, are one
context. In each call every full-attention layer keeps what the press's sources need from that call's queries
(their causal log-sum-exp comes from the call's own attention, :func:`kvcompress.hf_attention.
handing_over_prefill_rows`), and the call that reaches token ``n`` compresses every layer as one ``n``-token call
would. The sources read so are ``"novelty"`` (the keys alone, at the end), ``"window"`` (the last
``observation_window`` queries, carried from call to call with their normalisers and outputs) and ``"induction"``
(each query's recall of the key after it, span by span: :func:`kvcompress.selection.recall_score`): the default
press's. A repeat pass (``"repeat"``: ``thorough()``, ``balanced()``, ``kvzip()``) runs after the last call, as
after a one-call prefill: layer by layer (:meth:`~kvcompress.repeat_hooks.RepeatPassHooks._repeat_layer_by_layer`),
each layer compressed before the next is read, or, on a model with sliding-window layers, through the whole model
before the first layer is compressed. A press reading sampled or all prefill queries at once is refused, and says
why. Calls after the context (a question, decode steps) run as after a one-call prefill.

With ``defer_compression=True`` the last call only records each layer's references: its layers are then compressed
by :meth:`ContextChunks.compress_next`, a few at a time (a server spreads them over the rounds between decode
steps, so the last call stalls the other answers no longer than a chunk does), into the same cache.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, NamedTuple

import torch
from transformers import DynamicCache

from kvcompress._checks import check_bool, check_int_range
from kvcompress.cache import check_cache, empty_cache_restorer
from kvcompress.hf_attention import PrefillRows, handing_over_prefill_rows, take_prefill_rows
from kvcompress.padding import real_token_rows
from kvcompress.press_guards import refuse_non_finite_layers
from kvcompress.reference import post_rope_queries
from kvcompress.selection import causal_row_lse, recall_score

if TYPE_CHECKING:
    from kvcompress.weighted_press import WeightedSubsetPress

CHUNKED_SOURCES = ("window", "novelty", "induction", "repeat")


class ChunkedReference(NamedTuple):
    """What a layer hands :meth:`~kvcompress.weighted_press.WeightedSubsetPress.record_reference` in the context's
    last call: the context's last ``t`` rows (:class:`~kvcompress.hf_attention.PrefillRows`: queries
    ``[b, h_q, t, d]`` at positions ``n - t ..``, their causal log-sum-exp, their outputs or None) and every key's
    induction score ``[b, h_kv, n]`` float32 (None where the press reads none)."""

    rows: PrefillRows
    induction: torch.Tensor | None


class ContextChunks:
    """The next ``tokens`` tokens prefilled into an empty cache, over several calls, are one context for ``press``.

    Enter it inside the press's block, around all the calls (``model.generate(..., prefill_chunk_size=C)``) or
    around each (a server's chunk between two decode steps; the state is kept between entries)::

        reading = press.context_in_chunks(input_ids.shape[1])
        with press(model), reading:
            model.generate(input_ids, prefill_chunk_size=4096, max_new_tokens=64)

    The calls must continue the context in order from an empty cache, the last one ending at token ``tokens``, with
    no padding (``attention_mask`` all ones or None); each is checked before it runs. A call that fails puts the
    cache back empty, and this object refuses further calls: read the context again with a new one.

    ``defer_compression``: the last call records what each layer's compression needs and compresses none;
    :meth:`compress_next` then compresses them in layer order (the press need not be entered), and a call after the
    context is refused until every layer is. The same cache as without it.
    """

    def __init__(self, press: WeightedSubsetPress, tokens: int, defer_compression: bool = False):
        check_int_range("tokens", tokens, 1)
        check_bool("defer_compression", defer_compression)
        refusal = press.chunk_refusal()
        if refusal is not None:
            raise ValueError(f"context_in_chunks: {type(press).__name__} {refusal}")
        sources = press.reference_sources()
        self.press, self.tokens = press, tokens
        self.read = 0  # context tokens in the cache
        self.call: tuple[int, int] | None = None  # the running call's span of the context
        self.failed = False
        self.defer_compression = defer_compression
        self._repeat = "repeat" in sources  # the last call defers every layer: the pass runs after it
        self._ids: list[torch.Tensor] = []  # the context's token ids, call by call: the repeat pass reads them again
        self._decoder, self._shift, self._hidden = None, None, None  # the repeat pass's decoder, positions, states
        self._layer_by_layer = True  # else the whole-model pass (sliding-window layers), run before the first layer
        self.waiting: list[tuple] = []  # (cache, layer state) of the layers the last call left to compress
        self._flags: list = []  # their compressed values' finite flags, read after the last
        self.wants_rows = bool({"window", "induction"} & set(sources))
        self._induction = "induction" in sources
        self._tail_rows = press.chunk_tail_rows()
        self._output_rows = press.prefill_output_rows()
        self._scores: dict[int, list[torch.Tensor]] = {}
        self._tails: dict[int, PrefillRows] = {}
        self._stack: contextlib.ExitStack | None = None
        self._slot = None
        self.restore = None  # from the first call: puts the cache back empty and marks this reading failed

    @property
    def done(self) -> bool:
        """Whether every context token has been read and the cache compressed."""
        return self.read == self.tokens and not self.waiting

    @property
    def compressing(self) -> bool:
        """Whether every context token has been read and layers are left to :meth:`compress_next`."""
        return bool(self.waiting)

    @property
    def defers(self) -> bool:
        """Whether the last call leaves its layers to :meth:`compress_next` (asked for, or a repeat pass's: it runs
        after the last call, at its end unless asked for)."""
        return self.defer_compression or self._repeat

    @property
    def last_call(self) -> bool:
        """Whether the running call ends the context."""
        return self.call is not None and self.call[1] == self.tokens

    def __enter__(self) -> ContextChunks:
        if self.failed:
            raise RuntimeError("context_in_chunks: a call of this context failed and its cache was put back empty; "
                               "read the context again with a new press.context_in_chunks(...)")  # fmt: skip
        if self.press._chunks is not None:
            raise RuntimeError("context_in_chunks: this press already reads a context in chunks")
        self._stack = contextlib.ExitStack()
        if self.wants_rows:
            self._slot = self._stack.enter_context(handing_over_prefill_rows(self._output_rows, unpadded=False))
        self.press._chunks = self
        return self

    def __exit__(self, *exc) -> None:
        self.press._chunks = None
        self.call = None
        stack, self._stack, self._slot = self._stack, None, None
        if stack is not None:
            stack.close()

    def begin_call(self, cache, inputs: torch.Tensor, attention_mask, input_ids, position_ids) -> bool:
        """The decoder's pre-hook: check a call of ``inputs`` (its token ids ``[b, c]`` or embeddings ``[b, c,
        hidden]``) and start it; False for a call after the context (read as usual)."""
        batch, tokens, device = inputs.shape[0], inputs.shape[1], inputs.device
        if self.done:
            return False
        if self.compressing:
            raise ValueError(f"context_in_chunks: {len(self.waiting)} layers of the context are left to compress: "
                             f"call compress_next() until none is left before a call after the context")  # fmt: skip
        if not isinstance(cache, DynamicCache):
            raise ValueError(f"past_key_values: a context read in chunks needs one DynamicCache passed to every call, "
                             f"got {type(cache).__name__}")  # fmt: skip
        held = cache.get_seq_length()
        if held != self.read:
            raise ValueError(
                f"context_in_chunks: the cache holds {held} tokens where {self.read} of the context's {self.tokens} "
                f"have been read: the calls must continue the context in order, from an empty cache"
            )
        if self.read + tokens > self.tokens:
            raise ValueError(
                f"context_in_chunks: a {tokens}-token call after {self.read} of the context's {self.tokens} tokens "
                f"runs past its end: the call that ends the context must end at token {self.tokens} (a question "
                f"after it in a call of its own)"
            )
        if real_token_rows(attention_mask, batch, tokens, device) is not None:
            raise ValueError("attention_mask: a context read in chunks has no padding (a mask of ones, or None)")
        if self.read == 0:
            check_cache(cache)
            restore = empty_cache_restorer(cache)

            def put_back() -> None:
                self.failed = True
                self._scores.clear()
                self._tails.clear()
                self.waiting.clear()
                self._ids, self._hidden = [], None
                restore()

            self.restore = put_back
        self.call = (self.read, self.read + tokens)
        if self._repeat:
            self._start_repeat(input_ids, position_ids)
        if self._slot is not None:
            self._slot.unpadded = True
        return True

    def end_call(self) -> None:
        """The decoder's forward hook, after the call went through."""
        self.read, self.call = self.call[1], None
        if self._slot is not None:
            self._slot.unpadded = False
        if self.read == self.tokens:
            self._scores.clear()
            self._tails.clear()

    @torch.no_grad()  # the press's work runs outside autograd
    def compress_next(self, layers: int | None = 1) -> int:
        """Compress the next ``layers`` layers the last call left (all of them when None); the number left. After
        the last, the compressed values are checked finite (else the cache is put back empty, ValueError)."""
        if layers is not None:
            check_int_range("layers", layers, 1)
        if self.failed:
            raise RuntimeError("context_in_chunks: a call of this context failed and its cache was put back empty")
        if self._repeat and self.waiting and not self.press._entered:
            raise RuntimeError(f"compress_next: {type(self.press).__name__} reads reference 'repeat', a pass through "
                               f"the model's layers: call it inside `with press(model):`")  # fmt: skip
        count = len(self.waiting) if layers is None else min(layers, len(self.waiting))
        try:
            for _ in range(count):
                cache, state = self.waiting[0]
                layer = state["module"].layer_idx
                held = cache.layers[layer].keys.shape[-2]
                if held != self.tokens:
                    raise ValueError(f"context_in_chunks: layer {layer} holds {held} rows where the context has "
                                     f"{self.tokens}: a call ran on the cache before its layers were all compressed")
                if self._repeat:
                    self._repeat_through(cache, state)
                self.press._compress_layer(cache, state, self._flags)
                self.waiting.pop(0)
            if not self.waiting and count:
                flags, self._flags = self._flags, []
                refuse_non_finite_layers(flags, cache.layers[layer].keys.dtype)
        except BaseException:
            self.restore()
            raise
        return len(self.waiting)

    def _repeat_through(self, cache, state: dict) -> None:
        """The repeat pass through the next waiting layer (the first: the repeated tokens embedded), inside the
        press's block (its attention hooks record the queries); on a model with sliding-window layers the whole
        pass, before the first waiting layer."""
        press = self.press
        if not self._layer_by_layer:
            if self._ids:
                ids, self._ids = torch.cat(self._ids, dim=1), []
                references = {waiting["module"].layer_idx: waiting["references"][0] for _, waiting in self.waiting}
                press._repeat_whole_model(self._decoder, cache, ids, references, self._shift)
            return
        if self._hidden is None:
            layers = [waiting["module"].layer_idx for _, waiting in self.waiting]
            if layers != list(range(len(self._decoder.layers))):  # a layer left out would break the pass's chain
                raise ValueError(f"context_in_chunks: a repeat pass runs through every layer in order; layers "
                                 f"{layers} of {len(self._decoder.layers)} wait to be compressed")  # fmt: skip
            ids, self._ids = torch.cat(self._ids, dim=1), []
            references = [waiting["references"][0] for _, waiting in self.waiting]
            self._hidden = press._embedded_chunks(self._decoder, ids, references)
        press._repeat_through(self._decoder, cache, state, self._hidden, self._shift)
        if len(self.waiting) == 1:
            self._hidden = None

    def _start_repeat(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None) -> None:
        """A call of a context a repeat pass reads again: keep its token ids (and, in the last call, where its
        positions put the repeated tokens); the pass runs layer by layer where the model allows it (no
        sliding-window layer, a decoder with its own embedding and rotary tables), else through the whole model."""
        press, decoder = self.press, self.press._call[0]
        if input_ids is None:
            raise ValueError(f"input_ids: {type(press).__name__} with reference 'repeat' reads the context's token ids "
                             f"a second time; call the model with input_ids (not inputs_embeds)")  # fmt: skip
        self._layer_by_layer = all(window is None for window in press._windows) and \
            hasattr(decoder, "rotary_emb") and hasattr(decoder, "embed_tokens")  # fmt: skip
        self._ids.append(input_ids)
        self._decoder = decoder
        if self.call[1] == self.tokens and position_ids is not None:  # the tokens after the context's last position
            self._shift = position_ids[:, -1] + 1 - self.tokens

    def add(self, layer_idx: int, rows: PrefillRows, keys: torch.Tensor, scaling: float) -> None:
        """Keep layer ``layer_idx``'s part of the running call: its queries' recall scores of the keys after them
        and the context's last rows so far. ``rows``: the call's queries ``[b, h_q, c, d]``, causal log-sum-exp
        ``[b, h_q, c]`` and last outputs (or None); ``keys``: the layer's cache ``[b, h_kv, >= end, d]``."""
        start, end = self.call
        earlier = self._tails.get(layer_idx)
        if self._induction:
            if start == 0:  # key 0 is recalled by no query: 0
                zero = torch.zeros(*keys.shape[:2], 1, dtype=torch.float32, device=keys.device)
                span = recall_score(rows.queries[:, :, :-1], rows.lse[:, :, :-1], keys[:, :, 1:end], scaling, 1)
                span = torch.cat([zero, span], dim=2)
            else:  # key `start` is recalled by the earlier call's last query
                queries = torch.cat([earlier.queries[:, :, -1:], rows.queries[:, :, :-1]], dim=2)
                lse = torch.cat([earlier.lse[:, :, -1:], rows.lse[:, :, :-1]], dim=2)
                span = recall_score(queries, lse, keys[:, :, start:end], scaling, start)
            self._scores.setdefault(layer_idx, []).append(span)
        self._tails[layer_idx] = _last_rows(earlier, rows, self._tail_rows, self._output_rows)

    def reference(self, layer_idx: int) -> ChunkedReference:
        """Layer ``layer_idx``'s :class:`ChunkedReference` once the last call has run through it."""
        scores = self._scores.pop(layer_idx, None)
        induction = torch.cat(scores, dim=2) if scores else None
        return ChunkedReference(self._tails.pop(layer_idx, None), induction)


class ContextChunkHooks:
    """The press's side of a context read in chunks, for :class:`~kvcompress.weighted_press.WeightedSubsetPress`
    (a mixin: it reads the press's ``_chunks``, ``reference_sources``, ``plan`` and sets ``_restore``,
    ``_attention_mask``, ``_rows`` and ``_prefilled``): what the press refuses, each call's start (the decoder's
    pre-hook) and each layer's part of it (the layer's hook)."""

    def chunk_refusal(self) -> str | None:
        """Why this press cannot read a context in chunks (:meth:`context_in_chunks`), or None."""
        others = [source for source in self.reference_sources() if source not in CHUNKED_SOURCES]
        if others:
            return (f"reads reference={others} (all prefill queries at once); a context read in chunks gives "
                    f"{list(CHUNKED_SOURCES)}")  # fmt: skip
        return None

    def chunk_tail_rows(self) -> int:
        """How many of the context's last queries a context read in chunks carries from call to call (at least the
        one the induction score of the next call's first key needs)."""
        return 1

    def context_in_chunks(self, tokens: int, defer_compression: bool = False) -> ContextChunks:
        """The next ``tokens`` tokens prefilled into an empty cache, in several calls, are one context, compressed
        after the last as one call would be (:class:`kvcompress.context_chunks.ContextChunks`; ValueError naming
        the reason where this press's sources need the whole prefill at once). ``defer_compression``: the layers
        are compressed by the reading's ``compress_next()`` after the last call, not in it."""
        return ContextChunks(self, tokens, defer_compression)

    def _begin_chunk(self, cache, inputs: torch.Tensor, mask, input_ids, position_ids) -> None:
        """A call while the press reads a context in chunks (:mod:`kvcompress.context_chunks`): checked and started
        there; a call of the context puts the cache back empty if it fails, and its last call is a prefill this
        press compresses (sliding layers cut after it)."""
        chunks = self._chunks
        if chunks.begin_call(cache, inputs, mask, input_ids, position_ids):
            self._restore = chunks.restore
            self._attention_mask, self._rows = None, None  # checked: no padding
            self._prefilled = chunks.last_call and self.plan(chunks.tokens) is not None

    def _read_chunk(self, module: torch.nn.Module, kwargs: dict, cache, chunks: ContextChunks) -> None:
        """One call of a context read in chunks, through layer ``module``: its queries' part of the references,
        from what its attention handed over (else from its hidden states, the normalisers computed here)."""
        if not chunks.wants_rows:
            return
        hidden, keys = kwargs["hidden_states"], cache.layers[module.layer_idx].keys
        rows = take_prefill_rows(module.layer_idx)
        if rows is None or rows.queries.shape[-2] != hidden.shape[1]:
            queries = post_rope_queries(module, hidden, kwargs["position_embeddings"])
            lse = causal_row_lse(queries, keys, module.scaling, first=chunks.call[0])
            rows = PrefillRows(queries, lse, None)
        chunks.add(module.layer_idx, rows, keys, module.scaling)


def _last_rows(earlier: PrefillRows | None, rows: PrefillRows, count: int, outputs: int) -> PrefillRows:
    """The last ``count`` rows of ``earlier`` followed by ``rows`` (their last ``outputs`` outputs; None where a
    call kept none)."""
    if earlier is None:
        queries, lse, last = rows
    else:
        queries = torch.cat([earlier.queries, rows.queries], dim=2)
        lse = torch.cat([earlier.lse, rows.lse], dim=2)
        last = None
        if earlier.last_outputs is not None and rows.last_outputs is not None:
            last = torch.cat([earlier.last_outputs, rows.last_outputs], dim=2)
        elif rows.last_outputs is not None and rows.last_outputs.shape[2] >= outputs:
            last = rows.last_outputs
    if last is not None:
        last = last[:, :, -outputs:] if outputs else None
    # copies: a view would hold the whole call's queries
    return PrefillRows(queries[:, :, -count:].clone(), lse[:, :, -count:].clone(),
                       None if last is None else last.clone())  # fmt: skip


def prefill_in_chunks(
    model,
    press: WeightedSubsetPress | None,
    input_ids: torch.Tensor,
    chunk_size: int,
    cache: DynamicCache | None = None,
) -> DynamicCache:
    """Prefill the context ``input_ids [b, n]`` (no padding) under ``press`` in calls of at most ``chunk_size``
    tokens: the cache one call under the press makes (compressed after the last call), with activations of
    ``chunk_size`` tokens at a time (``press`` None: the plain calls, nothing compressed). ``cache``: an empty
    :class:`~transformers.DynamicCache` (a new one if None)."""
    check_int_range("chunk_size", chunk_size, 1)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
        shape = getattr(input_ids, "shape", input_ids)
        raise ValueError(f"input_ids: expected token ids [batch, tokens >= 1], got {shape}")
    cache = DynamicCache() if cache is None else cache
    decoder = model.model
    reading = None if press is None else press.context_in_chunks(input_ids.shape[1])
    with contextlib.nullcontext() if press is None else press(model), reading or contextlib.nullcontext():
        for start in range(0, input_ids.shape[1], chunk_size):
            chunk = input_ids[:, start : start + chunk_size]
            positions = torch.arange(start, start + chunk.shape[1], device=chunk.device).expand(chunk.shape[0], -1)
            decoder(input_ids=chunk, past_key_values=cache, position_ids=positions, use_cache=True)
    return cache
