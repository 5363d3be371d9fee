"""The blue/green pieces that need no Serve cluster: backend app names, the gateway version, the
gateway ingress switching backends with requests in flight (fake handles), the traffic log taking
the served head from the answer header, and a first roll's order of deployments against a stand-in Serve (a real
failed first roll costs ~85 s of CI: a Serve cluster, and Serve's 20 s wait to delete an unplaced replica)."""

import asyncio
import json
import os
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from pipelines import settings

pytestmark = pytest.mark.unit


def test_backend_app_name():
    assert settings.serve_backend_app_name("v3", "1a2b3c4d5e6f") == "peagle-backend-v3-1a2b3c4d"
    assert settings.serve_backend_app_name("v3", "1a2b3c4d5e6f").startswith(settings.SERVE_BACKEND_PREFIX)
    for label, digest in (("", "ab"), ("v/1", "ab"), ("v1", ""), ("v 1", "ab")):
        with pytest.raises(ValueError, match="backend app name"):
            settings.serve_backend_app_name(label, digest)


def test_gateway_version_ignores_backend_fields():
    from pipelines.serve import ServeAppArgs, gateway_version

    a = ServeAppArgs(head="models:/peagle-x/1", num_speculative_tokens=3)
    assert gateway_version(a, "m") == gateway_version(a.model_copy(update={
        "head": "models:/peagle-x/2", "num_speculative_tokens": 5, "engine_kwargs": {"max_model_len": 64}}), "m")
    assert gateway_version(a, "m") != gateway_version(a, "other-model")
    assert gateway_version(a, "m") != gateway_version(a.model_copy(update={"max_body_bytes": 4096}), "m")


class FakeHandle:
    """An ``LLMServer`` handle: ``options(stream=True).chat.remote(body, raw)`` streams ``name:0``, ``name:1``
    after each release of ``gate``."""

    def __init__(self, name: str) -> None:
        self.name, self.gate = name, asyncio.Event()
        self.chat = SimpleNamespace(remote=self._remote)

    def options(self, **_):
        return self

    async def _remote(self, body, raw_request_info):
        for i in range(2):
            await self.gate.wait()
            yield f"{self.name}:{i}"


def request() -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [],
                    "query_string": b""})


def test_gateway_switches_backend_with_requests_in_flight(monkeypatch):
    from fastapi import HTTPException
    from ray import serve

    from pipelines.serve.gateway import PeagleIngress, Route

    handles = {"app-a": FakeHandle("a"), "app-b": FakeHandle("b")}
    monkeypatch.setattr(serve, "get_deployment_handle", lambda name, app_name, **_: handles[app_name])
    card = {"id": "m", "object": "model", "owned_by": "x", "permission": [], "metadata": {}}

    def route(app: str, head: str) -> dict:
        return Route(app=app, deployment="LLMServer:m", model_card=card, served={"head": head}).model_dump()

    async def scenario():
        gw = PeagleIngress(version="gw-1")
        await gw.reconfigure({})  # a gateway started beside its first backend: no route yet
        assert (await gw.gateway_state())["backend"] is None
        with pytest.raises(HTTPException) as early:
            await gw._get_response(body=SimpleNamespace(model="m"), call_method="chat", raw_request=request()).__anext__()
        assert early.value.status_code == 503
        await gw.reconfigure(route("app-a", "models:/x/1"))
        req_a = request()
        old = gw._get_response(body=SimpleNamespace(model="m"), call_method="chat", raw_request=req_a)
        handles["app-a"].gate.set()
        assert await old.__anext__() == "a:0"  # a request on A, not finished
        await gw.reconfigure(route("app-b", "models:/x/2"))
        assert await gw.gateway_state() == {"backend": "app-b", "version": "gw-1", "pid": os.getpid(),
                                            "in_flight": {"app-a": 1}}
        req_b = request()
        new = gw._get_response(body=SimpleNamespace(model="m"), call_method="chat", raw_request=req_b)
        handles["app-b"].gate.set()
        assert [x async for x in new] == ["b:0", "b:1"]  # a new request goes to B
        assert [x async for x in old] == ["a:1"]  # the old one ends on A
        assert (await gw.gateway_state())["in_flight"] == {}
        assert json.loads(req_a.state.peagle_served) == {"backend": "app-a", "head": "models:/x/1"}
        assert json.loads(req_b.state.peagle_served) == {"backend": "app-b", "head": "models:/x/2"}

    asyncio.run(scenario())


def test_traffic_log_rows_follow_the_served_header(tmp_path):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from pipelines.recipe import TrafficLogConfig
    from pipelines.serve.ingress import SERVED_HEADER
    from pipelines.serve.traffic import TrafficLog
    from pipelines.traffic import read_log

    heads = iter(["models:/x/1", "models:/x/2"])

    async def chat(req):
        body = await req.json()
        served = json.dumps({"backend": "b", "head": next(heads), "num_speculative_tokens": 5})
        return JSONResponse({"id": "c", "object": "chat.completion", "model": body["model"], "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]},
            headers={SERVED_HEADER: served})

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    mw = TrafficLog(app, config=TrafficLogConfig(), uri=str(tmp_path / "log"),
                    meta={"model": "m", "head": "static", "num_speculative_tokens": 3})
    client = TestClient(mw)
    for i in range(2):
        client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]})
    assert mw.writer.flush()
    rows = sorted(read_log(tmp_path / "log").to_pylist(), key=lambda r: r["messages"][-1]["content"])
    assert [(r["head"], r["num_speculative_tokens"]) for r in rows] == [("models:/x/1", 5), ("models:/x/2", 5)]


class FakeServe:
    """Ray Serve as :func:`pipelines.serve.rollout.roll` sees it: apps by name with a status; ``run_many`` adds
    them DEPLOYING (a backend becomes RUNNING when ``ready`` says so), ``delete`` removes them; ``deployed`` and
    ``routes`` record the order of deployments and the gateway's routes."""

    def __init__(self, ready: bool) -> None:
        self.apps: dict[str, str] = {}
        self.ready, self.deployed, self.routes = ready, [], []

    def RunTarget(self, app, name, route_prefix):  # Serve's name
        return SimpleNamespace(app=app, name=name)

    def run_many(self, targets, **_):
        for t in targets:
            self.deployed.append(t.name)
            self.apps[t.name] = "RUNNING" if t.name == settings.SERVE_APP_NAME or self.ready else "DEPLOYING"

    def delete(self, name):
        self.apps.pop(name)

    def get_app_handle(self, name):
        return SimpleNamespace(deployment_name="LLMServer:m")

    def gateway(self):
        return {"backend": self.routes[-1]["app"] if self.routes and self.routes[-1] else None, "version": "gw"}


@pytest.mark.parametrize("ready", [True, False])
def test_a_first_roll_starts_the_gateway_beside_its_backend(monkeypatch, ready):
    """No gateway yet: the gateway app is deployed first with no route (its replica starts while the backend's
    does), then takes the route in place. A backend that never becomes RUNNING takes the new gateway with it: the
    cluster is left with no app (no gateway answering 503 for a backend that never came)."""
    import ray.serve.llm

    import pipelines.serve
    from pipelines.serve import rollout

    fake = FakeServe(ready)
    backend = SimpleNamespace(app_name="peagle-backend-v1-aaaa", model_id="m", served={}, head_ref="models:/x/1",
                              llm_config=None, args=SimpleNamespace(accelerator="cpu"))
    monkeypatch.setattr(pipelines.serve, "resolve_backend", lambda args: backend)
    monkeypatch.setattr(pipelines.serve, "gateway_version", lambda args, model_id: "gw")
    monkeypatch.setattr(pipelines.serve, "build_ingress",
                        lambda b, route, runtime_env: fake.routes.append(route) or "ingress")
    monkeypatch.setattr(ray.serve.llm, "build_llm_deployment", lambda config: "llm")
    monkeypatch.setattr(rollout, "ray_serve", lambda: fake)
    monkeypatch.setattr(rollout, "app_statuses", lambda: dict(fake.apps))
    monkeypatch.setattr(rollout, "gateway_state", lambda: fake.gateway() if settings.SERVE_APP_NAME in fake.apps else None)
    monkeypatch.setattr(rollout, "gateway_runtime_env", lambda: None)
    monkeypatch.setattr(rollout, "job_runtime_env", lambda: {"working_dir": None})
    monkeypatch.setattr(rollout, "_probe", lambda handle, model_id: None)
    with monkeypatch.context() as m:
        m.setattr("pipelines.serve.gateway.Route", lambda **kw: SimpleNamespace(model_dump=lambda: kw))
        m.setattr("ray.llm._internal.serve.core.configs.openai_api_models.to_model_metadata",
                  lambda model_id, config: SimpleNamespace(model_dump=lambda mode: {"id": model_id}))
        if ready:
            result = rollout.roll(object(), ready_timeout_s=5, poll_s=0.01)
            assert result.backend == backend.app_name and result.previous is None and result.changed
            assert fake.deployed == [settings.SERVE_APP_NAME, backend.app_name, settings.SERVE_APP_NAME]
            assert fake.routes[0] == {} and fake.routes[1]["app"] == backend.app_name
        else:
            with pytest.raises(rollout.RolloutError, match="not RUNNING"):
                rollout.roll(object(), ready_timeout_s=0.1, poll_s=0.01)
            assert fake.deployed == [settings.SERVE_APP_NAME, backend.app_name] and fake.apps == {}
