"""The traffic log (pipelines.traffic, pipelines.serve.traffic) and the traffic prompt source: shards,
rotation and the size cap, sampling, drops that never reach the caller, the time split, dedup, and
greedy served answers that skip regeneration. No Ray, no vLLM: the middleware runs in front of a
small Starlette app that answers like Ray's OpenAI ingress (JSON, or SSE ending with ``data: [DONE]``)."""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipelines import settings, traffic
from pipelines.data import regenerate
from pipelines.data import traffic_source as tsource
from pipelines.data.prompts import load_conversations
from pipelines.data.rows import KEEP_ANSWERS
from pipelines.recipe import RegenerateConfig, SourceConfig, TrafficLogConfig
from pipelines.serve.traffic import TrafficLog
from tests.unit.test_capture_regenerate import EchoEngine

pytestmark = pytest.mark.unit

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def row(i: int, prompt: str | None = None, *, temperature: float | None = 0.0, minutes: int | None = None,
        completion: str | None = None) -> dict:
    return {"time": T0 + timedelta(minutes=i if minutes is None else minutes), "request_id": f"chatcmpl-{i}",
            "model": "m", "head": "models:/peagle-m/1", "num_speculative_tokens": 3,
            "messages": [{"role": "user", "content": prompt or f"question number {i} about topic {i * 7}"}],
            "completion": completion or f"answer {i}", "finish_reason": "stop", "stream": False,
            "temperature": temperature, "acceptance_length": 1.5, "num_draft_tokens": 30,
            "num_accepted_tokens": 15}


def writer(tmp_path: Path, **kw) -> traffic.TrafficLogWriter:
    cfg = TrafficLogConfig(**({"rows_per_shard": 1000, "flush_interval_s": 60.0} | kw))
    return traffic.TrafficLogWriter(cfg, tmp_path / "log")


def shards(d: Path) -> list[Path]:
    return sorted(d.glob("traffic-*.parquet"))


# ---------------------------------------------------------------------------------------------- writer


def test_shards_by_row_count_readable_by_pyarrow_and_datasets(tmp_path):
    import datasets

    w = writer(tmp_path, rows_per_shard=3)
    assert all(w.submit(row(i)) for i in range(7))
    assert w.flush(30)
    files = shards(tmp_path / "log")
    assert [pq.read_metadata(f).num_rows for f in files] == [3, 3, 1]  # 2 full shards + the flushed rest
    assert not list((tmp_path / "log").glob(".*"))  # no temporary left behind
    t = traffic.read_log(tmp_path / "log")
    assert t.num_rows == 7 and t.schema == traffic.schema()
    assert sorted(t.column("request_id").to_pylist()) == sorted(f"chatcmpl-{i}" for i in range(7))
    ds = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train",
                               cache_dir=str(tmp_path / "hf"))
    assert len(ds) == 7 and ds[0]["messages"][0]["role"] == "user" and ds[0]["acceptance_length"] == 1.5
    assert w.stats["written_rows"] == 7 and w.stats["written_shards"] == 3
    w.close()


def test_flush_interval_writes_without_a_full_shard(tmp_path):
    import time

    w = writer(tmp_path, rows_per_shard=1000, flush_interval_s=0.2)
    w.submit(row(0))
    deadline = time.monotonic() + 10
    while not shards(tmp_path / "log") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(shards(tmp_path / "log")) == 1  # written by the timer, no flush() call
    w.close()


def test_rotation_keeps_the_directory_under_the_cap(tmp_path):
    probe = writer(tmp_path / "probe", rows_per_shard=1)
    probe.submit(row(0))
    probe.flush()
    shard_bytes = shards(tmp_path / "probe" / "log")[0].stat().st_size
    cap = int(3.5 * shard_bytes)
    w = writer(tmp_path, rows_per_shard=1, max_bytes=cap, on_full="rotate")
    for i in range(10):
        w.submit(row(i))
    w.flush()
    files = shards(tmp_path / "log")
    assert sum(f.stat().st_size for f in files) <= cap and len(files) == 3
    assert w.stats["deleted_shards"] == 7 and w.stats["written_shards"] == 10
    kept = sorted(traffic.read_log(tmp_path / "log").column("request_id").to_pylist())
    assert kept == ["chatcmpl-7", "chatcmpl-8", "chatcmpl-9"]  # the oldest went first


def test_stop_at_the_cap_drops_new_rows(tmp_path, caplog):
    w = writer(tmp_path, rows_per_shard=1, max_bytes=1024, on_full="stop")
    with caplog.at_level(logging.WARNING, logger="pipelines.traffic"):
        for i in range(5):
            w.submit(row(i))
        w.flush()
    assert len(shards(tmp_path / "log")) == 1  # one shard (> 1 KiB) reaches the cap; the rest is dropped
    assert w.stats["dropped_full"] == 4 and w.stats["written_rows"] == 1
    assert sum("at its cap" in r.message for r in caplog.records) == 1  # one warning, not one per row


def test_sampling_rate(tmp_path):
    random.seed(0)
    assert not any(writer(tmp_path, sample_rate=0.0).sampled() for _ in range(1000))
    assert all(writer(tmp_path, sample_rate=1.0).sampled() for _ in range(1000))
    n = sum(writer(tmp_path, sample_rate=0.25).sampled() for _ in range(4000))
    assert 850 < n < 1150  # 1000 expected; binomial sd ~27


def test_bad_rows_are_dropped_and_counted_never_raised(tmp_path, caplog):
    w = writer(tmp_path)
    bad_schema = row(1) | {"messages": "not a list of messages"}
    bad_exchange = traffic.Exchange(request=b"{not json", response=b"", stream=False, started=0.0, finished=1.0)
    cut_stream = traffic.Exchange(request=json.dumps({"messages": []}).encode(), response=b'data: {"choices": []}\n\n',
                                  stream=True, started=0.0, finished=1.0)
    with caplog.at_level(logging.WARNING, logger="pipelines.traffic"):
        for item in (row(0), bad_schema, bad_exchange, cut_stream, row(2)):
            assert w.submit(item)
        assert w.flush()
    t = traffic.read_log(tmp_path / "log")
    assert sorted(t.column("request_id").to_pylist()) == ["chatcmpl-0", "chatcmpl-2"]
    assert w.stats["dropped_bad_row"] == 3
    assert sum("dropping a row" in r.message for r in caplog.records) == 2  # one per kind: parse, schema


def test_unwritable_directory_never_raises(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")  # a directory cannot be created under a file, even as root
    w = traffic.TrafficLogWriter(TrafficLogConfig(rows_per_shard=2), blocker / "log")
    with caplog.at_level(logging.WARNING, logger="pipelines.traffic"):
        for i in range(5):
            assert w.submit(row(i)) is True
        assert w.flush()
    assert w.stats["dropped_write_error"] == 5 and w.stats["written_rows"] == 0
    assert sum("cannot write a shard" in r.message for r in caplog.records) == 1
    assert w._thread.is_alive()  # the writer keeps running
    w.close()


def test_full_queue_drops_without_blocking(tmp_path):
    w = traffic.TrafficLogWriter(TrafficLogConfig(max_queue_rows=1, rows_per_shard=1000), tmp_path / "log")
    results = [w.submit(row(i)) for i in range(2000)]
    w.flush()
    assert results.count(False) == w.stats["dropped_queue_full"]
    assert w.stats["submitted"] + w.stats["dropped_queue_full"] == 2000


def test_default_location_is_under_peagle_home(tmp_peagle_home):
    assert traffic.resolve_log_uri(None, "smollm2") == str((tmp_peagle_home / "traffic" / "smollm2").resolve())
    assert settings.traffic_dir() == tmp_peagle_home / "traffic"
    assert traffic.resolve_log_uri("s3://bucket/log", "x") == "s3://bucket/log"


# ---------------------------------------------------------------------------------------------- middleware


def chat_app(*, status: int = 200, cut_stream: bool = False):
    """An ASGI chat endpoint answering like Ray's OpenAI ingress (vLLM's response shapes)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def chat(request: Request):
        body = await request.json()
        text = "echo: " + body["messages"][-1]["content"]
        spec = {"speculative_decoding": {"mean_acceptance_length": 2.25, "num_draft_tokens": 12,
                                         "num_accepted_draft_tokens": 5}}
        if status != 200:
            return JSONResponse({"error": {"message": "boom"}}, status_code=status)
        if not body.get("stream"):
            return JSONResponse({"id": "chatcmpl-x", "model": body["model"], "metrics": spec,
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                              "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": 9, "completion_tokens": 4}})

        async def events():
            for i, piece in enumerate(text.split(" ")):
                delta = {"content": piece if i == 0 else " " + piece}
                yield "data: " + json.dumps({"id": "chatcmpl-s", "model": body["model"],
                                             "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}) + "\n\n"
            if cut_stream:
                return
            yield "data: " + json.dumps({"id": "chatcmpl-s", "choices": [{"index": 0, "delta": {},
                                                                          "finish_reason": "length"}]}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def client_for(app, tmp_path, **cfg):
    from starlette.testclient import TestClient

    mw = TrafficLog(app, config=TrafficLogConfig(**cfg), uri=str(tmp_path / "log"),
                    meta={"model": "m", "head": "models:/peagle-m/4", "num_speculative_tokens": 3})
    return TestClient(mw), mw


def test_middleware_logs_json_and_streamed_chats(tmp_path):
    client, mw = client_for(chat_app(), tmp_path)
    for i in range(3):
        r = client.post("/v1/chat/completions", json={"model": "m", "temperature": 0, "max_tokens": 8,
                                                      "messages": [{"role": "user", "content": f"hi {i}"}]})
        assert r.json()["choices"][0]["message"]["content"] == f"echo: hi {i}"
    for i in range(2):
        with client.stream("POST", "/v1/chat/completions", json={
                "model": "m", "stream": True, "temperature": 0.8,
                "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": f"tell me {i} things"}]}) as r:
            body = r.read()
        assert body.endswith(b"data: [DONE]\n\n")  # the client's stream is untouched
    assert client.get("/v1/models").status_code in (404, 405)  # not a chat: passes through, not logged
    assert mw.writer.flush()
    rows = sorted(traffic.read_log(tmp_path / "log").to_pylist(), key=lambda r: r["time"])
    assert len(rows) == 5
    js, st = rows[0], rows[3]
    assert js["completion"] == "echo: hi 0" and js["acceptance_length"] == 2.25 and js["num_draft_tokens"] == 12
    assert js["num_accepted_tokens"] == 5 and js["prompt_tokens"] == 9 and js["temperature"] == 0.0
    assert js["head"] == "models:/peagle-m/4" and js["num_speculative_tokens"] == 3 and not js["stream"]
    assert st["stream"] and st["completion"] == "echo: tell me 0 things" and st["finish_reason"] == "length"
    assert st["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "tell me 0 things"}]
    assert st["acceptance_length"] is None  # a stream carries it only with stream_options.include_usage
    assert st["latency_s"] >= 0


def test_middleware_skips_errors_and_cut_streams(tmp_path):
    client, mw = client_for(chat_app(status=500), tmp_path / "a")
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 500
    client2, mw2 = client_for(chat_app(cut_stream=True), tmp_path / "b")
    with client2.stream("POST", "/v1/chat/completions", json={
            "model": "m", "stream": True, "messages": [{"role": "user", "content": "x y"}]}) as r:
        r.read()
    assert mw.writer.flush() and mw2.writer.flush()
    assert mw.writer.stats["submitted"] == 0 and mw2.writer.stats["submitted"] == 0
    assert not shards(tmp_path / "a" / "log") and not shards(tmp_path / "b" / "log")


def test_middleware_sample_rate_zero_logs_nothing(tmp_path):
    client, mw = client_for(chat_app(), tmp_path, sample_rate=0.0)
    for _ in range(3):
        client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "q"}]})
    assert mw.writer.stats["submitted"] == 0 and mw.writer._thread is None  # no thread ever started


# ---------------------------------------------------------------------------------------------- source


def write_log(tmp_path: Path, rows: list[dict]) -> Path:
    w = writer(tmp_path, rows_per_shard=4)
    random.Random(0).shuffle(rows)  # shards in any order: the source sorts by time
    for r in rows:
        w.submit(r)
    w.flush()
    return tmp_path / "log"


def traffic_source(path: Path, **kw) -> SourceConfig:
    return SourceConfig(kind="traffic", path=str(path), traffic=kw or None)


def test_time_split_dedup_and_greedy_answers(tmp_path):
    rows = [row(i, temperature=0.0 if i % 2 == 0 else 0.7) for i in range(10)]
    rows.append(row(10, prompt=rows[3]["messages"][0]["content"], minutes=20))  # exact duplicate, newest
    rows.append(row(11, prompt=rows[4]["messages"][0]["content"] + " ", minutes=21))  # same after whitespace
    rows.append(row(12, prompt="Explain how a hash map handles collisions with chaining in Python code", minutes=22))
    rows.append(row(13, prompt="Explain how a hash map handles collisions with chaining in Python code!",
                    minutes=23))  # near duplicate (>= 0.9 Jaccard of 3-grams? no: punctuation; see dedup below)
    rows.append(row(14, temperature=None, minutes=24))  # temperature not sent: sampled by the engine's default
    log_dir = write_log(tmp_path, rows)
    stats: Counter = Counter()
    src = traffic_source(log_dir, heldout_fraction=0.25)
    table = traffic.read_log(log_dir).to_pylist()
    train = tsource.traffic_rows(table, src, stats=stats)
    held = tsource.traffic_rows(table, src, heldout=True)
    assert stats["exact_duplicates"] == 2  # rows 10 and 11: the oldest occurrence (3, 4) is kept
    n = 15 - 2 - stats["near_duplicates"]
    assert len(train) + len(held) == n and len(held) == round(0.25 * n)
    # the held-out slice is the newest rows, and never overlaps the training part
    ids = [r["id"] for r in train + held]
    assert ids == sorted(ids, key=lambda i: int(i.split("-")[1])) and not {r["id"] for r in train} & {
        r["id"] for r in held}
    assert held[-1]["id"] == "chatcmpl-14"
    by_id = {r["id"]: r for r in train + held}
    greedy, sampled, unsent = by_id["chatcmpl-0"], by_id["chatcmpl-1"], by_id["chatcmpl-14"]
    assert greedy[KEEP_ANSWERS] and greedy["messages"][-1] == {"role": "assistant", "content": "answer 0"}
    assert not sampled[KEEP_ANSWERS] and sampled["messages"][-1]["role"] == "user"
    assert not unsent[KEEP_ANSWERS] and unsent["messages"][-1]["role"] == "user"
    assert not tsource.traffic_rows(table, traffic_source(log_dir, keep_greedy_answers=False))[0][KEEP_ANSWERS]


def test_near_duplicate_prompts_are_dropped(tmp_path):
    base = "please write a python function that returns the sum of the squares of a list of integers quickly"
    rows = [row(0, prompt=base), row(1, prompt=base + " thanks"), row(2, prompt="what is the capital of France")]
    table = traffic.read_log(write_log(tmp_path, rows)).to_pylist()
    stats: Counter = Counter()
    out = tsource.traffic_rows(table, traffic_source(tmp_path / "log", heldout_fraction=0.0, dedup_threshold=0.7),
                               stats=stats)
    assert [r["id"] for r in out] == ["chatcmpl-0", "chatcmpl-2"] and stats["near_duplicates"] == 1
    exact_only = tsource.traffic_rows(table, traffic_source(tmp_path / "log", heldout_fraction=0.0,
                                                            dedup_threshold=None))
    assert len(exact_only) == 3


def test_until_pins_the_split(tmp_path):
    log_dir = write_log(tmp_path, [row(i) for i in range(10)])
    src = traffic_source(log_dir, heldout_fraction=0.2, until=(T0 + timedelta(minutes=4)).isoformat())
    table = traffic.read_log(log_dir).to_pylist()
    assert [r["id"] for r in tsource.traffic_rows(table, src, heldout=True)] == ["chatcmpl-4"]
    assert len(tsource.traffic_rows(table, src)) == 4


def test_source_in_data_and_in_evaluation(tmp_path):
    from pipelines.data.prompt_dataset import load_prompt_dataset
    from pipelines.recipe import DataConfig

    bad = row(99, minutes=-1) | {"messages": [{"role": "assistant", "content": "no user turn"}]}
    log_dir = write_log(tmp_path, [row(i, temperature=0.0 if i < 5 else 1.0) for i in range(10)] + [bad])
    src = traffic_source(log_dir, heldout_fraction=0.3)
    train = load_conversations(src)
    held = load_conversations(src, heldout=True)
    assert len(train) == 7 and len(held) == 3 and set(train.column_names) == {"id", "messages", "source",
                                                                                 KEEP_ANSWERS}
    assert held["id"] == ["chatcmpl-7", "chatcmpl-8", "chatcmpl-9"]
    assert train[KEEP_ANSWERS] == [True] * 5 + [False] * 2
    assert src.eval_set_name() == "traffic-log" and SourceConfig(kind="traffic").eval_set_name() == "traffic"
    # mixed with a file source: the other rows get keep_answers False
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"messages": [{"role": "user", "content": "from a file"}]}) + "\n")
    mixed = load_prompt_dataset(DataConfig(sources=[src, SourceConfig(kind="openai_jsonl", path=str(other))]),
                                home=tmp_path / "home")
    assert len(mixed) == 8 and mixed[KEEP_ANSWERS].count(True) == 5 and mixed[KEEP_ANSWERS][-1] is False


def test_missing_log_and_config_errors(tmp_path):
    with pytest.raises(ValueError, match="no traffic log shards under"):
        load_conversations(traffic_source(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="belong to kind traffic"):
        SourceConfig(kind="humaneval", traffic={"heldout_fraction": 0.1})
    assert SourceConfig(kind="traffic").traffic.heldout_fraction == 0.1


def test_greedy_rows_are_not_regenerated(tmp_path, monkeypatch):
    eng = EchoEngine()
    monkeypatch.setattr(regenerate, "engine_setup", lambda *a, **k: (tmp_path, {}))
    monkeypatch.setattr(regenerate, "make_engine", lambda backend, path, **kw: eng)
    log_dir = write_log(tmp_path, [row(0, temperature=0.0), row(1, temperature=0.9), row(2, temperature=0.0)])
    ds = load_conversations(traffic_source(log_dir, heldout_fraction=0.0))
    res = regenerate.run_regenerate(ds, None, RegenerateConfig(backend="transformers"), None, use_ray=False)
    out = {r["id"]: r for r in res.rows}
    assert [r["id"] for r in res.rows] == ["chatcmpl-0", "chatcmpl-1", "chatcmpl-2"]  # input order kept
    assert out["chatcmpl-0"]["messages"][-1]["content"] == "answer 0" and out["chatcmpl-0"]["regen_model"] == "served"
    assert out["chatcmpl-1"]["messages"][-1]["content"].startswith("re:") and out["chatcmpl-1"]["regen_model"] == "echo"
    assert [p[-1]["content"] for p in eng.prompts] == [ds[1]["messages"][-1]["content"]]  # only the sampled one
    assert res.stats["kept_served_answers"] == 2
    # all greedy: no engine at all
    monkeypatch.setattr(regenerate, "engine_setup", lambda *a, **k: pytest.fail("engine started"))
    only_greedy = ds.select([0, 2])
    assert len(regenerate.run_regenerate(only_greedy, None, RegenerateConfig(), None, use_ray=False).rows) == 2


def test_recipe_turns_the_log_on_for_serve():
    from pipelines.recipe import load_recipe
    from pipelines.serve import ServeAppArgs
    from tests.conftest import CONFIGS

    off = load_recipe(CONFIGS / "smollm2-135m-ci.yaml")
    assert off.serving.traffic_log is None and ServeAppArgs.from_recipe(off).traffic_log is None
    on = load_recipe(CONFIGS / "smollm2-135m-ci.yaml", ["serving.traffic_log={sample_rate: 0.5, on_full: stop}"])
    args = ServeAppArgs.from_recipe(on)
    assert args.traffic_log.sample_rate == 0.5 and args.traffic_log.on_full == "stop" and args.traffic_log.uri is None
    with pytest.raises(ValueError, match="sample_rate"):
        load_recipe(CONFIGS / "smollm2-135m-ci.yaml", ["serving.traffic_log={sample_rate: 2}"])
