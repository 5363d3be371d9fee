"""Load ramp against peagle's Serve endpoint: requests/s, TTFT and TPOT per concurrency level, the LLM replicas
Serve's autoscaler runs meanwhile, how long scaling up and back down took, and what a replica SIGKILL costs.

The endpoint is the serve stage's (``peagle run`` / ``ray job submit ... ray_jobs.pipeline``): this script only
sends load and watches. Each level is a closed loop of ``c`` streaming clients (``/v1/completions``, a random
prompt of ``--input-len`` words each, ``--output-len`` tokens with ``ignore_eos``) for ``seconds``; TTFT is the
time to the first streamed token, TPOT (e2e - TTFT) / (tokens - 1). Prompts are text (random common English
words, about one token each; ``--token-ids`` sends token-id prompts, as the first GPU ramp of 2026-11-27 did):
the gateway continues a text stream cut by a dead replica on another one (``pipelines.serve.resume``), not a
token-id one. A poller reads ``serve.status()`` every second: the RUNNING / STARTING replicas of the LLMServer deployments of
peagle's backend apps. Each answer's ``x-peagle-served`` header names the head version that served it.

    python -m bench.serve_autoscale --url http://127.0.0.1:8000 --model smollm2-135m-instruct \\
        --levels 1:30,16:60,64:150 --idle-s 90 --max-replicas 4 [--kill-replica-at 64] [--name serve_autoscale]

``--kill-replica-at C``: during level C, once ``--max-replicas`` replicas run (or three quarters through the
level), SIGKILL the process of one RUNNING LLMServer replica (a real fault: Serve restarts it; the gateway sends
what it held again or continues its streams). Needs this host's processes (the device's two raylets are one host).

``--roll-at C --roll-cmd CMD``: ``--roll-after-s`` into level C, run the shell command CMD (a blue/green roll
to a new champion: ``bench/device/run_multi_gpu.sh roll`` promotes a new version and submits the serve stage)
while the clients go on; the row says when it started and ended, its exit status and which head versions
answered. Writes ``bench/results/<name>.json`` (``bench.common.write_result``).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    ok: bool
    start_s: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_tokens: int = 0
    error: str | None = None
    served: str | None = None  # the head version that answered (the x-peagle-served header's "head")


@dataclass
class ReplicaTimeline:
    """``(seconds since start, running, starting)`` samples of the LLM replicas, one per poll."""

    samples: list[tuple[float, int, int]] = field(default_factory=list)
    messages: list[tuple[float, str, str]] = field(default_factory=list)  # (seconds, deployment, status: message)

    def running_between(self, t0: float, t1: float) -> list[int]:
        return [r for t, r, _ in self.samples if t0 <= t <= t1]

    def first_reach(self, count: int, after_s: float = 0.0) -> float | None:
        return next((t for t, r, _ in self.samples if t >= after_s and r >= count), None)

    def first_at_most(self, count: int, after_s: float) -> float | None:
        return next((t for t, r, _ in self.samples if t >= after_s and r <= count), None)

    def running_at(self, t: float) -> int | None:
        """RUNNING replicas at the last poll at or before ``t`` (the first poll's before any; polls are in time
        order)."""
        if not self.samples:
            return None
        i = bisect.bisect_right(self.samples, t, key=lambda s: s[0])
        return self.samples[max(i - 1, 0)][1]

    def seconds_at(self, t0: float, t1: float) -> dict[int, float]:
        """Seconds of ``[t0, t1]`` spent at each RUNNING count (each poll's count holds until the next poll)."""
        out: dict[int, float] = {}
        marks = [(t, r) for t, r, _ in self.samples if t0 < t < t1]
        first = self.running_at(t0)
        if first is None:
            return out
        for (a, r), (b, _) in itertools.pairwise([(t0, first), *marks, (t1, None)]):
            out[r] = out.get(r, 0.0) + (b - a)
        return out


# Prompt words: common English words, about one SmolLM2/Llama token each.
_WORD_TEXT = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her all she there would their we him been has when who will more no if out so said what up "
         "its about into than them can only other new some could time these two may then do first any my now such "
         "like our over man me even most made after also did many before must through back years where much your "
         "way well down should because each just those people how too little state good very make world still own "
         "see men work long get here between both life being under never day same another know while last might "
         "us great old year off come since against go came right used take three")
WORDS = tuple(_WORD_TEXT.split())


def text_prompt(rng: random.Random, num_words: int) -> str:
    """``num_words`` random :data:`WORDS` (about as many tokens)."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def llm_replicas(app_prefix: str) -> tuple[int, int, dict[str, str]]:
    """``(RUNNING, STARTING, messages)`` of every ``LLMServer`` deployment of the Serve apps named ``app_prefix*``:
    replica counts summed, and each deployment's status and Serve's message on it (``app/deployment`` ->
    ``"STATUS: message"``; e.g. replicas that wait for resources or whose constructor failed)."""
    from ray import serve

    running = starting = 0
    messages: dict[str, str] = {}
    for name, app in serve.status().applications.items():
        if not name.startswith(app_prefix):
            continue
        for dname, dep in app.deployments.items():
            if "LLMServer" in dname:
                states = {str(k).split(".")[-1]: v for k, v in (dep.replica_states or {}).items()}
                running += states.get("RUNNING", 0)
                starting += states.get("STARTING", 0)
                messages[f"{name}/{dname}"] = f"{str(dep.status).split('.')[-1]}: {dep.message or ''}"
    return running, starting, messages


def poll_replicas(timeline: ReplicaTimeline, t0: float, stop: threading.Event, app_prefix: str,
                  period_s: float = 1.0) -> None:
    """Sample the replicas every ``period_s`` into ``timeline``; a deployment's status message is kept each time it
    changes (``timeline.messages``: seconds, deployment, message)."""
    last: dict[str, str] = {}
    while not stop.is_set():
        try:
            r, s, messages = llm_replicas(app_prefix)
            t = time.monotonic() - t0
            timeline.samples.append((t, r, s))
            for dep, msg in messages.items():
                if last.get(dep) != msg:
                    timeline.messages.append((round(t, 1), dep, msg[:2000]))
                    print(f"[{t:.0f}s] {dep}: {msg[:500]}", flush=True)
                    last[dep] = msg
        except Exception as e:  # noqa: BLE001 - a failed poll is a gap, not a failed benchmark
            print(f"replica poll failed: {e}", flush=True)
        stop.wait(period_s)


def kill_one_replica() -> int | None:
    """SIGKILL one ``ServeReplica:...LLMServer`` process of this host; its pid, or None when none runs."""
    import psutil

    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "ServeReplica:" in cmd and "LLMServer" in cmd:
            os.kill(p.info["pid"], signal.SIGKILL)
            return p.info["pid"]
    return None


async def one_request(client, url: str, model: str, prompt: str | list[int], output_len: int,
                      headers: dict[str, str]) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "stream": True,
            "temperature": 0.0}
    t = time.monotonic()
    res = RequestResult(ok=False, start_s=t)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            res.served = _served_head(r.headers)
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("error"):
                    res.error = str(chunk["error"])[:200]
                    return res
                text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                if text and res.ttft_s is None:
                    res.ttft_s = time.monotonic() - t
                res.num_tokens += sum(1 for c in chunk.get("choices") or [] if c.get("text") is not None)
        res.e2e_s = time.monotonic() - t
        res.ok = res.ttft_s is not None
        if not res.ok:
            res.error = "no token streamed"
    except Exception as e:  # noqa: BLE001 - a failed request is a result
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


def _served_head(headers) -> str | None:
    from pipelines.serve.ingress import SERVED_HEADER

    try:
        return json.loads(headers.get(SERVED_HEADER) or "{}").get("head")
    except ValueError:
        return None


async def run_level(url: str, model: str, *, concurrency: int, seconds: float, input_len: int, output_len: int,
                    vocab: int | None, headers: dict[str, str], seed: int) -> list[RequestResult]:
    """``concurrency`` closed-loop clients for ``seconds`` (requests started before the deadline finish);
    text prompts of ``input_len`` words, or token-id prompts below ``vocab`` when it is given."""
    import httpx

    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    results: list[RequestResult] = []

    async def client_loop(client) -> None:
        while time.monotonic() < deadline:
            prompt = ([rng.randrange(100, vocab) for _ in range(input_len)] if vocab
                      else text_prompt(rng, input_len))
            results.append(await one_request(client, url, model, prompt, output_len, headers))

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return results


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def latencies(ok: list[RequestResult]) -> dict[str, float | None]:
    """TTFT and TPOT p50 / p99 (ms) of completed requests."""
    ttft = [r.ttft_s * 1e3 for r in ok]
    tpot = [(r.e2e_s - r.ttft_s) * 1e3 / (r.num_tokens - 1) for r in ok if r.num_tokens > 1]
    return {"ttft_ms_p50": _pct(ttft, 0.5), "ttft_ms_p99": _pct(ttft, 0.99),
            "tpot_ms_p50": _pct(tpot, 0.5), "tpot_ms_p99": _pct(tpot, 0.99)}


def level_row(concurrency: int, results: list[RequestResult], wall_s: float, replicas: list[int]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.num_tokens for r in ok)
    return {"concurrency": concurrency, "seconds": round(wall_s, 1), "completed": len(ok),
            "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error})[:5],
            "requests_per_s": round(len(ok) / wall_s, 3), "output_tokens_per_s": round(tokens / wall_s, 1),
            **latencies(ok),
            "replicas_min": min(replicas) if replicas else None, "replicas_max": max(replicas) if replicas else None,
            "replicas_end": replicas[-1] if replicas else None,
            "served": dict(collections.Counter(r.served for r in ok if r.served))}


def by_replicas(concurrency: int, results: list[RequestResult], timeline: ReplicaTimeline, t0: float,
                start_s: float, end_s: float) -> list[dict[str, Any]]:
    """A level's requests grouped by the RUNNING replicas when each started: per count, the seconds the level
    spent there, requests completed, requests/s and TTFT / TPOT p50 and p99 (ms)."""
    spent = timeline.seconds_at(start_s, end_s)
    groups: dict[int, list[RequestResult]] = collections.defaultdict(list)
    for r in results:
        n = timeline.running_at(r.start_s - t0)
        if n is not None:
            groups[n].append(r)
    rows = []
    for n in sorted(groups):
        ok = [r for r in groups[n] if r.ok]
        secs = spent.get(n, 0.0)
        rows.append({"concurrency": concurrency, "replicas": n, "seconds": round(secs, 1), "completed": len(ok),
                     "failed": len(groups[n]) - len(ok),
                     "requests_per_s": round(len(ok) / secs, 3) if secs >= 1 else None, **latencies(ok)})
    return rows


def wait_ready(url: str, model: str, timeout_s: float) -> float:
    """Seconds until ``/v1/models`` lists ``model``.

    Raises:
        SystemExit: not within ``timeout_s`` (no load is sent and no result written: a ramp against an endpoint that
            is not there measures nothing).
    """
    import httpx

    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < timeout_s:
        try:
            r = httpx.get(f"{url}/v1/models", timeout=5)
            if r.status_code == 200 and any(m.get("id") == model for m in r.json().get("data", [])):
                return time.monotonic() - t0
            last = f"HTTP {r.status_code}"
        except (httpx.HTTPError, ValueError) as e:
            last = type(e).__name__
        time.sleep(2)
    raise SystemExit(f"{url} does not serve {model!r} after {timeout_s:.0f} s ({last}): no load sent")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True, help="served model id")
    ap.add_argument("--levels", default="1:30,16:60,64:150", help="C:SECONDS,... concurrency levels in order")
    ap.add_argument("--idle-s", type=float, default=90.0, help="watch this long after the load for the scale-down")
    ap.add_argument("--input-len", type=int, default=128, help="prompt words (tokens with --token-ids)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--token-ids", action="store_true", help="token-id prompts (not resumable by the gateway)")
    ap.add_argument("--vocab", type=int, default=49152, help="with --token-ids: prompt token ids are drawn below this")
    ap.add_argument("--kill-replica-at", type=int, default=None,
                    help="SIGKILL one replica during level C, once --max-replicas run (or 3/4 through it)")
    ap.add_argument("--roll-at", type=int, default=None, help="run --roll-cmd during level C")
    ap.add_argument("--roll-cmd", default=None, help="shell command of the roll (a new champion, the serve stage)")
    ap.add_argument("--roll-after-s", type=float, default=20.0, help="seconds into level --roll-at")
    ap.add_argument("--api-key-env", default=None, help="env var holding the endpoint's API key")
    ap.add_argument("--max-replicas", type=int, default=None, help="for the scale-up time (default: the most seen)")
    ap.add_argument("--name", default="serve_autoscale", help="result file bench/results/<name>.json")
    ap.add_argument("--note", default="")
    ap.add_argument("--ready-timeout-s", type=float, default=300.0, help="wait this long for the endpoint first")
    opts = ap.parse_args(argv)
    if (opts.roll_at is None) != (opts.roll_cmd is None):
        ap.error("--roll-at and --roll-cmd go together")
    return opts


def kill_when_scaled(timeline: ReplicaTimeline, t0: float, seconds: float, want: int | None,
                     kills: list[dict[str, Any]]) -> None:
    """Wait until ``want`` replicas run (or three quarters of ``seconds`` passed), then SIGKILL one."""
    start = time.monotonic()
    while time.monotonic() - start < 0.75 * seconds:
        if want and (timeline.running_at(time.monotonic() - t0) or 0) >= want:
            break
        time.sleep(1.0)
    running = timeline.running_at(time.monotonic() - t0)
    kills.append({"t_s": round(time.monotonic() - t0, 1), "pid": kill_one_replica(), "replicas_running": running})


def run_roll(cmd: str, t0: float, delay_s: float, rolls: list[dict[str, Any]]) -> None:
    """After ``delay_s``, run the shell command ``cmd``; its start and end (s since ``t0``), exit status and tail."""
    time.sleep(delay_s)
    start = time.monotonic() - t0
    out = subprocess.run(cmd, shell=True, capture_output=True, text=True, check=False)
    tail = (out.stdout + out.stderr)[-2000:]
    print(tail, flush=True)
    rolls.append({"cmd": cmd, "t_start_s": round(start, 1), "t_end_s": round(time.monotonic() - t0, 1),
                  "returncode": out.returncode, "tail": tail})


def summarize(opts, rows: list[dict[str, Any]], timeline: ReplicaTimeline, load_end: float) -> dict[str, Any]:
    """Replicas at the start and at most, seconds to reach the top after the first level above concurrency 1,
    seconds back down after the load."""
    seen = max((r for _, r, _ in timeline.samples), default=0)
    top = opts.max_replicas or seen
    first = timeline.samples[0][1] if timeline.samples else None
    up_from = next((r["t_start_s"] for r in rows if r["concurrency"] > 1), 0.0)
    reach = timeline.first_reach(top, after_s=up_from) if top else None
    down = timeline.first_at_most(first, after_s=load_end) if first is not None else None
    return {"replicas_at_start": first, "replicas_max_seen": seen,
            "scale_up_to_max_s": round(reach - up_from, 1) if reach is not None else None,
            "scale_down_s": round(down - load_end, 1) if down is not None else None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    opts = parse_args(argv)
    wait_ready(opts.url, opts.model, opts.ready_timeout_s)

    import ray

    from bench.common import write_result
    from pipelines.settings import SERVE_BACKEND_PREFIX

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level="WARNING", log_to_driver=False)
    headers = {"Authorization": f"Bearer {os.environ[opts.api_key_env]}"} if opts.api_key_env else {}
    levels = [tuple(int(x) for x in part.split(":")) for part in opts.levels.split(",")]
    timeline, stop = ReplicaTimeline(), threading.Event()
    t0 = time.monotonic()
    poller = threading.Thread(target=poll_replicas, args=(timeline, t0, stop, SERVE_BACKEND_PREFIX), daemon=True)
    poller.start()
    rows, per_replicas, kills, rolls = [], [], [], []
    for i, (c, seconds) in enumerate(levels):
        start = time.monotonic() - t0
        side = []
        if opts.kill_replica_at == c:
            side.append(threading.Thread(target=kill_when_scaled, args=(timeline, t0, seconds, opts.max_replicas,
                                                                        kills), daemon=True))
        if opts.roll_at == c:
            side.append(threading.Thread(target=run_roll, args=(opts.roll_cmd, t0, opts.roll_after_s, rolls),
                                         daemon=True))
        for t in side:
            t.start()
        results = asyncio.run(run_level(opts.url, opts.model, concurrency=c, seconds=seconds,
                                        input_len=opts.input_len, output_len=opts.output_len,
                                        vocab=opts.vocab if opts.token_ids else None, headers=headers, seed=i))
        end = time.monotonic() - t0
        for t in side:
            t.join()
        row = level_row(c, results, end - start, timeline.running_between(start, end)) | {"t_start_s": round(start, 1)}
        rows.append(row)
        per_replicas += by_replicas(c, results, timeline, t0, start, end)
        print(json.dumps(row), flush=True)
    load_end = time.monotonic() - t0
    stop.wait(opts.idle_s)
    stop.set()
    poller.join()
    result = {"benchmark": "serve_autoscale", "url": opts.url, "model": opts.model, "levels": rows,
              "by_replicas": per_replicas, "kills": kills, "rolls": rolls, "input_len": opts.input_len,
              "prompts": "token ids" if opts.token_ids else "text", "output_len": opts.output_len,
              **summarize(opts, rows, timeline, load_end), "timeline": timeline.samples,
              "deployment_messages": timeline.messages, "note": opts.note,
              "failed_total": sum(r["failed"] for r in rows),
              "command": "python -m bench.serve_autoscale " + " ".join(argv if argv is not None else sys.argv[1:])}
    path = write_result(opts.name, result)
    print(f"wrote {path}: {len(rows)} levels, replicas {result['replicas_at_start']} -> "
          f"{result['replicas_max_seen']}, up {result['scale_up_to_max_s']} s, down {result['scale_down_s']} s, "
          f"failed {result['failed_total']}", flush=True)
    return result


if __name__ == "__main__":
    main()
