"""The refresh job's middle (issue 16 item 4): the gate eval set, the champion measured in the challenger's
evaluate run (same prompts, K and engine settings; pinned in the evaluate key) and the gate deciding on
that same-run AL. Real sqlite MLflow in ``tmp_path`` (versions created straight through ``MlflowClient``);
vLLM and the head download are replaced by recording fakes."""

import dataclasses
import json
import types

import pytest

from pipelines.pipeline import PipelineRun
from pipelines.recipe import load_recipe
from pipelines.registry import promotion
from pipelines.registry import register as reg
from pipelines.stages.base import StageRecord
from pipelines.stages.evaluate import EvaluateOutput
from pipelines.stages.train import TrainOutput
from tests.conftest import CONFIGS

pytestmark = pytest.mark.unit

NAME = "peagle-smollm2-135m-instruct"  # the CI recipe's registered model (registry.model_name unset)
TWO_SETS = "evaluation.sources=[{kind: humaneval}, {kind: traffic}]"


def ci(*overrides: str):
    return load_recipe(CONFIGS / "smollm2-135m-ci.yaml", list(overrides))


def version(client, tmp_path, **tags) -> str:
    """A model version of NAME with ``tags`` (no head files: the gate reads tags only)."""
    if not client.search_registered_models(f"name = '{NAME}'"):
        client.create_registered_model(NAME)
    (tmp_path / "src").mkdir(exist_ok=True)
    return str(client.create_model_version(NAME, source=str(tmp_path / "src"), tags=tags).version)


# ---------------------------------------------------------------------------------------------- recipe


def test_gate_eval_set_is_chosen_in_one_place(tmp_path):
    def gate(*overrides):
        r = ci(*overrides)
        return r.registry.resolved_gate_eval_set(r.evaluation)

    assert gate() == "humaneval"  # no traffic source: the first set, as before
    assert gate("evaluation.sources=[{kind: mtbench}, {kind: humaneval}]") == "mtbench"
    assert gate(TWO_SETS) == "traffic"  # the held-out traffic slice, wherever it is listed
    assert gate("evaluation.sources=[{kind: humaneval}, {kind: traffic, path: /logs/shop}]") == "traffic-shop"
    assert gate(TWO_SETS, "registry.gate_eval_set=humaneval") == "humaneval"  # explicit wins
    with pytest.raises(ValueError, match=r"gate_eval_set='mtbench' is not an eval set of evaluation.sources "
                                         r"\['humaneval', 'traffic'\]"):
        gate(TWO_SETS, "registry.gate_eval_set=mtbench")
    # refused when the run is built, before any compute
    with pytest.raises(ValueError, match="gate_eval_set='mtbench'"):
        PipelineRun(ci("registry.gate_eval_set=mtbench"), run_dir=tmp_path)
    for name in ("ci", "cpu"):
        r = load_recipe(CONFIGS / f"smollm2-135m-{name}-refresh.yaml")
        assert r.registry.resolved_gate_eval_set(r.evaluation) == "traffic"
        base = load_recipe(CONFIGS / f"smollm2-135m-{name}.yaml")
        # the same registered model (its champion is the base run's) and a drafter the warm start accepts
        assert r.registry.resolved_model_name(r.target) == base.registry.resolved_model_name(base.target) == NAME
        assert r.drafter == base.drafter and r.target == base.target
        assert r.training.init_from == f"models:/{NAME}@champion" and r.evaluation.compares_champion(r.training)


def test_compare_champion_defaults_to_a_registry_warm_start(tmp_path):
    def compares(*overrides):
        r = ci(*overrides)
        return r.evaluation.compares_champion(r.training)

    assert not compares()
    assert compares(f"training.init_from=models:/{NAME}@champion")
    assert not compares(f"training.init_from={tmp_path}")  # a local head: no registry champion implied
    assert not compares(f"training.init_from=models:/{NAME}@champion", "evaluation.compare_champion=false")
    assert compares("evaluation.compare_champion=true")


# ---------------------------------------------------------------------------------------------- keys


def test_evaluate_key_pins_the_champion(uri, tmp_path):
    client = reg.get_client(uri)

    def keys(*overrides):
        run = PipelineRun(ci(f"registry.tracking_uri={uri}", *overrides), run_dir=tmp_path / "run")
        return {s: run.key(s) for s in ("train", "evaluate", "register", "serve")}

    off = keys()
    none = keys("evaluation.compare_champion=true")  # no champion yet: compared, nothing to measure
    assert none["train"] == off["train"] and none["evaluate"] != off["evaluate"]
    v1 = version(client, tmp_path, **{reg.HEAD_SHA256_TAG: "a" * 64})
    promotion.promote(NAME, v1, tracking_uri=uri)
    first = keys("evaluation.compare_champion=true")
    assert first["evaluate"] not in (none["evaluate"], off["evaluate"])
    assert keys("evaluation.compare_champion=true") == first  # same champion: a re-run skips evaluate and after
    v2 = version(client, tmp_path, **{reg.HEAD_SHA256_TAG: "b" * 64})
    promotion.promote(NAME, v2, tracking_uri=uri)
    moved = keys("evaluation.compare_champion=true")
    assert moved["train"] == first["train"]
    assert all(moved[s] != first[s] for s in ("evaluate", "register", "serve"))  # the new champion is measured
    promotion.rollback(NAME, tracking_uri=uri)
    assert keys("evaluation.compare_champion=true") == first
    # the same version re-tagged with other files (head_sha256) re-keys too
    client.set_model_version_tag(NAME, v1, reg.HEAD_SHA256_TAG, "c" * 64)
    assert keys("evaluation.compare_champion=true")["evaluate"] != first["evaluate"]
    # the gate set is in the key only when it is not the first set (older recipes keep their keys)
    assert keys("registry.gate_eval_set=humaneval")["evaluate"] == off["evaluate"]
    assert keys(TWO_SETS)["evaluate"] != keys(TWO_SETS, "registry.gate_eval_set=humaneval")["evaluate"]


# ---------------------------------------------------------------------------------------------- gate


def test_gate_uses_the_champion_al_measured_in_this_run(uri, tmp_path):
    client = reg.get_client(uri)
    # the champion was registered with a high AL on another set (HumanEval): not comparable with traffic
    v1 = version(client, tmp_path, eval_set="humaneval", **{"al.K3": "2.9"})
    promotion.promote(NAME, v1, tracking_uri=uri)
    v2 = version(client, tmp_path, eval_set="traffic", **{"al.K3": "1.8"})
    old = promotion.maybe_promote(NAME, v2, K=3, eval_set="traffic", tracking_uri=uri)
    assert not old.promoted and "not comparable" in old.reason  # the recorded-AL rule cannot decide

    # measured in v3's own evaluate run on traffic: champion 1.5, challenger 1.8 -> promoted
    v3 = version(client, tmp_path, eval_set="traffic", **{"al.K3": "1.8"})
    d = promotion.maybe_promote(NAME, v3, K=3, eval_set="traffic", tracking_uri=uri,
                                measured=promotion.MeasuredChampion(version=v1, al=1.5, eval_set="traffic"))
    assert d.promoted and d.champion_version == v3 and d.new_al == 1.8 and d.champion_al == 1.5
    assert "AL 1.800 vs champion v" + v1 + " AL 1.500 (both measured in this evaluate run)" in d.reason
    assert "on traffic" in d.reason and "2.9" not in d.reason  # the registered AL played no part
    assert client.get_model_version(NAME, v3).tags["promotion_reason"] == d.reason
    assert str(client.get_model_version_by_alias(NAME, promotion.CHAMPION).version) == v3

    # a worse challenger (1.7 vs the champion's 1.75 in the same run) is refused; the reason names both
    v4 = version(client, tmp_path, eval_set="traffic", **{"al.K3": "1.7"})
    d = promotion.maybe_promote(NAME, v4, K=3, eval_set="traffic", tracking_uri=uri,
                                measured=promotion.MeasuredChampion(version=v3, al=1.75, eval_set="traffic"))
    assert not d.promoted and d.champion_version == v3 and d.champion_al == 1.75
    assert d.reason.startswith("champion stays: AL 1.700 vs champion v" + v3 + " AL 1.750")
    # ... and with a margin the same numbers still refuse a challenger that wins by less
    v5 = version(client, tmp_path, eval_set="traffic", **{"al.K3": "1.80"})
    d = promotion.maybe_promote(NAME, v5, K=3, eval_set="traffic", promote_margin=0.1, tracking_uri=uri,
                                measured=promotion.MeasuredChampion(version=v3, al=1.75, eval_set="traffic"))
    assert not d.promoted and "margin 0.1" in d.reason

    # the champion moved after the evaluate run measured another one: refused, re-run evaluate
    v6 = version(client, tmp_path, eval_set="traffic", **{"al.K3": "3.0"})
    d = promotion.maybe_promote(NAME, v6, K=3, eval_set="traffic", tracking_uri=uri,
                                measured=promotion.MeasuredChampion(version=v1, al=1.0, eval_set="traffic"))
    assert not d.promoted and f"the champion is v{v3} now" in d.reason and f"measured v{v1}" in d.reason
    assert str(client.get_model_version_by_alias(NAME, promotion.CHAMPION).version) == v3


def test_gate_without_a_champion_when_measured(uri, tmp_path):
    client = reg.get_client(uri)
    v1 = version(client, tmp_path, eval_set="traffic", **{"al.K3": "1.2"})
    measured = promotion.MeasuredChampion(version=None, al=None, eval_set="traffic")
    d = promotion.maybe_promote(NAME, v1, K=3, eval_set="traffic", measured=measured, tracking_uri=uri)
    assert d.promoted and "no champion yet" in d.reason
    # a champion that appeared after the run found none is not compared blindly
    v2 = version(client, tmp_path, eval_set="traffic", **{"al.K3": "5.0"})
    d = promotion.maybe_promote(NAME, v2, K=3, eval_set="traffic", measured=measured, tracking_uri=uri)
    assert not d.promoted and f"the champion is v{v1} now" in d.reason and "measured no champion" in d.reason


def test_register_reads_the_champion_from_the_gate_set_rows():
    def row(method, K, al, eval_set):
        return {"method": method, "K": K, "concurrency": 1, "acceptance_length": al, "eval_set": eval_set}

    rows = [row("peagle", 3, 1.8, "traffic"), row("champion", 3, 1.5, "traffic"), row("champion", 5, 1.9, "traffic"),
            row("peagle", 3, 1.4, "humaneval"), row("champion", 3, 2.2, "humaneval")]
    ev = EvaluateOutput(table="t.json", rows=rows, eval_set="traffic", eval_sets=["traffic", "humaneval"],
                        champion={"model": NAME, "version": "4", "head_sha256": "a" * 64, "method": "peagle"})
    assert ev.measured_champion(gate_K=3, concurrency=1) == promotion.MeasuredChampion("4", 1.5, "traffic")
    assert ev.al_by_K("peagle", 1) == {3: 1.8}  # the trained head's rows exclude the champion's
    assert dataclasses.replace(ev, champion=None).measured_champion(gate_K=3, concurrency=1) is None
    none = dataclasses.replace(ev, champion={"model": NAME, "version": None})
    assert none.measured_champion(gate_K=3, concurrency=1) == promotion.MeasuredChampion(None, None, "traffic")
    again = EvaluateOutput.from_json(json.loads(json.dumps(ev.to_json())))
    assert again == ev and "champion" not in dataclasses.replace(ev, champion=None).to_json()


# ---------------------------------------------------------------------------------------------- evaluate


def test_evaluate_measures_the_champion_like_the_trained_head(monkeypatch):
    from pipelines.evaluate import measure as ev

    specs = []

    def engine(spec, timeout_s, report=None):
        specs.append(spec)
        al = {"none": 1.0, "peagle": 1.8}[spec.method] - (0.3 if spec.head == "/champion" else 0.0)
        return [{"method": spec.method, "K": spec.K, "concurrency": c, "acceptance_length": al,
                 "tokens_per_s": 10.0 * al, "al_per_pos": []} for c in spec.concurrency]

    monkeypatch.setattr(ev, "_check_inputs", lambda prompts, heads: None)
    monkeypatch.setattr(ev, "run_engine_subprocess", engine)
    cfg = ci("evaluation.num_speculative_tokens_sweep=[2, 3]", "evaluation.concurrency_sweep=[1, 4]",
             'evaluation.methods=["none", "peagle"]').evaluation  # the CI recipe measures no baseline (CI time)
    report = ev.evaluate(target="/t", prompts=[[1, 2], [3]], heads={"peagle": "/trained"}, cfg=cfg, eval_set="traffic",
                         engine_kwargs={"dtype": "float32"}, champion_head="/champion", champion_method="peagle")
    assert [(s.method, s.K, s.head) for s in specs] == [
        ("none", 0, None), ("peagle", 2, "/trained"), ("peagle", 3, "/trained"),
        ("peagle", 2, "/champion"), ("peagle", 3, "/champion")]
    # like with like: every engine sees the same prompts, concurrency sweep, max tokens and engine kwargs
    assert len({json.dumps([s.prompts, s.concurrency, s.max_tokens, s.engine_kwargs]) for s in specs}) == 1
    champ = [r for r in report.rows if r["method"] == ev.CHAMPION_LABEL]
    assert len(champ) == 4 and all(r["head_method"] == "peagle" and r["eval_set"] == "traffic" for r in champ)
    assert report.al_by_K("peagle", 1) == {2: 1.8, 3: 1.8}
    assert report.al_by_K(ev.CHAMPION_LABEL, 1) == {2: 1.5, 3: 1.5}
    assert set(report.best_K) == {"peagle", "champion"}
    assert {r["speedup"] for r in champ} == {1.5}  # over the one no-speculation baseline
    from pipelines.registry.runs import eval_metric_name

    assert eval_metric_name(champ[0], "acceptance_length", "traffic") == "eval.champion.K2.c1.acceptance_length"


def test_evaluate_stage_measures_the_pinned_champion_on_every_set(uri, tmp_path, monkeypatch):
    import transformers

    from pipelines import assets
    from pipelines.evaluate import measure as ev
    from pipelines.evaluate import prompts as eval_prompts
    from pipelines.evaluate.report import EvalReport
    from pipelines.train import warm_start

    client = reg.get_client(uri)
    v1 = version(client, tmp_path, **{reg.HEAD_SHA256_TAG: "a" * 64})
    promotion.promote(NAME, v1, tracking_uri=uri)
    recipe = ci(f"registry.tracking_uri={uri}", TWO_SETS, f"training.init_from=models:/{NAME}@champion")
    run = PipelineRun(recipe, run_dir=tmp_path / "run", say=lambda m: None)
    run.records["train"] = StageRecord("train", "ran", 1.0, run.key("train"),
                                       TrainOutput(head_dir="/trained", step=1))
    v2 = version(client, tmp_path, **{reg.HEAD_SHA256_TAG: "b" * 64})
    promotion.promote(NAME, v2, tracking_uri=uri)  # moved after the run was built: v1 is the one measured

    head = tmp_path / "champion"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"mask_token_id": 16}))
    fetched = []

    def fetch(init, dst, tracking_uri=None):
        fetched.append(init.pinned_ref)
        return dataclasses.replace(init, head_dir=str(head))

    calls = []

    def evaluate(*, prompts, eval_set, out_dir, heads, **kw):
        calls.append((eval_set, heads, kw.get("champion_head"), kw.get("champion_method")))
        rows = [{"method": m, "K": 3, "concurrency": 1, "acceptance_length": al, "tokens_per_s": 1.0,
                 "eval_set": eval_set} for m, al in (("none", 1.0), ("peagle", 1.6), ("champion", 1.4))]
        return EvalReport(eval_set=eval_set, rows=rows, best_K={"peagle": {1: 3}}, markdown="| t |\n")

    monkeypatch.setattr(warm_start, "fetch_init_head", fetch)
    monkeypatch.setattr(assets, "resolve_target", lambda t: (types.SimpleNamespace(path=tmp_path), {}))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda p: "tok")
    monkeypatch.setattr(eval_prompts, "load_eval_prompts",
                        lambda sources, tok, **kw: {"humaneval": [[1]], "traffic": [[2]]})
    monkeypatch.setattr(ev, "evaluate", evaluate)
    stage = run._stages["evaluate"]  # built with the run: the champion pinned then
    out = stage.run()
    assert fetched == [f"models:/{NAME}/{v1}"]  # the version pinned when the run was built, not the alias now
    # the gate set (traffic) first; champion and trained head in the same call on every set
    assert calls == [("traffic", {"peagle": "/trained"}, str(head), "peagle"),
                     ("humaneval", {"peagle": "/trained"}, str(head), "peagle")]
    assert out.eval_set == "traffic" and out.eval_sets == ["traffic", "humaneval"]
    assert out.champion == {"model": NAME, "version": v1, "head_sha256": "a" * 64, "method": "peagle"}
    assert out.measured_champion(gate_K=3, concurrency=1) == promotion.MeasuredChampion(v1, 1.4, "traffic")
    table = json.loads((tmp_path / "run" / "evaluate" / "table.json").read_text())
    assert table["gate_eval_set"] == "traffic" and table["champion"]["version"] == v1
    summary = stage.summary(out)[1]
    assert summary["champion"]["al_by_K"] == {"traffic": {3: 1.4}, "humaneval": {3: 1.4}}
