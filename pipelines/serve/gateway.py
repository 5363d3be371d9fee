"""The OpenAI ingress of peagle: Ray's ``OpenAiIngress`` whose backend can be switched in place.

:class:`PeagleIngress` runs in two shapes (both built in :mod:`pipelines.serve`):

- one complete app (:func:`pipelines.serve.build_app`, ``serve run`` / RayService): the ``LLMServer``
  deployment is bound in the same app and passed as ``llm_deployments``, as with Ray's own ingress;
- the gateway of a blue/green rollout (:mod:`pipelines.serve.rollout`): the app ``settings.SERVE_APP_NAME``
  holds only this ingress; its ``user_config`` (:class:`Route`) names the backend app + ``LLMServer``
  deployment to forward to. The deployment has a fixed ``version`` (:func:`pipelines.serve.gateway_version`),
  so a new ``user_config`` is applied by Ray Serve with :meth:`PeagleIngress.reconfigure` on the running
  replica (Ray 2.60 ``DeploymentVersion.requires_actor_restart``: only a new code version, actor options or
  placement restart a replica; ``user_config`` is reconfigure-only) -- no request is dropped by the switch.

Each request takes the route active when it starts and keeps it to its end (stream included); a request whose
``LLMServer`` replica dies before it answered anything (queued in the dead replica's engine) is sent again, up
to :data:`REPLICA_LOST_RETRIES` times, and Serve routes it to a live replica (or holds it until one is back):
nothing was sent to the client yet, so the client sees one answer. A stream the replica had begun is continued
by another one from the text already sent (:mod:`pipelines.serve.resume`: same stream, same id, usage of the whole
answer), within the same number of sends; a stream that cannot be resumed (several choices, tool calls, token-id
prompts) ends with the error event :data:`pipelines.serve.ingress.STREAM_INTERRUPTED` instead. Requests
in flight per backend app are counted (:meth:`PeagleIngress.gateway_state`, read by the rollout before it
deletes an old backend). Every answer carries :data:`pipelines.serve.ingress.SERVED_HEADER`: JSON of the
served head (``backend``, ``head``, ``num_speculative_tokens``, ``k_schedule``), which the traffic log
copies into its rows.

Imports Ray Serve LLM (and so vLLM): import this module lazily.
"""

import asyncio
import collections
import json
import os
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
)
from ray.llm._internal.serve.core.ingress.utils import _apply_openai_json_format
from ray.serve.llm.ingress import OpenAiIngress
from starlette.responses import Response

from pipelines.serve.ingress import SERVED_HEADER
from pipelines.serve.resume import StreamResume

REPLICA_LOST_RETRIES = 3  # sends after the first of a request (or of a stream's rest) whose replica died
REPLICA_LOST_BACKOFF_S = 0.5  # wait before the n-th retry: n * this


def _replica_lost(e: BaseException) -> bool:
    """Whether ``e`` says the replica handling a request is gone (killed, crashed, unreachable)."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    return isinstance(e, RayActorError | ActorUnavailableError)


def _is_sse(item) -> bool:
    """Whether a streamed item is server-sent-event text (a string, or a batch of them)."""
    return isinstance(item, str) or (isinstance(item, list) and bool(item) and all(isinstance(i, str) for i in item))


def _stream_resume(body, call_method: str):
    """``(StreamResume or None, the first leg's body)``: a resumable stream asks its replica for usage on every
    chunk (:mod:`pipelines.serve.resume`); anything else goes as the client sent it."""
    if call_method not in ("chat", "completions") or not getattr(body, "stream", False):
        return None, body
    resume = StreamResume(body.model_dump(mode="json", exclude_unset=True), chat=call_method == "chat")
    if not resume.resumable:
        return None, body
    return resume, type(body).model_validate(resume.upstream_body())


class Route(BaseModel):
    """The gateway's ``user_config``: where requests go.

    ``app``: the backend Serve app; ``deployment``: its ``LLMServer`` deployment name; ``model_card``: the
    served model's ``ModelCard`` as a dict (its ``id`` is the model id clients send; its metadata, e.g. the
    context length, follows the backend); ``served``: the served head's description (``head``,
    ``num_speculative_tokens``, ``k_schedule``) for the answer header.
    """

    model_config = ConfigDict(extra="forbid")

    app: str
    deployment: str
    model_card: dict[str, Any]
    served: dict[str, Any] = {}


class _Active:
    """One backend as the gateway uses it (replaced whole on a switch, never mutated)."""

    def __init__(self, app: str, handles: dict, cards: dict, served: dict[str, Any]) -> None:
        self.app, self.handles, self.cards = app, handles, cards
        self.header = json.dumps({"backend": app, **served}, sort_keys=True)  # ASCII (ensure_ascii)


class PeagleIngress(OpenAiIngress):
    """``OpenAiIngress`` with a switchable backend, an in-flight count per backend and the served header.

    Args:
        llm_deployments: ``{model_id: LLMServer handle}`` (one complete app), or None for a gateway
            whose route comes from ``user_config`` (:meth:`reconfigure`).
        model_cards: ``{model_id: ModelCard}`` (one complete app).
        served: the served head's description (one complete app; a gateway gets it with its route).
        version: the gateway deployment's ``version`` (reported by :meth:`gateway_state`).

    Raises:
        ValueError: ``llm_deployments`` and ``model_cards`` name different models.
    """

    def __init__(self, llm_deployments: dict | None = None, model_cards: dict | None = None, *,
                 served: dict[str, Any] | None = None, version: str | None = None) -> None:
        super().__init__({}, {})
        self._version = version
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._active: _Active | None = None
        if llm_deployments:
            if set(llm_deployments) != set(model_cards or {}):
                raise ValueError(f"llm_deployments {sorted(llm_deployments)} != model_cards {sorted(model_cards or {})}")
            self._switch(_Active("", dict(llm_deployments), dict(model_cards), served or {}))

    async def reconfigure(self, config: dict[str, Any]) -> None:
        """Switch to the backend ``config`` (a :class:`Route` as a dict) for requests that start from now on.

        No ``await`` from reading the route to installing it: Ray runs this on the replica's user event
        loop, so a request sees either the old or the new backend, whole. An empty ``config``: no backend yet
        (a gateway started beside its first backend, ``pipelines.serve.rollout.roll``).
        """
        if not config:
            return
        route = Route.model_validate(config)
        card = ModelCard.model_validate(route.model_card)
        handle = serve.get_deployment_handle(route.deployment, app_name=route.app, _check_exists=False)
        self._switch(_Active(route.app, {card.id: handle}, {card.id: card}, route.served))

    def _switch(self, active: _Active) -> None:
        # OpenAiIngress reads these three; new dicts, so cached handles of the previous backend are never
        # reused.
        self._default_serve_handles = active.handles
        self._model_cards = active.cards
        self._configured_serve_handles = {}
        self._active = active

    async def gateway_state(self) -> dict[str, Any]:
        """``{"backend": active app or None, "in_flight": {app: requests not finished}, "version", "pid"}`` of
        this replica."""
        return {"backend": self._active.app if self._active else None, "version": self._version,
                "pid": os.getpid(),
                "in_flight": {app: n for app, n in self._in_flight.items() if n}}

    async def _get_response(self, *, body, call_method: str, raw_request: Request | None = None):
        # Runs up to the handle call without suspending: the handle OpenAiIngress picks is that of ``active``.
        active = self._active
        if active is None:
            from fastapi import HTTPException

            raise HTTPException(503, "no backend yet: the gateway waits for its first route")
        if raw_request is not None:
            raw_request.state.peagle_served = active.header
        self._in_flight[active.app] += 1
        resume, leg = _stream_resume(body, call_method)
        try:
            for attempt in range(REPLICA_LOST_RETRIES + 1):
                answered = False
                try:
                    async for item in super()._get_response(body=leg, call_method=call_method,
                                                            raw_request=raw_request):
                        answered = True
                        if resume is None or not _is_sse(item):  # e.g. an ErrorResponse: the ingress raises it
                            yield item
                        elif packet := resume.observe(_apply_openai_json_format(item)):
                            yield packet
                    return
                except Exception as e:
                    resumable = resume is not None and resume.resumable
                    if (answered and not resumable) or attempt == REPLICA_LOST_RETRIES or not _replica_lost(e):
                        raise
                    if answered:  # a stream cut mid-answer: the next leg continues it (pipelines.serve.resume)
                        if (rest := resume.continuation()) is None:
                            return  # nothing left to generate: the stream ends with [DONE]
                        leg = type(body).model_validate(rest)
                await asyncio.sleep(REPLICA_LOST_BACKOFF_S * (attempt + 1))
        finally:
            self._in_flight[active.app] -= 1

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        return _stamp(await super().chat(body, request), request)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return _stamp(await super().completions(body, request), request)


def _stamp(response: Response, request: Request) -> Response:
    header = getattr(request.state, "peagle_served", None)
    if header is not None:
        response.headers[SERVED_HEADER] = header
    return response


__all__ = ["PeagleIngress", "Route"]
