"""The model side of the server: context prefill under the press, the store, question prefill, sampling, streaming.

Protocol (kvpress's pipeline): a request is ``context_ids`` (compressed, stored, reused) and ``question_ids`` (never
compressed). The context is prefilled once under the press (``with press(model): model.model(...)``, in one call or,
when long, in chunks: :mod:`kvcompress.serve.contexts`), the question runs outside the press on an
:func:`~kvcompress.serve.store.answer_view` of the stored cache, with explicit positions continuing after the
context's tokens (:meth:`Engine.begin`, then :meth:`Engine.feed` in one piece or in chunks; a request's other
choices :meth:`Engine.fork` the result); then the session decodes in the
:class:`~kvcompress.serve.scheduler.Scheduler`'s batch with every other active session, one token per step.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from kvcompress.hf_attention import use_weighted_attention
from kvcompress.serve.batch import STATIC_CAPACITY_STEP, RowSource, batch_capacity, build, session_rows
from kvcompress.serve.contexts import ContextSource
from kvcompress.serve.jobs import Job, Opening, Session, TokenLogprob
from kvcompress.serve.metrics import ServerMetrics
from kvcompress.serve.sampling import StopText, TokenBytes
from kvcompress.serve.step import compiled_forward, decode_step, warm_up
from kvcompress.serve.store import COMPRESS_MIN_TOKENS, ContextStore, answer_view, check_compress_min_tokens

log = logging.getLogger("kvcompress.serve")


class Engine(ContextSource):
    """Owns the model and the store; :meth:`submit` hands a :class:`Job` to the scheduler (continuous batching)."""

    def __init__(self, model, tokenizer, *, model_name: str, press, press_label: str, store: ContextStore,
                 metrics: ServerMetrics, max_queue: int = 64, prefix_min_fraction: float = 0.5, max_batch: int = 8,
                 max_batch_tokens: int = 131072, memory: int | None = None, decode_per_prefill: float | None = None,
                 compile_decode: str = "auto", prefill_chunk: int | None = None,
                 compress_min_tokens: int = COMPRESS_MIN_TOKENS):
        from kvcompress.serve.scheduler import DECODE_PER_PREFILL, PREFILL_CHUNK, Scheduler

        self.model, self.tokenizer, self.press = model, tokenizer, press
        self.token_bytes = TokenBytes(tokenizer)
        self.model_name, self.press_label = model_name, press_label
        self.store, self.metrics = store, metrics
        self.prefix_min_fraction = prefix_min_fraction
        self.max_queue = max_queue
        self.vocab_size = int((getattr(model.config, "text_config", None) or model.config).vocab_size)
        self.max_length = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = set(eos)
        use_weighted_attention(model)  # decode batches are tagged cache layers; untagged caches still run sdpa
        self.decode_forward = compiled_forward(model, compile_decode)  # None: eager steps
        self.ready = threading.Event()  # set once warm_up has compiled the decode step (at once without compiling)
        config = getattr(model.config, "text_config", None) or model.config
        heads = config.num_key_value_heads or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        element = torch.finfo(model.dtype).bits // 8
        layers = config.num_hidden_layers
        self.context_row_bytes = layers * heads * (2 * head_dim * element + 4)  # K, V, Nystrom weight
        self.full_row_bytes = layers * heads * 2 * head_dim * element  # a context row before compression
        self.repeat_row_bytes = config.hidden_size * element  # a repeated token's hidden state (a repeat pass)
        self.batch_row_bytes = layers * heads * (2 * head_dim * element + 4)
        self.batch_session_bytes = layers * heads * head_dim * 4 * 2  # clip range, float32
        keep = 1.0 - float(getattr(press, "compression_ratio", 0.0) or 0.0) if press is not None else 1.0
        self.kept_fraction = keep  # of a context of at least compress_min_tokens tokens; shorter ones are kept whole
        self.compress_min_tokens = check_compress_min_tokens(compress_min_tokens)
        self.scheduler = Scheduler(self, max_batch=max_batch, max_batch_tokens=max_batch_tokens,
                                   memory=store.capacity if memory is None else memory, max_queue=max_queue,
                                   decode_per_prefill=DECODE_PER_PREFILL if decode_per_prefill is None
                                   else decode_per_prefill,
                                   prefill_chunk=PREFILL_CHUNK if prefill_chunk is None else prefill_chunk)

    # -- HTTP side ---------------------------------------------------------------------------------------
    def submit(self, jobs: list[Job]) -> None:
        """Queue a request's choices, all or none."""
        self.scheduler.submit(jobs)

    def shutdown(self) -> None:
        self.scheduler.stop()

    # -- model side (the scheduler's thread) ---------------------------------------------------------------
    def open_session(self, job: Job) -> Session:
        """Context (stored or prefilled), question prefill and the first token (streamed), in one go: :meth:`begin`
        then :meth:`feed` of the whole question. The returned session has ``finish`` set when that token already
        ended it, else its ``rows`` ready to join the decode batch."""
        return self.feed(self.begin(job))

    def begin(self, job: Job) -> Opening:
        """Open ``job``: its context's cache (stored, or prefilled and compressed now) and a view its question writes
        into (the stored cache stays as it is); no question token is fed yet. A context that :meth:`reads_in_chunks`
        is not read yet: :meth:`feed` reads it first, chunk by chunk."""
        started = time.perf_counter()
        self.metrics.prompt_tokens.inc(len(job.context_ids) + len(job.question_ids))
        reading = self.start_reading(job.context_ids)
        if reading is not None:  # read by feed, chunk by chunk
            read, cache, held = reading
            return Opening(job, None, _generator(job), started, reading=read, context_cache=cache, held_bytes=held)
        context = self.context_cache(job.context_ids, job.rid)
        self.metrics.set_store(self.store.stats())
        return Opening(job, answer_view(context) if job.context_ids else context, _generator(job), started)

    def feed(self, opening: Opening, tokens: int | None = None) -> Session | None:
        """Prefill the next ``tokens`` question tokens of ``opening`` (all that are left when None), at their
        positions after the context's and the chunks before; a context being read in chunks takes its next chunk
        first (all of it when None). None while some are left; after the last one, the first token is sampled and
        streamed and the :class:`Session` returned (as :meth:`open_session` returns it)."""
        if opening.reading is not None:
            self.read_chunk(opening, tokens)
            if tokens is not None or opening.reading is not None:
                return None
        job, device = opening.job, self.model.device
        n_ctx, n_q = len(job.context_ids), len(job.question_ids)
        end = n_q if tokens is None else min(n_q, opening.fed + tokens)
        start = time.perf_counter()
        chunk = dict(input_ids=torch.tensor([job.question_ids[opening.fed:end]], device=device),
                     past_key_values=opening.cache,
                     position_ids=torch.arange(n_ctx + opening.fed, n_ctx + end, device=device).unsqueeze(0))
        if end < n_q:  # no logits before the last chunk
            self.model.model(**chunk)
        else:
            out = self.model(**chunk, logits_to_keep=1)
        now = time.perf_counter()
        opening.fed, opening.chunks, opening.seconds = end, opening.chunks + 1, opening.seconds + now - start
        self.metrics.question_chunks.inc()
        if end < n_q:
            return None
        self.metrics.question_seconds.observe(opening.seconds)
        log.info("request %s question prefill: %d tokens in %.2f s (%d chunk%s); first token %.2f s after arrival "
                 "(queued %.2f s)", job.rid, n_q, opening.seconds, opening.chunks, "" if opening.chunks == 1 else "s",
                 now - job.submitted, opening.started - job.submitted)
        opening.logits = out.logits[0, -1]
        return self._first_token(opening, job, opening.generator, opening.started)

    def fork(self, opening: Opening, job: Job) -> Session:
        """Another choice of the request ``opening`` answers (the same context and question; its own seed and index),
        from the rows and first-token logits of that opening, once its question is prefilled: no prefill of its own
        (its rows are copied when it joins the decode batch). Sampled as :meth:`feed` samples."""
        self.metrics.prompt_tokens.inc(len(job.context_ids) + len(job.question_ids))
        self.metrics.shared_prefills.inc()
        log.info("request %s choice %d takes choice %d's question prefill", job.rid, job.index, opening.job.index)
        return self._first_token(opening, job, _generator(job), time.perf_counter())

    def _first_token(self, opening: Opening, job: Job, generator: torch.Generator | None, started: float) -> Session:
        """``job``'s session after ``opening``'s question: its first token sampled from the opening's last logits and
        streamed; ``rows`` (views of the opening's cache) unless that token ended it."""
        now = time.perf_counter()
        session = Session(job, len(job.context_ids) + len(job.question_ids), StopText(job.stop), generator,
                          started=started, first_at=now, last_at=now)
        self.metrics.ttft_seconds.observe(now - job.submitted)
        logits = opening.logits
        if not self.advance(session, job.choose(logits, [], generator), logits):
            session.rows = session_rows(opening.cache)
            session.need = tuple(r.keys.shape[-2] + job.max_tokens - len(session.ids) for r in session.rows)
        return session

    def advance(self, session: Session, token: int, logits: torch.Tensor) -> bool:
        """Take a token sampled from ``logits`` (``[vocab]``): stream what can be sent; True (and ``finish`` set)
        when the session is done."""
        job = session.job
        session.ids.append(token)
        if token in self.eos_ids:
            session.finish = "stop"
            return True
        text = self.tokenizer.decode(session.ids, skip_special_tokens=True)
        if job.top_logprobs is not None:
            session.logprobs.append(self.token_logprob(token, logits, session.ends[-1] if session.ends else 0,
                                                       job.top_logprobs))
            session.ends.append(len(text))
        safe, stopped = session.stop.cut(text)
        if safe > session.sent or (stopped and session.reported < len(session.logprobs)):
            job.emit("text", text[session.sent:safe], self.sent_logprobs(session, safe, cut=stopped))
            session.sent = safe
        if stopped:
            session.finish = "stop"
            return True
        if len(session.ids) >= job.max_tokens:
            session.finish = "length"
            return True
        if job.cancelled.is_set():
            session.finish = "cancelled"
            return True
        session.pending = token
        return False

    def close(self, session: Session, batch: int = 1) -> None:
        """Send the end of a finished session (the rest of its text, ``done``), or count it cancelled."""
        job, ids = session.job, session.ids
        seconds = time.perf_counter() - session.first_at
        self.metrics.decode_seconds.observe(seconds)
        self.metrics.completion_tokens.inc(len(ids))
        if job.cancelled.is_set() or session.finish == "cancelled":
            self.metrics.cancelled.inc()
            log.info("request %s cancelled by the client after %d tokens", job.rid, len(ids))
            return
        if not session.stop.stopped:
            text = self.tokenizer.decode([t for t in ids if t not in self.eos_ids], skip_special_tokens=True)
            if len(text) > session.sent or session.reported < len(session.logprobs):
                job.emit("text", text[session.sent:], self.sent_logprobs(session, None))
        log.info("request %s decode: %d tokens in %.2f s (%.1f tokens/s), finish %s, batch %d", job.rid, len(ids),
                 seconds, (len(ids) - 1) / seconds if seconds > 0 and len(ids) > 1 else 0.0, session.finish, batch)
        job.emit("done", session.finish, len(job.context_ids) + len(job.question_ids), len(ids))

    @property
    def capacity_step(self) -> int:
        """Batch rows come in steps of this many: :data:`~kvcompress.serve.batch.STATIC_CAPACITY_STEP` when decode
        steps are compiled, else 1."""
        return 1 if self.decode_forward is None else STATIC_CAPACITY_STEP

    def batch_capacity(self, rows: int) -> int:
        """:func:`kvcompress.serve.batch.batch_capacity`: rounded up when decode steps are compiled."""
        return batch_capacity(rows, static=self.decode_forward is not None)

    def build_batch(self, kept, keep: list[int], new: list[list[RowSource]], capacity: tuple[int, ...]):
        """:func:`kvcompress.serve.batch.build`, static when decode steps are compiled."""
        return build(kept, keep, new, capacity, static=self.decode_forward is not None)

    def decode(self, batch, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step of ``batch`` (:func:`kvcompress.serve.step.decode_step`), compiled or eager. A compiled
        step that raises (a graph its warm-up did not foresee, say) is run again eager, as is every later step, and
        the log says why: a failed step leaves the rows it wrote past the batch's counts, unread, so the eager step
        reads the cache the compiled one would have (the sessions go on instead of failing)."""
        if self.decode_forward is not None:
            try:
                return decode_step(self.model, batch, tokens, positions, forward=self.decode_forward)
            except Exception:  # noqa: BLE001 - the eager step below serves; the log has the trace
                log.exception("compiled decode step failed; decoding eager from now on")
                self.decode_forward = None
        return decode_step(self.model, batch, tokens, positions)

    def warm_up(self) -> None:
        """Compile the decode step before the first request (with ``compile_decode``; the scheduler's thread calls it
        first: :func:`kvcompress.serve.step.warm_up`), then set :attr:`ready` (``/health`` answers 503 until then).
        If compiling fails, the steps run eager, and the log says why."""
        if self.decode_forward is None:
            self.ready.set()
            return
        start = time.perf_counter()
        try:
            warm_up(self.model, self.decode_forward)
            log.info("compiled decode warmed up in %.1f s", time.perf_counter() - start)
        except Exception:  # noqa: BLE001 - eager steps still serve; the log has the trace
            log.exception("compiled decode failed to warm up; decoding eager")
            self.decode_forward = None
        self.ready.set()

    def run_alone(self, job: Job) -> None:
        """Serve ``job`` start to end in this thread, in a decode batch of one (what ``--max-batch 1`` does)."""
        session = self.open_session(job)
        capacity = tuple(self.batch_capacity(rows) for rows in session.need)
        batch = self.build_batch(None, [], [session.rows], capacity) if session.finish is None else None
        while session.finish is None:
            logits = self.decode(batch, [session.pending], [session.position])
            session.position += 1
            self.advance(session, job.choose(logits[0], session.ids, session.generator), logits[0])
        self.close(session)

    def token_logprob(self, token: int, logits: torch.Tensor, offset: int, top: int) -> TokenLogprob:
        """``token``'s log probability under ``logits`` (float64 log-softmax) and the ``top`` likeliest tokens'."""
        logprobs = torch.log_softmax(logits.detach().double().cpu(), -1)
        best = logprobs.topk(top) if top else None
        alternatives = () if best is None else tuple(
            (self.tokenizer.decode([i]), v, self.token_bytes(i))
            for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True))
        return TokenLogprob(token, self.tokenizer.decode([token]), float(logprobs[token]), offset, alternatives,
                            self.token_bytes(token))

    @staticmethod
    def sent_logprobs(session: Session, sent: int | None, cut: bool = False) -> list[TokenLogprob] | None:
        """The logprobs not yet reported of the tokens whose text ends within the first ``sent`` characters, and
        with ``cut`` (a stop string ends the answer there) of those whose text starts before; ``sent`` None: every
        one left (the answer's last piece). None when the request asked for none."""
        if session.job.top_logprobs is None:
            return None
        count = session.reported
        while count < len(session.logprobs) and (
            sent is None or session.ends[count] <= sent or (cut and session.logprobs[count].offset < sent)
        ):
            count += 1
        new, session.reported = session.logprobs[session.reported:count], count
        return new


def _generator(job: Job) -> torch.Generator | None:
    """The CPU generator ``job`` samples with (seeded with its seed, else a fresh one); None when it is greedy."""
    if job.temperature <= 0:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(job.seed if job.seed is not None else int(torch.seed() % 2**63))
    return generator
