"""What the server's worker passes around: a request's :class:`Job` (one choice), the :class:`Opening` of an admitted
request until its first token, the :class:`Session` that then decodes, each answer token's :class:`TokenLogprob`, and
the two refusals at submission (:class:`QueueFull`, :class:`TooLarge`)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcompress.serve.batch import RowSource
from kvcompress.serve.sampling import StopText, sample


class QueueFull(Exception):
    def __init__(self, retry_after: int, why: str = "the model worker's queue is full"):
        super().__init__(f"{why}; retry after {retry_after} s")
        self.retry_after = retry_after


class TooLarge(Exception):
    """A request that could not fit the memory budget even with nothing else resident; ``param``: what to change
    (``max_tokens``, or ``prompt`` when the prompt alone leaves no room: the route names its own prompt field)."""

    def __init__(self, message: str, param: str = "max_tokens"):
        super().__init__(message)
        self.param = param


@dataclass
class Job:
    """One generation (one choice of a request: ``index``). Events go to ``events`` (an asyncio queue of the server's
    loop, shared by a request's choices), each led by ``index``: ``("text", delta, logprobs)``, then ``("done",
    finish_reason, prompt_tokens, completion_tokens)`` or ``("error", msg)``. ``logprobs``: None (not asked:
    ``top_logprobs`` None), else the :class:`TokenLogprob` of the tokens whose text the delta completes (a token cut
    by a stop string counts; the EOS token never does)."""

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
    rid: str = "-"
    flexible_max: bool = False  # max_tokens was not given: the server may lower it to fit its memory budget
    top_logprobs: int | None = None  # None: no log probabilities; k: each token's and its k likeliest alternatives'
    index: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    submitted: float = field(default_factory=time.perf_counter)

    @property
    def shapes_logits(self) -> bool:
        """Whether sampling changes the logits (penalties or a bias) before it draws."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    def choose(self, logits: torch.Tensor, generated: list[int], generator: torch.Generator | None) -> int:
        """The next token from the model's ``logits [vocab]`` after the ``generated`` tokens: the bias and the
        penalties (OpenAI's: each token's logit lowered by ``presence_penalty`` once it occurs in the answer and by
        ``frequency_penalty`` per occurrence), then :func:`sample`."""
        if self.shapes_logits:
            logits = logits.detach().to("cpu", torch.float64, copy=True)  # the raw ones stay for the logprobs
            for token, bias in self.logit_bias.items():
                logits[token] += bias
            if generated and (self.presence_penalty or self.frequency_penalty):
                counts = torch.bincount(torch.tensor(generated), minlength=logits.shape[0])[: logits.shape[0]]
                logits -= self.frequency_penalty * counts + self.presence_penalty * (counts > 0)
        return sample(logits, self.temperature, self.top_p, generator)

    def emit(self, *event: Any) -> None:
        if self.loop is not None and self.events is not None:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, *event))


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability under the model (its raw next-token distribution: before temperature
    and top_p), its text and bytes (:class:`~kvcompress.serve.sampling.TokenBytes`), where that text starts in the
    answer, and the ``top`` likeliest tokens as (text, logprob, bytes)."""

    token_id: int
    token: str
    logprob: float
    offset: int
    top: tuple[tuple[str, float, bytes], ...]
    token_bytes: bytes = b""


@dataclass
class Session:
    """A request between its first token and its last: what it generated, where it continues, what it streamed."""

    job: Job
    position: int  # token position of the pending token (context tokens + question + generated before it)
    stop: StopText
    generator: torch.Generator | None
    rows: list[RowSource] | None = None  # its cache rows until it joins the decode batch
    need: tuple[int, ...] = ()  # batch rows reserved per layer: rows held now + tokens still to feed
    ids: list[int] = field(default_factory=list)
    pending: int = -1  # the last sampled token, fed at the next step
    sent: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per non-EOS token (top_logprobs asked)
    ends: list[int] = field(default_factory=list)  # the answer's text length after each of those tokens
    reported: int = 0  # logprobs sent with the text so far
    finish: str | None = None
    started: float = 0.0  # admission
    first_at: float = 0.0
    last_at: float = 0.0


@dataclass
class Opening:
    """A request between its admission and its first token: its cache (the context's, then the question chunks fed so
    far) and how far its question prefill got. A long question, and before it a long new context, is fed in chunks
    between decode steps (:class:`~kvcompress.serve.scheduler.Scheduler`), so the sessions decoding meanwhile keep
    streaming."""

    job: Job
    cache: Any
    generator: torch.Generator | None
    started: float  # admission
    need: tuple[int, ...] = ()  # batch rows the scheduler reserved for it while it opens (its estimate)
    fed: int = 0  # question tokens prefilled so far
    chunks: int = 0
    seconds: float = 0.0  # question prefill time so far
    logits: torch.Tensor | None = None  # [vocab] after the last chunk: the first token's (its other choices share it)
    # A new context read in chunks before the question (kvcompress.context_chunks): its reading, the cache it fills
    # (``cache`` is None until it is read, compressed and stored), the uncompressed bytes it holds meanwhile
    reading: Any = None
    context_cache: Any = None
    held_bytes: int = 0
    context_chunks: int = 0
    compress_rounds: int = 0  # rounds its layers were compressed in, after its last chunk, and their time
    compress_seconds: float = 0.0
    context_seconds: float = 0.0  # the chunks' and the compression rounds' time
