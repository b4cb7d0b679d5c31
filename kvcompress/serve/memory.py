"""The server's memory budget, as the :class:`~kvcompress.serve.scheduler.Scheduler` keeps it.

One budget (``--cache-memory``) for everything resident: the stored contexts plus the decode batch, plus the
uncompressed rows of a new context being read in chunks (held from its first chunk to its last). A
session reserves its whole answer when it joins (rows of its context and question + ``max_tokens``), in each layer
padded to the longest session of the batch there (each layer of the batch is rectangular), so a step never needs
memory it does not hold. Before its prefill, a request's rows are estimated from the press's kept fraction (all its
tokens for a context under ``--compress-min-tokens``, which is kept whole), the same in every layer; its session's
own rows are checked again when it joins.
Admission evicts least recently used stored contexts, never an active session; a request that does not fit waits
in the queue (first come, first served); a full queue answers 429 with ``Retry-After``.
"""

from __future__ import annotations

import math

from kvcompress.serve.batch import batch_bytes
from kvcompress.serve.jobs import Job, Opening, Session, TooLarge


class MemoryBudget:
    """What a session reserves and what fits beside the rest, for the scheduler that mixes it in: it reads the
    scheduler's ``engine`` (byte counts per row, the store, the press's kept fraction), ``memory``, ``max_batch``,
    ``max_batch_tokens``, ``active`` (the decode batch's sessions) and ``_opening`` (the request whose question is
    being prefilled in chunks, which holds its reservation until it joins)."""

    def _check_size(self, job: Job) -> None:
        """``TooLarge`` unless ``job`` fits the memory budget with nothing else resident (a job without a
        ``max_tokens`` of its own is lowered to what fits)."""
        need, context_bytes, _ = self._estimate(job, peek=True)
        alone = max(context_bytes, self._batch_bytes(1, self._capacity([], need)))  # the stored copy may be dropped
        if alone > self.memory and job.flexible_max and need:  # no max_tokens given: as many as the budget holds
            room = (self.memory - self.engine.batch_session_bytes) // self.engine.batch_row_bytes
            room -= room % self.engine.capacity_step  # a compiled server's batch holds whole steps of rows
            job.max_tokens = max(1, min(job.max_tokens, room - (max(need) - job.max_tokens)))  # 1: no batch rows
            need, _, _ = self._estimate(job, peek=True)
            alone = max(context_bytes, self._batch_bytes(1, self._capacity([], need)))
        if context_bytes > self.memory:  # whatever max_tokens: the compressed context alone is too large
            raise TooLarge(
                f"the prompt's context needs about {context_bytes / 2**20:.1f} MiB resident once compressed, more "
                f"than the server's memory budget of {self.memory / 2**20:.1f} MiB (--cache-memory); send a "
                "shorter context", "prompt")
        if alone > self.memory:
            raise TooLarge(
                f"max_tokens: this request needs about {alone / 2**20:.1f} MiB resident (its context's cache and "
                f"room for {job.max_tokens} tokens), more than the server's memory budget of "
                f"{self.memory / 2**20:.1f} MiB (--cache-memory); ask for fewer tokens")

    def _batch_bytes(self, sessions: int, capacities: tuple[int, ...]) -> int:
        e = self.engine
        return batch_bytes(sessions, capacities, e.batch_row_bytes, e.batch_session_bytes)

    def _estimate(self, job: Job, peek: bool = False) -> tuple[tuple[int, ...], int, tuple | None]:
        """(batch rows the session will reserve, per layer or one value for every layer, () for none; bytes its
        context adds to the store; the key of the stored entry it will use). A stored context's rows are known, layer
        by layer (a press that keeps some layers wider or whole holds fewer rows in the others); a new one is
        estimated from the press's kept fraction (every token when it is short enough to be kept whole), one value for
        every layer, and checked again after its prefill."""
        e = self.engine
        entry = None if peek else e.stored(job.context_ids)
        key = None
        if entry is not None:
            rows, new_bytes, key = tuple(layer.keys.shape[-2] for layer in entry.cache.layers), 0, entry.key
        else:
            short = len(job.context_ids) < e.compress_min_tokens  # kept whole
            rows = (len(job.context_ids) if short else math.ceil(len(job.context_ids) * e.kept_fraction),)
            new_bytes = rows[0] * e.context_row_bytes
            if not peek:  # a new context read in chunks is held uncompressed until its last chunk
                new_bytes = max(new_bytes, e.bytes_held_while_read(job.context_ids))
            if not peek and job.context_ids:  # a stored earlier turn of this chat is used, not evicted
                min_tokens = max(1, math.ceil(e.prefix_min_fraction * len(job.context_ids)))
                prefix = e.store.longest_prefix(tuple(job.context_ids), e.model_name, e.press_label, min_tokens)
                key = prefix.key if prefix is not None else None
        need = () if job.max_tokens <= 1 else tuple(r + len(job.question_ids) + job.max_tokens - 1 for r in rows)
        return need, new_bytes, key

    def _capacity(self, sessions: list[Session | Opening], need: tuple[int, ...] = ()) -> tuple[int, ...]:
        """Per layer, the capacity a batch of ``sessions`` (and a session reserving ``need``) gets: the most rows a
        session reserves in that layer, rounded up when steps are compiled. A one-value ``need`` (an estimate)
        stands for every layer."""
        needs = [s.need for s in sessions if s.need] + ([need] if need else [])
        layers = max((len(n) for n in needs), default=0)
        widest = [max(n[i] if len(n) > 1 else n[0] for n in needs) for i in range(layers)]
        return tuple(self.engine.batch_capacity(rows) for rows in widest)

    def _fits(self, joining: list[Session], need: tuple[int, ...], new_bytes: int, keep, evict: bool = True) -> bool:
        """Whether a session reserving ``need`` batch rows (per layer) fits beside the active and joining sessions.
        When it does, stored contexts are evicted (least recently used first, ``keep`` last) so the batch, the stored
        contexts and ``new_bytes`` of a context about to be stored stay within the budget; a context that then
        does not fit is served but not stored. Active sessions are never touched; a request opening in chunks counts
        as one of them (it holds its reservation until it joins)."""
        holding = self.active + joining + ([self._opening] if self._opening is not None else [])
        sessions = len(holding)
        capacity = self._capacity(holding, need)
        if need:
            if sessions >= self.max_batch:
                return False
            if sessions and (sessions + 1) * max(capacity) > self.max_batch_tokens:
                return False
            sessions += 1
        held = self._opening.held_bytes if self._opening is not None else 0  # a context being read, uncompressed
        batch = self._batch_bytes(sessions, capacity) + held
        if batch > self.memory and sessions > 1:
            return False
        if not evict:
            return True
        store = self.engine.store
        room = max(self.memory - batch, 0)
        if store.evict_to(max(room - new_bytes, 0), keep) > room:
            store.evict_to(room)  # even the context this request uses: the request holds it until it joins
        store.capacity = room
        return True
