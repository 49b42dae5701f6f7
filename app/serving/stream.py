"""One streamed chat request to a served model's OpenAI-compatible API, with the standard library only.

No Qt and no torch: the chat panel runs `stream_chat` on a worker thread and gets each piece of text through
`on_text`. Server-sent events are read only as far as their `data:` lines, which is all the server sends.

A server listening beyond loopback (`rigpilot serve --listen`) speaks TLS with the engine's self-signed
certificate and wants the job's API key: the job reports both (its "serving" status: `tls_fingerprint`,
`api_key_file`), and `Access` carries them here. The certificate is checked by that fingerprint after the
handshake, as the engine's own clients check it (engine.api.tls), and the key goes in the Authorization header.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rigpilot.engine.api import tls

# Why a chat request failed, for the panel to word (ChatError.reason).
GONE = "gone"  # nothing listens at the URL any more: the serve job ended
REFUSED = "refused"  # the server answered with an error (OpenAI's shape: its message is in `detail`)
NO_ANSWER = "no_answer"  # it stopped answering mid-way, or what it sent is not an event stream
UNTRUSTED = "untrusted"  # TLS with a certificate other than the one its job reported (or none known to check)

READ_TIMEOUT_S = 120.0  # between two pieces of the stream: a long prompt's first token on a slow CPU


class ChatError(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Access:
    """What a server beyond loopback asks of its clients: the job's API key and its certificate's fingerprint."""

    api_key: str | None = None
    fingerprint: str | None = None


@dataclass
class ChatReply:
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None  # OpenAI's: "stop", "length"; None when the user stopped it
    stopped: bool = False  # the user's Stop ended it before the server did


class Stop:
    """Stop generating, from any thread: the request's connection is shut at once (also while the server is still
    reading a long prompt), which frees its slot on the server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._sock: socket.socket | None = None

    def set(self) -> None:
        with self._lock:
            self._set, sock = True, self._sock
        if sock is not None:
            _shut(sock)

    def is_set(self) -> bool:
        return self._set

    def _attach(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock
            stopped = self._set
        if stopped and sock is not None:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # the reading thread's recv returns at once
    except OSError:
        pass  # closed already


def stream_chat(
    url: str,
    model: str,
    messages: list[dict[str, str]],
    on_text: Callable[[str], None],
    stop: Stop | None = None,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    timeout: float = READ_TIMEOUT_S,
    access: Access | None = None,
) -> ChatReply:
    """POST `messages` to `url`/chat/completions with streaming and usage on; `on_text` gets each piece of the
    answer as it arrives, until the answer ends or `stop` is set."""
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    stop = stop or Stop()
    access = access or Access()
    where = urllib.parse.urlsplit(url)
    host = where.hostname or "127.0.0.1"
    connection: http.client.HTTPConnection
    if where.scheme == "https":
        if not access.fingerprint:
            raise ChatError(UNTRUSTED, "the server's job reported no certificate to check it by")
        connection = http.client.HTTPSConnection(host, where.port, timeout=timeout, context=tls.client_context())
    else:
        connection = http.client.HTTPConnection(host, where.port, timeout=timeout)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if access.api_key:
        headers["Authorization"] = f"Bearer {access.api_key}"
    reply = ChatReply()
    try:
        connection.connect()
        stop._attach(connection.sock)
        if where.scheme == "https":
            _check_certificate(connection.sock, access.fingerprint)
        connection.request("POST", where.path.rstrip("/") + "/chat/completions", body=json.dumps(body).encode(),
                           headers=headers)  # fmt: skip
        response = connection.getresponse()
        if response.status >= 400:
            raise ChatError(REFUSED, _error_message(response))
        while not stop.is_set():
            line = response.readline()
            if not line or _take(line, reply, on_text):
                break
        if stop.is_set():
            reply.stopped = reply.finish_reason is None
        elif reply.finish_reason is None:
            raise ChatError(NO_ANSWER, "the stream ended before the answer did")
    except (ConnectionRefusedError, FileNotFoundError):
        raise ChatError(GONE) from None
    except (OSError, http.client.HTTPException) as e:  # reset mid-stream, silent past the timeout, or stopped
        if not stop.is_set():
            raise ChatError(NO_ANSWER, str(e) or type(e).__name__) from None
        reply.stopped = True
    finally:
        stop._attach(None)
        connection.close()
    return reply


def _check_certificate(sock: Any, fingerprint: str | None) -> None:
    """Before the key or a message goes out: the certificate is the one the job reported."""
    der = sock.getpeercert(binary_form=True) if sock is not None else None
    seen = tls.fingerprint_of(der) if der else "none"
    if seen != fingerprint:
        raise ChatError(UNTRUSTED, f"it presents certificate {seen}, not the engine's {fingerprint}")


def _take(raw: bytes, reply: ChatReply, on_text: Callable[[str], None]) -> bool:
    """Fold one line of the stream into `reply`; True at its end (`data: [DONE]`)."""
    line = raw.decode("utf-8", "replace").strip()
    if not line.startswith("data:"):
        return False  # blank separators, comments, other fields
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    try:
        chunk = json.loads(data)
    except ValueError:
        raise ChatError(NO_ANSWER, "the server sent an event that is not JSON") from None
    if not isinstance(chunk, dict):
        return False
    if isinstance(chunk.get("error"), dict):
        raise ChatError(REFUSED, str(chunk["error"].get("message") or "an error"))
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        reply.prompt_tokens = _int(usage.get("prompt_tokens"))
        reply.completion_tokens = _int(usage.get("completion_tokens"))
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else None
        if isinstance(text, str) and text:
            reply.text += text
            on_text(text)
        if isinstance(choice.get("finish_reason"), str):
            reply.finish_reason = choice["finish_reason"]
    return False


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _error_message(response: http.client.HTTPResponse) -> str:
    """The message of an error in OpenAI's shape ({"error": {"message": ...}}), else the HTTP status."""
    try:
        error = json.loads(response.read(64 * 1024) or b"{}").get("error")
    except (ValueError, OSError, AttributeError):
        error = None
    message = error.get("message") if isinstance(error, dict) else None
    return str(message) if message else f"HTTP {response.status} {response.reason}"
