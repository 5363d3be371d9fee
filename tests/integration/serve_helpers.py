"""Helpers of the Serve integration tests (test_serve, test_serve_rollout; MlflowServer also test_train and
test_faults_register): a free loopback port, the CPU Serve args, peagle's ``mlflow server`` process, the
replica processes of a local Ray cluster, and one streamed chat request. (The random-init head is
``bench.serve_load.random_head``: the benchmark serves the same one.)"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import time
from pathlib import Path

import httpx

from pipelines import settings
from pipelines.ports import free_port
from pipelines.serve.ingress import SERVED_HEADER  # Ray-free module

MODEL_ID = "smollm2-135m-instruct"
REGISTERED = "peagle-smollm2-135m-instruct"
LLM_REPLICA_TAG = "ServeReplica:peagle:LLMServer"  # process title of the app's LLMServer replicas


@contextlib.contextmanager
def serve_cluster(*, key_env: str, key: str, num_cpus: int = 4):
    """A local Ray cluster (``num_cpus`` logical CPUs) with Serve's HTTP proxy on a free port and the API key
    in ``$key_env``; yields the proxy's URL, shuts Serve and Ray down afterwards."""
    import ray
    from ray import serve

    os.environ[key_env] = key
    port = free_port()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop(key_env, None)


def cpu_serve_args(**kw):
    """ServeAppArgs for one CPU replica of SmolLM2 on a 2-core box (K=3, 1024-token context)."""
    from pipelines.serve import ServeAppArgs

    base = {"model_id": MODEL_ID, "num_speculative_tokens": 3,
            "engine_kwargs": {"max_model_len": 1024, **settings.CPU_VLLM_KWARGS},
            "min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 8, "max_ongoing_requests": 32,
            "replica_num_cpus": 0.5, "ingress_num_cpus": 0.25}
    base.update(kw)
    return ServeAppArgs(**base)


class MlflowServer:
    """peagle's own ``mlflow server`` (``pipelines.registry.server.launch``: sqlite store + served artifacts in
    ``root``, its own process group) on a free loopback port, restartable on the same store and port."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self._server = None
        root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def started(cls, root: Path) -> MlflowServer:
        """Start one and wait for ``/health``."""
        server = cls(root)
        server.start()
        server.wait_healthy()
        return server

    def start(self) -> None:
        """Launch the process; returns at once."""
        from pipelines.registry import server

        self._server = server.launch(self.root, port=self.port, workers=1)

    def wait_healthy(self, timeout_s: float = 300.0) -> float:
        """Seconds until ``/health`` answers (RuntimeError with its log otherwise)."""
        return self._server.wait_healthy(timeout_s)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.uri}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server and its workers (the process group it leads)."""
        if self._server is not None:
            self._server.kill(sig)
            self._server = None

    kill = stop


def llm_replica_pids() -> list[int]:
    """Pids of this process's descendants that are LLMServer replicas of the app ``peagle``."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if LLM_REPLICA_TAG in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.Error:
            continue
    return sorted(out)


def stream_chat(url: str, prompt: str, *, key: str, max_tokens: int, timeout_s: float = 300.0,
                on_first_token=None) -> dict:
    """One streamed chat request. Returns ``{ok, why, num_chunks, seconds}``; ``ok`` means HTTP 200,
    no error event, text received and the closing ``[DONE]``. Never raises for transport errors."""
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    t0, num_chunks, why, done = time.monotonic(), 0, "", False
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout_s,
                          headers={"Authorization": f"Bearer {key}"} if key else {}) as r:
            if r.status_code != 200:
                why = f"HTTP {r.status_code}: {r.read()[:200]!r}"
            for line in r.iter_lines() if not why else ():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    why = f"error event: {str(event['error'])[:200]}"
                    break
                num_chunks += 1
                if num_chunks == 1 and on_first_token is not None:
                    on_first_token()
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        why = repr(e)[:200]
    if not why and not done:
        why = f"stream ended without [DONE] after {num_chunks} chunks"
    return {"ok": not why and num_chunks > 0, "why": why, "num_chunks": num_chunks,
            "seconds": round(time.monotonic() - t0, 3)}


def chat_request(url: str, prompt: str, *, key: str | None, stream: bool, max_tokens: int = 12,
                 timeout_s: float = 300.0) -> dict:
    """One chat request (streamed or not). Returns ``{ok, why, prompt, stream, served, started, finished}``: ``ok`` =
    HTTP 200 with an answer (a stream: no error event and the closing ``[DONE]``); ``served`` = the parsed
    ``x-peagle-served`` header (None without one); ``key`` None: no Authorization header (an open endpoint).
    Never raises for transport errors."""
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    out = {"ok": False, "why": "", "prompt": prompt, "stream": stream, "served": None, "started": time.monotonic()}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout_s,
                          headers={"Authorization": f"Bearer {key}"} if key else {}) as r:
            served = r.headers.get(SERVED_HEADER)
            out["served"] = json.loads(served) if served else None
            if r.status_code != 200:
                out["why"] = f"HTTP {r.status_code}: {r.read()[:200]!r}"
            elif not stream:
                answer = json.loads(r.read())
                out["ok"] = bool(answer.get("choices"))
                out["why"] = "" if out["ok"] else f"no choices: {str(answer)[:200]}"
            else:
                done = False
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: ") and "error" in json.loads(line[6:]):
                        out["why"] = f"error event: {line[:200]}"
                        break
                out["ok"] = done and not out["why"]
                out["why"] = out["why"] or ("" if done else "stream ended without [DONE]")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out["why"] = repr(e)[:200]
    out["finished"] = time.monotonic()
    return out


class ChatLoad:
    """``num_threads`` clients sending chat requests ``pause_s`` apart (every other one streamed) until
    :meth:`stop`; :attr:`results` holds one :func:`chat_request` dict per request."""

    def __init__(self, url: str, *, key: str | None, num_threads: int = 3, max_tokens: int = 12, pause_s: float = 0.0) -> None:
        import threading

        self.url, self.key, self.max_tokens, self.pause_s = url, key, max_tokens, pause_s
        self.results: list[dict] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(num_threads)]

    def _loop(self, worker: int) -> None:
        i = 0
        while not self._stop.is_set():
            r = chat_request(self.url, f"Client {worker}, request {i}: name a colour.", key=self.key,
                             stream=(i + worker) % 2 == 1, max_tokens=self.max_tokens)
            self.results.append(r)  # list.append is atomic under the GIL
            i += 1
            self._stop.wait(self.pause_s)

    def start(self) -> ChatLoad:
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 600.0) -> list[dict]:
        """Stop after each client's current request; returns :attr:`results`."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
        return self.results

    @staticmethod
    def failures(results: list[dict]) -> list[dict]:
        return [r for r in results if not r["ok"]]

    @staticmethod
    def max_gap_s(results: list[dict]) -> float:
        """The longest time (s) with no request finishing: a stall shows here even when nothing fails."""
        ends = sorted(r["finished"] for r in results)
        return max((b - a for a, b in itertools.pairwise(ends)), default=0.0)
