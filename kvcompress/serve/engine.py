"""The model worker: one thread, a bounded queue, context prefill under the press, the store, generation.

Protocol (kvpress's pipeline): a request is ``context_ids`` (compressed, stored, reused) and ``question_ids``
(never compressed). The context is prefilled once under the press (``with press(model): model.model(...)``),
the question and every generated token run outside the press on an :func:`~kvcompress.serve.store.answer_view`
of the stored cache, with explicit positions continuing after the context's tokens.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from kvcompress.serve.metrics import ServerMetrics
from kvcompress.serve.store import ContextStore, answer_view

log = logging.getLogger("kvcompress.serve")


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the model worker's queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


@dataclass
class Job:
    """One generation. Events go to ``events`` (an asyncio queue of the server's loop):
    ``("text", delta)``, then ``("done", finish_reason, prompt_tokens, completion_tokens)`` or ``("error", msg)``."""

    context_ids: list[int]
    question_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, *event: Any) -> None:
        if self.loop is not None and self.events is not None:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """Owns the model; :meth:`submit` queues a :class:`Job`, the worker thread serves jobs one at a time."""

    def __init__(self, model, tokenizer, *, model_name: str, press, press_label: str, store: ContextStore,
                 metrics: ServerMetrics, max_queue: int = 64, prefix_min_fraction: float = 0.5):
        self.model, self.tokenizer, self.press = model, tokenizer, press
        self.model_name, self.press_label = model_name, press_label
        self.store, self.metrics = store, metrics
        self.prefix_min_fraction = prefix_min_fraction
        self.max_length = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = set(eos)
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._seconds_per_job = 1.0  # running mean, for Retry-After
        self._thread = threading.Thread(target=self._run, name="kvcompress-worker", daemon=True)
        self._thread.start()

    # -- HTTP side ---------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(max(1, math.ceil(self._queue.qsize() * self._seconds_per_job))) from None
        self.metrics.queue_depth.set(self._queue.qsize())

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    # -- worker ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            job = self._queue.get()
            self.metrics.queue_depth.set(self._queue.qsize())
            if job is None:
                return
            if job.cancelled.is_set():
                self.metrics.cancelled.inc()
                continue
            start = time.perf_counter()
            self.metrics.running.set(1)
            try:
                with torch.inference_mode():
                    self._serve(job)
            except Exception as err:  # noqa: BLE001 - the client gets a one-line error, the log the trace
                log.exception("generation failed")
                first = str(err).splitlines()[0] if str(err) else ""
                job.emit("error", f"generation failed: {type(err).__name__}: {first}")
            finally:
                self.metrics.running.set(0)
                self.metrics.set_store(self.store.stats())
                self._seconds_per_job = 0.8 * self._seconds_per_job + 0.2 * (time.perf_counter() - start)

    def context_cache(self, context_ids: list[int]) -> DynamicCache:
        """The stored cache of this context (exact hit, a stored earlier turn extended, or a new prefill)."""
        tokens = tuple(context_ids)
        key = (tokens, self.model_name, self.press_label)
        if not tokens:
            return DynamicCache()
        entry = self.store.get(key)
        if entry is not None:
            self.metrics.context_hits.labels(kind="exact").inc()
            return entry.cache
        start = time.perf_counter()
        min_tokens = max(1, math.ceil(self.prefix_min_fraction * len(tokens)))
        prefix = self.store.longest_prefix(tokens, self.model_name, self.press_label, min_tokens)
        device = self.model.device
        if prefix is not None:  # a later turn: the stored part stays as it is, the new turns are prefilled exact
            self.metrics.context_hits.labels(kind="prefix").inc()
            cache = answer_view(prefix.cache)
            tail = torch.tensor([tokens[prefix.tokens:]], device=device)
            positions = torch.arange(prefix.tokens, len(tokens), device=device).unsqueeze(0)
            self.model.model(input_ids=tail, past_key_values=cache, position_ids=positions)
        else:
            self.metrics.context_misses.inc()
            self.metrics.prefills.inc()
            cache = DynamicCache()
            ids = torch.tensor([tokens], device=device)
            if self.press is None:
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
        self.metrics.prefill_seconds.observe(time.perf_counter() - start)
        self.store.put(key, cache, len(tokens))
        return cache

    def _serve(self, job: Job) -> None:
        context = self.context_cache(job.context_ids)
        self.metrics.set_store(self.store.stats())
        cache = answer_view(context) if job.context_ids else context
        device = self.model.device
        n_ctx, n_q = len(job.context_ids), len(job.question_ids)
        self.metrics.prompt_tokens.inc(n_ctx + n_q)
        generator = None
        if job.temperature > 0:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(job.seed if job.seed is not None else int(torch.seed() % 2**63))
        start = time.perf_counter()
        out = self.model(
            input_ids=torch.tensor([job.question_ids], device=device),
            past_key_values=cache,
            position_ids=torch.arange(n_ctx, n_ctx + n_q, device=device).unsqueeze(0),
            logits_to_keep=1,
        )
        self.metrics.question_seconds.observe(time.perf_counter() - start)
        decode_start = time.perf_counter()
        ids: list[int] = []
        sent, finish = 0, "length"
        stream = StopText(job.stop)
        position = n_ctx + n_q
        while True:
            token = sample(out.logits[0, -1], job.temperature, job.top_p, generator)
            ids.append(token)
            if token in self.eos_ids:
                finish = "stop"
                break
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            safe, stopped = stream.cut(text)
            if safe > sent:
                job.emit("text", text[sent:safe])
                sent = safe
            if stopped:
                finish = "stop"
                break
            if len(ids) >= job.max_tokens or job.cancelled.is_set():
                break
            out = self.model(
                input_ids=torch.tensor([[token]], device=device),
                past_key_values=cache,
                position_ids=torch.tensor([[position]], device=device),
            )
            position += 1
        self.metrics.decode_seconds.observe(time.perf_counter() - decode_start)
        self.metrics.completion_tokens.inc(len(ids))
        if job.cancelled.is_set():
            self.metrics.cancelled.inc()
            return
        if not stream.stopped:
            text = self.tokenizer.decode([t for t in ids if t not in self.eos_ids], skip_special_tokens=True)
            if len(text) > sent:
                job.emit("text", text[sent:])
        job.emit("done", finish, n_ctx + n_q, len(ids))


class StopText:
    """Where a growing text may be sent: before any stop string, holding back a tail that could start one
    (and an unfinished UTF-8 character)."""

    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self.stopped = False

    def cut(self, text: str) -> tuple[int, bool]:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return min(hits), True
        safe = len(text)
        while safe > 0 and text[safe - 1] == "\ufffd":
            safe -= 1
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return safe, False


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0, else a draw from softmax(logits / temperature) restricted to the top-p mass."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p  # the smallest set whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
