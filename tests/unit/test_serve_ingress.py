"""RequestGuard (the ingress middleware of pipelines.serve) on a bare Starlette app: API key, body
size (declared and chunked), non-UTF-8 JSON, the body reaching the app unchanged, and an event
stream cut before ``[DONE]`` ending with an error event."""

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pipelines.serve.ingress import RequestGuard

pytestmark = pytest.mark.unit

KEY_ENV = "PEAGLE_TEST_GUARD_KEY"


async def echo(request):
    body = await request.body()
    return JSONResponse({"num_bytes": len(body), "head": body[:16].decode(errors="replace")})


async def stream(request):
    finish = request.query_params.get("finish") == "1"

    async def events():
        yield b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
        yield b'data: {"choices": [{"delta": {"content": "b"}}]}\n\n'
        if finish:
            yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


RAY_WRAPPED = ("Internal exception: ray.llm._internal.serve.core.configs.openai_api_models.OpenAIHTTPException "
               "(Request ID: 3f1c-77), original exception: 'max_tokens' must be at most 2048")


async def refused(request):
    message = RAY_WRAPPED if request.query_params.get("only") != "1" else RAY_WRAPPED.split("'max")[0]
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": 400}}, status_code=400)


def client(monkeypatch, *, api_key_env: str | None = KEY_ENV, max_body_bytes: int = 1024) -> TestClient:
    monkeypatch.setenv(KEY_ENV, "sk-1")
    app = Starlette(routes=[Route("/v1/echo", echo, methods=["GET", "POST"]),
                                Route("/v1/stream", stream, methods=["POST"]),
                                Route("/v1/refused", refused, methods=["POST"])])
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes, api_key_env=api_key_env)
    return TestClient(app)


def test_api_key(monkeypatch):
    c = client(monkeypatch)
    assert c.post("/v1/echo", json={}).status_code == 401
    r = c.post("/v1/echo", json={}, headers={"Authorization": "Bearer sk-2"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert c.post("/v1/echo", json={}, headers={"Authorization": "Bearer sk-1"}).status_code == 200
    assert c.post("/v1/echo", json={}, headers={"x-api-key": "sk-1"}).status_code == 200
    monkeypatch.delenv(KEY_ENV)
    r = c.post("/v1/echo", json={}, headers={"Authorization": "Bearer sk-1"})
    assert r.status_code == 500 and KEY_ENV in r.json()["error"]["message"]
    assert client(monkeypatch, api_key_env=None).post("/v1/echo", json={}).status_code == 200


def test_body_size_and_encoding(monkeypatch):
    c = client(monkeypatch, api_key_env=None)
    ok = c.post("/v1/echo", content=b'{"a": "' + b"x" * 900 + b'"}', headers={"Content-Type": "application/json"})
    assert ok.status_code == 200 and ok.json() == {"num_bytes": 909, "head": '{"a": "xxxxxxxxx'}
    r = c.post("/v1/echo", content=b"x" * 1025)
    assert r.status_code == 413 and "1025 bytes exceeds the limit of 1024" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted while reading
        for _ in range(5):
            yield b"x" * 300

    r = c.post("/v1/echo", content=chunks())
    assert r.status_code == 413 and "limit of 1024" in r.json()["error"]["message"]
    r = c.post("/v1/echo", content=b'{"a": "\xff\xfe"}', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid UTF-8 (byte 7" in r.json()["error"]["message"]
    # Binary bodies that are not JSON (e.g. multipart audio) are not decoded.
    r = c.post("/v1/echo", content=b"\xff\xfe", headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 200 and r.json()["num_bytes"] == 2
    assert c.get("/v1/echo").status_code == 200


def test_cut_stream_ends_with_an_error_event(monkeypatch):
    import json

    c = client(monkeypatch, api_key_env=None)
    whole = c.post("/v1/stream?finish=1").text
    assert whole.endswith("data: [DONE]\n\n") and "error" not in whole
    events = [line[len("data: "):] for line in c.post("/v1/stream").text.splitlines() if line.startswith("data: ")]
    assert len(events) == 3 and "stream interrupted" in json.loads(events[-1])["error"]["message"]


def test_error_bodies_lose_rays_internal_wrapper(monkeypatch):
    c = client(monkeypatch, api_key_env=None)
    r = c.post("/v1/refused", json={})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "'max_tokens' must be at most 2048", "type": "BadRequestError", "code": 400}
    assert int(r.headers["content-length"]) == len(r.content)
    r = c.post("/v1/refused?only=1", json={})
    assert r.json()["error"]["message"] == "the model server refused the request (HTTP 400)"
    assert "ray.llm" not in r.text


class _Upstream:
    """Stands in for the LLMServer behind the gateway: its replica is gone (Ray's ActorDiedError) for the first
    ``lost`` calls, before or after the first chunk (``after_chunks``), then it answers ``chunks``."""

    def __init__(self, lost: int, after_chunks: int = 0, chunks=("a", "b")) -> None:
        self.lost, self.after_chunks, self.chunks, self.calls = lost, after_chunks, chunks, 0

    def __call__(self, ingress, *, body, call_method, raw_request=None):
        from ray.exceptions import ActorDiedError

        async def gen():
            self.calls += 1
            if self.calls <= self.lost:
                for c in self.chunks[:self.after_chunks]:
                    yield c
                raise ActorDiedError()
            for c in self.chunks:
                yield c

        return gen()


def _gateway(monkeypatch, upstream):
    import asyncio

    from ray.serve.llm.ingress import OpenAiIngress

    from pipelines.serve import gateway

    monkeypatch.setattr(OpenAiIngress, "_get_response", lambda self, **kw: upstream(self, **kw))
    monkeypatch.setattr(gateway, "REPLICA_LOST_BACKOFF_S", 0.0)
    ingress = gateway.PeagleIngress.__new__(gateway.PeagleIngress)  # no Serve replica context needed
    ingress._in_flight, ingress._active = gateway.collections.Counter(), gateway._Active("b1", {}, {}, {})

    async def run():
        return [x async for x in ingress._get_response(body=None, call_method="completions")]

    return lambda: asyncio.run(run()), ingress


@pytest.mark.parametrize("lost", [1, 3])
def test_gateway_sends_again_a_request_whose_replica_died_before_answering(monkeypatch, lost):
    """Nothing was sent to the client yet: the gateway sends the request again (up to REPLICA_LOST_RETRIES), and
    the client gets one whole answer."""
    from pipelines.serve import gateway

    upstream = _Upstream(lost=lost)
    run, ingress = _gateway(monkeypatch, upstream)
    assert lost <= gateway.REPLICA_LOST_RETRIES
    assert run() == ["a", "b"] and upstream.calls == lost + 1
    assert not +ingress._in_flight  # counted out again


def test_gateway_does_not_resend_a_started_answer_or_retry_forever(monkeypatch):
    from ray.exceptions import ActorDiedError

    from pipelines.serve import gateway

    started = _Upstream(lost=1, after_chunks=1)  # the replica died mid-stream: tokens were already sent
    run, _ = _gateway(monkeypatch, started)
    with pytest.raises(ActorDiedError):
        run()
    assert started.calls == 1
    gone = _Upstream(lost=gateway.REPLICA_LOST_RETRIES + 1)  # no replica comes back
    run, _ = _gateway(monkeypatch, gone)
    with pytest.raises(ActorDiedError):
        run()
    assert gone.calls == gateway.REPLICA_LOST_RETRIES + 1
