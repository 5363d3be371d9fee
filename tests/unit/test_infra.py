"""infra/ manifests: validated against a typed model of the KubeRay (ray.io/v1) and Kubernetes fields
peagle uses; the RayService's serveConfigV2 must be the Serve YAML in configs/serve; every Serve YAML's
args must validate as pipelines.serve.ServeAppArgs."""

from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
INFRA, SERVE_CONFIGS = ROOT / "infra", ROOT / "configs" / "serve"


class _M(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class Metadata(_M):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    namespace: str = "peagle"


class Container(_M):
    name: str
    image: str = Field(min_length=3)
    resources: dict[str, Any] = Field(default_factory=dict)
    env: list[dict[str, Any]] = Field(default_factory=list)


class PodSpec(_M):
    containers: list[Container] = Field(min_length=1)
    nodeSelector: dict[str, str] = Field(default_factory=dict)
    volumes: list[dict[str, Any]] = Field(default_factory=list)


class PodTemplate(_M):
    spec: PodSpec


class HeadGroupSpec(_M):
    rayStartParams: dict[str, str]
    template: PodTemplate


class WorkerGroupSpec(_M):
    groupName: str
    replicas: int = Field(ge=0)
    minReplicas: int = Field(ge=0)
    maxReplicas: int = Field(ge=1)
    rayStartParams: dict[str, str]
    template: PodTemplate

    @model_validator(mode="after")
    def _bounds(self):
        assert self.minReplicas <= self.replicas <= self.maxReplicas, "minReplicas <= replicas <= maxReplicas"
        return self

    def gpus(self) -> int:
        c = self.template.spec.containers[0]
        lim, req = c.resources.get("limits", {}), c.resources.get("requests", {})
        assert lim.get("nvidia.com/gpu") == req.get("nvidia.com/gpu"), "GPU requests must equal limits"
        return int(lim.get("nvidia.com/gpu", 0))


class RayClusterSpec(_M):
    rayVersion: str
    headGroupSpec: HeadGroupSpec
    workerGroupSpecs: list[WorkerGroupSpec] = Field(min_length=1)


class RayJobSpec(_M):
    entrypoint: str
    runtimeEnvYAML: str
    shutdownAfterJobFinishes: bool
    rayClusterSpec: RayClusterSpec

    @field_validator("runtimeEnvYAML")
    @classmethod
    def _yaml(cls, v: str) -> str:
        assert isinstance(yaml.safe_load(v), dict), "runtimeEnvYAML must be a YAML mapping"
        return v


class RayServiceSpec(_M):
    serveConfigV2: str
    rayClusterConfig: RayClusterSpec


class RayJob(_M):
    apiVersion: Literal["ray.io/v1"]
    kind: Literal["RayJob"]
    metadata: Metadata
    spec: RayJobSpec


class RayService(_M):
    apiVersion: Literal["ray.io/v1"]
    kind: Literal["RayService"]
    metadata: Metadata
    spec: RayServiceSpec


class K8sObject(_M):
    apiVersion: str
    kind: str
    metadata: Metadata
    spec: dict[str, Any] = Field(default_factory=dict)


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((INFRA / name).read_text()) if d]


def _check_b200(cluster: RayClusterSpec) -> None:
    assert cluster.rayVersion == "2.60.0"
    assert cluster.headGroupSpec.rayStartParams.get("num-gpus") == "0"
    for g in cluster.workerGroupSpecs:
        assert g.gpus() >= 1
        assert g.template.spec.nodeSelector.get("nvidia.com/gpu.product") == "NVIDIA-B200"
        assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in g.template.spec.volumes), "/dev/shm"


def test_rayjob_runs_the_pipeline():
    (doc,) = _docs("rayjob-pipeline-b200.yaml")
    job = RayJob.model_validate(doc)
    assert job.spec.entrypoint == "python -m ray_jobs.pipeline --config configs/gpt-oss-20b-b200.yaml"
    assert (ROOT / "configs" / "gpt-oss-20b-b200.yaml").is_file()
    assert job.spec.shutdownAfterJobFinishes is True
    env = yaml.safe_load(job.spec.runtimeEnvYAML)["env_vars"]
    assert env["MLFLOW_TRACKING_URI"].startswith("http://mlflow.peagle.svc")
    _check_b200(job.spec.rayClusterSpec)


def test_rayservice_serves_the_serve_yaml():
    (doc,) = _docs("rayservice-gpt-oss-20b-b200.yaml")
    svc = RayService.model_validate(doc)
    serve_cfg = yaml.safe_load(svc.spec.serveConfigV2)
    assert serve_cfg == yaml.safe_load((SERVE_CONFIGS / "gpt-oss-20b-b200.yaml").read_text())
    args = serve_cfg["applications"][0]["args"]
    assert args["accelerator_type"] == "B200" and args["tracking_uri"].startswith("http://mlflow.peagle.svc")
    _check_b200(svc.spec.rayClusterConfig)
    gpus = sum(g.gpus() * g.maxReplicas for g in svc.spec.rayClusterConfig.workerGroupSpecs)
    tp = args["engine_kwargs"].get("tensor_parallel_size", 1)
    assert gpus >= args["max_replicas"] * tp, "worker groups cannot host max_replicas LLM replicas"


def test_mlflow_server_with_database_and_object_store():
    objs = [K8sObject.model_validate(d) for d in _docs("mlflow.yaml")]
    kinds = {(o.kind, o.metadata.name) for o in objs}
    assert {("Deployment", "mlflow"), ("Service", "mlflow"), ("StatefulSet", "mlflow-postgres"),
            ("StatefulSet", "mlflow-minio")} <= kinds
    (dep,) = [o for o in objs if o.kind == "Deployment"]
    container = PodSpec.model_validate(dep.spec["template"]["spec"]).containers[0]
    cmd = " ".join(container.model_extra.get("args", []))
    assert "postgresql://" in cmd and "--artifacts-destination s3://" in cmd and "--serve-artifacts" in cmd
    assert "3.17" in container.image
    services = {o.metadata.name: o.spec for o in objs if o.kind == "Service"}
    for o in objs:  # every workload is reachable through a Service selecting its labels
        if o.kind in ("Deployment", "StatefulSet"):
            labels = o.spec["template"]["metadata"]["labels"]
            assert any(s["selector"].items() <= labels.items() for s in services.values()), o.metadata.name


@pytest.mark.parametrize("path", sorted(SERVE_CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_serve_yaml_args_validate(path):
    from pipelines.serve import ServeAppArgs

    cfg = yaml.safe_load(path.read_text())
    (app,) = cfg["applications"]
    assert app["import_path"] == "pipelines.serve:build_app"
    args = ServeAppArgs.model_validate(app["args"])
    assert args.max_ongoing_requests >= args.target_ongoing_requests  # Ray's 1e9 defaults overridden
    assert args.head is None or args.head.startswith("models:/")


def test_typed_model_rejects_a_broken_manifest():
    (doc,) = _docs("rayjob-pipeline-b200.yaml")
    doc["apiVersion"] = "ray.io/v1alpha1"
    with pytest.raises(ValueError):
        RayJob.model_validate(doc)
    (doc,) = _docs("rayjob-pipeline-b200.yaml")
    del doc["spec"]["rayClusterSpec"]["headGroupSpec"]
    with pytest.raises(ValueError):
        RayJob.model_validate(doc)
