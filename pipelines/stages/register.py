"""Stage ``register``: log the run to MLflow, register the head, run the promotion gate (``pipelines.registry.register``,
``pipelines.registry.promotion``).

One MLflow run per pipeline run (experiment ``peagle``: resolved recipe, training curves, eval
table, stage timings, data-manifest hash); the head becomes a new model version (alias
``challenger``) tagged with this stage's key, and the gate moves ``champion`` only when its AL at
``registry.gate_num_speculative_tokens`` on the gate eval set (``RegistryConfig.resolved_gate_eval_set``)
beats the champion's. When the evaluate stage measured the champion beside the trained head
(``evaluation.compare_champion``), that same-run AL is the champion's
(``pipelines.registry.promotion.MeasuredChampion``), not the AL tagged on it when it was registered (maybe on
another set, with other engine settings); the decision's reason names both ALs. The version also
carries the evaluate stage's K schedule (tag ``pipelines.evaluate.k_schedule.K_SCHEDULE_TAG``, JSON), which
Serve passes to vLLM. Key: registry section (``gate_eval_set`` only when set).

Re-runs and outages (issue 15): before logging anything the stage looks up the version and run tagged
with its key (``pipelines.registry.register.find_registered``) and reuses them, and re-reads the gate's recorded
decision instead of deciding again, so an interrupted register (version created, ``stage.json`` never
written) re-run still leaves exactly one version. With an ``http(s)://`` store that does not answer, it
fails in seconds with one line naming the URI (``pipelines.registry.register.tracking_guard``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipelines.preflight import Machine, Problem, Severity
from pipelines.stages.base import Stage, StageOutput
from pipelines.stages.capture import CaptureOutput
from pipelines.stages.evaluate import EvaluateOutput
from pipelines.stages.train import TrainOutput

# the end of the stage's error line when the tracking server is down (pipelines.registry.register.tracking_guard)
RERUN_HINT = ("start it (or point registry.tracking_uri / $MLFLOW_TRACKING_URI at a live one) and re-run the "
              "register stage: it reuses the version and run this stage key already has (tag peagle.pipeline_key), "
              "so a re-run registers nothing twice; earlier stages' outputs are kept")


@dataclass
class RegisterOutput(StageOutput):
    """The registered version and the gate's decision."""

    model_name: str
    version: str
    run_id: str
    tracking_uri: str
    promoted: bool
    reason: str
    champion_version: str | None = None


class RegisterStage(Stage):
    name = "register"
    Output = RegisterOutput

    @staticmethod
    def requirements(recipe) -> tuple[str, ...]:
        return ("mlflow",)

    @classmethod
    def preflight(cls, recipe, machine: Machine) -> list[Problem]:
        """Also: the gate's K is measured, the gate's eval set is one of the recipe's."""
        problems = super().preflight(recipe, machine)
        gate_K, sweep = recipe.registry.gate_num_speculative_tokens, recipe.evaluation.num_speculative_tokens_sweep
        if gate_K not in sweep:
            problems.append(cls.problem(
                Severity.INVALID, f"registry.gate_num_speculative_tokens={gate_K} is not in evaluation."
                f"num_speculative_tokens_sweep={sweep}: the gate compares ALs measured at its K; add it to the sweep",
                "registry.gate_num_speculative_tokens"))
        try:
            recipe.registry.resolved_gate_eval_set(recipe.evaluation)
        except ValueError as e:  # not an eval set of the recipe
            problems.append(cls.problem(Severity.INVALID, str(e), "registry.gate_eval_set"))
        return problems

    @staticmethod
    def sections(recipe):
        return (recipe.registry,)

    def run(self) -> RegisterOutput:
        from pipelines.assets import resolve_target
        from pipelines.evaluate.k_schedule import K_SCHEDULE_TAG, schedule_or_none, schedule_to_tag
        from pipelines.registry import register as reg
        from pipelines.registry.promotion import maybe_promote, recorded_decision

        r, uri, name = self.recipe, self.ctx.tracking_uri, self.ctx.model_name
        train, ev = self.ctx.upstream(TrainOutput), self.ctx.upstream(EvaluateOutput)
        method, gate_K = r.training.method, r.registry.gate_num_speculative_tokens
        gate_set = r.registry.resolved_gate_eval_set(r.evaluation)
        if gate_set != ev.eval_set:  # the evaluate key covers the gate set: only a hand-edited record gets here
            raise ValueError(f"the evaluate stage's gate set is {ev.eval_set!r}, the recipe's {gate_set!r}; re-run "
                             "evaluate (peagle run --stage evaluate --force)")
        # the gate compares ALs on one eval set: the gate set's rows only (best_K is the gate set's too)
        al_by_K = ev.al_by_K(method, min(r.evaluation.concurrency_sweep), eval_set=ev.eval_set)
        measured = ev.measured_champion(gate_K=gate_K, concurrency=min(r.evaluation.concurrency_sweep))
        # records written before evaluate stored the schedule: the same function on the same gate-set rows
        schedule = ev.k_schedule if ev.k_schedule is not None else schedule_or_none(ev.set_rows(), method)
        schedule_tag = {K_SCHEDULE_TAG: schedule_to_tag(schedule)} if schedule is not None else {}
        key = self.ctx.key(self.name)
        with reg.tracking_guard(uri, hint=RERUN_HINT):
            # an earlier run of this key may have registered this head (or logged its run) before it was
            # interrupted: reuse them (a head retrained under the same key, --force, is a new version)
            found = reg.find_registered(name, key, head_sha=reg.head_sha256(train.head_dir), tracking_uri=uri)
            if found.version is None:
                run_id = self._log_run(train, ev, run_id=found.run_id)
                mv = reg.register_head(
                    train.head_dir, model_name=name, eval_al=al_by_K[gate_K], K=gate_K, eval_set=ev.eval_set,
                    run_id=run_id, al_by_K=al_by_K,
                    K_best={int(c): int(k) for c, k in (ev.best_K or {}).get(method, {}).items()},
                    target=r.target.model, target_config=resolve_target(r.target)[1],
                    parallel_drafting=method == "peagle",
                    tags={reg.PIPELINE_KEY_TAG: key, "peagle.recipe": r.name, **schedule_tag}, tracking_uri=uri)
            else:
                mv, run_id = found.version, found.run_id
                self.ctx.say(f"{name} v{mv.version} was registered for this stage key by an earlier, interrupted "
                             "run: reusing it (nothing registered twice)")
            decision = (recorded_decision(name, mv.version, K=gate_K, tracking_uri=uri)
                        or maybe_promote(name, mv.version, K=gate_K, promote_margin=r.registry.promote_margin,
                                         eval_set=ev.eval_set, measured=measured, tracking_uri=uri))
            reg.get_client(uri).set_terminated(run_id)
        self.ctx.say(f"{name} v{mv.version} (AL {al_by_K[gate_K]:.3f} at K={gate_K} on {ev.eval_set}; K schedule "
                     f"{schedule_tag.get(K_SCHEDULE_TAG, 'none')}); gate: {decision.reason}")
        return RegisterOutput(model_name=name, version=str(mv.version), run_id=run_id, tracking_uri=uri,
                              promoted=decision.promoted, reason=decision.reason,
                              champion_version=decision.champion_version)

    def _log_run(self, train: TrainOutput, ev: EvaluateOutput, run_id: str | None = None) -> str:
        """The pipeline's MLflow run: recipe, curves, eval table, data manifest, stage timings (``run_id``:
        continue the run an interrupted register of this key left)."""
        from pipelines.registry import register as reg
        from pipelines.registry.runs import log_metrics_now

        r, uri = self.recipe, self.ctx.tracking_uri
        champion = {f"peagle.champion_{k}": str(ev.champion.get(k) or "") for k in ("version", "head_sha256")
                    } if ev.champion is not None else {}
        # every set's rows as metrics: the gate set's as eval.<method>..., the others' as eval.<set>.<method>...
        # (the champion's rows: method "champion", e.g. eval.champion.K5.c1.acceptance_length)
        run_id = reg.log_run(
            config=r, training_curves=train.history or [], eval_table=ev.rows, gate_eval_set=ev.eval_set,
            data_manifest=self.ctx.upstream(CaptureOutput).manifest(),
            artifacts={"evaluate": str(self.ctx.stage_dir("evaluate"))}, run_name=r.name, run_id=run_id,
            tags={"peagle.recipe": r.name, "peagle.pipeline_key": self.ctx.key(self.name),
                  "peagle.train_mlflow_run": str(train.mlflow_run_id or ""), **champion},
            tracking_uri=uri)
        log_metrics_now(run_id, {f"stage_seconds.{n}": rec.seconds for n, rec in self.ctx.records.items()
                                     if rec.status == "ran"}, tracking_uri=uri)
        return run_id

    def is_valid(self, out: RegisterOutput) -> bool:
        from pipelines.registry import register as reg

        with reg.tracking_guard(out.tracking_uri, hint=RERUN_HINT):  # fails in seconds, not minutes of retries
            mv = reg.get_client(out.tracking_uri).get_model_version(out.model_name, out.version)
        return (mv.tags or {}).get(reg.PIPELINE_KEY_TAG) == self.ctx.key(self.name)

    def summary(self, out: RegisterOutput) -> tuple[str, dict[str, Any]]:
        return "mlflow", {"tracking_uri": out.tracking_uri, "run_id": out.run_id, "model_name": out.model_name,
                          "version": out.version, "promoted": out.promoted, "champion_version": out.champion_version,
                          "reason": out.reason}
