"""The main job: run the stages of one recipe, prompts → served P-EAGLE head.

::

    prompts ─► regenerate ─► capture ─► train ─► evaluate ─► register ─► serve
    (datasets)  (Ray Data     (Ray Data   (Ray     (vLLM:     (MLflow:    (Ray Serve LLM,
                 + vLLM)       actors)     Train)   AL, tok/s) version,    parallel drafting)
                                                                gate)

The stages are objects (``pipelines/stages/``: recipe sections, run, validity check, typed output; each a
thin wiring of its package, e.g. ``pipelines.stages.train`` of ``pipelines/train/``); :class:`PipelineRun`
only orders them, keys them, skips the current ones and summarizes. Everything
lives under one run directory (default ``$PEAGLE_HOME/runs/<recipe.name>``)::

    regenerate/conversations.jsonl   capture/<key>/ (shards + manifest.parquet)   train/head/
    ray_results/ (Ray Train checkpoints)   evaluate/table.json   <stage>/stage.json   summary.json

Skipping: every stage has a *key* = sha256 of the recipe sections it reads plus its upstream
stage's key. A stage is skipped when its ``stage.json`` holds the same key and its outputs are still
valid (regenerated rows, a capture manifest, an exported head that validates, an eval table, a
registered model version tagged with the key, a RUNNING Serve app of the same version); ``force``
re-runs it. Interrupted work resumes inside the stage: capture keeps verified shards, Ray Train
resumes from the latest checkpoint of the same run name (the train key).

Streaming (``capture.streaming: true``): no capture stage on disk; the trainer consumes
``pipelines.capture.capture_stream`` directly (the target forward runs again each epoch). The
summary reports the bytes written under the run directory by capture+train (checkpoints and the
head only) next to what the materialized capture would have written.

Shape legend: not applicable (orchestration only; tensors live in the stage modules).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from peagle_core.atomic import atomic_write_text
from pipelines import settings
from pipelines.placement import Placement, PlacementProbe
from pipelines.preflight import Machine, Problem, Severity, raise_for_errors
from pipelines.stages.base import (
    STAGE_FILE,
    Stage,
    StageOutput,
    StageRecord,
    engine_settings,
    read_json,
    stage_key,
    write_json,
)
from pipelines.stages.capture import CaptureStage
from pipelines.stages.evaluate import EvaluateStage
from pipelines.stages.regenerate import RegenerateStage
from pipelines.stages.register import RegisterStage
from pipelines.stages.serve import ServeStage
from pipelines.stages.train import TrainStage

if TYPE_CHECKING:
    from rich.console import Console

    from pipelines.recipe import Recipe

log = logging.getLogger("peagle.pipeline")
O = TypeVar("O", bound=StageOutput)

# The stages in pipeline order: one ``Stage`` subclass each, wiring its package (``pipelines/stages/``).
STAGE_TYPES: tuple[type[Stage], ...] = (RegenerateStage, CaptureStage, TrainStage, EvaluateStage, RegisterStage,
                                        ServeStage)
STAGES: tuple[str, ...] = tuple(s.name for s in STAGE_TYPES)


# ---------------------------------------------------------------------------------------------- pre-flight


def preflight(recipe: Recipe, stages: Iterable[str] | None = None, machine: Machine | None = None) -> list[Problem]:
    """Every problem of ``recipe`` on ``machine`` (default :meth:`Machine.probe`), in pipeline order: the
    ``INVALID`` and ``NOT_RUN`` ones of every stage (a stage not selected still needs valid settings, and one
    that cannot run here blocks the ones after it) and the ``MACHINE`` ones of the stages that will run here:
    selected (``stages``, default all) and not blocked (:func:`not_runnable`). Nothing is started or downloaded.
    The severities are :mod:`pipelines.preflight`'s.

    Raises:
        ValueError: an unknown stage name.
    """
    selected = set(STAGES if stages is None else stages)
    unknown = selected - set(STAGES)
    if unknown:
        raise ValueError(f"unknown stage(s) {sorted(unknown)}; stages are {list(STAGES)}")
    machine = machine or Machine.probe()
    problems = [p for t in STAGE_TYPES for p in t.preflight(recipe, machine)]
    skipped = not_runnable(problems)
    return [p for p in problems if p.severity is not Severity.MACHINE or (p.stage in selected and p.stage not in skipped)]


def not_runnable(problems: Iterable[Problem]) -> dict[str, str]:
    """``{stage: reason}`` for the stages with a ``NOT_RUN`` problem and every stage after the first of them
    (each needs its upstream's outputs), in pipeline order."""
    reasons: dict[str, list[str]] = {}
    for p in problems:
        if p.severity is Severity.NOT_RUN:
            reasons.setdefault(p.stage, []).append(p.message)
    out: dict[str, str] = {}
    blocked: str | None = None
    for name in STAGES:
        if name in reasons:
            out[name] = "; ".join(reasons[name])
            blocked = blocked or name
        elif blocked is not None:
            out[name] = f"needs the outputs of {blocked}, which cannot run here"
    return out


class PipelineRun:
    """One pipeline run over ``recipe`` in ``run_dir`` (the :class:`~pipelines.stages.base.RunContext`
    its stages see).

    Args:
        recipe: the validated recipe (``pipelines.recipe.load_recipe``).
        run_dir: default ``$PEAGLE_HOME/runs/<recipe.name>``.
        force: stage names to re-run even when their outputs are current (or True = all).
        stages: the stages to run, in pipeline order (default all). A stage whose upstream output
            is missing raises ValueError naming the stage to run first.
        say: where a stage's one-line messages go (default ``print``).
        verbose: stages may say more (the full eval table).
        machine: what the machine the job runs on has (default ``pipelines.preflight.Machine.probe()``).

    The pre-flight (:func:`preflight`) runs first, before Ray starts: recipe settings
    invalid anywhere (gate K not evaluated, the trained method not evaluated, ...) and choices this machine
    cannot honour in a selected stage (``regenerate.backend: vllm`` without vLLM, ``training.use_gpu: true``
    without the GPUs, a missing source file, ...) raise. A stage that needs a package this machine lacks
    (evaluate and serve without vLLM, the registry stages without MLflow, e.g. on a GPU box that only
    trains) is not run, nor are the stages after it; the run says so before any compute, runs the others
    and records them as ``not run`` with the reason in the summary (:attr:`not_run`).

    Raises:
        ValueError: an unknown stage name, or every problem of the pre-flight that is an error (each
            naming the stage, the recipe field and the fix), before any compute.
    """

    def __init__(self, recipe: Recipe, *, run_dir: str | os.PathLike | None = None,
                 force: bool | Iterable[str] = False, stages: Iterable[str] = STAGES,
                 say: Callable[[str], None] = print, verbose: bool = False, machine: Machine | None = None) -> None:
        stages = list(stages)
        problems = preflight(recipe, stages, machine)  # ValueError: an unknown stage name
        raise_for_errors(problems, recipe.name)
        self.recipe = recipe
        self.run_dir = Path(run_dir) if run_dir else settings.run_dir(recipe.name)
        self.stages = [s for s in STAGES if s in set(stages)]
        self.force = set(STAGES) if force is True else set(force or ())
        self.records: dict[str, StageRecord] = {}
        self.verbose = verbose
        self._say = say
        self.tracking_uri = recipe.registry.resolved_tracking_uri()
        self.model_name = recipe.registry.resolved_model_name(recipe.target)
        self.engine = engine_settings(recipe)
        self.not_run = not_runnable(problems)
        self._stages: dict[str, Stage] = {t.name: t(self) for t in STAGE_TYPES if t.name not in self.not_run}
        self._current: str | None = None

    # ------------------------------------------------------------------------------------------ context

    def say(self, message: str) -> None:
        """One line of a stage's progress, prefixed ``[stage]``."""
        self._say(f"[{self._current}] {message}" if self._current else message)

    def key(self, name: str) -> str:
        """Stage ``name``'s key: its recipe sections + the key of the stage before it."""
        i = STAGES.index(name)
        upstream = self.key(STAGES[i - 1]) if i > 0 else ""
        return stage_key(name, upstream, self._stages[name].sections(self.recipe))

    def stage_dir(self, name: str) -> Path:
        return self.run_dir / name

    def upstream(self, output_type: type[O]) -> O:
        """The output of the stage that produces ``output_type``, from this run or an earlier one
        with the same key.

        Raises:
            ValueError: that stage has not run with the current recipe (names the command to run).
        """
        name = next(t.name for t in STAGE_TYPES if t.Output is output_type)
        if name in self.records:
            return self.records[name].output
        rec = self._cached(name)
        if rec is None:
            off = (" (regenerate.enabled is false: that stage then only mixes, splits and writes the prompts, in "
                   "seconds)" if name == "regenerate" and not self.recipe.regenerate.enabled else "")
            raise ValueError(f"stage {name!r} has no current outputs in {self.run_dir} for this recipe; run it "
                             f"first: peagle run --config <recipe> --stage {name}{off}")
        return rec.output

    # ------------------------------------------------------------------------------------------ driver

    def run(self) -> dict[str, Any]:
        """Run the selected stages; return the summary (also written to ``run_dir/summary.json``).

        Ray must be initialized (``pipelines.console.init_ray``); a local one is started otherwise.
        """
        import ray

        if any(n not in self.not_run for n in self.stages) and not ray.is_initialized():
            from pipelines.console import init_ray

            init_ray(verbose=self.verbose)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.run_dir / "recipe.yaml", self.recipe.dump_resolved())
        self._say(f"peagle pipeline {self.recipe.name!r}: stages {', '.join(self.stages)}; run dir {self.run_dir}")
        for name in self.stages:
            if name in self.not_run:
                self._say(f"[{name}] not run: {self.not_run[name]}")
        t0 = time.perf_counter()
        for name in self.stages:
            if name in self.not_run:
                self.records[name] = StageRecord(name, "not run", 0.0, None, None, reason=self.not_run[name])
                continue
            self._current = name
            try:
                self.records[name] = self._run_or_skip(name)
            finally:
                self._current = None
        summary = self.summary(time.perf_counter() - t0)
        write_json(self.run_dir / "summary.json", summary)
        return summary

    def _run_or_skip(self, name: str) -> StageRecord:
        cached = None if name in self.force else self._cached(name)
        if cached is not None:
            self.say(f"skipped: outputs current (key {cached.key[:10]}); --force to re-run")
            return StageRecord(name, "skipped", 0.0, cached.key, cached.output)
        stage = self._stages[name]
        for other in STAGE_TYPES:
            if other.name != name:
                other.before_other_stage_runs(self, name)
        self.say("running")
        probe = PlacementProbe()
        probe.start()
        s0 = time.perf_counter()
        output = stage.run()
        seconds = time.perf_counter() - s0
        placement = probe.finish()
        rec = StageRecord(name, "ran", seconds, self.key(name), output,
                          placement=placement.to_json() if placement else None)
        write_json(self.stage_dir(name) / STAGE_FILE, rec.to_json())
        self.say(f"done in {rec.seconds:.1f}s")
        return rec

    def _cached(self, name: str) -> StageRecord | None:
        """The recorded run of ``name`` if its key is current and its outputs are still valid."""
        data = read_json(self.stage_dir(name) / STAGE_FILE)
        if not data or data.get("key") != self.key(name):
            return None
        stage = self._stages[name]
        try:
            output = stage.Output.from_json(data["outputs"])
            if not stage.is_valid(output):
                return None
        except Exception as e:  # noqa: BLE001 - any failure to verify means: re-run the stage
            log.warning("%s outputs no longer valid (%s); re-running", name, e)
            return None
        return StageRecord(name, data["status"], data["seconds"], data["key"], output, placement=data.get("placement"))

    # ------------------------------------------------------------------------------------------ summary

    def summary(self, seconds: float) -> dict[str, Any]:
        """``summary.json``: stage statuses and times plus each stage's own section (eval, train,
        mlflow, endpoint)."""
        out: dict[str, Any] = {"recipe": self.recipe.name, "run_dir": str(self.run_dir), "total_seconds": seconds,
                               "stages": {n: {"status": r.status, "seconds": round(r.seconds, 1)}
                                          | ({"reason": r.reason} if r.reason else {})
                                          | ({"placement": r.placement} if r.placement else {})
                                          for n, r in self.records.items()}}
        for name, rec in self.records.items():
            if rec.output is None:
                continue
            part = self._stages[name].summary(rec.output)
            if part is not None:
                out[part[0]] = part[1]
        return out


# ---------------------------------------------------------------------------------------------- printing


def print_summary(s: dict[str, Any], console: Console) -> None:
    """The summary as rich tables (stages; AL and tokens/s per K), then whole lines that stay
    copyable (run dir, MLflow run and model version, endpoint and curl): never wrapped."""
    from rich.table import Table

    def line(text: str) -> None:
        console.print(text, soft_wrap=True, highlight=False, markup=False)

    line(f"peagle pipeline {s['recipe']}: {s['total_seconds']:.0f}s")
    table = Table()
    for col, justify in (("stage", "left"), ("status", "left"), ("seconds", "right"), ("where", "left")):
        table.add_column(col, justify=justify)
    for name, st in s["stages"].items():
        table.add_row(name, st["status"], f"{st['seconds']:.1f}", Placement.describe(st.get("placement")))
    console.print(table)
    for name, st in s["stages"].items():
        if st.get("reason"):
            line(f"{name} not run: {st['reason']}")
    ev = s.get("eval")
    sets = (ev.get("by_eval_set") or {ev["eval_set"]: ev}) if ev else {}  # one table per eval set, gate first
    champ = (ev or {}).get("champion")  # measured in the same run (evaluation.compare_champion)
    for eval_set, part in sets.items():
        base = part.get("none_tokens_per_s")
        gate = " (gate set)" if len(sets) > 1 and eval_set == ev["eval_set"] else ""
        line(f"{ev['method']} on {eval_set}{gate} (vLLM, greedy, concurrency {ev['concurrency']}):")
        table = Table()
        for col in ("K", "AL", "tokens/s", "vs none") + ((f"champion v{champ.get('version')} AL",) if champ else ()):
            table.add_column(col, justify="right")
        if base:
            table.add_row("none", "1.000", f"{base:.1f}", "1.00x", *(["-"] if champ else []))
        champ_al = {int(k): v for k, v in (champ["al_by_K"].get(eval_set) or {}).items()} if champ else {}
        for k, v in sorted(part["per_K"].items(), key=lambda kv: int(kv[0])):
            al, tps, sp = v.get("acceptance_length"), v.get("tokens_per_s"), v.get("speedup")
            c_al = champ_al.get(int(k))
            table.add_row(str(k), f"{al:.3f}" if al is not None else "-", f"{tps:.1f}" if tps else "-",
                          f"{sp:.2f}x" if sp else "-", *([f"{c_al:.3f}" if c_al is not None else "-"] if champ else []))
        console.print(table)
    lines = [f"run dir: {s['run_dir']}"]
    tr = s.get("train")
    if tr:
        est = tr.get("materialized_capture_bytes_estimate")
        lines.append(f"train: {tr['step']} steps, streaming={tr['streaming']}, {tr['bytes_written_run_dir']:,} bytes "
                     f"written under the run dir, hidden states on disk {tr.get('hidden_state_bytes_on_disk') or 0:,}"
                     + (f" (materialized would be ~{est:,})" if est else ""))
    m = s.get("mlflow")
    if m:
        role = "champion" if m["promoted"] else f"challenger; champion v{m['champion_version']}"
        lines.append(f"MLflow: run {m['run_id']}, model {m['model_name']} v{m['version']} ({role})")
        uri = m["tracking_uri"]
        lines.append(f"  MLflow UI: {uri}" if uri.startswith(("http://", "https://"))
                     else f"  mlflow ui --backend-store-uri {uri}")
    e = s.get("endpoint")
    if e:
        lines.append(f"endpoint: {e['url']}/v1 (model {e['model_id']}, head {e['head']})")
        lines.append(f"  {e['curl']}")
    for text in lines:
        line(text)
