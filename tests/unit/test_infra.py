"""infra/ manifests: every document validates against the vendored schemas in infra/schemas/ (KubeRay
ray.io/v1 RayJob/RayService transcribed from the CRDs, Kubernetes v1.33 strict definitions from
kubernetes-validate), where an unknown or misspelled field is an error; the RayService's serveConfigV2 must
be the Serve YAML in configs/serve; every Serve YAML's args must validate as pipelines.serve.ServeAppArgs."""

import json
import re
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from referencing import Registry, Resource

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
INFRA, SERVE_CONFIGS = ROOT / "infra", ROOT / "configs" / "serve"
SCHEMAS = [json.loads(p.read_text()) for p in sorted((INFRA / "schemas").glob("*.json"))]
REGISTRY = Registry().with_resources((s["$id"], Resource.from_contents(s)) for s in SCHEMAS)
MANIFESTS = sorted(INFRA.glob("*.yaml"))
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _kinds() -> dict[tuple[str, str], str]:
    """(apiVersion, kind) -> the URI of its schema, from each definition's x-kubernetes-group-version-kind."""
    kinds = {}
    for schema in SCHEMAS:
        for name, definition in schema["$defs"].items():
            for gvk in definition.get("x-kubernetes-group-version-kind", []):
                api_version = f"{gvk['group']}/{gvk['version']}" if gvk["group"] else gvk["version"]
                kinds[api_version, gvk["kind"]] = f"{schema['$id']}#/$defs/{name}"
    return kinds


KINDS = _kinds()


def schema_errors(doc: dict) -> list[str]:
    """Every violation of the vendored schema by the manifest `doc`, as 'path: message' (empty when valid).

    A kind/apiVersion with no vendored schema is itself an error, so nothing is skipped silently.
    """
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in KINDS:
        return [f"<root>: no vendored schema for apiVersion={key[0]!r} kind={key[1]!r} (have {sorted(KINDS)})"]
    validator = Draft202012Validator({"$ref": KINDS[key]}, registry=REGISTRY)
    out = []
    for err in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
        if err.context:  # oneOf/anyOf: name the closest branch's failure, not only "not valid under any"
            err = best_match(err.context)
        out.append(f"{'.'.join(map(str, err.absolute_path)) or '<root>'}: {err.message}")
    return out


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((INFRA / name).read_text()) if d]


def _gpus(group: dict) -> int:
    resources = group["template"]["spec"]["containers"][0].get("resources", {})
    lim, req = resources.get("limits", {}), resources.get("requests", {})
    assert lim.get("nvidia.com/gpu") == req.get("nvidia.com/gpu"), "GPU requests must equal limits"
    return int(lim.get("nvidia.com/gpu", 0))


def _check_b200(cluster: dict) -> None:
    assert cluster["rayVersion"] == "2.60.0"
    assert cluster["headGroupSpec"]["rayStartParams"].get("num-gpus") == "0"
    assert cluster["workerGroupSpecs"]
    for g in cluster["workerGroupSpecs"]:
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g["groupName"]
        assert _gpus(g) >= 1
        pod = g["template"]["spec"]
        assert pod["nodeSelector"].get("nvidia.com/gpu.product") == "NVIDIA-B200"
        assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"]), "/dev/shm"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_matches_the_vendored_schema(path):
    docs = _docs(path.name)
    assert docs
    for doc in docs:
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        assert schema_errors(doc) == [], name
        assert DNS_LABEL.match(doc["metadata"]["name"]), name
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "peagle", name


# (manifest, kind of the document, path to the mapping that holds the field, field, misspelling)
_MISSPELLED = [
    ("rayjob-pipeline-b200.yaml", "RayJob", ["spec", "rayClusterSpec"], "workerGroupSpecs", "workerGroupSpec"),
    ("rayjob-pipeline-b200.yaml", "RayJob", ["spec", "rayClusterSpec", "workerGroupSpecs", 0],
     "rayStartParams", "rayStartParam"),
    ("rayjob-pipeline-b200.yaml", "RayJob", ["spec"], "shutdownAfterJobFinishes", "shutdownAfterJobFinish"),
    ("rayservice-gpt-oss-20b-b200.yaml", "RayService", ["spec"], "serveConfigV2", "serveConfig"),
    ("rayservice-gpt-oss-20b-b200.yaml", "RayService",
     ["spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0], "resources", "resource"),
    ("rayservice-gpt-oss-20b-b200.yaml", "RayService",
     ["spec", "rayClusterConfig", "workerGroupSpecs", 0, "template", "spec"], "nodeSelector", "nodeselector"),
    ("mlflow.yaml", "Deployment", ["spec", "template", "spec", "containers", 0], "readinessProbe", "readinesProbe"),
    ("storage.yaml", "PersistentVolumeClaim", ["spec"], "accessModes", "accessMode"),
]


@pytest.mark.parametrize(("manifest", "kind", "where", "field", "typo"), _MISSPELLED,
                         ids=[f"{k}.{t}" for _, k, _, _, t in _MISSPELLED])
def test_misspelled_field_is_rejected(manifest, kind, where, field, typo):
    (doc,) = [d for d in _docs(manifest) if d["kind"] == kind]
    assert schema_errors(doc) == []
    parent = doc
    for key in where:
        parent = parent[key]
    parent[typo] = parent.pop(field)
    errors = schema_errors(doc)
    location = ".".join(map(str, where))
    assert f"{location}: Additional properties are not allowed ('{typo}' was unexpected)" in errors, errors


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda d: d.update(apiVersion="ray.io/v1alpha1"), "<root>: no vendored schema for apiVersion='ray.io/v1alpha1'"),
    (lambda d: d["spec"]["rayClusterSpec"].pop("headGroupSpec"),
     "spec.rayClusterSpec: 'headGroupSpec' is a required property"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(replicas="2"),
     "spec.rayClusterSpec.workerGroupSpecs.0.replicas: '2' is not of type 'integer'"),
    (lambda d: d["spec"]["rayClusterSpec"].update(autoscalerOptions={"upscalingMode": "Fast"}),
     "spec.rayClusterSpec.autoscalerOptions.upscalingMode: 'Fast' is not one of"),
    (lambda d: d["spec"].update(deletionStrategy={"onSuccess": {"policy": "DeleteCluster"}}),
     "spec.deletionStrategy: 'onFailure' is a required property"),
    (lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0].pop("name"),
     "spec.rayClusterSpec.headGroupSpec.template.spec.containers.0: 'name' is a required property"),
], ids=["apiVersion", "no-head", "replicas-type", "upscalingMode-enum", "deletionStrategy", "container-name"])
def test_broken_rayjob_is_rejected(edit, expected):
    (doc,) = _docs("rayjob-pipeline-b200.yaml")
    edit(doc)
    errors = schema_errors(doc)
    assert any(e.startswith(expected) for e in errors), errors


def _walk(node, path=()):
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from _walk(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, (*path, i))


def test_vendored_schemas_are_closed_resolvable_and_sourced():
    assert {s["$id"].rsplit(":", 1)[-1] for s in SCHEMAS} == {"k8s-v1.33.0-strict", "kuberay-v1"}
    k8s, kuberay = sorted(SCHEMAS, key=lambda s: s["$id"])
    assert k8s["x-source"]["package"] == "kubernetes-validate==1.37.0" and len(k8s["x-source"]["wheel_sha256"]) == 64
    assert re.fullmatch(r"[0-9a-f]{40}", kuberay["x-source"]["commit"])
    assert kuberay["x-source"]["kubernetes"] == k8s["x-source"]["kubernetes"]  # the k8s.io/api KubeRay builds with
    assert {("ray.io/v1", "RayJob"), ("ray.io/v1", "RayService")} <= KINDS.keys()
    for schema in SCHEMAS:
        resolver = REGISTRY.resolver(base_uri=schema["$id"])
        for path, node in _walk(schema["$defs"]):
            if "$ref" in node:
                resolver.lookup(node["$ref"])  # raises referencing.exceptions.Unresolvable if dangling
            if "properties" in node:  # every object that names its fields rejects any other field
                assert node.get("additionalProperties") is False, (schema["$id"], path)


def test_rayjob_runs_the_pipeline():
    (job,) = _docs("rayjob-pipeline-b200.yaml")
    spec = job["spec"]
    assert spec["entrypoint"] == "python -m ray_jobs.pipeline --config configs/gpt-oss-20b-b200.yaml"
    assert (ROOT / "configs" / "gpt-oss-20b-b200.yaml").is_file()
    assert spec["shutdownAfterJobFinishes"] is True
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert isinstance(runtime_env, dict), "runtimeEnvYAML must be a YAML mapping"
    assert runtime_env["env_vars"]["MLFLOW_TRACKING_URI"].startswith("http://mlflow.peagle.svc")
    _check_b200(spec["rayClusterSpec"])


def test_rayservice_serves_the_serve_yaml():
    (svc,) = _docs("rayservice-gpt-oss-20b-b200.yaml")
    serve_cfg = yaml.safe_load(svc["spec"]["serveConfigV2"])
    assert serve_cfg == yaml.safe_load((SERVE_CONFIGS / "gpt-oss-20b-b200.yaml").read_text())
    args = serve_cfg["applications"][0]["args"]
    assert args["accelerator_type"] == "B200" and args["tracking_uri"].startswith("http://mlflow.peagle.svc")
    cluster = svc["spec"]["rayClusterConfig"]
    _check_b200(cluster)
    gpus = sum(_gpus(g) * g["maxReplicas"] for g in cluster["workerGroupSpecs"])
    tp = args["engine_kwargs"].get("tensor_parallel_size", 1)
    assert gpus >= args["max_replicas"] * tp, "worker groups cannot host max_replicas LLM replicas"


def test_mlflow_server_with_database_and_object_store():
    objs = _docs("mlflow.yaml")
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert {("Deployment", "mlflow"), ("Service", "mlflow"), ("StatefulSet", "mlflow-postgres"),
            ("StatefulSet", "mlflow-minio")} <= kinds
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    cmd = " ".join(container.get("args", []))
    assert "postgresql://" in cmd and "--artifacts-destination s3://" in cmd and "--serve-artifacts" in cmd
    assert "3.17" in container["image"]
    services = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "Service"}
    for o in objs:  # every workload is reachable through a Service selecting its labels
        if o["kind"] in ("Deployment", "StatefulSet"):
            labels = o["spec"]["template"]["metadata"]["labels"]
            assert any(s["selector"].items() <= labels.items() for s in services.values()), o["metadata"]["name"]


@pytest.mark.parametrize("path", sorted(SERVE_CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_serve_yaml_args_validate(path):
    from pipelines.serve import ServeAppArgs

    cfg = yaml.safe_load(path.read_text())
    (app,) = cfg["applications"]
    assert app["import_path"] == "pipelines.serve:build_app"
    args = ServeAppArgs.model_validate(app["args"])
    assert args.max_ongoing_requests >= args.target_ongoing_requests  # Ray's 1e9 defaults overridden
    assert args.head is None or args.head.startswith("models:/")
