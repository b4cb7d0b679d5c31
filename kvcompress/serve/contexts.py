"""The context side of the server's :class:`~kvcompress.serve.engine.Engine`: a request's context cache, from the
store (the same context), a stored earlier turn extended by the new turns (``--turn-reuse prefix``), or a new prefill
under the press; and, for a long one, read in chunks between decode steps.

A context is read in chunks of ``--prefill-chunk`` tokens (:meth:`ContextSource.start_reading`, then
:meth:`ContextSource.read_chunk` once a round) when what must be prefilled is longer than a chunk: a new context
under a press that reads its sources call by call (:mod:`kvcompress.context_chunks`: compressed after its last chunk
as one call compresses it; its uncompressed rows held against the memory budget until then), or the new turns after
a stored earlier turn (prefilled exact, as in one call). Otherwise one call does it (:meth:`ContextSource.
context_cache`). A new context's layers are compressed in the rounds after its last chunk, a few layers a round, each
round about as long as one of its chunks: its last chunk then stalls the other answers no longer than the others do.
"""

from __future__ import annotations

import logging
import math
import time

import torch
from transformers import DynamicCache

from kvcompress.serve.jobs import Opening
from kvcompress.serve.store import answer_view

log = logging.getLogger("kvcompress.serve")


class TailRead:
    """The new turns after a stored earlier turn, read in chunks: tokens ``[read, tokens)`` of the context are left
    (no press: they are kept exact, as a one-call prefill keeps them)."""

    def __init__(self, stored: int, tokens: int):
        self.stored, self.read, self.tokens = stored, stored, tokens

    @property
    def done(self) -> bool:
        return self.read == self.tokens


class ContextSource:
    """A mixin of the engine: it reads ``model``, ``press``, ``store``, ``metrics``, ``model_name``, ``press_label``,
    ``prefix_min_fraction``, ``compress_min_tokens``, ``full_row_bytes``, ``repeat_row_bytes`` and ``scheduler``
    (its ``prefill_chunk`` and ``memory``)."""

    compress_round_seconds: float | None = None  # layers compressed a round after a context's last chunk, until
    # this long (at least one layer); None: its chunks' mean time

    def stored(self, context_ids: list[int]):
        """The store entry of exactly this context, or None (marks it used)."""
        return self.store.get((tuple(context_ids), self.model_name, self.press_label)) if context_ids else None

    def is_stored(self, context_ids: list[int]) -> bool:
        """Whether exactly this context is stored (a request on it needs no context prefill); marks nothing."""
        return bool(context_ids) and (tuple(context_ids), self.model_name, self.press_label) in self.store

    def context_cache(self, context_ids: list[int], rid: str = "-") -> DynamicCache:
        """The stored cache of this context (exact hit, a stored earlier turn extended, or a new prefill)."""
        tokens = tuple(context_ids)
        key = (tokens, self.model_name, self.press_label)
        if not tokens:
            return DynamicCache()
        entry = self.store.get(key)
        if entry is not None:
            self.metrics.context_hits.labels(kind="exact").inc()
            log.info("request %s reuse hit: %d context tokens stored as %d rows, no prefill", rid, len(tokens),
                     entry.cache.get_seq_length(0))
            return entry.cache
        start = time.perf_counter()
        prefix = self._prefix(tokens)
        if prefix is not None:  # a later turn: the stored part stays as it is, the new turns are prefilled exact
            self.metrics.context_hits.labels(kind="prefix").inc()
            cache = answer_view(prefix.cache)
            self._prefill_at(cache, tokens, prefix.tokens, len(tokens))
            log.info("request %s reuse hit (earlier turn): %d of %d context tokens stored, %d new tokens prefilled "
                     "exact in %.2f s", rid, prefix.tokens, len(tokens), len(tokens) - prefix.tokens,
                     time.perf_counter() - start)
        else:
            self.metrics.context_misses.inc()
            self.metrics.prefills.inc()
            cache = DynamicCache()
            ids = torch.tensor([tokens], device=self.model.device)
            short = self.press is not None and len(tokens) < self.compress_min_tokens  # kept whole
            if short:
                self.metrics.short_contexts.inc()
            if self.press is None or short:
                self.model.model(input_ids=ids, past_key_values=cache)
            else:
                try:
                    with self.press(self.model):
                        self.model.model(input_ids=ids, past_key_values=cache)
                except (AssertionError, ValueError) as err:  # e.g. kvpress's SnapKV on a context under its window
                    log.warning("the press cannot compress this %d-token context (%s); it is kept uncompressed",
                                len(tokens), str(err).splitlines()[0] if str(err) else type(err).__name__)
                    self.metrics.uncompressed.inc()
                    cache = DynamicCache()
                    self.model.model(input_ids=ids, past_key_values=cache)
            whole = f" (kept whole: under --compress-min-tokens {self.compress_min_tokens})" if short else ""
            log.info("request %s prefill+compress: %d context tokens -> %d rows in %.2f s%s", rid, len(tokens),
                     cache.get_seq_length(0), time.perf_counter() - start, whole)
        self.metrics.prefill_seconds.observe(time.perf_counter() - start)
        self.store.put(key, cache, len(tokens))
        return cache

    def _prefill_at(self, cache, token_ids, start: int, end: int) -> None:
        """Prefill context tokens ``token_ids[start:end]`` into ``cache`` at their positions (the calls of a stored
        turn's new turns and of a context read in chunks)."""
        device = self.model.device
        ids = torch.tensor([token_ids[start:end]], device=device)
        positions = torch.arange(start, end, device=device).unsqueeze(0)
        self.model.model(input_ids=ids, past_key_values=cache, position_ids=positions)

    def _prefix(self, tokens: tuple[int, ...]):
        """The stored earlier turn that serves ``tokens`` (the longest stored proper prefix covering at least
        ``prefix_min_fraction`` of it; marked used), or None."""
        min_tokens = max(1, math.ceil(self.prefix_min_fraction * len(tokens)))
        return self.store.longest_prefix(tokens, self.model_name, self.press_label, min_tokens)

    def reads_in_chunks(self, context_ids: list[int]) -> bool:
        """Whether this context is read in chunks of ``--prefill-chunk`` tokens between decode steps: not stored,
        and either the new turns after a stored earlier turn are longer than a chunk, or it is new, longer than a
        chunk, compressed (not under ``--compress-min-tokens``) under a press that reads its sources call by call
        (the default press does; a press with a repeat pass too, the pass run in the rounds after the last chunk,
        layer by layer, or whole in the first of them on a model with sliding-window layers; a kvpress press needs
        one call), with its uncompressed rows within the memory budget."""
        return self._reading(context_ids) is not None

    def _reading(self, context_ids: list[int]) -> str | tuple | None:
        """``"new"``, ``("tail", stored entry)`` or None (one call, or nothing to prefill): see
        :meth:`reads_in_chunks`."""
        n, chunk, press = len(context_ids), self.scheduler.prefill_chunk, self.press
        if n <= chunk or self.is_stored(context_ids):
            return None
        prefix = self._prefix(tuple(context_ids))
        if prefix is not None:
            return ("tail", prefix) if n - prefix.tokens > chunk else None
        if press is None or n < self.compress_min_tokens or self._held_bytes(n) > self.scheduler.memory:
            return None
        if not hasattr(press, "chunk_refusal") or press.chunk_refusal() is not None:
            return None
        return "new"

    def bytes_held_while_read(self, context_ids: list[int]) -> int:
        """What reading this context holds beyond its estimate until it is compressed: a new context read in chunks,
        all its rows uncompressed (:meth:`_held_bytes`); else 0 (new turns after a stored one are stored as they
        are)."""
        return self._held_bytes(len(context_ids)) if self._reading(context_ids) == "new" else 0

    def _held_bytes(self, tokens: int) -> int:
        """What a new context of ``tokens`` tokens read in chunks holds until compressed: its uncompressed rows and,
        under a press with a repeat pass, the repeated tokens' hidden states (at most all of them)."""
        repeat = self.repeat_row_bytes if "repeat" in getattr(self.press, "reference_sources", tuple)() else 0
        return tokens * (self.full_row_bytes + repeat)

    def start_reading(self, context_ids: list[int]) -> tuple | None:
        """For a context :meth:`reads_in_chunks`: ``(reading, cache it fills, bytes it holds uncompressed until it is
        compressed)``, nothing read yet (the context counted a miss or a prefix hit now); else None."""
        reading = self._reading(context_ids)
        if reading is None:
            return None
        n = len(context_ids)
        if reading == "new":
            self.metrics.context_misses.inc()
            self.metrics.prefills.inc()
            reading = self.press.context_in_chunks(n, defer_compression=True)
            return reading, DynamicCache(), self._held_bytes(n)
        prefix = reading[1]
        self.metrics.context_hits.labels(kind="prefix").inc()
        return TailRead(prefix.tokens, n), answer_view(prefix.cache), 0  # the tail's rows are stored as they are

    def read_chunk(self, opening: Opening, tokens: int | None) -> None:
        """Prefill the next ``tokens`` context tokens of ``opening`` (all that are left when None): under the press
        for a new context, exact for the new turns after a stored earlier one; once a new context's tokens are all
        read, compress its next layers instead (:meth:`_compress_round`; all of them when None). After that, the
        context is stored (compressed, or extended) and ``opening.cache`` becomes a view of it."""
        job, reading, cache = opening.job, opening.reading, opening.context_cache
        n, start = len(job.context_ids), reading.read
        end = n if tokens is None else min(n, start + tokens)
        began = time.perf_counter()
        if isinstance(reading, TailRead):
            self._prefill_at(cache, job.context_ids, start, end)
            reading.read = end
        elif not reading.compressing:  # a call that fails puts the cache back empty, and the request fails
            with self.press(self.model), reading:
                self._prefill_at(cache, job.context_ids, start, end)
        if start < end:
            opening.context_chunks += 1
            self.metrics.context_chunks.inc()
            opening.context_seconds += time.perf_counter() - began
        if not isinstance(reading, TailRead) and reading.compressing and (start == end or tokens is None):
            self._compress_round(opening, every_layer=tokens is None)
        if not reading.done:
            return
        if isinstance(reading, TailRead):
            log.info("request %s reuse hit (earlier turn): %d of %d context tokens stored, %d new tokens prefilled "
                     "exact in %.2f s (%d chunks between decode steps)", job.rid, reading.stored, n,
                     n - reading.stored, opening.context_seconds, opening.context_chunks)  # fmt: skip
        else:
            log.info("request %s prefill+compress: %d context tokens -> %d rows in %.2f s (%d chunks and %d "
                     "compression rounds between decode steps)", job.rid, n, cache.get_seq_length(0),
                     opening.context_seconds, opening.context_chunks, opening.compress_rounds)  # fmt: skip
        self.metrics.prefill_seconds.observe(opening.context_seconds)
        self.store.put((tuple(job.context_ids), self.model_name, self.press_label), cache, n)
        self.metrics.set_store(self.store.stats())
        opening.cache, opening.reading, opening.context_cache = answer_view(cache), None, None
        opening.held_bytes = 0

    def _compress_round(self, opening: Opening, every_layer: bool) -> None:
        """Compress the next layers of a new context whose tokens are all read: one, then another while the round's
        time so far plus the last layer's stays within ``compress_round_seconds`` (its chunks' mean time when None),
        so a round outlasts a chunk only by a layer slower than the one before; all of them if ``every_layer``. A
        layer whose compression fails puts the cache back empty, and the request fails."""
        reading, device = opening.reading, self.model.device
        budget = self.compress_round_seconds
        if budget is None:
            budget = (opening.context_seconds - opening.compress_seconds) / max(1, opening.context_chunks)
        began = last = time.perf_counter()
        with self.press(self.model):  # a repeat pass's layers record their queries through the press's hooks
            left = reading.compress_next(None if every_layer else 1)
            while left:
                if device.type == "cuda":  # the time the layers took on the device, not their launches'
                    torch.cuda.synchronize(device)
                now = time.perf_counter()
                if 2 * now - last - began > budget:  # (now - began) + the last layer's (now - last)
                    break
                last = now
                left = reading.compress_next(1)
        seconds = time.perf_counter() - began
        opening.compress_rounds += 1
        self.metrics.compress_rounds.inc()
        opening.compress_seconds += seconds
        opening.context_seconds += seconds
