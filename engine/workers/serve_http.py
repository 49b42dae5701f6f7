"""The server's HTTP side: an OpenAI-compatible API (Starlette, run by uvicorn on its own thread).

/v1/models, /v1/completions and /v1/chat/completions, with `stream` as server-sent events in OpenAI's chunk
shape ending with `data: [DONE]`. Errors keep OpenAI's shape ({"error": {"message", "type", "param",
"code"}}) and status codes: 400 a bad request, 404 another model or path, 413 a body or prompt too large,
429 every slot taken, 500 a failure of the server. The body's size and the requests at once are bounded;
a client that disconnects has its request dropped from the batch, which frees its slot.

Only text goes back and forth: request bodies are JSON, nothing is ever unpickled.

A request's `model` picks the base (its name) or one of the LoRA adapters served beside it. With an API key
(a server listening beyond loopback), every request must carry `Authorization: Bearer KEY`; anything else is
answered 401 in OpenAI's shape, the key compared in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rigpilot.engine.workers.serve_batch import Event, Request, Sampling

MAX_BODY_BYTES = 1 << 20  # a prompt of this many bytes is far past any prompt-token limit already
MAX_STOPS = 4  # as OpenAI's API
# How often a non-streaming request looks whether its client is still there.
DISCONNECT_POLL_S = 0.5
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error"
        )
        if self.status >= 500:
            kind = "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


@dataclass
class ServedModel:
    """What the HTTP side needs of the model: its name, its tokenizer and the limits of a request."""

    name: str
    tokenizer: Any
    context: int | None  # positions the model takes (max_position_embeddings), where its config says
    max_new_tokens: int
    max_prompt_tokens: int
    max_concurrent: int
    submit: Callable[[Request], None]  # thread-safe: hands a request to the generation thread
    adapters: tuple[str, ...] = ()  # LoRA adapters served on the base, by the name a request's `model` gives
    api_key: str | None = None  # required of every request when set

    @property
    def names(self) -> list[str]:
        return [self.name, *self.adapters]


def build_app(served: ServedModel) -> Any:
    """The ASGI app: Starlette's routes, behind the API key's check where there is one."""
    state = {"active": 0}
    boxes: dict[str, _Mailbox] = {}  # the event loop's, made on its first request (it runs only then)
    created = int(time.time())

    async def models(request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(n, created) for n in served.names]})

    async def health(request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok", "active": state["active"]})

    async def completions(request: HttpRequest) -> Response:
        return await _serve(request, chat=False)

    async def chat(request: HttpRequest) -> Response:
        return await _serve(request, chat=True)

    async def _serve(request: HttpRequest, chat: bool) -> Response:
        if state["active"] >= served.max_concurrent:
            return ApiError(429, f"the server is busy: {served.max_concurrent} requests at once at most",
                            code="too_many_requests").response()  # fmt: skip
        state["active"] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                state["active"] -= 1

        try:
            body = await _read_json(request)
            if "mailbox" not in boxes:
                boxes["mailbox"] = _Mailbox(asyncio.get_running_loop())
            req, events = _make_request(served, body, chat, boxes["mailbox"])
            streamed = body.get("stream") is True
            served.submit(req)
            ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            if streamed:
                options = body.get("stream_options")
                include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
                stream = _stream(ident, body["model"], chat, events, include_usage)

                def closed() -> None:
                    # A request still in the batch (its client left) is dropped at the next step; one that ended
                    # is in it no more, and this changes nothing.
                    req.cancelled = True
                    release()

                return _EventStream(stream, closed)
            try:
                return JSONResponse(await _whole(ident, body["model"], chat, req, events, request))
            finally:
                release()
        except ApiError as e:
            release()
            return e.response()
        except BaseException:
            release()
            raise

    async def not_found(request: HttpRequest, exc: Exception) -> Response:
        return ApiError(404, f"no such path: {request.url.path}", code="not_found").response()

    async def server_error(request: HttpRequest, exc: Exception) -> Response:
        return ApiError(500, f"the server failed: {type(exc).__name__}", code="server_error").response()

    async def not_allowed(request: HttpRequest, exc: Exception) -> Response:
        return ApiError(
            405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed"
        ).response()

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed, 500: server_error})
    return _RequireKey(app, served.api_key) if served.api_key else app


class _RequireKey:
    """Every HTTP request carries `Authorization: Bearer <key>`, or is answered 401 before the app sees it."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                said = "no API key given" if not given else "the API key is not this server's"
                error = ApiError(401, f"{said}: send Authorization: Bearer KEY (rigpilot serve printed the key)",
                                 code="invalid_api_key")  # fmt: skip
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "rigpilot"}


async def _read_json(request: HttpRequest) -> dict[str, Any]:
    """The body as a JSON object, refused past MAX_BODY_BYTES whatever Content-Length claims."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {int(declared):,} bytes; at most {MAX_BODY_BYTES:,} are taken",
                       code="request_too_large")  # fmt: skip
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES:,} bytes", code="request_too_large")
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _make_request(
    served: ServedModel, body: dict[str, Any], chat: bool, mailbox: _Mailbox
) -> tuple[Request, asyncio.Queue[Event]]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: the name /v1/models lists", param="model", code="missing_model")
    if model not in served.names:
        names = ", ".join(repr(n) for n in served.names)
        raise ApiError(404, f"the model {model!r} is not served here; this server serves {names}",
                       param="model", code="model_not_found")  # fmt: skip
    n = body.get("n", 1)
    if n not in (1, None):
        raise ApiError(400, "n: only 1 completion per request in this version", param="n", code="not_yet_supported")
    for name in ("logprobs", "top_logprobs", "tools", "functions", "suffix"):
        if body.get(name) not in (None, False, [], {}):
            raise ApiError(400, f"{name}: not yet in this version", param=name, code="not_yet_supported")
    if body.get("echo") or body.get("best_of") not in (None, 1):
        param = "echo" if body.get("echo") else "best_of"
        raise ApiError(400, f"{param}: not yet in this version", param=param, code="not_yet_supported")
    prompt_ids = _chat_ids(served, body) if chat else _prompt_ids(served, body)
    if len(prompt_ids) > served.max_prompt_tokens:
        raise ApiError(413, f"the prompt is {len(prompt_ids)} tokens; this server takes {served.max_prompt_tokens} "
                       "at most", param="messages" if chat else "prompt", code="context_length_exceeded")  # fmt: skip
    room = served.max_new_tokens
    if served.context is not None:
        room = min(room, served.context - len(prompt_ids))
        if room < 1:
            raise ApiError(400, f"the prompt is {len(prompt_ids)} tokens, and the model takes {served.context} "
                           "in all", param="messages" if chat else "prompt", code="context_length_exceeded")  # fmt: skip
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    asked = body.get(key)
    if asked is None:
        asked = room if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
    if not _is_int(asked) or asked < 1:
        raise ApiError(400, f"{key} must be a whole number of at least 1", param=key, code="invalid_value")
    if asked > served.max_new_tokens:
        raise ApiError(400, f"{key} is {asked}; this server generates {served.max_new_tokens} tokens a request at "
                       "most", param=key, code="invalid_value")  # fmt: skip
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise ApiError(400, "top_p must be above 0", param="top_p", code="invalid_value")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise ApiError(400, "seed must be a whole number", param="seed", code="invalid_value")
    stop = _stops(body.get("stop"))
    bias = _logit_bias(body.get("logit_bias"), len(served.tokenizer))
    events: asyncio.Queue[Event] = asyncio.Queue()

    def emit(event: Event) -> None:
        mailbox.put(events, event)

    sampling = Sampling(temperature, top_p, None if seed is None else int(seed) % 2**63, bias)
    adapter = model if model != served.name else None
    return Request(prompt_ids, min(asked, room), sampling, stop, emit, adapter=adapter), events


class _Mailbox:
    """Events from the generation thread into the event loop, one wake-up for all that came meanwhile: a decode
    step of 16 requests is one wake-up of the loop (a write to its self-pipe), not 16."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[asyncio.Queue[Event], Event]] = []

    def put(self, events: asyncio.Queue[Event], event: Event) -> None:
        with self.lock:
            self.pending.append((events, event))
            if len(self.pending) > 1:
                return  # a flush is on its way already
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self.lock:
            items, self.pending = self.pending, []
        for events, event in items:
            events.put_nowait(event)


def _prompt_ids(served: ServedModel, body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        vocab = len(served.tokenizer)
        if any(not 0 <= t < vocab for t in prompt):
            raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
        return list(prompt)
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string (one prompt a request in this version)", param="prompt",
                       code="invalid_value")  # fmt: skip
    if not prompt:
        raise ApiError(400, "prompt is empty: give some text to continue", param="prompt", code="invalid_value")
    return list(served.tokenizer(prompt)["input_ids"])


def _chat_ids(served: ServedModel, body: dict[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages", code="invalid_value")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ApiError(400, f"messages[{i}] needs a role and a text content", param=f"messages[{i}]",
                           code="invalid_value")  # fmt: skip
        plain.append({"role": m["role"], "content": m["content"]})
    if not getattr(served.tokenizer, "chat_template", None):
        raise ApiError(400, f"the model {served.name!r} has no chat template: use /v1/completions",
                       param="messages", code="no_chat_template")  # fmt: skip
    try:
        text = served.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template's own check of the roles and their order (jinja's raise_exception)
        raise ApiError(400, f"the model's chat template refused the messages: {e}", param="messages",
                       code="invalid_value") from None  # fmt: skip
    # The template writes the special tokens (BOS) itself.
    return list(served.tokenizer(text, add_special_tokens=False)["input_ids"])


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop", code="invalid_value")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop takes {MAX_STOPS} strings at most", param="stop", code="invalid_value")
    return stops


def _logit_bias(bias: Any, vocab: int) -> dict[int, float]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}; -100 bans a token, 100 all but forces it."""
    if bias is None:
        return {}
    out: dict[int, float] = {}
    problem = not isinstance(bias, dict) or len(bias) > 300
    for key, value in bias.items() if not problem else ():
        token = int(key) if isinstance(key, str) and key.isdigit() else -1
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not 0 <= token < vocab or not number or not -100 <= value <= 100:
            problem = True
            break
        out[token] = float(value)
    if problem:
        raise ApiError(400, f"logit_bias maps token ids (0 to {vocab - 1}, 300 at most) to numbers in [-100, 100]",
                       param="logit_bias", code="invalid_value")  # fmt: skip
    return out


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ApiError(400, f"{key} must be a number in [{lo:g}, {hi:g}]", param=key, code="invalid_value")
    return float(value)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _usage(event: Event) -> dict[str, int]:
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens}  # fmt: skip


async def _whole(ident: str, name: str, chat: bool, req: Request, events: asyncio.Queue[Event],
                 http: HttpRequest) -> dict[str, Any]:  # fmt: skip
    text = ""
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await http.is_disconnected():
                    raise asyncio.CancelledError from None
                continue
            text += event.text
            if event.finish_reason is not None:
                break
    except BaseException:
        req.cancelled = True  # the batch drops it at its next step
        raise
    choice: dict[str, Any] = {"index": 0, "finish_reason": event.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": name, "choices": [choice], "usage": _usage(event)}  # fmt: skip


async def _stream(
    ident: str, name: str, chat: bool, events: asyncio.Queue[Event], include_usage: bool
) -> AsyncIterator[str]:
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        data = {"id": ident, "object": obj, "created": created, "model": name, "choices": [choice]}
        return f"data: {json.dumps(data)}\n\n"

    if chat:
        yield chunk(None, None, first=True)
    while True:
        event = await events.get()
        if event.text or event.finish_reason:
            yield chunk(event.text, event.finish_reason)
        if event.finish_reason is not None:
            break
    if include_usage:
        data = {"id": ident, "object": obj, "created": created, "model": name, "choices": [], "usage": _usage(event)}
        yield f"data: {json.dumps(data)}\n\n"
    yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events that call `on_close` however the response ends: its last event sent, its client gone
    mid-stream (Starlette cancels the events), or gone before the first one (they never start)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
