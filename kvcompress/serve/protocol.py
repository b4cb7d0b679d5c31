"""OpenAI request schemas, their validation and OpenAI-shaped errors.

Statuses: 400 a value the server cannot use (body not JSON, empty ``messages``, a number out of range, an OpenAI
option this server does not implement set to anything but its default (``UNSUPPORTED``: tools, JSON formats,
echo, ...), the last message not from the user or without text, text that is not valid Unicode); 401 a wrong API key;
404 an unknown model or route; 413 a prompt longer than the model's maximum; 422 a missing field or one of the
wrong type (a non-integer ``max_tokens``, an unknown role); 429 the worker's queue is full. Every message starts
with the field it is about. Fields OpenAI's API does not have are ignored.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "internal_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat has none: up to the context)


class _Schema(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields this server does not use


class TextPart(_Schema):
    type: Literal["text"]
    text: StrictStr


class Message(_Schema):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Schema):
    include_usage: StrictBool = False


def _unset(value: Any) -> bool:
    return value is None or value is False or (type(value) in (int, float) and value == 0) or value in ("", [], {})


# OpenAI fields this server does not implement, and the values that ask for nothing (clients send defaults):
# anything else is refused (400), never ignored, since an answer without them would look served.
_NO_TOOLS = "this server does not call tools"
UNSUPPORTED = {
    "echo": (_unset, "this server does not echo the prompt"),
    "best_of": (lambda v: v is None or (type(v) is int and v == 1),
                "this server does not rank candidate completions (ask for n choices instead)"),
    "suffix": (_unset, "this server does not insert text before a suffix"),
    "repetition_penalty": (lambda v: v is None or (type(v) in (int, float) and v == 1),
                           "this server takes OpenAI's presence_penalty and frequency_penalty instead"),
    "response_format": (lambda v: _unset(v) or v == {"type": "text"}, "this server generates plain text only"),
    "tools": (_unset, _NO_TOOLS),
    "tool_choice": (lambda v: _unset(v) or v == "none", _NO_TOOLS),
    "functions": (_unset, _NO_TOOLS),
    "function_call": (lambda v: _unset(v) or v == "none", _NO_TOOLS),
    "audio": (_unset, "this server generates text only"),
    "modalities": (lambda v: _unset(v) or v == ["text"], "this server generates text only"),
}


class _Sampling(_Schema):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, except those in UNSUPPORTED
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = 1  # null: the default, as OpenAI's API takes it
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat | StrictInt | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None
    logit_bias: dict[StrictStr, StrictFloat | StrictInt] | None = None


class ChatRequest(_Sampling):
    messages: list[Message]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr]
    max_tokens: StrictInt | None = COMPLETION_MAX_TOKENS
    logprobs: StrictInt | None = None  # k: each token's log probability and its k likeliest alternatives'


MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 128  # OpenAI's; a server also takes at most its --max-queue
MAX_LOGIT_BIAS = 300


def top_logprobs(request: _Sampling) -> int | None:
    """How many alternatives per token the request asks log probabilities for (0: the chosen token's only), or None
    for no log probabilities (chat: ``logprobs`` / ``top_logprobs``; completions: ``logprobs``)."""
    if isinstance(request, ChatRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def _field(loc: tuple) -> str:
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in ("str", "list[TextPart]", "list[str]", "int", "float", "bool", "TextPart"):
            continue  # the branch of a union pydantic tried, not a field
        else:
            name += f".{part}" if name else str(part)
    return name or "body"


def parse(schema: type[_Sampling], body: Any) -> _Sampling:
    """Validate a decoded JSON body (422 naming the first bad field; 400 if the body is not an object)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"body: expected a JSON object, got {type(body).__name__}")
    try:
        request = schema.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = _field(first["loc"])
        got = "" if first["type"] == "missing" else f", got {first.get('input')!r}"
        raise ApiError(422, f"{param}: {first['msg']}{got}"[:500], param) from None
    check_values(request)
    return request


def check_values(request: _Sampling) -> None:
    """Ranges and the semantic rules the schema does not express (400)."""
    if isinstance(request, ChatRequest):
        if not request.messages:
            raise ApiError(400, "messages: must hold at least one message", "messages")
        if request.messages[-1].role != "user":
            raise ApiError(400, "messages: the last message must be from the user (the question to answer), got "
                                f"{request.messages[-1].role!r}", "messages")
        last = request.messages[-1].content
        question = last if isinstance(last, str) else last[-1].text if last else None
        if not question:  # the last text part is the question (kvpress's pipeline protocol)
            got = "no text part" if question is None else "an empty one"
            raise ApiError(400, f"messages: the last message must end with the question's text, got {got}",
                           "messages")
        for i, message in enumerate(request.messages):
            check_text(f"messages[{i}].content", message.text())
        if request.max_completion_tokens is not None:
            request.max_tokens = request.max_completion_tokens
    else:
        if isinstance(request.prompt, list):
            if len(request.prompt) != 1:
                count = len(request.prompt)
                raise ApiError(400, f"prompt: this server takes one prompt per request, got {count}", "prompt")
            request.prompt = request.prompt[0]
        check_text("prompt", request.prompt)
        if request.max_tokens is None:  # null: the default, as for n
            request.max_tokens = COMPLETION_MAX_TOKENS
    for name, value in (request.model_extra or {}).items():
        if name in UNSUPPORTED and not UNSUPPORTED[name][0](value):
            raise ApiError(400, f"{name}: {UNSUPPORTED[name][1]}; leave it unset (got {value!r})"[:500], name)
    if isinstance(request, ChatRequest) and request.top_logprobs is not None:
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"top_logprobs: must be an integer in [0, {MAX_TOP_LOGPROBS}], got "
                                f"{request.top_logprobs}", "top_logprobs")
        if request.top_logprobs and not request.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs set to true", "top_logprobs")
    if isinstance(request, CompletionRequest) and request.logprobs is not None:
        if not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"logprobs: must be an integer in [0, {MAX_TOP_LOGPROBS}], got {request.logprobs}",
                           "logprobs")
    request.n = 1 if request.n is None else request.n
    request.stream = bool(request.stream)
    name = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) is not None else "max_tokens"
    if request.max_tokens is not None and request.max_tokens < 1:
        raise ApiError(400, f"{name}: must be an integer >= 1, got {request.max_tokens}", name)
    if request.temperature is not None and not 0 <= request.temperature <= 2:
        raise ApiError(400, f"temperature: must be in [0, 2], got {request.temperature}", "temperature")
    if request.top_p is not None and not 0 < request.top_p <= 1:
        raise ApiError(400, f"top_p: must be in (0, 1], got {request.top_p}", "top_p")
    if request.seed is not None and not -(2**63) <= request.seed < 2**64:
        raise ApiError(400, f"seed: must be an integer in [-2^63, 2^64), got {request.seed}", "seed")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        if value is not None and not -2 <= value <= 2:
            raise ApiError(400, f"{name}: must be in [-2, 2], got {value}", name)
    bias = request.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", "logit_bias")
    for key, value in bias.items():
        # at most 20 digits: int() of a longer string can raise (Python's 4300-digit limit), and no vocabulary is near
        if not (key.isascii() and key.isdigit() and len(key) <= 20) or not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias: maps token ids (decimal strings of at most 20 digits) to a bias in "
                                f"[-100, 100], got {key!r}: {value!r}"[:300], "logit_bias")
    if not 1 <= request.n <= MAX_CHOICES:
        raise ApiError(400, f"n: must be an integer in [1, {MAX_CHOICES}] (choices per request), got {request.n}", "n")
    stops = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(400, f"stop: up to 4 non-empty strings, got {request.stop!r}", "stop")
    for stop in stops:
        check_text("stop", stop)
    request.stop = stops


def check_text(name: str, text: str) -> None:
    """400 unless ``text`` is valid Unicode (JSON can carry a lone surrogate such as \\ud800; no tokenizer takes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(400, f"{name}: not valid Unicode text ({err.reason} at position {err.start})", name) from None


def completion_split(text: str) -> tuple[str, str]:
    """A raw completions prompt: the context is everything through its last blank line, the rest is the question."""
    cut = text.rfind("\n\n")
    return (text[: cut + 2], text[cut + 2:]) if cut >= 0 else ("", text)


CHAT_CONTEXT_MODES = ("parts", "blank-line")  # how chat_split splits the last user message (serve --chat-context)


def control_token_texts(tokenizer) -> tuple[str, ...]:
    """The texts the tokenizer turns into its special (control) tokens: ``<|im_end|>``, ``</s>``, ..."""
    texts = set(tokenizer.all_special_tokens)
    texts.update(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)
    return tuple(sorted(t for t in texts if t))


def chat_split(tokenizer, messages: list[Message], mode: str = "parts") -> tuple[list[int], list[int]]:
    """(context ids, question ids) of a chat, split as kvpress's pipeline splits its chat template.

    The context is the rendered conversation up to the start of the last user message's text (its turn header
    included); the question is that text and what the template puts after it (end of turn, the assistant's
    header). When the last user message has several text parts, all but the last one belong to the context: a
    document followed by a question, exactly kvpress's ``pipeline(context, question=...)``. ``mode="blank-line"``
    also splits a one-part message, as ``/v1/completions`` splits its prompt: its text through its last blank line
    joins the context, the rest is the question (a message with no blank line, or nothing after its last one, stays
    all question). Both parts are tokenized separately without special tokens, as the pipeline does.

    Messages' text is text: where one holds a control token's text (``<|im_end|>``, ``<filename>``, ...), which
    tokenized with the rendered chat would become that token (and let a user end their turn and write another
    role's), the template is rendered around placeholders and each message's text tokenized on its own with the
    control tokens split into ordinary ones (a template's own edits of a text, such as trimming, then do not
    apply to it). Without such text the ids are the pipeline's exactly.
    """
    if mode not in CHAT_CONTEXT_MODES:
        raise ValueError(f"chat context mode: choose from {', '.join(CHAT_CONTEXT_MODES)}, got {mode!r}")
    last = messages[-1]
    parts = [last.content] if isinstance(last.content, str) else [p.text for p in last.content]
    if mode == "blank-line" and len(parts) == 1:
        context_text, question_text = completion_split(parts[0])
        if context_text and question_text:
            parts = [context_text, question_text]
    texts = [m.text() for m in messages[:-1]] + ["".join(parts[:-1]), parts[-1]]
    controls = control_token_texts(tokenizer)
    plain: dict[str, str] = {}  # placeholder -> the text it stands for
    if any(c in text for c in controls for text in texts):
        tag = uuid.uuid4().hex
        plain = {f"\u2063kvcompress-text-{i}-{tag}\u2063": text for i, text in enumerate(texts)}
        texts = list(plain)
    if tokenizer.chat_template is None:  # the pipeline's rule without a template: bos + context, question + "\n"
        context = (tokenizer.bos_token or "") + "".join(t + "\n" for t in texts[:-2]) + texts[-2]
        question = texts[-1] + "\n"
    else:
        separator = f"\u2063kvcompress-split-{uuid.uuid4().hex}\u2063"  # found in no user text
        rendered = [{"role": "system" if m.role == "developer" else m.role, "content": t}
                    for m, t in zip(messages[:-1], texts[:-2], strict=True)]  # fmt: skip
        rendered.append({"role": last.role, "content": texts[-2] + separator + texts[-1]})
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False,
                                             enable_thinking=False)
        context, question = text.split(separator)
    return _encode(tokenizer, context, plain), _encode(tokenizer, question, plain)


def _encode(tokenizer, text: str, plain: dict[str, str]) -> list[int]:
    """``text``'s ids without added special tokens; each placeholder of ``plain`` stands for its text, tokenized with
    control tokens' texts split into ordinary tokens."""
    if not plain:
        return tokenizer.encode(text, add_special_tokens=False) if text else []
    ids: list[int] = []
    for i, piece in enumerate(re.split("(" + "|".join(map(re.escape, plain)) + ")", text)):
        if i % 2:  # a placeholder
            if plain[piece]:
                ids += tokenizer.encode(plain[piece], add_special_tokens=False, split_special_tokens=True)
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids
