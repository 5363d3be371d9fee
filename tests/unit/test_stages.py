"""The stage framework without Ray: keys, typed outputs, skipping, upstream reads and the summary."""

import io
import json
import sys

import pytest

from pipelines import settings
from pipelines.pipeline import STAGE_TYPES, STAGES, PipelineRun, print_summary
from pipelines.preflight import Machine
from pipelines.recipe import load_recipe
from pipelines.stages.base import STAGE_FILE, StageRecord, engine_settings
from pipelines.stages.capture import CaptureOutput
from pipelines.stages.evaluate import EvaluateOutput
from pipelines.stages.regenerate import RegenerateOutput
from pipelines.stages.register import RegisterOutput
from pipelines.stages.serve import ServeOutput
from pipelines.stages.train import TrainOutput
from tests.conftest import CONFIGS

pytestmark = pytest.mark.unit

# Stage keys of the committed recipes (first computed with the pipeline before stages became objects, commit
# e35a825; changed on purpose on 2026-11-28: regenerate.num_workers and capture.num_workers left the keys, so that a
# stage run on 1 GPU is current for the same recipe on 4; smollm2-135m-ci.yaml's train to serve keys on 2026-11-28 too:
# its drafter.draft_vocab_size became 4096; its evaluate to serve keys on 2026-11-29: evaluation.methods became
# [peagle]; all its keys on 2026-11-29 again: regenerate.vllm_runner became actor). A changed value invalidates every run directory made with that recipe: change a key only on purpose.
KEYS = {
    "smollm2-135m-ci.yaml": {
        "regenerate": "51f7926566588d94dd0e2fd324bed37a644c07a36b84ff8a0487db27f3096041",
        "capture": "8b2ea86d285f1c1d46d41c31d25321d4d1a52b3a5d8c9368d19be11920f592ed",
        "train": "b68d284a8421890cce348bf1fa673c04d4cfe9264a3e2c6850266083faf55f58",
        "evaluate": "496bb092686b2225164cc326c824877a4e5ad593b901f9ee39f783de358b6d43",
        "register": "0272ec36bd14e415a92dc875f877eea74eebba8ee97d28362e1692fb9e4506f4",
        "serve": "7a9640f85b4902468f1ddc3928374596cc49e32868b3f94b599239b5c8ad84c7",
    },
    "smollm2-135m-cpu.yaml": {
        "regenerate": "1a12c5f27a07db00a346f499272b9fffe0cef6c0b1f43882ada731f865cd15a4",
        "capture": "919557d60468acd6b85061750958a122bf2906e1b33bc6dfe7dfbaee5e3ec03c",
        "train": "86ca28edcd74f89ab879ef56b968c1bf25c192b21702856bfd5c1df8a9fccc3e",
        "evaluate": "89a65d16efb5cb79903efeba7bb53b57424bff9146e788d5178253c82e41c06d",
        "register": "904a9ab57585ecffddfd1f2c81cbc44fb55c18b18f709405275397a1469af778",
        "serve": "b8d5ee89beaf259da7effdf5ec40cfcdae09252ce565fbc75da55b0976733a1e",
    },
    "smollm2-135m-gpu.yaml": {
        "regenerate": "0159e197976aa382f1ee898ba2a058652870e769900448ef0019805a052eebde",
        "capture": "c195a0b20848a3d6870146b44d227070a5ca171738ffc43ba8b1b1dd30a1d4bc",
        "train": "c3d4e9377184a62e7d827551e34d5285c7fabafe42c382457401bef98737ba88",
        "evaluate": "c7faed75ee873b8944005f7ec437ac0c99ef8cf09f2feca49b6233d1434c4741",
        "register": "a7eb726bbd8e1d635b17242f7c4dcc6ff6577e8e32d32b7bcc987450295eb16a",
        "serve": "5e854512ba016f87ca950bdf8d41174be0ac69043cf82e38cf2901bfe3c494a8",
    },
}


@pytest.fixture
def ci_recipe():
    return load_recipe(CONFIGS / "smollm2-135m-ci.yaml")


@pytest.mark.parametrize("config", sorted(KEYS))
def test_stage_keys_unchanged(config, tmp_path):
    run = PipelineRun(load_recipe(CONFIGS / config), run_dir=tmp_path, machine=Machine.ideal())  # GPU recipes too
    assert {s: run.key(s) for s in STAGES} == KEYS[config]


@pytest.mark.parametrize("config", sorted(KEYS))
def test_stage_keys_do_not_depend_on_class_names(config, tmp_path):
    """Which fields a key leaves out while None is marked on the fields (KEY_NEUTRAL_WHEN_NONE), not listed
    by class name: renaming every recipe section class changes no key."""
    import pipelines.recipe as r

    classes = (r.SourceConfig, r.DataConfig, r.RegenerateConfig, r.CaptureConfig, r.DrafterSpec, r.TrainingConfig,
               r.EvalConfig, r.RegistryConfig, r.ServeConfig, r.TargetConfig, r.TrafficSourceConfig,
               r.TrafficLogConfig, r.SelfInstructConfig)
    names = [(c.__name__, c.__qualname__) for c in classes]
    try:
        for c in classes:
            c.__name__, c.__qualname__ = f"Renamed{c.__name__}", f"Renamed{c.__qualname__}"
        run = PipelineRun(load_recipe(CONFIGS / config), run_dir=tmp_path, machine=Machine.ideal())
        keys = {s: run.key(s) for s in STAGES}
    finally:
        for c, (name, qualname) in zip(classes, names, strict=True):
            c.__name__, c.__qualname__ = name, qualname
    assert keys == KEYS[config]


@pytest.mark.parametrize("override", ["training.lr=0.001", "training.depth_decay=0.5"])
def test_key_follows_upstream_sections(ci_recipe, tmp_path, override):
    """A training field moves the train stage's key and the keys after it (a key-neutral field too, once set)."""
    base = PipelineRun(ci_recipe, run_dir=tmp_path)
    changed = PipelineRun(load_recipe(CONFIGS / "smollm2-135m-ci.yaml", [override]), run_dir=tmp_path)
    same, moved = STAGES[:STAGES.index("train")], STAGES[STAGES.index("train"):]
    assert all(base.key(s) == changed.key(s) for s in same)
    assert all(base.key(s) != changed.key(s) for s in moved)


@pytest.mark.parametrize("override", ["training.block_mask=blockwise", "training.max_failures=5",
                                      "regenerate.num_workers=4", "capture.num_workers=3"])
def test_fields_that_do_not_change_the_head_do_not_move_a_key(ci_recipe, tmp_path, override):
    """How the (same) block mask is built, how many failures to recover from and how many engines or capture actors
    share the work leave every key as it is."""
    base = PipelineRun(ci_recipe, run_dir=tmp_path)
    changed = PipelineRun(load_recipe(CONFIGS / "smollm2-135m-ci.yaml", [override]), run_dir=tmp_path)
    assert all(base.key(s) == changed.key(s) for s in STAGES)


def test_engines_sharing_a_gpu_do_not_move_a_key(tmp_path):
    """regenerate.engines_per_gpu (valid with the actor runner only) leaves every key as it is."""
    base, shared = (PipelineRun(load_recipe(CONFIGS / "smollm2-135m-ci.yaml", ["regenerate.vllm_runner=actor", *more]),
                                run_dir=tmp_path) for more in ([], ["regenerate.engines_per_gpu=2"]))
    assert all(base.key(s) == shared.key(s) for s in STAGES)


SAMPLES = [
    RegenerateOutput(path="/r/conversations.jsonl", num_conversations=14, regenerated=True, num_turns=14,
                     num_generated_tokens=751, tokens_per_s=8.8, wall_tokens_per_s=7.9),
    RegenerateOutput(path="/r/conversations.jsonl", num_conversations=14, regenerated=False),
    RegenerateOutput(path="/r/conversations.jsonl", num_conversations=14, regenerated=True, num_turns=14,
                     self_instruct=[{"generated": 16, "kept": 12, "generate_s": 3.5}]),
    CaptureOutput(streaming=False, capture_dir="/r/capture/40725644328e", num_samples=14, num_tokens=1774,
                  num_loss_tokens=762, num_shards=2, bytes_on_disk=16759593, bytes_per_token=9223.0,
                  tokens_per_s=55.0, dropped={"too_long": 0}, num_truncated=0),
    CaptureOutput(streaming=True, num_conversations=14),
    TrainOutput(head_dir="/r/train/head", step=10, checkpoint="/r/ray_results/x/checkpoint_00000010",
                history=[{"step": 10, "loss": 10.4}], bytes_written_run_dir=123, streaming=False,
                hidden_state_bytes_on_disk=16759593, stream={}),
    EvaluateOutput(table="/r/evaluate/table.json", rows=[{"method": "peagle", "K": 3, "acceptance_length": 1.2}],
                   eval_set="humaneval", best_K={"peagle": {"1": 3}}, plots={"al_vs_K": "/r/evaluate/al.png"}),
    EvaluateOutput(table="/r/evaluate/table.json", rows=[{"method": "peagle", "K": 3, "acceptance_length": 1.2,
                                                          "eval_set": "mtbench"}],
                   eval_set="humaneval", eval_sets=["humaneval", "mtbench"], best_K={"peagle": {"1": 3}},
                   plots={"mtbench/al_vs_K": "/r/evaluate/mtbench/al.png"}),
    RegisterOutput(model_name="peagle-x", version="1", run_id="abc", tracking_uri="sqlite:////x.db", promoted=True,
                   reason="no champion yet", champion_version="1"),
    ServeOutput(url="http://127.0.0.1:8000", model_id="x", head="models:/peagle-x/1", registered="1",
                smoke_answer="4", api_key_env=None),
]


REGISTERED, SERVED = SAMPLES[-2], SAMPLES[-1]


@pytest.mark.parametrize("out", SAMPLES, ids=lambda o: type(o).__name__)
def test_output_json_round_trip(out):
    data = json.loads(json.dumps(out.to_json()))
    assert type(out).from_json(data) == out
    assert type(out).from_json(data | {"added_by_a_later_version": 1}) == out


def test_outputs_read_records_of_the_old_pipeline():
    # outputs dicts exactly as the pipeline wrote them before stages became objects
    regen = {"path": "/r/c.jsonl", "num_conversations": 14, "regenerated": False}
    assert RegenerateOutput.from_json(regen).to_json() == regen
    cap = {"streaming": True, "num_conversations": 14}
    assert CaptureOutput.from_json(cap).to_json() == cap
    train = {"head_dir": "/h", "step": 10, "resumed_from_step": None, "checkpoint": None, "mlflow_run_id": None,
             "history": [], "bytes_written_run_dir": 5, "streaming": True, "hidden_state_bytes_on_disk": 0,
             "stream": {"steps_per_epoch": 2}}
    assert TrainOutput.from_json(train).to_json() == train
    with pytest.raises(TypeError):
        TrainOutput.from_json({"step": 10})  # no head_dir: an incompatible record


def test_evaluate_output_of_one_and_of_several_eval_sets():
    # a record of the single-set stage (rows without eval_set are the gate set's) loads unchanged
    old = {"table": "/r/evaluate/table.json", "rows": [{"method": "peagle", "K": 3, "concurrency": 1,
                                                        "acceptance_length": 1.25}],
           "eval_set": "humaneval", "best_K": {"peagle": {"1": 3}}, "plots": {}}
    out = EvaluateOutput.from_json(old)
    assert out.to_json() == old and out.set_names() == ["humaneval"] and out.al_by_K("peagle", 1) == {3: 1.25}
    rows = [{"method": "peagle", "K": 3, "concurrency": 1, "acceptance_length": al, "eval_set": name}
            for name, al in (("humaneval", 1.25), ("mtbench", 1.5))]
    out = EvaluateOutput(table="t.json", rows=rows, eval_set="humaneval", eval_sets=["humaneval", "mtbench"])
    assert out.al_by_K("peagle", 1) == out.al_by_K("peagle", 1, eval_set="humaneval") == {3: 1.25}
    assert out.al_by_K("peagle", 1, eval_set="mtbench") == {3: 1.5} and out.set_rows("mtbench") == rows[1:]


def test_eval_sets_must_have_distinct_names(tmp_path):
    same = ('evaluation.sources=[{kind: openai_jsonl, path: a/chats.jsonl}, '
            '{kind: openai_jsonl, path: b/chats.jsonl}]')
    with pytest.raises(ValueError, match=r"eval set\(s\) \['chats'\] more than once"):
        PipelineRun(load_recipe(CONFIGS / "smollm2-135m-ci.yaml", [same]), run_dir=tmp_path)


def test_summary_shows_every_eval_set(ci_recipe, tmp_path):
    run = PipelineRun(ci_recipe, run_dir=tmp_path)
    rows = [{"method": m, "K": k, "concurrency": 1, "acceptance_length": al, "tokens_per_s": 10.0, "eval_set": name}
            for name, al in (("humaneval", 1.27), ("mtbench", 1.41)) for m, k in (("none", 0), ("peagle", 3))]
    out = EvaluateOutput(table="t.json", rows=rows, eval_set="humaneval", eval_sets=["humaneval", "mtbench"])
    run.records = {"evaluate": StageRecord("evaluate", "ran", 1.0, run.key("evaluate"), out)}
    s = json.loads(json.dumps(run.summary(1.0)))
    assert s["eval"]["eval_set"] == "humaneval" and s["eval"]["per_K"]["3"]["acceptance_length"] == 1.27
    assert {n: v["per_K"]["3"]["acceptance_length"] for n, v in s["eval"]["by_eval_set"].items()} == {
        "humaneval": 1.27, "mtbench": 1.41}
    from rich.console import Console

    buf = io.StringIO()
    print_summary(s, Console(file=buf, width=80))
    text = buf.getvalue()
    assert "on humaneval (gate set)" in text and "on mtbench (vLLM" in text and "1.410" in text


def test_evaluate_stage_measures_every_eval_set(tmp_path, monkeypatch):
    # the stage's wiring without vLLM: one evaluate() per eval set, rows together, the first set gates,
    # and MT-Bench turns: 2 gets a (transformers) engine for the first answers
    import types

    import transformers

    from pipelines import assets
    from pipelines.data import engines
    from pipelines.evaluate import measure as ev
    from pipelines.evaluate import prompts as eval_prompts
    from pipelines.evaluate.report import EvalReport
    from pipelines.stages.evaluate import EvaluateStage

    recipe = load_recipe(CONFIGS / "smollm2-135m-ci.yaml",
                         ["evaluation.sources=[{kind: humaneval}, {kind: mtbench, turns: 2}]"])
    run = PipelineRun(recipe, run_dir=tmp_path, say=lambda m: None)
    run.records["train"] = StageRecord("train", "ran", 1.0, run.key("train"), SAMPLES[5])
    engine, calls = object(), []
    monkeypatch.setattr(assets, "resolve_target", lambda t: (types.SimpleNamespace(path=tmp_path), {}))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda p: "tok")
    monkeypatch.setattr(engines, "make_engine", lambda backend, path, **kw: calls.append(backend) or engine)

    def load_eval_prompts(sources, tok, **kw):
        calls.append(kw["engine"])
        return {"humaneval": [[1, 2]], "mtbench-2turn": [[3]]}

    def evaluate(*, prompts, eval_set, out_dir, **kw):
        calls.append((eval_set, out_dir.name, prompts))
        rows = [{"method": "peagle", "K": 3, "concurrency": 1, "acceptance_length": 1.0 + len(prompts[0]) / 10,
                 "eval_set": eval_set}]
        return EvalReport(eval_set=eval_set, rows=rows, best_K={"peagle": {1: 3}}, markdown="| t |\n")

    monkeypatch.setattr(eval_prompts, "load_eval_prompts", load_eval_prompts)
    monkeypatch.setattr(ev, "evaluate", evaluate)
    out = EvaluateStage(run).run()
    assert calls == ["transformers", engine, ("humaneval", "humaneval", [[1, 2]]),
                     ("mtbench-2turn", "mtbench-2turn", [[3]])]
    assert out.eval_set == "humaneval" and out.eval_sets == ["humaneval", "mtbench-2turn"] and len(out.rows) == 2
    assert out.al_by_K("peagle", 1) == {3: 1.2} and out.al_by_K("peagle", 1, eval_set="mtbench-2turn") == {3: 1.1}
    table = json.loads((tmp_path / "evaluate" / "table.json").read_text())
    assert table["gate_eval_set"] == "humaneval" and len(table["rows"]) == 2 and set(table["best_K"]) == {
        "humaneval", "mtbench-2turn"}
    assert "## humaneval (gate)" in (tmp_path / "evaluate" / "table.md").read_text()


def test_every_stage_declares_an_output():
    assert STAGES == ("regenerate", "capture", "train", "evaluate", "register", "serve")
    assert len({t.Output for t in STAGE_TYPES}) == len(STAGE_TYPES)


def test_unknown_stage_name(ci_recipe, tmp_path):
    with pytest.raises(ValueError, match=r"unknown stage\(s\) \['trian'\]; stages are \['regenerate'"):
        PipelineRun(ci_recipe, run_dir=tmp_path, stages=["trian"])


def test_recipe_checks_before_compute(tmp_path):
    bad = load_recipe(CONFIGS / "smollm2-135m-ci.yaml", ["registry.gate_num_speculative_tokens=5"])
    with pytest.raises(ValueError, match="gate_num_speculative_tokens=5 is not in"):
        PipelineRun(bad, run_dir=tmp_path)
    bad = load_recipe(CONFIGS / "smollm2-135m-ci.yaml", ["evaluation.methods=[none]"])
    with pytest.raises(ValueError, match="does not measure the trained head"):
        PipelineRun(bad, run_dir=tmp_path)


def test_engine_settings_cpu_and_gpu(ci_recipe):
    cpu = engine_settings(ci_recipe)
    assert not cpu.use_gpu and cpu.accelerator == "cpu" and cpu.export_dtype == "float32"
    assert cpu.vllm_kwargs == settings.CPU_VLLM_KWARGS and cpu.vllm_kwargs["kv_cache_memory_bytes"] == 2 << 30
    gpu = engine_settings(load_recipe(CONFIGS / "smollm2-135m-ci.yaml", ["training.use_gpu=true"]))
    assert gpu.use_gpu and gpu.vllm_kwargs == {} and gpu.export_dtype == "bfloat16" and not gpu.serve_resources


def test_serving_engine_kwargs_reach_the_engines_that_draft_and_key_what_they_measure(ci_recipe, tmp_path):
    """serving.engine_kwargs: one recipe field, given to the evaluate stage's engines and to every Serve replica after
    the CPU defaults; it moves the evaluate and serve keys (not the training's), unset it moves none; arguments that
    other fields set are refused when the recipe loads."""
    from pipelines.stages.serve import serve_app_args

    sets = ['serving.engine_kwargs={max_num_seqs: 8, compilation_config: {cudagraph_mode: FULL_AND_PIECEWISE}}']
    tuned = load_recipe(CONFIGS / "smollm2-135m-ci.yaml", sets)
    eng = engine_settings(tuned)
    evaluate_kwargs = eng.drafting_engine_kwargs(dtype="float32", max_model_len=1024)
    assert evaluate_kwargs == {"dtype": "float32", "max_model_len": 1024, **settings.CPU_VLLM_KWARGS, "max_num_seqs": 8,
                               "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}}
    served = serve_app_args(tuned, eng, tracking_uri=None).engine_kwargs
    assert {k: v for k, v in served.items() if k != "max_model_len"} == {
        k: v for k, v in evaluate_kwargs.items() if k not in ("dtype", "max_model_len")}
    base, changed = PipelineRun(ci_recipe, run_dir=tmp_path), PipelineRun(tuned, run_dir=tmp_path)
    moved = [s for s in STAGES if base.key(s) != changed.key(s)]
    assert moved == ["evaluate", "register", "serve"]
    with pytest.raises(ValueError, match=r"serving.engine_kwargs sets \['max_model_len', 'speculative_config'\]"):
        load_recipe(CONFIGS / "smollm2-135m-ci.yaml",
                    ["serving.engine_kwargs={speculative_config: {}, max_model_len: 4096}"])


def _record_regenerate(run: PipelineRun, num_lines: int, key: str | None = None) -> RegenerateOutput:
    d = run.stage_dir("regenerate")
    d.mkdir(parents=True, exist_ok=True)
    path = d / "conversations.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "messages": [], "source": "t"}) + "\n" for i in range(num_lines)))
    out = RegenerateOutput(path=str(path), num_conversations=num_lines, regenerated=False)
    rec = StageRecord("regenerate", "ran", 1.5, key or run.key("regenerate"), out)
    (d / STAGE_FILE).write_text(json.dumps(rec.to_json()))
    return out


def test_upstream_reads_a_current_record(ci_recipe, tmp_path):
    run = PipelineRun(ci_recipe, run_dir=tmp_path, stages=["capture"])
    out = _record_regenerate(run, 3)
    assert json.loads((tmp_path / "regenerate" / STAGE_FILE).read_text()).keys() == {
        "name", "status", "seconds", "key", "outputs"}
    assert run.upstream(RegenerateOutput) == out
    assert [r["id"] for r in out.rows()] == ["0", "1", "2"]


def test_upstream_refuses_a_stale_or_broken_record(ci_recipe, tmp_path):
    run = PipelineRun(ci_recipe, run_dir=tmp_path, stages=["capture"])
    _record_regenerate(run, 3, key="0" * 64)  # made with another recipe
    with pytest.raises(ValueError, match="stage 'regenerate' has no current outputs.*--stage regenerate"):
        run.upstream(RegenerateOutput)
    (tmp_path / "regenerate" / STAGE_FILE).unlink()
    (tmp_path / "regenerate" / "conversations.jsonl").unlink()
    out = _record_regenerate(run, 3)
    with open(out.path, "a") as f:
        f.write("{}\n")  # the file no longer matches the record: re-run
    with pytest.raises(ValueError, match="no current outputs"):
        run.upstream(RegenerateOutput)


def test_summary_and_its_table(ci_recipe, tmp_path):
    run = PipelineRun(ci_recipe, run_dir=tmp_path)
    rows = [{"method": "none", "K": 0, "concurrency": 1, "acceptance_length": 1.0, "tokens_per_s": 12.8},
            {"method": "peagle", "K": 3, "concurrency": 1, "acceptance_length": 1.27, "tokens_per_s": 15.0}]
    run.records = {
        "evaluate": StageRecord("evaluate", "ran", 151.5, run.key("evaluate"),
                                EvaluateOutput(table="t.json", rows=rows, eval_set="humaneval")),
        "register": StageRecord("register", "skipped", 0.0, run.key("register"), REGISTERED),
        "serve": StageRecord("serve", "ran", 88.0, run.key("serve"), SERVED),
    }
    s = run.summary(240.0)
    assert s["stages"] == {"evaluate": {"status": "ran", "seconds": 151.5},
                           "register": {"status": "skipped", "seconds": 0.0}, "serve": {"status": "ran", "seconds": 88.0}}
    assert s["eval"]["per_K"][3]["acceptance_length"] == 1.27 and s["eval"]["eval_set"] == "humaneval"
    assert s["mlflow"]["version"] == "1" and s["mlflow"]["run_id"] == "abc"
    assert s["endpoint"]["url"] == "http://127.0.0.1:8000" and s["endpoint"]["curl"].startswith("curl -s http")
    from rich.console import Console

    buf = io.StringIO()
    print_summary(json.loads(json.dumps(s)), Console(file=buf, width=80))
    text = buf.getvalue()
    assert s["endpoint"]["curl"] in text.splitlines()[-1]  # whole, on one line, copyable
    assert "1.270" in text and "serve" in text and "peagle-x v1 (champion)" in text


def test_summary_shows_the_champion_measured_in_the_same_run(ci_recipe, tmp_path):
    run = PipelineRun(ci_recipe, run_dir=tmp_path)
    rows = [{"method": "none", "K": 0, "concurrency": 1, "acceptance_length": 1.0, "tokens_per_s": 12.8},
            {"method": "peagle", "K": 3, "concurrency": 1, "acceptance_length": 1.27, "tokens_per_s": 15.0},
            {"method": "champion", "head_method": "peagle", "K": 3, "concurrency": 1, "acceptance_length": 1.09,
             "tokens_per_s": 13.9}]
    champion = {"model": "peagle-x", "version": "4", "head_sha256": "ab" * 32}
    run.records = {"evaluate": StageRecord("evaluate", "ran", 151.5, run.key("evaluate"),
                                           EvaluateOutput(table="t.json", rows=rows, eval_set="humaneval",
                                                          champion=champion))}
    s = json.loads(json.dumps(run.summary(200.0)))
    from rich.console import Console

    buf = io.StringIO()
    print_summary(s, Console(file=buf, width=100))
    text = buf.getvalue()
    assert "champion v4 AL" in text and "1.090" in text and "1.270" in text, text


def test_stages_this_machine_cannot_run(ci_recipe, tmp_path, monkeypatch):
    """A box without vLLM (the lent GPU machine): evaluate and serve are not run, nor register between them; the run
    says so before any stage, and the summary keeps the reasons."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails in this process, as where it is absent
    lines: list[str] = []
    run = PipelineRun(ci_recipe, run_dir=tmp_path, stages=["evaluate", "register", "serve"], say=lines.append)
    assert run.not_run == {"evaluate": "vllm not installed on this machine",
                           "register": "needs the outputs of evaluate, which cannot run here",
                           "serve": "vllm not installed on this machine"}
    assert [run.key(s) for s in ("regenerate", "capture", "train")]  # the stages that can run keep their keys
    s = run.run()  # nothing to run: no Ray, no compute
    assert s["stages"]["evaluate"] == {"status": "not run", "seconds": 0.0,
                                       "reason": "vllm not installed on this machine"}
    assert [line for line in lines if "not run" in line] == [
        "[evaluate] not run: vllm not installed on this machine",
        "[register] not run: needs the outputs of evaluate, which cannot run here",
        "[serve] not run: vllm not installed on this machine"]
    assert json.loads((tmp_path / "summary.json").read_text())["stages"]["serve"]["status"] == "not run"
    assert not (tmp_path / "evaluate" / STAGE_FILE).exists()  # a machine with vLLM runs it later
    from rich.console import Console

    buf = io.StringIO()
    print_summary(s, Console(file=buf, width=100))
    assert "evaluate not run: vllm not installed on this machine" in buf.getvalue()


def test_registry_stages_need_mlflow(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    run = PipelineRun(load_recipe(CONFIGS / "smollm2-135m-ci.yaml"), run_dir=tmp_path)
    assert run.not_run == {"register": "mlflow not installed on this machine",
                           "serve": "mlflow not installed on this machine"}
    warm = load_recipe(CONFIGS / "smollm2-135m-ci.yaml", ["training.init_from=models:/peagle-x@champion"])
    assert PipelineRun(warm, run_dir=tmp_path).not_run["train"] == "mlflow not installed on this machine"


def test_gpu_actor_cpus_gives_every_gpu_its_actor():
    """One actor per GPU must fit every GPU node: the tightest node's CPUs (one kept for Ray Data's tasks) split
    over its GPUs; no GPU node: None (the CPU rule applies)."""
    from pipelines.stages.base import gpu_actor_cpus

    node = lambda cpus, gpus: {"Alive": True, "Resources": {"CPU": cpus} | ({"GPU": gpus} if gpus else {})}
    assert gpu_actor_cpus([node(24, 2), node(24, 2)]) == 11  # the 4-GPU host as two nodes: 2 x 11 <= 24 each
    assert gpu_actor_cpus([node(64, 4), node(8, 2)]) == 3
    assert gpu_actor_cpus([node(2, 4)]) == 1
    assert gpu_actor_cpus([node(16, 0)]) is None and gpu_actor_cpus([]) is None


def test_a_missing_regenerate_record_with_regeneration_off_says_the_stage_takes_seconds(ci_recipe, tmp_path):
    """A capture run alone with ``regenerate.enabled: false`` still needs the regenerate stage's mixed and split
    prompts (4x H200, 2026-11-28: the capture job failed at once); the error says that stage is cheap then."""
    recipe = ci_recipe.model_copy(update={"regenerate": ci_recipe.regenerate.model_copy(update={"enabled": False})})
    run = PipelineRun(recipe, run_dir=tmp_path, stages=["capture"])
    with pytest.raises(ValueError, match=r"--stage regenerate \(regenerate.enabled is false: .* in seconds\)"):
        run.upstream(RegenerateOutput)
