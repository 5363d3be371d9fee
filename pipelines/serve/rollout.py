"""Blue/green rollout of the served head: the endpoint moves to a new head with no failed request.

Apps on the Serve cluster::

    peagle (settings.SERVE_APP_NAME, route "/")       the gateway: RequestGuard [+ traffic log] + OpenAI
                                                      ingress (pipelines.serve.gateway.PeagleIngress)
        -- handle --> peagle-backend-v3-1a2b3c4d      one backend: the LLMServer deployment, no route
                      (settings.serve_backend_app_name)

:func:`roll` to a new head (one resolved :class:`pipelines.serve.Backend`):

1. deploy the new backend app beside the old one (two vLLM replicas for a while);
2. wait until it is RUNNING and answers one chat request through its own handle (else: delete it, keep
   the old one, raise :class:`RolloutError`);
3. switch the gateway to it in place: the same gateway deployment ``version`` and ``runtime_env`` with a new
   ``user_config`` (:class:`pipelines.serve.gateway.Route`), which Ray Serve applies by calling ``reconfigure``
   on the running gateway replica (no restart); wait until the gateway reports it. The ``runtime_env`` is the
   one the running gateway was deployed with (:func:`gateway_runtime_env`): Serve gives a deployment without
   one the ``runtime_env`` of the job that deploys it, and that is part of a replica's identity, so a roll
   from another Ray job (another working_dir package) would restart the gateway (a 4x H200 roll did: ~26 s
   with no gateway replica, requests waiting; ``bench/results/serve_autoscale_run4.json``);
4. wait until the gateway has no request in flight on the old backend (streams included), then delete the
   old backend app.

First deployment (no gateway app): the gateway starts with no route beside the backend (its replica's start,
~20 s on 2 cores, overlaps the backend's), then takes the route in place as in step 3; a backend that fails
then takes the new gateway with it. The same backend already active: nothing is done.
A gateway whose own settings (:data:`pipelines.serve.GATEWAY_FIELDS`, model id, code) changed is
redeployed with a restart -- a short outage, as with any Serve rolling update of a single replica.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipelines import settings

log = logging.getLogger(__name__)

RUNNING = "RUNNING"
FAILED = ("DEPLOY_FAILED", "UNHEALTHY")


class RolloutError(RuntimeError):
    """The new backend did not become healthy; the gateway still serves the previous one."""


@dataclass
class RollResult:
    """``backend``: the app serving now; ``previous``: the backend app it replaced (deleted), None on a first
    deployment; ``changed``: False when that backend was already active; ``served``: its head description;
    ``seconds``: wall time of the roll; ``drained``: False when old requests were still in flight at the
    drain timeout (deleted anyway: Serve's graceful shutdown of the old replica let them finish or cut them)."""

    backend: str
    previous: str | None
    changed: bool
    served: dict[str, Any]
    seconds: float
    drained: bool = True


def app_statuses() -> dict[str, str]:
    """``{app name: status}`` of the Serve cluster (``RUNNING``, ``DEPLOYING``, ``DEPLOY_FAILED``, ...)."""
    from ray import serve

    return {name: str(getattr(app.status, "value", app.status)).split(".")[-1]
            for name, app in serve.status().applications.items()}


def backend_apps(statuses: dict[str, str] | None = None) -> list[str]:
    """Names of the backend apps on the cluster (``settings.SERVE_BACKEND_PREFIX``)."""
    return sorted(n for n in (statuses if statuses is not None else app_statuses())
                  if n.startswith(settings.SERVE_BACKEND_PREFIX))


def gateway_state() -> dict[str, Any] | None:
    """The gateway replica's ``{"backend", "in_flight", "version"}`` (:meth:`PeagleIngress.gateway_state`), or None when
    there is no gateway app, or the app ``SERVE_APP_NAME`` is not a gateway (a ``build_app`` single app)."""
    from ray import serve

    if settings.SERVE_APP_NAME not in app_statuses():
        return None
    try:
        return serve.get_app_handle(settings.SERVE_APP_NAME).gateway_state.remote().result(timeout_s=60)
    except Exception as e:  # noqa: BLE001 - not a gateway (no such method) or not running: no active backend
        log.debug("no gateway state: %s", e)
        return None


def roll(args, *, ready_timeout_s: float = 900.0, drain_timeout_s: float = 600.0, poll_s: float = 1.0) -> RollResult:
    """Make the gateway ``settings.SERVE_APP_NAME`` serve ``args`` (a ``ServeAppArgs``), blue/green.

    Serve must be started (``serve.start(http_options=...)``). The model id must not change across rolls
    of one gateway (it is part of the gateway's version: a new id restarts the gateway).

    Raises:
        pydantic.ValidationError / ValueError / HeadContractError: from
            :func:`pipelines.serve.resolve_backend`, before anything is deployed.
        RolloutError: the new backend failed, or was not RUNNING and answering within ``ready_timeout_s``;
            it is deleted and the gateway keeps its previous backend.
    """
    from pipelines.serve import gateway_version, resolve_backend

    t0 = time.monotonic()
    backend = resolve_backend(args)
    name = backend.app_name
    state = gateway_state()
    previous = state["backend"] if state else None
    same_code = state is not None and state["version"] == gateway_version(backend.args, backend.model_id)
    statuses = app_statuses()
    if previous == name and statuses.get(name) == RUNNING and same_code:
        log.info("peagle serve: %s already serves %s", settings.SERVE_APP_NAME, name)
        return RollResult(backend=name, previous=None, changed=False, served=backend.served,
                          seconds=time.monotonic() - t0)
    runtime_env = (gateway_runtime_env() if same_code else None) or job_runtime_env()
    first = settings.SERVE_APP_NAME not in statuses
    if first:  # the gateway's replica starts while the backend's does; the route follows in place
        _deploy_gateway(backend, route={}, runtime_env=runtime_env, wait=False)
    try:
        deployment = _deploy_backend(backend, ready_timeout_s=ready_timeout_s, poll_s=poll_s)
    except RolloutError:
        if first:
            log.warning("peagle serve: deleting the gateway app %s started beside it", settings.SERVE_APP_NAME)
            ray_serve().delete(settings.SERVE_APP_NAME)
        raise
    _route_gateway(backend, deployment, runtime_env=runtime_env, timeout_s=ready_timeout_s, poll_s=poll_s)
    drained = True
    stale = [n for n in backend_apps() if n != name]  # the old backend, and any a failed run left behind
    if previous in stale:
        drained = _drain(previous, timeout_s=drain_timeout_s, poll_s=poll_s)
    for old in stale:
        log.info("peagle serve: deleting the old backend app %s", old)
        ray_serve().delete(old)
    seconds = time.monotonic() - t0
    log.info("peagle serve: %s now serves %s (was %s) after %.1fs", settings.SERVE_APP_NAME, name, previous, seconds)
    return RollResult(backend=name, previous=previous if previous in stale else None, changed=True,
                      served=backend.served, seconds=seconds, drained=drained)


def ray_serve():
    """``ray.serve``, its logger kept quiet (importing it sets the logger to INFO)."""
    from ray import serve

    from pipelines.console import quiet_loggers

    quiet_loggers()
    return serve


def delete_apps_on_cpu(say: Callable[[str], None]) -> None:
    """Before a compute stage on a CPU cluster: delete the running endpoint (gateway and backend apps) unless
    the cluster has :func:`pipelines.settings.local_num_cpus` CPUs free beside it, what a CPU stage may
    reserve. A demo endpoint holds ~2 CPUs of a laptop cluster (2x the cores, logical); a cluster started
    with more (``peagle ray start --num-cpus``) keeps serving through a refresh run. ``say``s which it did."""
    try:
        serve = ray_serve()
        import ray

        statuses = app_statuses()
        apps = [a for a in (settings.SERVE_APP_NAME,) if a in statuses] + backend_apps(statuses)
    except Exception as e:  # noqa: BLE001 - no Serve controller is fine
        log.debug("no Serve app to delete: %s", e)
        return
    if not apps:
        return
    free, need = ray.available_resources().get("CPU", 0.0), settings.local_num_cpus()
    if free >= need:
        say(f"keeping the Serve apps {apps} up: {free:g} CPUs free beside them (a CPU stage reserves <= {need})")
        return
    for app in apps:
        say(f"deleting the running Serve app {app!r} to free CPUs for compute stages ({free:g} free, a CPU "
            f"stage reserves <= {need}; start Ray with more logical CPUs to keep it serving)")
        serve.delete(app)


def _deploy_backend(backend, *, ready_timeout_s: float, poll_s: float) -> str:
    """Deploy ``backend`` as its own app (no route) unless it is there; return its deployment name once it
    is RUNNING and answered one chat request through its handle.

    Raises:
        RolloutError: failed or timed out (the app is deleted).
    """
    from ray.serve.llm import build_llm_deployment

    serve, name = ray_serve(), backend.app_name
    if name not in app_statuses():
        _warn_shared_host_raylets(backend)
        log.info("peagle serve: deploying the backend app %s (head %s)", name, backend.head_ref)
        serve.run_many([serve.RunTarget(build_llm_deployment(backend.llm_config), name=name, route_prefix=None)],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    deadline, status, why = time.monotonic() + ready_timeout_s, None, None
    while time.monotonic() < deadline:
        status = app_statuses().get(name)
        if status in FAILED:
            app = serve.status().applications[name]
            why = f"status {status}: " + "; ".join(
                [app.message] + [f"{d}: {st.message}" for d, st in app.deployments.items() if st.message])[-3000:]
            break
        if status == RUNNING:
            handle = serve.get_app_handle(name)
            try:
                _probe(handle, backend.model_id)
                return handle.deployment_name
            except Exception as e:  # noqa: BLE001 - a replica that cannot answer yet: wait, then give up
                why = f"RUNNING but the probe request failed: {e!r}"[:2000]
        time.sleep(poll_s)
    else:
        why = why or f"not RUNNING after {ready_timeout_s:.0f}s (status {status})"
    log.warning("peagle serve: the new backend %s is not healthy (%s): deleting it", name, why)
    try:
        serve.delete(name)
    except Exception as e:  # noqa: BLE001 - report the rollout failure, not the cleanup's
        log.warning("peagle serve: could not delete %s: %s", name, e)
    raise RolloutError(f"backend {name} (head {backend.head_ref}) did not become healthy: {why}; "
                       f"{settings.SERVE_APP_NAME} still serves its previous backend")


def _warn_shared_host_raylets(backend) -> None:
    """Warn, before a GPU backend deploys, about hosts with several Ray nodes (``shared_host_raylets``): the
    replicas Serve places on a node of such a host other than its first will fail in vLLM's Ray executor."""
    if backend.args.accelerator != "gpu":
        return
    import ray

    from pipelines.serve import shared_host_raylets

    for ip, names in shared_host_raylets(ray.nodes()).items():
        log.warning("peagle serve: host %s runs %d Ray nodes with GPUs (%s): a GPU replica placed on a node other "
                    "than %s will fail to start (vLLM's engine core joins the raylet of %s); run one Ray node per "
                    "host to serve from all of its GPUs", ip, len(names), ", ".join(names), names[0], names[0])


def _probe(handle, model_id: str) -> None:
    """One greedy 1-token chat request through an ``LLMServer`` handle.

    Raises:
        RuntimeError: the answer is an error or has no choice.
    """
    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, ErrorResponse

    request = ChatCompletionRequest(model=model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                    temperature=0, stream=False)
    answers = list(handle.options(stream=True).chat.remote(request, None))
    first = answers[0] if answers else None
    first = first[0] if isinstance(first, list) and first else first
    if first is None or isinstance(first, ErrorResponse) or not getattr(first, "choices", None):
        raise RuntimeError(f"probe answer: {str(first)[:500]}")


def job_runtime_env() -> dict[str, Any]:
    """The ``runtime_env`` Serve would give a deployment of this job (the job's own), with a ``working_dir``
    key even when it has none (None): Serve fills a missing ``working_dir`` of an explicit ``runtime_env``
    from the deploying job's, so without the key a later roll from a job with a working_dir would change
    the gateway's ``runtime_env`` (and restart it)."""
    import ray

    return {"working_dir": None} | dict(ray.get_runtime_context().runtime_env)


def gateway_runtime_env() -> dict[str, Any] | None:
    """The ``runtime_env`` of the running gateway deployment's replicas as Serve stored it (from
    :func:`job_runtime_env` of the job that deployed it), or None when there is no gateway app or none was
    stored. Read from Serve's controller (``get_serve_details``, the data of ``serve status``)."""
    from ray.serve.context import _get_global_client

    try:
        app = _get_global_client().get_serve_details()["applications"].get(settings.SERVE_APP_NAME) or {}
        (deployment,) = app.get("deployments", {}).values()  # a gateway app holds only its ingress
        return deployment["deployment_config"]["ray_actor_options"].get("runtime_env") or None
    except Exception as e:  # noqa: BLE001 - no gateway, or details Serve no longer gives: Serve's default then
        log.debug("no gateway runtime_env: %s", e)
        return None


def _route_gateway(backend, deployment: str, *, runtime_env: dict[str, Any] | None, timeout_s: float,
                   poll_s: float) -> None:
    """Deploy the gateway with the route to ``backend`` (in place when its version and ``runtime_env`` are
    those of the running gateway; None = the deploying job's, Serve's default) and wait until it reports that
    backend.

    Raises:
        RolloutError: the gateway did not take the route within ``timeout_s``.
    """
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata

    from pipelines.serve.gateway import Route

    route = Route(app=backend.app_name, deployment=deployment,
                  model_card=to_model_metadata(backend.model_id, backend.llm_config).model_dump(mode="json"),
                  served=backend.served)
    _deploy_gateway(backend, route=route.model_dump(), runtime_env=runtime_env, wait=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = gateway_state()
        if state and state["backend"] == backend.app_name:
            return
        time.sleep(poll_s)
    raise RolloutError(f"{settings.SERVE_APP_NAME} did not switch to {backend.app_name} within {timeout_s:.0f}s")


def _deploy_gateway(backend, *, route: dict[str, Any], runtime_env: dict[str, Any] | None, wait: bool) -> None:
    """Deploy the gateway app with ``route`` (``{}``: none yet) under its fixed version; with ``wait``, return once
    the app is RUNNING."""
    from pipelines.serve import build_ingress

    serve = ray_serve()
    ingress = build_ingress(backend, route=route, runtime_env=runtime_env)
    serve.run_many([serve.RunTarget(ingress, name=settings.SERVE_APP_NAME, route_prefix="/")],
                   wait_for_ingress_deployment_creation=wait, wait_for_applications_running=wait)


def _drain(app: str, *, timeout_s: float, poll_s: float) -> bool:
    """Wait until the gateway has no request in flight on ``app`` (3 reads in a row: each read reaches one
    gateway replica). Returns False at the timeout."""
    deadline, zeros = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        state = gateway_state() or {"in_flight": {}}
        n = state["in_flight"].get(app, 0)
        zeros = zeros + 1 if n == 0 else 0
        if zeros >= 3:
            return True
        if n:
            log.info("peagle serve: %d request(s) still in flight on %s", n, app)
        time.sleep(poll_s)
    log.warning("peagle serve: requests still in flight on %s after %.0fs: deleting it anyway", app, timeout_s)
    return False


__all__ = ["RollResult", "RolloutError", "app_statuses", "backend_apps", "gateway_runtime_env", "gateway_state",
           "job_runtime_env", "roll"]
