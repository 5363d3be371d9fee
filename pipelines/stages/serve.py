"""Stage ``serve``: deploy the champion head behind an OpenAI endpoint on Ray Serve LLM (``pipelines.serve``).

Rolls the Serve gateway ``settings.SERVE_APP_NAME`` to a backend app serving the head alias pinned to
its version (:func:`pipelines.serve.rollout.roll`: blue/green, the old backend keeps answering until the
new one does; no request fails), then sends one chat request as a smoke test; the apps stay up after
the job ends. Current when the gateway and a backend app are RUNNING with the version the alias points
at now. Key: serving section.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines import settings
from pipelines.preflight import Machine, Problem, Severity
from pipelines.stages.base import EngineSettings, RunContext, Stage, StageOutput
from pipelines.stages.register import RegisterOutput

log = logging.getLogger(__name__)


@dataclass
class ServeOutput(StageOutput):
    """The endpoint: ``url`` (``/v1`` OpenAI API), served ``model_id`` and pinned ``head`` reference."""

    url: str
    model_id: str
    head: str
    registered: str
    smoke_answer: str
    api_key_env: str | None = None

    def curl(self) -> str:
        """A copy-paste chat request against the endpoint."""
        from pipelines.serve.client import curl_line

        return curl_line(self.url, self.model_id, self.api_key_env)


def serve_app_args(recipe, engine: EngineSettings, *, tracking_uri: str | None, **overrides: Any):
    """The ``pipelines.serve.ServeAppArgs`` the serve stage deploys for ``recipe`` on engines ``engine``
    (:func:`pipelines.stages.base.engine_settings`): the serving section, the served model id (the target's
    basename), ``max_model_len`` (>= 1024, >= ``data.max_length_tokens``), the drafting engines' vLLM kwargs
    (:meth:`EngineSettings.drafting_engine_kwargs`, ``serving.engine_kwargs`` last), accelerator and
    Serve CPU reservations; ``overrides`` replace fields (``bench.serve_replicas``: ``head=None``, replicas)."""
    from pipelines.serve import ServeAppArgs

    return ServeAppArgs.from_recipe(
        recipe, tracking_uri=tracking_uri, model_id=Path(recipe.target.model.rstrip("/")).name,
        engine_kwargs=engine.drafting_engine_kwargs(max_model_len=max(1024, recipe.data.max_length_tokens)),
        accelerator=engine.accelerator, **engine.serve_resources | overrides)


class ServeStage(Stage):
    name = "serve"
    Output = ServeOutput

    @staticmethod
    def requirements(recipe) -> tuple[str, ...]:
        return ("vllm", "mlflow")  # Ray Serve LLM's engine; the head is pinned from the registry

    @staticmethod
    def num_gpus(recipe) -> tuple[int, str]:
        n = max(1, recipe.serving.min_replicas)
        return (n, f"one per vLLM replica (accelerator gpu), serving.min_replicas={recipe.serving.min_replicas}") \
            if recipe.training.use_gpu else (0, "")

    @classmethod
    def preflight(cls, recipe, machine: Machine) -> list[Problem]:
        """Also: the API key variable ``serving.api_key_env`` names is set (the endpoint refuses to start
        without it, after every earlier stage ran)."""
        problems = super().preflight(recipe, machine)
        env = recipe.serving.api_key_env
        if env and not machine.has_env(env):
            problems.append(cls.problem(Severity.MACHINE, f"serving.api_key_env={env!r} but ${env} is not set on this "
                                        "machine: export it, or set serving.api_key_env: null for an open endpoint",
                                        "serving.api_key_env"))
        return problems

    @staticmethod
    def sections(recipe):
        return (recipe.serving,)

    @classmethod
    def before_other_stage_runs(cls, ctx: RunContext, name: str) -> None:
        """A compute stage on a CPU cluster: delete the endpoint unless the cluster has CPUs free beside it
        (:func:`pipelines.serve.rollout.delete_apps_on_cpu`). Serve replaces its own app: nothing to free."""
        if not ctx.engine.use_gpu:
            from pipelines.serve.rollout import delete_apps_on_cpu

            delete_apps_on_cpu(ctx.say)

    def run(self) -> ServeOutput:
        from pipelines.registry.refs import HeadRef
        from pipelines.serve import resolve_k_schedule
        from pipelines.serve.client import chat_once
        from pipelines.serve.heads import PIN_FIX
        from pipelines.serve.rollout import ray_serve, roll

        serve = ray_serve()

        s = self.recipe.serving
        registered = self.ctx.upstream(RegisterOutput).version
        args = serve_app_args(self.recipe, self.ctx.engine, tracking_uri=self.ctx.tracking_uri)
        serve.start(http_options={"host": s.host, "port": s.port})
        rolled = roll(args)
        if rolled.changed:
            self.ctx.say(f"Serve: {settings.SERVE_APP_NAME} -> backend {rolled.backend}" + (
                f" (replaced {rolled.previous})" if rolled.previous else "") + f" in {rolled.seconds:.0f}s")
        url = f"http://{s.host}:{s.port}"
        answer = chat_once(url, args.resolved_model_id(), api_key_env=s.api_key_env)
        served = rolled.served["head"]  # the version roll pinned (the alias may have moved since)
        schedule = resolve_k_schedule(args, HeadRef.parse(served).resolve(self.ctx.tracking_uri, fix=PIN_FIX))
        K = f"K={s.num_speculative_tokens}" if schedule is None else f"K schedule {schedule}" + (
            "" if any(k for _, _, k in schedule) else ": no speculation")
        self.ctx.say(f"{url} serves {args.resolved_model_id()} + {served} ({K}); smoke answer: {answer!r}")
        return ServeOutput(url=url, model_id=args.resolved_model_id(), head=served, registered=registered,
                           smoke_answer=answer, api_key_env=s.api_key_env)

    def is_valid(self, out: ServeOutput) -> bool:
        from pipelines.registry.refs import HeadRef
        from pipelines.serve.heads import pin_head_ref
        from pipelines.serve.rollout import RUNNING, app_statuses, backend_apps, ray_serve

        ray_serve()
        statuses = app_statuses()
        current = pin_head_ref(str(HeadRef(self.ctx.model_name, alias=self.recipe.serving.head_alias)),
                               self.ctx.tracking_uri)
        return (statuses.get(settings.SERVE_APP_NAME) == RUNNING and out.head == current
                and any(statuses[b] == RUNNING for b in backend_apps(statuses)))

    def summary(self, out: ServeOutput) -> tuple[str, dict[str, Any]]:
        return "endpoint", {"url": out.url, "model_id": out.model_id, "head": out.head, "curl": out.curl()}
