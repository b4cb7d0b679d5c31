"""Continuous batching: one worker thread decodes one token for every active session per step.

Between two steps the scheduler retires finished or cancelled sessions and admits waiting requests in arrival
order: a request's context is taken from the store or prefilled and compressed, its question is prefilled
(batch 1) and its first token streamed; then it joins the decode batch (:mod:`kvcompress.serve.batch`).

Question prefill in chunks (``--prefill-chunk`` C tokens): between two decode steps the worker prefills at most
one chunk of C tokens of a long question and C tokens of new questions, so the sessions decoding meanwhile keep
streaming (a one-part chat message is all question under ``--chat-context parts``: a pasted document of thousands
of tokens would otherwise stall every stream for its whole prefill, and several such requests admitted together
for all of theirs). A question longer than C tokens is prefilled C tokens at a time, one chunk between two steps,
one such request at a time; it starts in a round that has fed no new question yet. Shorter questions are prefilled
whole, up to C tokens of them a round, and pass the request opening in chunks (a follow-up waits one step, not
the whole long question). Why chunks run between decode steps, not inside them: the decode step keeps
one token per row, the fixed shape a static cache and one CUDA graph per batch-size bucket need. Chunking costs
little: each chunk re-reads the rows before it, a question's prefill is the same attention split in C-token
pieces (its logits equal the one-shot prefill's to rounding).

A new context longer than C tokens is read the same way, before its question: C tokens a round, one such request at
a time (it takes the place of a long question), under the press, which compresses it after its last chunk as one
call would, a few layers a round after its last chunk (:mod:`kvcompress.context_chunks`; the default press reads its
sources chunk by chunk, a repeat pass runs in those rounds, layer by layer or, on sliding-window layers, whole in
the first; a kvpress press reads it in one call). Its uncompressed rows count against the memory budget until then
(:mod:`kvcompress.serve.memory`). So are the new turns after a stored earlier turn when they are longer than C
(prefilled exact, as in one call; :mod:`kvcompress.serve.contexts`).

Admission policy (the prefill budget, ``--decode-per-prefill`` R). A context prefill (and compression) read in one
call stalls every decoding session for its whole length, while a decode step serves all of them at once; so the
worker alternates the two under a budget (a context read in chunks books all its chunks' seconds as one prefill):
while sessions decode, the next context prefill waits until the batch has decoded for R times the previous prefill's
seconds, and at least one step (context prefills take at most 1/(1+R) of the worker's time while the batch is not
empty). With no session decoding a prefill runs at once. A request whose context is stored (a follow-up: a question
prefill of about one decode step) is not held back by the budget: it passes the new contexts that wait for it, and
joins the batch at once; nothing passes a request that waits for memory, so none starves. Why this and which R: on a
closed load (users who send their next question after the answer) the total work is fixed, so the aggregate tokens/s
is best when every step decodes as many sessions as possible, i.e. when new contexts join as early as possible: R =
0 (measured on CPU, docs/BENCHMARKS.md: 8 users, 512-token contexts: R = 0 gave about twice the aggregate tokens/s
of R = 1, whose batches stayed small while new contexts waited). A larger R gives the running answers smoother
streams (an answer is no longer held to one token per prefill while a burst of new contexts is prefilled) and lets
follow-ups in sooner, at the cost of new contexts' time to first token and of smaller batches; it pays when prefills
dominate and answers must finish early (2048-token contexts of ~35-s prefills, no new question after 120 s: R = 1
gave 1.4x the aggregate tokens/s of R = 0, whose answers all waited for every context's prefill).

A request's ``n`` choices share one question prefill: when the first choice's question has run, the others still
waiting take its rows and first-token logits and sample their own first tokens. Memory (what a session reserves,
what fits, what is evicted): :mod:`kvcompress.serve.memory`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque

import torch

from kvcompress.serve.batch import DecodeBatch
from kvcompress.serve.jobs import Job, Opening, QueueFull, Session
from kvcompress.serve.memory import MemoryBudget

log = logging.getLogger("kvcompress.serve")
DECODE_PER_PREFILL = 0.0  # --decode-per-prefill's default (see the module docstring)
MAX_DECODE_PER_PREFILL = 1e6
PREFILL_CHUNK = 512  # --prefill-chunk's default: question tokens prefilled between two decode steps


def check_decode_per_prefill(value: float) -> float:
    """``value`` if it is a valid ``--decode-per-prefill`` (a number in [0, 1e6]), else a one-line ValueError."""
    if not (math.isfinite(value) and 0 <= value <= MAX_DECODE_PER_PREFILL):
        raise ValueError(f"--decode-per-prefill: must be a number in [0, 1e6], got {value}")
    return value


def failure(err: Exception) -> str:
    """The one-line error event a client gets when its generation fails."""
    first = str(err).splitlines()[0] if str(err) else ""
    return f"generation failed: {type(err).__name__}: {first}"


def check_prefill_chunk(value: int) -> int:
    """``value`` if it is a valid ``--prefill-chunk`` (an integer >= 1), else a one-line ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--prefill-chunk: must be an integer >= 1 (question tokens per chunk), got {value!r}")
    return value


class Scheduler(MemoryBudget):
    """Owns the decode batch and the waiting queue of an :class:`~kvcompress.serve.engine.Engine`."""

    def __init__(self, engine, *, max_batch: int, max_batch_tokens: int, memory: int, max_queue: int,
                 decode_per_prefill: float = DECODE_PER_PREFILL, prefill_chunk: int = PREFILL_CHUNK):
        check_decode_per_prefill(decode_per_prefill)
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)
        if max_batch < 1:
            raise ValueError(f"--max-batch: must be an integer >= 1, got {max_batch}")
        if max_batch_tokens < 1:
            raise ValueError(f"--max-batch-tokens: must be an integer >= 1, got {max_batch_tokens}")
        self.engine, self.metrics = engine, engine.metrics
        self.max_batch, self.max_batch_tokens, self.memory, self.max_queue = (
            max_batch, max_batch_tokens, memory, max_queue)
        self.active: list[Session] = []
        self.batch: DecodeBatch | None = None
        self._waiting: deque[Job] = deque()
        self._ready: deque[Session] = deque()  # opened, waiting for room in the batch
        self._opening: Opening | None = None  # admitted, its long question being prefilled chunk by chunk
        self._cond = threading.Condition()
        self._stopping = False
        self._seconds_per_request = 1.0  # running mean, for Retry-After
        self.decode_per_prefill = decode_per_prefill
        self._owed = 0.0  # seconds of decoding owed before the next context prefill (while sessions decode)
        self._steps_since_prefill, self._decoded_since_prefill = 0, 0.0
        self._thread = threading.Thread(target=self._run, name="kvcompress-scheduler", daemon=True)
        self._thread.start()

    # -- HTTP side ---------------------------------------------------------------------------------------
    def submit(self, jobs: list[Job]) -> None:
        """Queue every job of a request (its choices) or none: ``TooLarge`` if one cannot fit the memory budget
        even alone, ``QueueFull`` if the queue has no room for all of them."""
        for job in jobs:
            self._check_size(job)
        with self._cond:
            self._drop_cancelled()  # requests whose client has gone hold no place
            if len(self._waiting) + len(jobs) > self.max_queue:
                wait = math.ceil(len(self._waiting) * self._seconds_per_request / self.max_batch)
                raise QueueFull(max(1, wait), "the queue of waiting requests is full")
            self._waiting.extend(jobs)
            waiting = len(self._waiting)
            self._cond.notify()
        self.metrics.queue_depth.set(waiting)
        for job in jobs:
            log.info("request %s queued: context %d tokens, question %d tokens, max_tokens %d (%d waiting, %d "
                     "decoding)", job.rid, len(job.context_ids), len(job.question_ids), job.max_tokens, waiting,
                     len(self.active))

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=5)

    # -- metrics and the queue ---------------------------------------------------------------------------
    def _publish(self) -> None:
        stats = self.engine.store.stats()
        self.metrics.set_store(stats)
        self.metrics.resident.labels(kind="stored").set(stats["bytes"])
        self.metrics.resident.labels(kind="active").set(self.batch.nbytes() if self.batch is not None else 0)
        self.metrics.running.set(len(self.active))
        with self._cond:
            self._drop_cancelled()
            self.metrics.queue_depth.set(len(self._waiting))

    def _drop_cancelled(self) -> None:
        """Forget every waiting request whose client has gone, anywhere in the queue (one behind a live request
        held a place in ``--max-queue`` and in ``queue_depth``); under ``self._cond``. The worker takes the job it
        chose out of the queue later, and skips it if it is gone by then."""
        if any(job.cancelled.is_set() for job in self._waiting):
            kept = [job for job in self._waiting if not job.cancelled.is_set()]
            self.metrics.cancelled.inc(len(self._waiting) - len(kept))
            self._waiting = deque(kept)

    # -- the worker --------------------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        with torch.inference_mode():
            self.engine.warm_up()  # requests wait in the queue meanwhile
            while True:
                with self._cond:
                    while not (self._stopping or self._waiting or self.active or self._ready or self._opening):
                        self._cond.wait()
                    if self._stopping:
                        return
                try:
                    self._admit()
                    if self.active:
                        self._step()
                except Exception as err:  # noqa: BLE001 - the clients get a one-line error, the log the trace
                    log.exception("decode step failed")
                    self._fail_all(err)
                self._publish()

    def _fail_all(self, err: Exception) -> None:
        for session in self.active:
            session.job.emit("error", failure(err))
        self.active, self.batch = [], None

    def _next_job(self, joining: list[Session], budget: int) -> Job | None:
        """The waiting request to open now, or None. Arrival order, except that while the prefill budget holds
        context prefills back, a request whose context is stored (a follow-up: only its question to prefill)
        passes the contexts waiting for their prefill; a question longer than what is left of this round's new
        question tokens (``budget``) waits, unless the round has fed none and no request opens in chunks (it then
        opens in chunks), and shorter ones pass it (a new context read in chunks waits the same way). Nothing
        passes a request that waits for memory, so no request starves."""
        cold_ok = self._may_prefill(joining)
        with self._cond:
            self._drop_cancelled()
            jobs = list(self._waiting)
        for job in jobs:
            if job.cancelled.is_set():
                continue
            crowded = self._opening is not None or budget < self.prefill_chunk  # (the store is read only then)
            if crowded and (len(job.question_ids) > budget or self.engine.reads_in_chunks(job.context_ids)):
                continue  # not this round (``budget`` question tokens left of it); shorter ones pass it
            if cold_ok or self.engine.is_stored(job.context_ids) or not job.context_ids:
                return job
            if not self._fits(joining, self._estimate(job, peek=True)[0], 0, None, evict=False):
                return None  # it waits for memory, not for the budget: first come, first served
        return None

    def _may_prefill(self, joining: list[Session]) -> bool:
        """The prefill budget: a context prefill may run when no session decodes or joins, or when the batch has
        decoded for ``decode_per_prefill`` times the previous context prefill's seconds (and at least one step)
        since that prefill."""
        return not (self.active or joining) or (self._steps_since_prefill >= 1 and self._owed <= 0)

    def _admit(self) -> None:
        """Between two decode steps: the next chunk of the request opening in chunks, then the sessions and requests
        that fit join the batch (each request's context prefilled or taken from the store, its question prefilled,
        or its first chunk only when it needs several)."""
        joining: list[Session] = []
        budget = self.prefill_chunk  # new questions' tokens this round may prefill, beside the opening's chunk
        if self._opening is not None:
            self._feed_opening(joining)
        while True:
            if self._ready:  # opened sessions first: they hold memory already
                session = self._ready[0]
                if not self._fits(joining, session.need, 0, None):
                    break
                joining.append(self._ready.popleft())
                continue
            job = self._next_job(joining, budget)
            if job is None:
                break
            need, new_bytes, key = self._estimate(job)
            if not self._fits(joining, need, new_bytes, key):
                break
            with self._cond:  # by identity (a Job's == compares its token lists)
                place = next((i for i, waiting in enumerate(self._waiting) if waiting is job), None)
                if place is None:  # its client left after the choice, and a submit dropped it
                    continue
                del self._waiting[place]
            self.metrics.queue_seconds.observe(time.perf_counter() - job.submitted)
            cold = not self.engine.is_stored(job.context_ids) and bool(job.context_ids)
            start = time.perf_counter()
            try:
                opening = self.engine.begin(job)
                if cold and opening.reading is None:  # one call (a context read in chunks is booked when read)
                    self._prefilled(job, time.perf_counter() - start)
                session = self._feed(opening)
            except Exception as err:  # noqa: BLE001
                self._failed(job, err)
                continue
            budget -= opening.fed + (opening.reading.read if opening.reading is not None else 0)
            opening.need = need  # held while the rest of a long question is fed, one chunk between two decode steps
            self._fed(opening, session, joining)
        if joining:
            keep = list(range(len(self.active)))
            capacity = self._capacity(self.active + joining)
            self.batch = self.engine.build_batch(self.batch, keep, [s.rows for s in joining], capacity)
            for session in joining:
                session.rows = None  # the batch holds them now
            self.active += joining

    def _feed_opening(self, joining: list[Session]) -> None:
        """Prefill the next chunk of the request opening in chunks; after its last one, its session joins (or waits
        for room, or ends at its first token). A request whose client has gone is dropped between two chunks."""
        opening, self._opening = self._opening, None
        job = opening.job
        if job.cancelled.is_set():
            self.metrics.cancelled.inc()
            context = "" if opening.reading is None else f"{opening.reading.read} of {len(job.context_ids)} context "
            log.info("request %s cancelled by the client after %s%d of %d question tokens", job.rid, context,
                     opening.fed, len(job.question_ids))
            return
        try:
            session = self._feed(opening)
        except Exception as err:  # noqa: BLE001
            self._failed(job, err)
            return
        self._fed(opening, session, joining)

    def _feed(self, opening: Opening) -> Session | None:
        """The next chunk of ``opening`` (its context's while one is read in chunks, then its question's); a context
        read to its end is booked against the prefill budget as one prefill of all its chunks' seconds."""
        reading = opening.reading is not None
        session = self.engine.feed(opening, self.prefill_chunk)
        if reading and opening.reading is None:
            self._prefilled(opening.job, opening.context_seconds)
        return session

    def _fed(self, opening: Opening, session: Session | None, joining: list[Session]) -> None:
        """After a chunk of ``opening``'s question: it opens on in chunks (``session`` None), or its session and its
        request's other choices are placed."""
        if session is None:
            self._opening = opening
        else:
            self._place(session, joining)
            self._fork_choices(opening, joining)

    def _fork_choices(self, opening: Opening, joining: list[Session]) -> None:
        """The request's other choices still waiting (``n`` > 1: the same context and question) take ``opening``'s
        question prefill and first-token logits, each sampling its own first token: a request's question is
        prefilled once, not once per choice."""
        job = opening.job
        with self._cond:
            choices = [other for other in self._waiting if other is not job and job.events is not None
                       and other.events is job.events and not other.cancelled.is_set()
                       and other.context_ids == job.context_ids and other.question_ids == job.question_ids]
            if choices:  # by identity (a Job's == compares its token lists)
                self._waiting = deque(w for w in self._waiting if not any(w is other for other in choices))
        for other in choices:
            self.metrics.queue_seconds.observe(time.perf_counter() - other.submitted)
            try:
                session = self.engine.fork(opening, other)
            except Exception as err:  # noqa: BLE001
                self._failed(other, err)
                continue
            self._place(session, joining)

    def _place(self, session: Session, joining: list[Session]) -> None:
        """A session that has its first token: retired if that ended it, else joining now if it fits, else ready."""
        if session.finish is not None:
            self._retired(session)
        elif self._fits(joining, session.need, 0, None):
            joining.append(session)
        else:
            self._ready.append(session)

    def _failed(self, job: Job, err: Exception) -> None:
        log.exception("request %s failed", job.rid)
        job.emit("error", failure(err))

    def _prefilled(self, job: Job, seconds: float) -> None:
        """Book a context prefill of ``seconds`` against the budget: the batch owes that many seconds times
        ``decode_per_prefill`` of decoding before the next one (while sessions decode)."""
        if self.active:
            self.metrics.steps_between_prefills.observe(self._steps_since_prefill)
        log.info("request %s context prefill of %.3f s after %d decode steps (%.3f s) since the previous one, %d "
                 "sessions decoding; the next one after %.3f s of decoding", job.rid, seconds,
                 self._steps_since_prefill, self._decoded_since_prefill, len(self.active),
                 self.decode_per_prefill * seconds)
        self._owed = self.decode_per_prefill * seconds
        self._steps_since_prefill, self._decoded_since_prefill = 0, 0.0

    def _retired(self, session: Session) -> None:
        self.engine.close(session, batch=len(self.active))
        seconds = time.perf_counter() - session.started
        self._seconds_per_request = 0.8 * self._seconds_per_request + 0.2 * seconds

    def _step(self) -> None:
        start = time.perf_counter()
        sessions = self.active
        logits = self.engine.decode(self.batch, [s.pending for s in sessions], [s.position for s in sessions])
        greedy = logits.argmax(-1).tolist()
        now = time.perf_counter()
        done = []
        for b, session in enumerate(sessions):
            job = session.job
            session.position += 1
            plain_greedy = job.temperature <= 0 and not job.shapes_logits
            token = greedy[b] if plain_greedy else job.choose(logits[b], session.ids, session.generator)
            self.metrics.inter_token_seconds.observe(now - session.last_at)
            session.last_at = now
            if self.engine.advance(session, token, logits[b]):
                done.append(b)
        seconds = time.perf_counter() - start
        self._owed -= seconds
        self._steps_since_prefill += 1
        self._decoded_since_prefill += seconds
        self.metrics.batch_size.observe(len(sessions))
        self.metrics.step_seconds.observe(seconds)
        self.metrics.tokens_per_second.set(len(sessions) / seconds if seconds > 0 else 0.0)
        if done:
            for b in done:
                self._retired(sessions[b])
            keep = [b for b in range(len(sessions)) if b not in done]
            self.active = [sessions[b] for b in keep]
            self.batch = self.engine.build_batch(self.batch, keep, [], self._capacity(self.active))
