"""The request guard in front of Ray's OpenAI ingress: API key, body size, body encoding.

Ray's FastAPI app already answers malformed JSON and wrong types with 400, an unknown model with
404, and vLLM's own checks (prompt over the context length, ``max_tokens`` <= 0 or over
``max_model_len``, ``n``, ``logprobs``, ``temperature`` out of range) come back as 400. What it does
not do, :class:`RequestGuard` does before a byte reaches the router:

- 401 without ``Authorization: Bearer $<api_key_env>`` (or ``x-api-key``) when a key is configured
  (500 if the replica itself lacks the variable: a deployment error, not the client's);
- 413 for a body over ``max_body_bytes`` (declared by ``Content-Length`` or counted while reading a
  chunked body), so a huge upload is never buffered whole;
- 400 with the byte offset for a JSON body that is not UTF-8 (FastAPI would answer an opaque
  "There was an error parsing the body");
- an error body of Ray's OpenAI app loses Ray's internal wrapper ("Internal exception:
  ray.llm._internal...OpenAIHTTPException (Request ID: ...), original exception: "): the client reads
  vLLM's own message (:func:`clean_error_message`);
- a stream (``text/event-stream``) that ends without ``data: [DONE]`` -- the LLMServer replica died
  under it, and Ray closes the response as if it had finished -- gets a last ``data: {"error": ...}``
  event, so clients see an error (the OpenAI SDK raises ``APIError``) instead of a silently cut answer.

Errors use OpenAI's shape: ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import hmac
import json
import os
import re
from typing import Any

API_KEY_HEADER = "authorization"
SERVED_HEADER = "x-peagle-served"  # JSON of the head that answered (pipelines.serve.gateway; the traffic log reads it)
BODY_METHODS = ("POST", "PUT", "PATCH")
STREAM_DONE = b"data: [DONE]"
STREAM_INTERRUPTED = (b'data: {"error": {"message": "stream interrupted: the model replica serving it stopped '
                      b'before the end; retry the request", "type": "server_error", "code": 503}}\n\n')


# Ray Serve LLM's wrapper around the engine's error text (ray.llm._internal.serve.core)
_RAY_WRAPPER = re.compile(r"Internal exception: [\w.]+ \(Request ID: [^)]*\),? original exception: ?")


def clean_error_message(message: str, status: int) -> str:
    """``message`` without Ray's internal exception wrapper; a message that was only the wrapper becomes a
    plain sentence naming the status."""
    cleaned = _RAY_WRAPPER.sub("", message).strip()
    return cleaned or f"the model server refused the request (HTTP {status})"


def error_response(status: int, message: str, kind: str):
    """An OpenAI-style JSON error response."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class RequestGuard:
    """Pure ASGI middleware (``app.add_middleware(RequestGuard, max_body_bytes=..., api_key_env=...)``).

    The key is read from the replica's environment at request time (never stored in the app). The
    body of a POST/PUT/PATCH is read here (at most ``max_body_bytes``) and replayed to the app.
    """

    def __init__(self, app, *, max_body_bytes: int, api_key_env: str | None = None) -> None:
        self.app, self.max_body_bytes, self.api_key_env = app, max_body_bytes, api_key_env

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refused = self._check_key(headers) or self._check_length(headers)
        if refused is not None:
            await refused(scope, receive, send)
            return
        send = _StreamEndWatch(send)
        if scope.get("method") not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        body, refused = await self._read_body(receive, headers.get("content-type", ""))
        if refused is not None:
            await refused(scope, receive, send)
            return
        if body is None:  # the client went away
            return
        await self.app(scope, _replay(body, receive), send)

    def _check_key(self, headers: dict[str, str]):
        if not self.api_key_env:
            return None
        expected = os.environ.get(self.api_key_env)
        if not expected:
            return error_response(500, f"server misconfigured: {self.api_key_env} is not set on this replica",
                                  "server_error")
        auth = headers.get(API_KEY_HEADER, "")
        sent = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
        if not sent or not hmac.compare_digest(sent.encode(), expected.encode()):
            return error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                  "authentication_error")
        return None

    def _check_length(self, headers: dict[str, str]):
        length = headers.get("content-length")
        if length is None:
            return None
        if not length.strip().isdigit():
            return error_response(400, f"invalid Content-Length header {length[:40]!r}", "invalid_request_error")
        if int(length) > self.max_body_bytes:
            return self._too_large(int(length))
        return None

    def _too_large(self, declared_bytes: int | None = None):
        size = f" of {declared_bytes} bytes" if declared_bytes is not None else ""
        return error_response(413, f"request body{size} exceeds the limit of {self.max_body_bytes} bytes "
                              "(ServeAppArgs.max_body_bytes)", "invalid_request_error")

    async def _read_body(self, receive, content_type: str) -> tuple[bytes | None, Any]:
        """``(body, None)``, ``(None, error response)``, or ``(None, None)`` when the client disconnected."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None, self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body and (not content_type or "json" in content_type.lower()):
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as e:
                return None, error_response(
                    400, f"request body is not valid UTF-8 (byte {e.start}: {body[e.start:e.start + 4]!r}); "
                    "send JSON encoded as UTF-8", "invalid_request_error")
        return body, None


class _StreamEndWatch:
    """Wraps ASGI ``send``: an event stream whose last body message comes without ``data: [DONE]``
    gets :data:`STREAM_INTERRUPTED` appended; a JSON error response (status >= 400) is held until its
    body is complete and sent with :func:`clean_error_message` applied to ``error.message``."""

    def __init__(self, send) -> None:
        self.send, self.is_stream, self.done, self.tail = send, False, False, b""
        self.error_start: dict | None = None
        self.error_body = b""

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            self.is_stream = content_type.startswith(b"text/event-stream")
            if message.get("status", 200) >= 400 and b"json" in content_type:
                self.error_start = message
                return
        elif message["type"] == "http.response.body" and self.error_start is not None:
            self.error_body += message.get("body", b"")
            if not message.get("more_body", False):
                await self._send_error()
            return
        elif message["type"] == "http.response.body" and self.is_stream and not self.done:
            window = self.tail + message.get("body", b"")
            self.done, self.tail = STREAM_DONE in window, window[-len(STREAM_DONE):]
            if not self.done and not message.get("more_body", False):
                await self.send({**message, "more_body": True})
                message = {"type": "http.response.body", "body": STREAM_INTERRUPTED, "more_body": False}
        await self.send(message)

    async def _send_error(self) -> None:
        start, body = self.error_start, self.error_body
        try:
            payload = json.loads(body)
            err = payload.get("error") if isinstance(payload, dict) else None
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                err["message"] = clean_error_message(err["message"], start.get("status", 500))
                body = json.dumps(payload).encode()
        except ValueError:
            pass  # not JSON after all: passed on unchanged
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await self.send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


def _replay(body: bytes, receive):
    """An ASGI ``receive`` that yields ``body`` once, then defers to the client's (disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


__all__ = ["SERVED_HEADER", "RequestGuard", "error_response"]
