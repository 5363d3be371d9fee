"""MLflow runs of the pipeline: the resolved recipe as params, training curves and the eval table as
metrics, run files and artifacts (:func:`log_run`); the registry itself is :mod:`pipelines.registry.register`."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pipelines import settings
from pipelines.registry.client import _experiment_id, get_client
from pipelines.registry.params import flatten


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
        eval_table: rows of :func:`pipelines.evaluate.measure.evaluate` (``method``, ``K``, ``concurrency``,
            ``acceptance_length``, ``tokens_per_s``, ...); numbers logged as
            ``eval.<method>.K<k>.c<c>.<field>`` (rows of an eval set other than ``gate_eval_set`` as
            ``eval.<eval_set>.<method>...``, :func:`eval_metric_name`); the table also as ``eval/table.json``
            and ``.md``.
        artifacts: ``{artifact_dir: local file or directory}`` (head dir, plots, ...).
        data_manifest: data manifest file or mapping; its sha256 is the param ``data_manifest_sha256``.
        run_id: continue an existing run instead of creating one (metric points it already has, same
            key, step and value, are not logged again: a re-run of an interrupted log adds no duplicates).
        tracking_uri: see :func:`pipelines.settings.tracking_uri`.

    Params always include ``git_sha``, ``git_dirty`` and ``pkg.<dist>`` versions
    (``pipelines.registry.provenance.provenance``).

    Raises:
        ValueError: an ``artifacts`` path does not exist (raised after params, metrics and tables are logged).
    """
    client = get_client(tracking_uri)
    continued = run_id is not None
    run_id = _open_run(client, run_id, run_name=run_name, experiment=experiment, tags=tags)
    params = _provenance_params(data_manifest)
    rows = [dict(r) for r in eval_table]
    with tempfile.TemporaryDirectory(prefix="peagle-run-") as tmp:
        params |= _write_run_files(Path(tmp), config, rows)
        if any(Path(tmp).iterdir()):
            client.log_artifacts(run_id, tmp)
    _log_params(client, run_id, params)
    _log_metrics(client, run_id, training_curves, rows, gate_eval_set, skip_logged=continued)
    _log_artifact_paths(client, run_id, artifacts or {})
    return run_id


def log_metrics_now(run_id: str, metrics: Mapping[str, float], *, tracking_uri: str | None = None) -> None:
    """Log ``metrics`` (``{name: value}``, e.g. ``stage_seconds.<stage>``) to ``run_id`` at step 0, timestamped now."""
    if not metrics:
        return
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    get_client(tracking_uri).log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()])


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
    from pipelines.registry.provenance import provenance

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
        from pipelines.evaluate.report import table_markdown

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
                 rows: list[dict[str, Any]], gate_eval_set: str | None = None, *, skip_logged: bool = False) -> None:
    """Training curves at their steps; every number of the eval table at step 0 (:func:`eval_metric_name`).
    ``skip_logged``: leave out points the run already has (same key, step and value)."""
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
    if skip_logged:
        have = set(client.get_run(run_id).data.metrics) & {m.key for m in metrics}
        logged = {(m.key, m.step, m.value) for k in have for m in client.get_metric_history(run_id, k)}
        metrics = [m for m in metrics if (m.key, m.step, m.value) not in logged]
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
