"""Stage: version heads in MLflow (runs, model registry); the promotion gate is :mod:`pipelines.registry.promotion`.

A head is the directory ``peagle_core.contract.export_head`` writes (``config.json``,
``model.safetensors``, ``peagle_checksums.json``). It has no ``MLmodel`` file, so it is registered
with ``MlflowClient.create_model_version(name, source="runs:/<run>/<path>", run_id=...)`` after its
files were logged as run artifacts (``register_model`` would refuse it). :func:`register_head` points
the ``challenger`` alias at the new version; ``champion`` (the version served) is moved only by
:mod:`pipelines.registry.promotion`.

Version tags written here (all strings): ``target``, ``method`` (peagle|eagle3), ``eval_set``,
``K`` (K of ``acceptance_length``), ``acceptance_length``, ``al.K<k>`` (AL per measured K),
``K_best.c<c>`` (best served K per concurrency c), ``parallel_drafting``, ``head_sha256``
(``promotion_decision``/``promotion_reason`` are written by the gate; the register stage adds the K
schedule, tag ``pipelines.evaluate.k_schedule.K_SCHEDULE_TAG``).

Tracking store and its client: :mod:`pipelines.registry.client` (``get_client``, ``tracking_guard``); the
pipeline's run (recipe, curves, eval table): :mod:`pipelines.registry.runs` (``log_run``). Both are
re-exported here, the registry's public API.

Outages and re-runs (issue 15): the register stage tags its run and its version with its stage key
(:data:`PIPELINE_KEY_TAG`) and looks for them first (:func:`find_registered`), so a re-run after an
interruption reuses them and never registers a second version. :func:`tracking_guard` probes an
``http(s)://`` server first, bounds MLflow's own HTTP retries (minutes by default) and turns a failure
while the server is down into one :class:`TrackingUnreachableError` line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines import settings
from pipelines.registry.client import TrackingUnreachableError, _experiment_id, get_client, tracking_guard
from pipelines.registry.refs import HEAD_SHA256_TAG, HeadRef
from pipelines.registry.runs import eval_metric_name, log_run, manifest_hash

log = logging.getLogger(__name__)

CHALLENGER = "challenger"
HEAD_ARTIFACT_PATH = "head"
PIPELINE_KEY_TAG = "peagle.pipeline_key"  # run and version tag: the register stage's key (idempotent re-runs)

# ---------------------------------------------------------------------------------------------- registry


def version_tag(mv, key: str) -> str | None:
    """Tag ``key`` of a model version, else None."""
    return (mv.tags or {}).get(key)


@dataclass(frozen=True)
class Registered:
    """What an earlier register of one pipeline key left in MLflow (:func:`find_registered`).

    ``version``: its model version (``ModelVersion``, aliases and tags included), None when none was
    registered; ``run_id``: the version's run, else the newest active run of the experiment tagged with
    the key (a register interrupted before its version), else None.
    """

    version: Any
    run_id: str | None


def _tag_filter(key: str, value: str) -> str:
    """An MLflow search clause ``tags.`key` = 'value'`` (backquotes: the key may contain dots).

    Raises:
        ValueError: a quote in ``value`` (MLflow's filter grammar has no escape for it).
    """
    if "'" in value or "`" in key:
        raise ValueError(f"tag {key}={value!r}: quotes cannot be searched for")
    return f"tags.`{key}` = '{value}'"


def head_sha256(head_dir: str | os.PathLike) -> str | None:
    """The :data:`HEAD_SHA256_TAG` of a head: sha256 of its ``peagle_checksums.json`` (None when it has none)."""
    from peagle_core.contract import CHECKSUMS_FILE

    f = Path(head_dir) / CHECKSUMS_FILE
    return hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else None


def head_method(head_dir: str | os.PathLike) -> str:
    """``peagle`` for a head with a mask token id (parallel drafting), else ``eagle3``: the ``method`` a version
    of this head is tagged with when its registration does not say."""
    from peagle_core.contract import CONFIG_FILE, head_mask_token_id

    config = json.loads((Path(head_dir) / CONFIG_FILE).read_text())
    return "peagle" if head_mask_token_id(config) is not None else "eagle3"


def find_registered(model_name: str, pipeline_key: str, *, head_sha: str | None = None,
                    experiment: str = settings.EXPERIMENT, tracking_uri: str | None = None) -> Registered:
    """The model version and run an earlier register of ``pipeline_key`` left (tag :data:`PIPELINE_KEY_TAG`).

    Used by the register stage before it logs or registers anything: a re-run after an interruption
    (version registered, stage output never written; or run logged, version never registered) reuses
    them, so one stage key never gets two versions of one head. Works on sqlite and server stores
    (MLflow's ``search_model_versions`` / ``search_runs`` tag filters).

    Args:
        head_sha: only a version of this head counts (its :data:`HEAD_SHA256_TAG`, :func:`head_sha256`):
            a head retrained under the same key (``--force``) is a new version. None: any head.

    Returns:
        The newest matching version (a warning names the others, registered before this lookup existed)
        with its run; else no version and the newest active run of ``experiment`` with the key that no
        version of the key was registered from; else neither.

    Raises:
        ValueError: a quote in ``pipeline_key`` or ``model_name``.
        mlflow.exceptions.MlflowException: the store refused the search.
    """
    client = get_client(tracking_uri)
    clause = _tag_filter(PIPELINE_KEY_TAG, pipeline_key)
    if "'" in model_name:
        raise ValueError(f"model name {model_name!r}: quotes cannot be searched for")
    keyed = sorted(client.search_model_versions(f"name = '{model_name}' AND {clause}"), key=lambda m: int(m.version))
    versions = [m for m in keyed if head_sha is None or version_tag(m, HEAD_SHA256_TAG) == head_sha]
    if versions:
        if len(versions) > 1:
            log.warning("%s: versions %s all carry %s=%s; using the newest", model_name,
                        [m.version for m in versions], PIPELINE_KEY_TAG, pipeline_key[:12])
        mv = client.get_model_version(model_name, versions[-1].version)
        return Registered(mv, mv.run_id)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return Registered(None, None)
    taken = {m.run_id for m in keyed}
    runs = client.search_runs([exp.experiment_id], filter_string=clause, order_by=["attributes.start_time DESC"])
    return Registered(None, next((r.info.run_id for r in runs if r.info.run_id not in taken), None))


def register_head(
    head_dir: str | os.PathLike,
    *,
    model_name: str,
    eval_al: float,
    K: int,
    eval_set: str,
    run_id: str | None = None,
    tags: Mapping[str, Any] | None = None,
    al_by_K: Mapping[int, float] | None = None,
    K_best: Mapping[int, int] | None = None,
    target: str | None = None,
    target_config: Any = None,
    parallel_drafting: bool | None = None,
    experiment: str = settings.EXPERIMENT,
    tracking_uri: str | None = None,
):
    """Validate a head, log its files to a run and register them as a new model version.

    The contract validator (``peagle_core.contract.validate_head``) runs first: an incompatible head
    raises before anything is logged or registered. A head without ``peagle_checksums.json`` gets
    one written (``write_checksums``) so downloads can be verified.

    Args:
        head_dir: exported head directory.
        model_name: registered model (see :func:`pipelines.settings.model_name`); created if absent.
        eval_al: acceptance length (tokens per target step, >= 1) measured with real vLLM at ``K``.
        K: served K (num_speculative_tokens) of ``eval_al``.
        eval_set: name of the eval prompt set (``humaneval``, ``heldout``, a JSONL name); the gate only
            compares ALs on the same eval set.
        run_id: run to attach the files to; None creates a run in ``experiment``.
        tags: extra version tags.
        al_by_K: AL per measured K (tags ``al.K<k>``), so the gate can compare at its own K.
        K_best: best served K per concurrency ``{concurrency: K}`` (tags ``K_best.c<c>``).
        target: target name/path (tag ``target``); default from ``config.json['peagle']`` if present.
        target_config: the target's HF config (dict or object): the head must fit it.
        parallel_drafting: validate for parallel drafting (the mask-token keys of every vLLM release of
            ``peagle_core.contract.VLLM_RANGE``); None = inferred (a mask token id present).

    Returns:
        The ``mlflow.entities.model_registry.ModelVersion`` (alias ``challenger`` set on it).

    Raises:
        peagle_core.contract.HeadContractError: the head violates the vLLM contract / does not fit
            the target (nothing registered).
        ValueError: ``eval_al`` < 1 or ``K`` < 1.
    """
    head = Path(head_dir)
    head_cfg, parallel_drafting = _checked_head(head, eval_al=eval_al, K=K, target_config=target_config,
                                                parallel_drafting=parallel_drafting)
    client = get_client(tracking_uri)
    run_id = _log_head_files(client, head, run_id, experiment=experiment, model_name=model_name)
    _ensure_registered_model(client, model_name)
    vtags = _version_tags(head, head_cfg, eval_al=eval_al, K=K, eval_set=eval_set, target=target,
                          parallel_drafting=parallel_drafting, al_by_K=al_by_K, K_best=K_best, tags=tags)
    mv = client.create_model_version(
        model_name, source=f"runs:/{run_id}/{HEAD_ARTIFACT_PATH}", run_id=run_id, tags=vtags,
        description=f"{vtags['method']} head, AL {float(eval_al):.3f} at K={K} on {eval_set}",
    )
    client.set_registered_model_alias(model_name, CHALLENGER, mv.version)
    log.info("registered %s version %s (AL %.3f at K=%d on %s) as %s", model_name, mv.version, eval_al, K,
             eval_set, CHALLENGER)
    return client.get_model_version(model_name, mv.version)


def _checked_head(head: Path, *, eval_al: float, K: int, target_config: Any,
                  parallel_drafting: bool | None) -> tuple[dict[str, Any], bool]:
    """Check the gate numbers and the head (writing missing checksums) before anything is logged.

    Returns:
        ``(config.json of the head, parallel_drafting)``, the latter inferred when None (a mask token id set).

    Raises:
        ValueError: ``eval_al`` < 1 or ``K`` < 1.
        peagle_core.contract.HeadContractError: no ``config.json``, or the head violates the contract / does
            not fit ``target_config``.
    """
    from peagle_core.contract import (
        CHECKSUMS_FILE,
        CONFIG_FILE,
        HeadContractError,
        validate_head,
        write_checksums,
    )

    if K < 1:
        raise ValueError(f"K={K}: the served num_speculative_tokens must be >= 1")
    if not eval_al >= 1.0:
        raise ValueError(f"eval_al={eval_al}: an acceptance length is >= 1 (AL = 1 + accepted/drafts)")
    if not (head / CONFIG_FILE).is_file():
        raise HeadContractError(f"{head}/{CONFIG_FILE} is missing: not a head directory")
    if not (head / CHECKSUMS_FILE).exists():
        log.warning("%s has no %s; writing it before registration", head, CHECKSUMS_FILE)
        write_checksums(head)
    head_cfg = json.loads((head / CONFIG_FILE).read_text())
    if parallel_drafting is None:
        parallel_drafting = head_method(head) == "peagle"
    # every vLLM release of the supported range: a registered head may be served by any cluster
    validate_head(head, target_config=target_config, parallel_drafting=parallel_drafting)
    return head_cfg, parallel_drafting


def _log_head_files(client, head: Path, run_id: str | None, *, experiment: str, model_name: str) -> str:
    """Log the head's files under ``head/`` of ``run_id`` (None: a new, finished run in ``experiment``)."""
    if run_id is None:
        run_id = client.create_run(_experiment_id(client, experiment), run_name=f"register-{model_name}").info.run_id
        created_run = True
    else:
        created_run = False
    client.log_artifacts(run_id, str(head), HEAD_ARTIFACT_PATH)
    if created_run:
        client.set_terminated(run_id)
    return run_id


def _ensure_registered_model(client, model_name: str) -> None:
    """Create the registered model unless it exists (tolerates a concurrent creation)."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(model_name)
    except MlflowException:
        try:
            client.create_registered_model(model_name, description="peagle speculative-decoding heads")
        except MlflowException:  # created concurrently
            client.get_registered_model(model_name)


def _version_tags(head: Path, head_cfg: Mapping[str, Any], *, eval_al: float, K: int, eval_set: str,
                  target: str | None, parallel_drafting: bool, al_by_K: Mapping[int, float] | None,
                  K_best: Mapping[int, int] | None, tags: Mapping[str, Any] | None) -> dict[str, str]:
    """The version tags listed in the module docstring, then ``tags`` (which win)."""
    meta = head_cfg.get("peagle", {}) or {}
    sha = head_sha256(head)
    assert sha is not None, f"{head}: checksums missing after _checked_head"
    vtags: dict[str, str] = {
        "target": str(target or meta.get("target") or meta.get("target_name") or ""),
        "method": "peagle" if parallel_drafting else "eagle3",
        "parallel_drafting": str(bool(parallel_drafting)).lower(),
        "eval_set": eval_set,
        "K": str(int(K)),
        "acceptance_length": f"{float(eval_al):.4f}",
        HEAD_SHA256_TAG: sha,
        f"al.K{int(K)}": f"{float(eval_al):.4f}",
    }
    for k, al in (al_by_K or {}).items():
        vtags[f"al.K{int(k)}"] = f"{float(al):.4f}"
    for c, k in (K_best or {}).items():
        vtags[f"K_best.c{int(c)}"] = str(int(k))
    vtags |= {k: str(v) for k, v in (tags or {}).items()}
    return vtags


def download(ref: HeadRef | str, dst: str | os.PathLike, *, target_config: Any = None,
             parallel_drafting: bool | None = None, tracking_uri: str | None = None) -> Path:
    """Download ``ref`` (a :class:`~pipelines.registry.refs.HeadRef`, or its text: ``models:/NAME@ALIAS``,
    ``models:/NAME/VERSION``) into ``dst`` and verify it.

    The files are fetched into a temporary sibling directory, their sha256 checked against
    ``peagle_checksums.json`` and the head validated (``validate_head`` with ``for_vllm=False``: which
    mask-token keys the loading vLLM needs is its caller's check, e.g. ``pipelines.serve.heads.fetch_head``
    for the installed one) before ``dst`` is replaced (fsynced, renamed: ``peagle_core.atomic.replace_dir``),
    so a failed or killed download never destroys an existing ``dst``.

    Returns:
        ``dst`` (the head directory).

    Raises:
        ValueError: bad reference.
        peagle_core.contract.HeadContractError: checksum mismatch or an invalid head.
        mlflow.exceptions.MlflowException: unknown model or alias.
    """
    import mlflow

    from peagle_core.atomic import replace_dir, temp_dir_for
    from peagle_core.contract import validate_head, verify_checksums

    ref = ref if isinstance(ref, HeadRef) else HeadRef.parse(ref)
    get_client(tracking_uri)
    out = Path(dst)
    tmp = temp_dir_for(out)
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=str(ref), dst_path=str(tmp)))
        verify_checksums(local)
        if parallel_drafting is None:
            parallel_drafting = head_method(local) == "peagle"
        validate_head(local, target_config=target_config, parallel_drafting=parallel_drafting, for_vllm=False)
        replace_dir(local, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def list_versions(model_name: str | None = None, *, tracking_uri: str | None = None) -> list[dict[str, Any]]:
    """Rows ``{name, version, aliases, method, eval_set, K, acceptance_length, promotion_decision, run_id}``
    of ``model_name`` (None: every registered model), sorted by name and version.

    Raises:
        mlflow.exceptions.MlflowException: unknown ``model_name``.
    """
    client = get_client(tracking_uri)
    names = [model_name] if model_name else [m.name for m in client.search_registered_models()]
    rows = []
    for name in names:
        aliases: dict[str, list[str]] = {}
        for a, v in (client.get_registered_model(name).aliases or {}).items():
            aliases.setdefault(str(v), []).append(a)
        for mv in client.search_model_versions(f"name='{name}'"):
            rows.append({
                "name": name, "version": str(mv.version), "aliases": ",".join(sorted(aliases.get(str(mv.version), []))),
                **{k: version_tag(mv, k) for k in ("method", "eval_set", "K", "acceptance_length", "promotion_decision")},
                "run_id": mv.run_id,
            })
    rows.sort(key=lambda r: (r["name"], int(r["version"])))
    return rows



__all__ = [
    "CHALLENGER", "HEAD_SHA256_TAG", "PIPELINE_KEY_TAG", "Registered", "TrackingUnreachableError", "download",
    "eval_metric_name", "find_registered", "get_client", "head_method", "head_sha256", "list_versions", "log_run",
    "manifest_hash", "register_head", "tracking_guard", "version_tag",
]
