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
