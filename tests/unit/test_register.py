"""Pure helpers of the registry and the Serve args (no MLflow store, no Ray)."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from pipelines import settings
from pipelines.ports import free_port
from pipelines.registry import register as reg
from pipelines.registry.refs import HeadRef

pytestmark = pytest.mark.unit


def test_tracking_uri_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path))
    assert settings.tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert settings.tracking_uri() == "http://mlflow:5000"
    assert settings.tracking_uri("sqlite:////x.db") == "sqlite:////x.db"


@pytest.mark.parametrize(("ref", "want"), [
    ("peagle-x@champion", HeadRef("peagle-x", alias="champion")),
    ("models:/peagle-x@challenger", HeadRef("peagle-x", alias="challenger")),
    ("models:/peagle-x/12", HeadRef("peagle-x", version="12")),
])
def test_parse_model_ref(ref, want):
    assert HeadRef.parse(ref) == want


@pytest.mark.parametrize("ref", ["peagle-x", "models:/peagle-x/latest", "@champion", "peagle-x@"])
def test_parse_model_ref_rejects(ref):
    with pytest.raises(ValueError, match="NAME@ALIAS"):
        HeadRef.parse(ref)


def test_head_ref_str_round_trips():
    for text in ("models:/peagle-x@champion", "models:/peagle-x/12", "models:/org/peagle-x@a"):
        assert str(HeadRef.parse(text)) == text
    assert HeadRef.parse("models:/peagle-x/12").pinned and not HeadRef.parse("models:/peagle-x@c").pinned
    with pytest.raises(ValueError, match="exactly one of alias / version"):
        HeadRef("peagle-x", alias="champion", version="1")


def test_names_and_hashes(tmp_path):
    assert settings.model_name("smollm2-135m-instruct") == "peagle-smollm2-135m-instruct"
    assert settings.model_name("/models/Qwen3-8B/") == "peagle-Qwen3-8B"
    assert reg.manifest_hash({"b": 1, "a": 2}) == reg.manifest_hash({"a": 2, "b": 1})
    f = tmp_path / "m.json"
    f.write_bytes(b"abc")
    assert reg.manifest_hash(f) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert reg.eval_metric_name({"method": "none", "K": 0, "concurrency": 4}, "tokens_per_s") == \
        "eval.none.K0.c4.tokens_per_s"
    row = {"method": "peagle", "K": 5, "concurrency": 1, "eval_set": "mtbench"}
    assert reg.eval_metric_name(row, "acceptance_length", "humaneval") == "eval.mtbench.peagle.K5.c1.acceptance_length"
    assert reg.eval_metric_name(row, "acceptance_length", "mtbench") == "eval.peagle.K5.c1.acceptance_length"


def test_serve_args_checks():
    from pipelines.serve import ServeAppArgs

    assert ServeAppArgs().resolved_model_id() == "smollm2-135m-instruct"
    with pytest.raises(ValueError, match="autoscaling would never trigger"):
        ServeAppArgs(target_ongoing_requests=64, max_ongoing_requests=16)
    with pytest.raises(ValueError, match="speculative_config"):
        ServeAppArgs(engine_kwargs={"speculative_config": {}})
    with pytest.raises(ValueError, match="<= 0.5"):
        ServeAppArgs(engine_kwargs={"gpu_memory_utilization": 0.9})
    with pytest.raises(ValueError, match="accelerator='gpu'"):
        ServeAppArgs(accelerator_type="B200")
    with pytest.raises(ValueError):
        ServeAppArgs(num_speculative_tokens=0)


def test_autoscaling_delays_reach_serve_only_when_set():
    """serving.upscale_delay_s / downscale_delay_s go into the LLM deployment's autoscaling_config; unset, Serve's
    own defaults stay (the keys are absent)."""
    from pipelines.serve import ServeAppArgs, build_llm_config

    def autoscaling(**kw):
        args = ServeAppArgs(head=None, max_replicas=4, **kw)
        return build_llm_config(args, target_path="/t", target_config=None, head=None).deployment_config[
            "autoscaling_config"]

    assert "upscale_delay_s" not in autoscaling() and "downscale_delay_s" not in autoscaling()
    got = autoscaling(upscale_delay_s=5, downscale_delay_s=30)
    assert got["upscale_delay_s"] == 5 and got["downscale_delay_s"] == 30 and got["max_replicas"] == 4


def test_serve_args_from_recipe():
    from pipelines.recipe import load_recipe
    from pipelines.serve import ServeAppArgs

    r = load_recipe(Path(__file__).resolve().parents[2] / "configs" / "gpt-oss-20b-b200.yaml")
    args = ServeAppArgs.from_recipe(r, accelerator="gpu", accelerator_type="B200")
    assert args.head == "models:/peagle-gpt-oss-20b@champion" and args.num_speculative_tokens == 7
    assert args.target == "openai/gpt-oss-20b" and args.parallel_drafting


def test_serve_args_and_the_serving_section_share_one_schema():
    """The deployment fields have one home (ServeDeployment): same defaults and limits in the recipe's serving
    section and in the Serve app's args, and from_recipe carries every one of them."""
    from pipelines.recipe import ServeConfig, ServeDeployment, load_recipe
    from pipelines.serve import ServeAppArgs

    shared = set(ServeDeployment.model_fields)
    assert {"num_speculative_tokens", "min_replicas", "max_replicas", "target_ongoing_requests",
            "max_ongoing_requests", "upscale_delay_s", "downscale_delay_s", "api_key_env", "k_schedule",
            "traffic_log"} == shared
    assert issubclass(ServeConfig, ServeDeployment) and issubclass(ServeAppArgs, ServeDeployment)
    r = load_recipe(Path(__file__).resolve().parents[2] / "configs" / "smollm2-135m-cpu.yaml",
                    ["serving.num_speculative_tokens=3", "serving.max_replicas=2", "serving.api_key_env=KEY",
                     "serving.downscale_delay_s=30",
                     "serving.traffic_log={}", "serving.k_schedule=off"])
    args = ServeAppArgs.from_recipe(r)
    assert {f: getattr(args, f) for f in shared} == {f: getattr(r.serving, f) for f in shared}
    with pytest.raises(ValidationError, match="serving.min_replicas=2 > max_replicas=1"):
        ServeConfig(min_replicas=2)
    with pytest.raises(ValidationError, match="min_replicas=2 > max_replicas=1"):
        ServeAppArgs(min_replicas=2)


def test_head_ref_resolves_to_a_pinned_version(uri, tmp_path, monkeypatch):
    """One resolver for every caller: an alias pins to its version and head_sha256 tag, a version keeps itself;
    a model, alias or version the registry does not have is a ValueError naming the field (or None with
    missing_ok); a registry that does not answer is not "no such version": MLflow's error propagates."""

    from mlflow.exceptions import MlflowException

    client = reg.get_client(uri)
    client.create_registered_model("peagle-x")
    (tmp_path / "src").mkdir()
    v = str(client.create_model_version("peagle-x", source=str(tmp_path / "src"),
                                        tags={reg.HEAD_SHA256_TAG: "a" * 64}).version)
    client.set_registered_model_alias("peagle-x", "champion", v)
    pinned = HeadRef.parse("models:/peagle-x@champion").resolve(uri)
    assert pinned == HeadRef("peagle-x", version=v, head_sha256="a" * 64) and str(pinned) == f"models:/peagle-x/{v}"
    assert HeadRef("peagle-x", version=v).resolve(uri) == pinned
    for missing in ("models:/peagle-x@nope", "models:/peagle-x/99", "models:/peagle-y@champion"):
        with pytest.raises(ValueError, match="no such model version") as e:
            HeadRef.parse(missing).resolve(uri, field="training.init_from", fix="register one")
        assert str(e.value).startswith(f"training.init_from={missing!r}") and str(e.value).endswith("register one")
        assert HeadRef.parse(missing).resolve(uri, missing_ok=True) is None
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(MlflowException) as e:
        HeadRef.parse("models:/peagle-x@champion").resolve(dead, missing_ok=True)
    assert not isinstance(e.value, ValueError)
    reg.get_client(uri)  # the fluent API's URI back on the test's store


def test_replicas_get_the_address_of_the_cluster_that_deploys_them():
    """A GPU replica's vLLM engine core calls ray.init() on its own: the replicas' environment names the cluster
    (RAY_ADDRESS), which a private temp dir (pipelines.local_ray) hides from Ray's auto-detection."""
    import ray

    from pipelines.serve import ServeAppArgs, build_llm_config

    def env():
        c = build_llm_config(ServeAppArgs(head=None), target_path="/t", target_config=None, head=None)
        return (c.runtime_env or {}).get("env_vars") or {}

    assert "RAY_ADDRESS" not in env()  # not connected: nothing to name
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        assert env()["RAY_ADDRESS"] == ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def test_gpu_replicas_run_vllms_classic_ray_executor_without_the_compile_cache():
    """GPU replicas get GPU_REPLICA_ENV (replicas started beside others on one host died loading the first one's
    compiled graphs, or on RayExecutorV2's TCPStore port); CPU replicas get none of it, and CPU_REPLICA_ENV instead
    (Ray Serve LLM's engine class: peagle's, which runs one worker inside vLLM's engine core)."""
    from pipelines.serve import CPU_REPLICA_ENV, GPU_REPLICA_ENV, ServeAppArgs, build_llm_config

    def env(accelerator):
        c = build_llm_config(ServeAppArgs(head=None, accelerator=accelerator), target_path="/t", target_config=None,
                             head=None)
        return (c.runtime_env or {}).get("env_vars") or {}

    assert env("gpu").items() >= GPU_REPLICA_ENV.items() == {("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0"),
                                                            ("VLLM_DISABLE_COMPILE_CACHE", "1")}
    assert not env("cpu").keys() & GPU_REPLICA_ENV.keys() and not env("gpu").keys() & CPU_REPLICA_ENV.keys()
    assert env("cpu").items() >= CPU_REPLICA_ENV.items()
    pytest.importorskip("vllm")
    from ray._common.utils import import_attr
    from ray.llm._internal.serve.core.server.llm_server import LLMServer
    from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine

    from pipelines.serve.cpu_engine import UniprocVLLMEngine

    # the name Ray reads from the variable (LLMServer._get_default_engine_class) is peagle's VLLMEngine
    (var,) = CPU_REPLICA_ENV
    assert var == "RAYLLM_VLLM_ENGINE_CLS" and hasattr(LLMServer, "_get_default_engine_class")
    assert import_attr(CPU_REPLICA_ENV[var]) is UniprocVLLMEngine and issubclass(UniprocVLLMEngine, VLLMEngine)


@pytest.mark.parametrize(("world_size", "backend", "expected"), [(1, "mp", "uni"), (2, "mp", "mp"), (1, "ray", "ray")])
def test_cpu_engine_runs_one_worker_in_the_engine_core(monkeypatch, world_size, backend, expected):
    """Ray Serve LLM forces vLLM's mp executor on CPU; with one worker peagle's engine class asks for uni instead
    (one process less per replica); several workers, or another executor, are left as Ray set them."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine

    from pipelines.serve.cpu_engine import UniprocVLLMEngine

    args = SimpleNamespace(distributed_executor_backend=backend)
    config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=world_size,
                                                             distributed_executor_backend=backend))
    monkeypatch.setattr(VLLMEngine, "_prepare_engine_config", lambda self, ctx: (args, "frontend", config))
    engine = object.__new__(UniprocVLLMEngine)
    assert engine._prepare_engine_config(None) == (args, "frontend", config)
    assert config.parallel_config.distributed_executor_backend == args.distributed_executor_backend == expected


def test_replicas_skip_rays_node_initialization_unless_the_target_is_a_remote_uri(tmp_path, monkeypatch):
    """Ray's node initialization only downloads a remote source (s3://, gs://, ...); for a local directory or a hub
    id the replicas skip it (ReplicaCallback: a Ray worker importing vLLM, ~18 s of each CPU replica start), with a
    head or without one, and make torch's kernels directory as it would have."""
    import asyncio

    from pipelines.serve import ServeAppArgs, build_llm_config
    from pipelines.serve.heads import HeadDownloadCallback, ReplicaCallback

    def callback(target, head=None):
        c = build_llm_config(ServeAppArgs(head=head), target_path=target, target_config=None, head=head)
        return c.callback_config.callback_class, c.callback_config.callback_kwargs

    assert callback("/t") == (ReplicaCallback, {"skip_node_init": True})
    assert callback("HuggingFaceTB/SmolLM2-135M-Instruct")[1] == {"skip_node_init": True}
    assert callback("s3://bucket/smollm2")[1] == {"skip_node_init": False}
    cls, kwargs = callback("/t", head="/heads/h")
    assert cls is HeadDownloadCallback and kwargs["skip_node_init"] is True and kwargs["head"] == "/heads/h"

    class Cfg:  # what the hook reads of its LLMConfig: nothing when it only skips
        pass

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    for skip in (False, True):
        hook = ReplicaCallback(llm_config=Cfg(), skip_node_init=skip)
        asyncio.run(hook.on_before_node_init())
        assert hook.ctx.run_init_node is (not skip) and (tmp_path / "torch" / "kernels").is_dir() is skip


def test_hosts_with_several_gpu_raylets_are_found_head_first():
    """Two raylets with GPUs on one IP (emulated nodes) are reported, the head's name first; one raylet per host, a
    dead node or a CPU-only raylet beside a GPU one is not."""
    from pipelines.serve import shared_host_raylets

    def node(name, ip, gpus=2, head=False, alive=True):
        res = {"GPU": gpus, "CPU": 8, f"peagle_node_{name}": 1.0} | ({"node:__internal_head__": 1.0} if head else {})
        return {"NodeID": f"{name}0ff1ce", "NodeManagerAddress": ip, "Alive": alive, "Resources": res}

    assert shared_host_raylets([node("b", "10.0.0.1"), node("a", "10.0.0.1", head=True)]) == {"10.0.0.1": ["a", "b"]}
    assert shared_host_raylets([node("a", "10.0.0.1", head=True), node("b", "10.0.0.2")]) == {}
    assert shared_host_raylets([node("a", "10.0.0.1", head=True), node("b", "10.0.0.1", alive=False)]) == {}
    assert shared_host_raylets([node("a", "10.0.0.1", head=True), node("b", "10.0.0.1", gpus=0)]) == {}
