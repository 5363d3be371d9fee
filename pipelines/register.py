"""Stage: version heads in MLflow (runs, model registry); the promotion gate is :mod:`pipelines.promotion`.

A head is the directory ``peagle_core.contract.export_head`` writes (``config.json``,
``model.safetensors``, ``peagle_checksums.json``). It has no ``MLmodel`` file, so it is registered
with ``MlflowClient.create_model_version(name, source="runs:/<run>/<path>", run_id=...)`` after its
files were logged as run artifacts (``register_model`` would refuse it). :func:`register_head` points
the ``challenger`` alias at the new version; ``champion`` (the version served) is moved only by
:mod:`pipelines.promotion`.

Version tags written here (all strings): ``target``, ``method`` (peagle|eagle3), ``eval_set``,
``K`` (K of ``acceptance_length``), ``acceptance_length``, ``al.K<k>`` (AL per measured K),
``K_best.c<c>`` (best served K per concurrency c), ``parallel_drafting``, ``head_sha256``
(``promotion_decision``/``promotion_reason`` are written by the gate).

Tracking store: ``RegistryConfig.tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else
``sqlite:///$PEAGLE_HOME/mlflow.db`` with artifacts under ``$PEAGLE_HOME/mlartifacts``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pipelines import settings
from pipelines.mlflow_params import flatten

log = logging.getLogger(__name__)

CHALLENGER = "challenger"
HEAD_ARTIFACT_PATH = "head"
HEAD_SHA256_TAG = "head_sha256"  # version tag: sha256 of the head's peagle_checksums.json


# ---------------------------------------------------------------------------------------------- store


def get_client(tracking_uri: str | None = None):
    """An ``MlflowClient`` on the resolved tracking URI (the registry uses the same store).

    Also points the ``mlflow`` fluent API at it (``download_artifacts`` of ``models:/`` URIs uses it).
    The directory of a local sqlite store is created.
    """
    import mlflow
    from mlflow import MlflowClient

    uri = settings.tracking_uri(tracking_uri)
    d = settings.local_sqlite_dir(uri)
    if d is not None:
        d.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _experiment_id(client, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    d = settings.local_sqlite_dir(client.tracking_uri)
    # A local store keeps its artifacts beside the database (MLflow's default is ./mlruns of the cwd).
    location = (d / "mlartifacts" / name).as_uri() if d is not None else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # created concurrently by another process
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


# ---------------------------------------------------------------------------------------------- runs


def _param_value(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if len(s) <= 6000 else s[:5990] + "…"


def manifest_hash(manifest: str | os.PathLike | Mapping[str, Any] | None) -> str | None:
    """sha256 of a data manifest: a file's bytes, or the canonical JSON of a mapping."""
    if manifest is None:
        return None
    if isinstance(manifest, Mapping):
        return hashlib.sha256(json.dumps(manifest, sort_keys=True, default=str).encode()).hexdigest()
    return hashlib.sha256(Path(manifest).read_bytes()).hexdigest()


def eval_metric_name(row: Mapping[str, Any], field: str, gate_eval_set: str | None = None) -> str:
    """Metric key of one eval-table cell: ``eval.<method>.K<k>.c<c>.<field>`` (K0 = no speculation) for the
    gate set's rows (or rows without ``eval_set``), ``eval.<eval_set>.<method>.K<k>.c<c>.<field>`` for the
    other sets' rows."""
    cell = f"{row.get('method', 'peagle')}.K{int(row.get('K') or 0)}.c{int(row.get('concurrency', 1))}.{field}"
    other = row.get("eval_set")
    return f"eval.{other}.{cell}" if other and gate_eval_set and other != gate_eval_set else f"eval.{cell}"


def log_run(
    *,
    config: Any = None,
    training_curves: Iterable[Mapping[str, float]] = (),
    eval_table: Iterable[Mapping[str, Any]] = (),
    artifacts: Mapping[str, str | os.PathLike] | None = None,
    data_manifest: str | os.PathLike | Mapping[str, Any] | None = None,
    run_name: str | None = None,
    run_id: str | None = None,
    experiment: str = settings.EXPERIMENT,
    tags: Mapping[str, str] | None = None,
    tracking_uri: str | None = None,
    gate_eval_set: str | None = None,
) -> str:
    """Log one pipeline run to MLflow and return its run id.

    Args:
        config: the resolved recipe (a pydantic model with ``dump_resolved()``, a model, or a dict);
            logged flattened as params (``training.lr`` ...) and in full as ``config/recipe.yaml``.
        training_curves: rows ``{"step": int, "<metric>": float, ...}`` (e.g. ``loss``, ``lr``,
            ``acc_depth0``); each non-step key is logged as a metric at that step.
        eval_table: rows of :func:`pipelines.evaluate.evaluate` (``method``, ``K``, ``concurrency``,
            ``acceptance_length``, ``tokens_per_s``, ...); numbers logged as
            ``eval.<method>.K<k>.c<c>.<field>`` (rows of an eval set other than ``gate_eval_set`` as
            ``eval.<eval_set>.<method>...``, :func:`eval_metric_name`); the table also as ``eval/table.json``
            and ``.md``.
        artifacts: ``{artifact_dir: local file or directory}`` (head dir, plots, ...).
        data_manifest: data manifest file or mapping; its sha256 is the param ``data_manifest_sha256``.
        run_id: continue an existing run instead of creating one.
        tracking_uri: see :func:`pipelines.settings.tracking_uri`.

    Params always include ``git_sha``, ``git_dirty`` and ``pkg.<dist>`` versions
    (``pipelines.provenance.provenance``).

    Raises:
        ValueError: an ``artifacts`` path does not exist (raised after params, metrics and tables are logged).
    """
    client = get_client(tracking_uri)
    run_id = _open_run(client, run_id, run_name=run_name, experiment=experiment, tags=tags)
    params = _provenance_params(data_manifest)
    rows = [dict(r) for r in eval_table]
    with tempfile.TemporaryDirectory(prefix="peagle-run-") as tmp:
        params |= _write_run_files(Path(tmp), config, rows)
        if any(Path(tmp).iterdir()):
            client.log_artifacts(run_id, tmp)
    _log_params(client, run_id, params)
    _log_metrics(client, run_id, training_curves, rows, gate_eval_set)
    _log_artifact_paths(client, run_id, artifacts or {})
    return run_id


def _open_run(client, run_id: str | None, *, run_name: str | None, experiment: str,
              tags: Mapping[str, str] | None) -> str:
    """``run_id`` with ``tags`` added, or a new run in ``experiment`` carrying them."""
    from mlflow.entities import RunTag

    if run_id is None:
        run = client.create_run(_experiment_id(client, experiment), run_name=run_name, tags=dict(tags or {}))
        return run.info.run_id
    if tags:
        client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
    return run_id


def _provenance_params(data_manifest: str | os.PathLike | Mapping[str, Any] | None) -> dict[str, Any]:
    """``git_sha``, ``git_dirty``, ``pkg.<dist>`` and (with a manifest) ``data_manifest_sha256``."""
    from pipelines.provenance import provenance

    prov = provenance()
    params: dict[str, Any] = {"git_sha": prov.get("git_sha"), "git_dirty": prov.get("git_dirty")}
    params |= {f"pkg.{k}": v for k, v in prov.get("packages", {}).items()}
    digest = manifest_hash(data_manifest)
    if digest:
        params["data_manifest_sha256"] = digest
    return params


def _write_run_files(out: Path, config: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Write ``config/recipe.yaml`` and ``eval/table.{json,md}`` under ``out``; return the config's
    flattened params (empty without a config)."""
    params: dict[str, Any] = {}
    if config is not None:
        if hasattr(config, "dump_resolved"):
            text = config.dump_resolved()
            cfg_dict = config.model_dump(mode="json")
        elif hasattr(config, "model_dump"):
            cfg_dict = config.model_dump(mode="json")
            text = json.dumps(cfg_dict, indent=2)
        else:
            cfg_dict = dict(config)
            text = json.dumps(cfg_dict, indent=2, default=str)
        params = dict(flatten(cfg_dict))
        (out / "config").mkdir()
        (out / "config" / "recipe.yaml").write_text(text)
    if rows:
        (out / "eval").mkdir()
        (out / "eval" / "table.json").write_text(json.dumps(rows, indent=2, default=str))
        from pipelines.eval_report import table_markdown

        (out / "eval" / "table.md").write_text(table_markdown(rows))
    return params


def _log_params(client, run_id: str, params: Mapping[str, Any]) -> None:
    """Log the non-None params the run does not have yet (MLflow params are write-once)."""
    from mlflow.entities import Param

    existing = client.get_run(run_id).data.params
    items = [Param(k, _param_value(v)) for k, v in params.items() if v is not None and k not in existing]
    for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
        client.log_batch(run_id, params=items[i:i + 100])


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _log_metrics(client, run_id: str, training_curves: Iterable[Mapping[str, float]],
                 rows: list[dict[str, Any]], gate_eval_set: str | None = None) -> None:
    """Training curves at their steps; every number of the eval table at step 0 (:func:`eval_metric_name`)."""
    from mlflow.entities import Metric

    now_ms = int(time.time() * 1000)
    metrics = []
    for row in training_curves:
        step = int(row.get("step", 0))
        metrics += [Metric(k, float(v), now_ms, step) for k, v in row.items() if k != "step" and _is_number(v)]
    for row in rows:
        for k, v in row.items():
            if _is_number(v) and k not in ("K", "concurrency"):
                metrics.append(Metric(eval_metric_name(row, k, gate_eval_set), float(v), now_ms, 0))
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i:i + 1000])


def _log_artifact_paths(client, run_id: str, artifacts: Mapping[str, str | os.PathLike]) -> None:
    """Log each ``{artifact_dir: local file or directory}``.

    Raises:
        ValueError: a path that does not exist.
    """
    for dest, path in artifacts.items():
        p = Path(path)
        if p.is_dir():
            client.log_artifacts(run_id, str(p), dest)
        elif p.is_file():
            client.log_artifact(run_id, str(p), dest)
        else:
            raise ValueError(f"artifacts[{dest!r}] = {p} does not exist; pass an existing file or directory")


# ---------------------------------------------------------------------------------------------- registry


def version_tag(mv, key: str) -> str | None:
    """Tag ``key`` of a model version, else None."""
    return (mv.tags or {}).get(key)


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
        parallel_drafting: validate for parallel drafting; None = inferred (``mask_token_id`` present).

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
        ``(config.json of the head, parallel_drafting)``, the latter inferred when None (``mask_token_id`` set).

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
        parallel_drafting = head_cfg.get("mask_token_id") is not None
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
    from peagle_core.contract import CHECKSUMS_FILE

    meta = head_cfg.get("peagle", {}) or {}
    checksums = (head / CHECKSUMS_FILE).read_bytes()
    vtags: dict[str, str] = {
        "target": str(target or meta.get("target") or meta.get("target_name") or ""),
        "method": "peagle" if parallel_drafting else "eagle3",
        "parallel_drafting": str(bool(parallel_drafting)).lower(),
        "eval_set": eval_set,
        "K": str(int(K)),
        "acceptance_length": f"{float(eval_al):.4f}",
        HEAD_SHA256_TAG: hashlib.sha256(checksums).hexdigest(),
        f"al.K{int(K)}": f"{float(eval_al):.4f}",
    }
    for k, al in (al_by_K or {}).items():
        vtags[f"al.K{int(k)}"] = f"{float(al):.4f}"
    for c, k in (K_best or {}).items():
        vtags[f"K_best.c{int(c)}"] = str(int(k))
    vtags |= {k: str(v) for k, v in (tags or {}).items()}
    return vtags


def parse_model_ref(ref: str) -> tuple[str, str]:
    """``NAME@ALIAS`` | ``NAME/VERSION`` (optionally prefixed ``models:/``) -> ``(NAME, "@ALIAS" | "/VERSION")``.

    Raises:
        ValueError: neither an ``@ALIAS`` nor a ``/VERSION`` part.
    """
    body = ref.removeprefix("models:/")
    name, sep, alias = body.rpartition("@")
    if sep and name and alias:
        return name, "@" + alias
    name, sep, version = body.rpartition("/")
    if sep and name and version.isdigit():
        return name, "/" + version
    raise ValueError(f"model reference {ref!r} must look like NAME@ALIAS (e.g. peagle-smollm2-135m-instruct"
                     "@champion) or NAME/VERSION")


def download(ref: str, dst: str | os.PathLike, *, target_config: Any = None, parallel_drafting: bool | None = None,
             tracking_uri: str | None = None) -> Path:
    """Download ``models:/NAME@ALIAS`` (or ``NAME/VERSION``) into ``dst`` and verify it.

    The files are fetched into a temporary sibling directory, their sha256 checked against
    ``peagle_checksums.json`` and the head validated (``validate_head``) before ``dst`` is replaced,
    so a failed download never destroys an existing ``dst``.

    Returns:
        ``dst`` (the head directory).

    Raises:
        ValueError: bad reference.
        peagle_core.contract.HeadContractError: checksum mismatch or an invalid head.
        mlflow.exceptions.MlflowException: unknown model or alias.
    """
    import mlflow

    from peagle_core.contract import CONFIG_FILE, validate_head, verify_checksums

    name, selector = parse_model_ref(ref)
    get_client(tracking_uri)
    out = Path(dst)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}{selector}", dst_path=str(tmp)))
        verify_checksums(local)
        if parallel_drafting is None:
            parallel_drafting = json.loads((local / CONFIG_FILE).read_text()).get("mask_token_id") is not None
        validate_head(local, target_config=target_config, parallel_drafting=parallel_drafting)
        if out.exists():
            shutil.rmtree(out)
        os.replace(local, out)
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
    "CHALLENGER", "download", "eval_metric_name", "get_client", "list_versions", "log_run", "manifest_hash",
    "parse_model_ref", "register_head", "version_tag",
]
