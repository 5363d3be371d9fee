"""The traffic-log middleware of the Serve ingress: copies sampled chat completions to the log.

:class:`TrafficLog` is pure ASGI, added inside :class:`pipelines.serve.ingress.RequestGuard` (so only
admitted requests are seen). For a sampled ``POST /v1/chat/completions`` it keeps a copy of the
request body as the app reads it and of each response body chunk as it is sent on (nothing is held
back from the client; a stream's SSE events are assembled into the answer on the writer thread).
When the response is complete -- HTTP 200 and, for a stream, ``data: [DONE]`` seen -- the copy goes to
:meth:`pipelines.traffic.TrafficLogWriter.submit` (a non-blocking queue put). Anything else (an error
status, a cut stream, a client gone, a response over ``max_record_bytes``) is not logged. The writer
lives in the ingress replica's process and starts its thread on the first logged request.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pipelines.recipe.traffic import TrafficLogConfig
from pipelines.serve.ingress import SERVED_HEADER
from pipelines.traffic import STREAM_DONE, Exchange, TrafficLogWriter

CHAT_PATHS = ("/v1/chat/completions",)


class TrafficLog:
    """ASGI middleware (``app.add_middleware(TrafficLog, config=..., uri=..., meta=...)``).

    ``meta``: columns every row of this app carries (``model``, ``head``: the pinned head reference,
    ``num_speculative_tokens``, ``k_schedule``); a response's ``SERVED_HEADER`` (JSON, set by
    :class:`pipelines.serve.gateway.PeagleIngress`) overrides them for its row, so rows follow the
    backend that answered across a rollout.
    """

    def __init__(self, app, *, config: TrafficLogConfig | dict, uri: str, meta: dict[str, Any] | None = None) -> None:
        self.app = app
        cfg = config if isinstance(config, TrafficLogConfig) else TrafficLogConfig.model_validate(config)
        self.writer = TrafficLogWriter(cfg, uri)
        self.meta = dict(meta or {})

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in CHAT_PATHS
                or not self.writer.sampled()):
            await self.app(scope, receive, send)
            return
        tap = _Tap(self.writer.config.max_record_bytes)

        async def tee_receive():
            message = await receive()
            tap.request(message)
            return message

        async def tee_send(message):
            tap.response(message)
            await send(message)

        try:
            await self.app(scope, tee_receive, tee_send)
        finally:
            exchange = tap.exchange(self.meta)
            if exchange is not None:
                self.writer.submit(exchange)
            elif tap.too_large:
                self.writer.count("skipped_too_large")


class _Tap:
    """The copies of one request and its response (never raises: a failure just disables the copy)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.started = max_bytes, time.time()
        self.req: list[bytes] = []
        self.res: list[bytes] = []
        self.size, self.status, self.stream, self.ended, self.broken, self.too_large = 0, 0, False, False, False, False
        self.served: dict[str, Any] = {}

    def request(self, message) -> None:
        try:
            if message.get("type") == "http.request":
                self.req.append(message.get("body", b""))
        except Exception:  # noqa: BLE001 - the log never fails a request
            self.broken = True

    def response(self, message) -> None:
        try:
            if message["type"] == "http.response.start":
                self.status = message.get("status", 0)
                headers = dict(message.get("headers", []))
                self.stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                served = headers.get(SERVED_HEADER.encode())
                self.served = json.loads(served) if served else {}
            elif message["type"] == "http.response.body" and not self.broken:
                chunk = message.get("body", b"")
                self.size += len(chunk)
                if self.size > self.max_bytes:
                    self.broken = self.too_large = True
                    self.res = []
                else:
                    self.res.append(chunk)
                if not message.get("more_body", False):
                    self.ended = True
        except Exception:  # noqa: BLE001
            self.broken = True

    def exchange(self, meta: dict[str, Any]) -> Exchange | None:
        if self.broken or not self.ended or self.status != 200:
            return None
        body = b"".join(self.res)
        if self.stream and STREAM_DONE not in body[-64:]:
            return None
        return Exchange(request=b"".join(self.req), response=body, stream=self.stream, started=self.started,
                        finished=time.time(), meta=meta | self.served)


__all__ = ["CHAT_PATHS", "TrafficLog"]
