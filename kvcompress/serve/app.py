"""FastAPI routes: the OpenAI API over the :class:`~kvcompress.serve.engine.Engine` (no model code here)."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvcompress.serve.engine import Engine
from kvcompress.serve.jobs import Job, QueueFull, TokenLogprob, TooLarge
from kvcompress.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    chat_split,
    completion_split,
    parse,
    top_logprobs,
)

log = logging.getLogger("kvcompress.serve")
LONG_QUESTION = 1024  # question tokens from which a one-part chat message gets the --chat-context hint


def create_app(engine: Engine, served_model: str, api_key: str | None = None, chat_context: str = "parts") -> FastAPI:
    """The OpenAI-compatible routes over ``engine``; ``chat_context``: how a chat's last user message splits into
    compressed context and question (:func:`kvcompress.serve.protocol.chat_split`'s ``mode``)."""
    # redirect_slashes off: "/v1/models/" gets a JSON 404, not a bare 307 to an address built from the Host header
    app = FastAPI(title="kvcompress", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    body_limit = max_body_bytes(engine.max_length)
    metrics = engine.metrics
    created = int(time.time())
    hint_given = threading.Event()  # the one-part-message hint is logged once

    app.add_middleware(CountRequests, metrics=metrics)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError):
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        message = f"route: {request.method} {request.url.path} does not exist" if err.status_code in (404, 405) \
            else str(err.detail)
        return error_response(ApiError(err.status_code, message, "route", headers=err.headers))  # 405: its Allow

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode("utf-8", "surrogatepass")  # bytes: compare_digest refuses non-ASCII str
        if scheme.lower() != "bearer" or not secrets.compare_digest(given, api_key.encode("utf-8", "surrogatepass")):
            raise ApiError(401, "api_key: missing or wrong API key (send 'Authorization: Bearer <key>')",
                           "api_key", "invalid_api_key")

    async def read(request: Request, schema):
        authorize(request)
        kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind != "application/json" and not kind.endswith("+json"):  # a browser's form post cannot send JSON's
            raise ApiError(415, f"Content-Type: send the body as JSON with 'Content-Type: application/json', got "
                                f"{kind or 'none'!r}", "Content-Type")
        try:
            raw = await read_capped(request, body_limit)
        except ClientDisconnect:  # the client left while sending: nobody reads an answer
            raise ApiError(499, "body: the client disconnected before sending it", "body") from None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, nested too deep, an int too long
            raise ApiError(400, f"body: not valid JSON ({type(err).__name__}: {err})"[:300]) from None
        req = parse(schema, body)
        if req.model is not None and req.model != served_model:
            raise ApiError(404, f"model: the model {req.model!r} does not exist; this server serves {served_model!r}",
                           "model", "model_not_found")
        return req

    def make_jobs(req, context_ids: list[int], question_ids: list[int], field: str) -> list[Job]:
        """One job per choice (``n``); choice ``i > 0`` draws with ``seed + i`` (wrapped into the seed's range)."""
        prompt = len(context_ids) + len(question_ids)
        limit = engine.max_length
        if limit is not None and prompt >= limit:
            raise ApiError(413, f"{field}: the prompt is {prompt} tokens; the model's maximum context is {limit} "
                                "tokens (prompt plus at least one generated token)", field, "context_length_exceeded")
        if req.n > engine.max_queue:
            raise ApiError(400, f"n: at most {engine.max_queue} choices per request on this server (its queue, "
                                f"--max-queue), got {req.n}", "n")
        max_tokens, flexible = req.max_tokens, req.max_tokens is None
        if max_tokens is None:
            max_tokens = (limit - prompt) if limit is not None else 4096
        elif limit is not None and prompt + max_tokens > limit:
            name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise ApiError(400, f"{name}: the prompt is {prompt} tokens and the model's maximum context is {limit}, "
                                f"so at most {limit - prompt} tokens can be generated, got {max_tokens}", name)
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        top_p = 1.0 if req.top_p is None else float(req.top_p)

        def seed(index: int) -> int | None:
            if req.seed is None or index == 0:
                return req.seed
            return (req.seed + 2**63 + index) % 2**64 - 2**63

        bias = {int(token): float(value) for token, value in (req.logit_bias or {}).items()}
        unknown = [token for token in bias if token >= engine.vocab_size]
        if unknown:
            raise ApiError(400, f"logit_bias: token id {unknown[0]} is not in the model's vocabulary (ids 0 to "
                                f"{engine.vocab_size - 1})", "logit_bias")
        return [Job(context_ids, question_ids, max_tokens, temperature, top_p, seed(i), req.stop,
                    flexible_max=flexible, top_logprobs=top_logprobs(req), index=i, logit_bias=bias,
                    presence_penalty=float(req.presence_penalty or 0),
                    frequency_penalty=float(req.frequency_penalty or 0)) for i in range(req.n)]

    async def start(jobs: list[Job], prompt_field: str, tokens_field: str = "max_tokens") -> asyncio.Queue:
        """Submit a request's jobs, all or none; their events arrive on the returned queue. ``prompt_field`` /
        ``tokens_field``: the request's names for its prompt and its token limit (what an error names)."""
        events: asyncio.Queue = asyncio.Queue()
        for job in jobs:
            job.loop, job.events = asyncio.get_running_loop(), events
        try:
            engine.submit(jobs)
        except QueueFull as err:
            raise ApiError(429, f"queue: {err}", "queue", "queue_full", {"Retry-After": str(err.retry_after)}) from None
        except TooLarge as err:
            param = {"prompt": prompt_field, "max_tokens": tokens_field}.get(err.param, err.param)
            message = str(err).removeprefix(f"{err.param}: ")
            message = f"{param}: {message}"
            raise ApiError(413, message, param, "memory_budget_exceeded") from None
        return events

    async def respond(request: Request, req, jobs: list[Job], kind: str):
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        for job in jobs:
            job.rid = rid if len(jobs) == 1 else f"{rid}/{job.index}"
        chosen = getattr(req, "max_completion_tokens", None) is not None  # chat's newer name for max_tokens
        tokens_field = "max_completion_tokens" if chosen else "max_tokens"
        events = await start(jobs, "messages" if kind == "chat" else "prompt", tokens_field)
        if req.stream:
            stream = stream_events(request, jobs, events, rid, kind, req)
            return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text: list[list[str]] = [[] for _ in jobs]
        logprobs: list[list[TokenLogprob]] = [[] for _ in jobs]
        finish: list[str | None] = [None for _ in jobs]
        prompt_tokens = completion_tokens = 0
        open_jobs, next_check = len(jobs), time.monotonic() + DISCONNECT_CHECK_S
        try:
            while open_jobs:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=DISCONNECT_CHECK_S)
                except asyncio.TimeoutError:
                    event = None
                if time.monotonic() >= next_check:  # on a clock: tokens arrive faster than the check's period
                    next_check = time.monotonic() + DISCONNECT_CHECK_S
                    if await request.is_disconnected():
                        return Response(status_code=499)
                if event is None:
                    continue
                index, what, *rest = event
                if what == "text":
                    text[index].append(rest[0])
                    logprobs[index] += rest[1] or []
                elif what == "error":
                    raise ApiError(500, rest[0])
                else:
                    finish[index], prompt_tokens, completed = rest
                    completion_tokens += completed
                    open_jobs -= 1
        finally:
            if open_jobs:  # the client went away, or a choice failed: stop every generation
                for job in jobs:
                    job.cancelled.set()
        choices = []
        for job in jobs:
            content = "".join(text[job.index])
            shaped = None if job.top_logprobs is None else openai_logprobs(logprobs[job.index], kind)
            if kind == "chat":
                choices.append({"index": job.index, "message": {"role": "assistant", "content": content},
                                "logprobs": shaped, "finish_reason": finish[job.index]})
            else:
                choices.append({"index": job.index, "text": content, "logprobs": shaped,
                                "finish_reason": finish[job.index]})
        obj = "chat.completion" if kind == "chat" else "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": served_model, "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens)}

    async def stream_events(request: Request, jobs: list[Job], events: asyncio.Queue, rid: str, kind: str,
                            req) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        now = int(time.time())

        def chunk(index: int, content: str | None, finish: str | None, role: bool = False, logprobs=None) -> str:
            shaped = None if logprobs is None else openai_logprobs(logprobs, kind)
            if kind == "chat":
                delta = {"role": "assistant", "content": ""} if role else ({"content": content} if content else {})
                choice = {"index": index, "delta": delta, "logprobs": shaped, "finish_reason": finish}
            else:
                choice = {"index": index, "text": content or "", "logprobs": shaped, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": now, "model": served_model, "choices": [choice]}
            return f"data: {json.dumps(body)}\n\n"

        open_jobs, prompt_tokens, completion_tokens = len(jobs), 0, 0
        try:
            if kind == "chat":
                for job in jobs:
                    yield chunk(job.index, None, None, role=True)
            while open_jobs:
                index, what, *rest = await events.get()
                if what == "text":
                    yield chunk(index, rest[0], None, logprobs=rest[1])
                elif what == "error":  # the stream ends here; the other choices are stopped below
                    yield f"data: {json.dumps(ApiError(500, rest[0]).body())}\n\n"
                    break
                else:
                    finish, prompt_tokens, completed = rest
                    completion_tokens += completed
                    open_jobs -= 1
                    yield chunk(index, None, finish)
            if not open_jobs and req.stream_options is not None and req.stream_options.include_usage:
                body = {"id": rid, "object": obj, "created": now, "model": served_model, "choices": [],
                        "usage": usage(prompt_tokens, completion_tokens)}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if open_jobs:  # the client went away, a choice failed, or the response was cancelled: stop them all
                for job in jobs:
                    job.cancelled.set()

    # Tokenizing runs in a worker thread, so a long prompt does not hold the event loop (which streams every answer),
    # one prompt at a time (a fast tokenizer's settings, such as splitting control tokens, are shared state).
    tokenizing = threading.Lock()

    def tokenized(split, *args):
        with tokenizing:
            return split(*args)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await read(request, ChatRequest)
        context_ids, question_ids = await asyncio.to_thread(tokenized, chat_split, engine.tokenizer, req.messages,
                                                            chat_context)  # fmt: skip
        if chat_context == "parts" and not hint_given.is_set() and len(question_ids) >= LONG_QUESTION:
            last = req.messages[-1].content
            if isinstance(last, str) or len(last) == 1:  # a one-part message: a pasted document is not compressed
                hint_given.set()
                log.warning("a one-part chat message of %d tokens is all question under --chat-context parts: "
                            "prefilled and kept whole, never compressed; send the document as its own text part "
                            "before the question, or start the server with --chat-context blank-line (said once)",
                            len(question_ids))
        return await respond(request, req, make_jobs(req, context_ids, question_ids, "messages"), "chat")

    def completion_ids(prompt: str) -> tuple[list[int], list[int]]:
        context, question = completion_split(prompt)
        encode = engine.tokenizer.encode
        context_ids = encode(context, add_special_tokens=True) if context else []
        question_ids = encode(question, add_special_tokens=not context) if question else []
        return context_ids, question_ids

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read(request, CompletionRequest)
        context_ids, question_ids = await asyncio.to_thread(tokenized, completion_ids, req.prompt)
        if not question_ids:
            raise ApiError(400, "prompt: must end with text after its last blank line (the part not compressed)",
                           "prompt")
        return await respond(request, req, make_jobs(req, context_ids, question_ids, "prompt"), "completion")

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": served_model, "object": "model", "created": created,
                                            "owned_by": "kvcompress", "max_model_len": engine.max_length}]}

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def health():
        if not engine.ready.is_set():  # compiling its decode step: requests are queued, not yet served
            return JSONResponse({"status": "warming up", "model": served_model, "method": engine.press_label},
                                status_code=503, headers={"Retry-After": "5"})
        return {"status": "ok", "model": served_model, "method": engine.press_label}

    @app.get("/metrics")
    async def prometheus():
        metrics.set_store(engine.store.stats())
        metrics.resident.labels(kind="stored").set(engine.store.stats()["bytes"])
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


KNOWN_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}
DISCONNECT_CHECK_S = 0.25  # how often a non-streamed request looks for its client having gone


class CountRequests:
    """Pure ASGI middleware: counts requests by route and status, and answers an unhandled exception with a JSON
    500 (never a stack trace). Not ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware hands the route a
    receive channel on which ``request.is_disconnected()`` never turns true, so a non-streamed request whose client
    went away would generate to its end."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = []

        async def send_counted(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:  # noqa: BLE001 - never a stack trace to the client
            log.exception("request failed")
            if status:  # the response had started: nothing more can be sent
                raise
            await error_response(ApiError(500, "internal error: the server failed on this request"))(
                scope, receive, send_counted
            )
        finally:
            route = scope["path"] if scope["path"] in KNOWN_ROUTES else "other"
            self.metrics.requests.labels(route=route, status=str(status[0] if status else 500)).inc()


BODY_BYTES_PER_TOKEN = 256  # a request body's bound per token of the model's context (JSON escapes included)


def max_body_bytes(max_length: int | None) -> int:
    """The largest request body the server reads: 256 bytes per token of the model's context (a token's text is
    rarely above 16 bytes; ``\\uXXXX`` escapes take 6 a character) plus 1 MiB for the other fields, 64 MiB when
    the context is not known."""
    return 2**20 + BODY_BYTES_PER_TOKEN * max_length if max_length else 64 * 2**20


async def read_capped(request: Request, limit: int) -> bytes:
    """The request's body, or ApiError 413 as soon as it is longer than ``limit`` bytes (from its Content-Length
    before reading anything, else while it streams in)."""
    declared = request.headers.get("content-length", "")
    too_large = ApiError(413, f"body: longer than this server reads ({limit} bytes: {BODY_BYTES_PER_TOKEN} per token "
                              "of the model's context, plus 1 MiB)", "body", "request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def openai_logprobs(logprobs: list[TokenLogprob], kind: str) -> dict:
    """The ``logprobs`` object of a choice: chat's ``content`` list, or the completions API's parallel lists."""
    if kind == "chat":
        return {"content": [{"token": p.token, "logprob": p.logprob, "bytes": list(p.token_bytes),
                             "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, v, b in p.top]}
                            for p in logprobs], "refusal": None}
    return {"tokens": [p.token for p in logprobs], "token_logprobs": [p.logprob for p in logprobs],
            "top_logprobs": [{t: v for t, v, _ in p.top} for p in logprobs],
            "text_offset": [p.offset for p in logprobs]}


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
