"""Stage: version heads in MLflow (runs, model registry, champion/challenger promotion gate).

A head is the directory ``peagle_core.contract.export_head`` writes (``config.json``,
``model.safetensors``, ``peagle_checksums.json``). It has no ``MLmodel`` file, so it is registered
with ``MlflowClient.create_model_version(name, source="runs:/<run>/<path>", run_id=...)`` after its
files were logged as run artifacts (``register_model`` would refuse it). Stages are deprecated in
MLflow 3; the registry uses aliases:

- ``challenger``: the newest registered version (set by :func:`register_head`);
- ``champion``: the version served (``models:/NAME@champion``), moved only by :func:`maybe_promote`
  (gate: new acceptance length (AL) at the gate K beats the champion's on the same eval set by
  ``promote_margin``), :func:`promote` (forced) and :func:`rollback`.

Every champion move appends to the registered model tag ``champion_history`` (JSON list of
versions), so :func:`rollback` can restore the previous champion.

Version tags written here (all strings): ``target``, ``method`` (peagle|eagle3), ``eval_set``,
``K`` (K of ``acceptance_length``), ``acceptance_length``, ``al.K<k>`` (AL per measured K),
``K_best.c<c>`` (best served K per concurrency c), ``parallel_drafting``, ``head_sha256``,
``promotion_decision``/``promotion_reason`` (after a gate ran).

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines import settings
from pipelines.mlflow_params import flatten

log = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"
HISTORY_TAG = "champion_history"
HEAD_ARTIFACT_PATH = "head"


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


def eval_metric_name(row: Mapping[str, Any], field: str) -> str:
    """Metric key of one eval-table cell: ``eval.<method>.K<k>.c<c>.<field>`` (K0 = no speculation)."""
    return f"eval.{row.get('method', 'peagle')}.K{int(row.get('K') or 0)}.c{int(row.get('concurrency', 1))}.{field}"


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
) -> str:
    """Log one pipeline run to MLflow and return its run id.

    Args:
        config: the resolved recipe (a pydantic model with ``dump_resolved()``, a model, or a dict);
            logged flattened as params (``training.lr`` ...) and in full as ``config/recipe.yaml``.
        training_curves: rows ``{"step": int, "<metric>": float, ...}`` (e.g. ``loss``, ``lr``,
            ``acc_depth0``); each non-step key is logged as a metric at that step.
        eval_table: rows of :func:`pipelines.evaluate.evaluate` (``method``, ``K``, ``concurrency``,
            ``acceptance_length``, ``tokens_per_s``, ...); numbers logged as
            ``eval.<method>.K<k>.c<c>.<field>``; the table also as ``eval/table.json`` and ``.md``.
        artifacts: ``{artifact_dir: local file or directory}`` (head dir, plots, ...).
        data_manifest: data manifest file or mapping; its sha256 is the param ``data_manifest_sha256``.
        run_id: continue an existing run instead of creating one.
        tracking_uri: see :func:`pipelines.settings.tracking_uri`.

    Params always include ``git_sha``, ``git_dirty`` and ``pkg.<dist>`` versions
    (``pipelines.recipe.provenance``).
    """
    from mlflow.entities import Metric, Param, RunTag

    from pipelines.recipe import provenance

    client = get_client(tracking_uri)
    if run_id is None:
        run = client.create_run(_experiment_id(client, experiment), run_name=run_name, tags=dict(tags or {}))
        run_id = run.info.run_id
    elif tags:
        client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    prov = provenance()
    params: dict[str, Any] = {"git_sha": prov.get("git_sha"), "git_dirty": prov.get("git_dirty")}
    params |= {f"pkg.{k}": v for k, v in prov.get("packages", {}).items()}
    digest = manifest_hash(data_manifest)
    if digest:
        params["data_manifest_sha256"] = digest

    with tempfile.TemporaryDirectory(prefix="peagle-run-") as tmp:
        tmp_p = Path(tmp)
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
            params |= {k: v for k, v in flatten(cfg_dict).items()}
            (tmp_p / "config").mkdir()
            (tmp_p / "config" / "recipe.yaml").write_text(text)
        rows = [dict(r) for r in eval_table]
        if rows:
            (tmp_p / "eval").mkdir()
            (tmp_p / "eval" / "table.json").write_text(json.dumps(rows, indent=2, default=str))
            from pipelines.evaluate import table_markdown

            (tmp_p / "eval" / "table.md").write_text(table_markdown(rows))
        if any(tmp_p.iterdir()):
            client.log_artifacts(run_id, str(tmp_p))

    existing = client.get_run(run_id).data.params
    items = [Param(k, _param_value(v)) for k, v in params.items() if v is not None and k not in existing]
    for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
        client.log_batch(run_id, params=items[i:i + 100])

    import time

    now = int(time.time() * 1000)
    metrics = []
    for row in training_curves:
        step = int(row.get("step", 0))
        metrics += [Metric(k, float(v), now, step) for k, v in row.items()
                    if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)]
    for row in rows:
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("K", "concurrency"):
                metrics.append(Metric(eval_metric_name(row, k), float(v), now, 0))
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i:i + 1000])

    for dest, path in (artifacts or {}).items():
        p = Path(path)
        if p.is_dir():
            client.log_artifacts(run_id, str(p), dest)
        elif p.is_file():
            client.log_artifact(run_id, str(p), dest)
        else:
            raise ValueError(f"artifacts[{dest!r}] = {p} does not exist; pass an existing file or directory")
    return run_id


# ---------------------------------------------------------------------------------------------- registry


def _tag(mv, key: str) -> str | None:
    return (mv.tags or {}).get(key)


def _al_at(mv, K: int) -> float | None:
    v = _tag(mv, f"al.K{K}")
    if v is None and _tag(mv, "K") == str(K):
        v = _tag(mv, "acceptance_length")
    return float(v) if v is not None else None


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
    from peagle_core.contract import (
        CHECKSUMS_FILE,
        CONFIG_FILE,
        HeadContractError,
        validate_head,
        write_checksums,
    )

    head = Path(head_dir)
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

    client = get_client(tracking_uri)
    if run_id is None:
        run_id = client.create_run(_experiment_id(client, experiment), run_name=f"register-{model_name}").info.run_id
        created_run = True
    else:
        created_run = False
    client.log_artifacts(run_id, str(head), HEAD_ARTIFACT_PATH)
    if created_run:
        client.set_terminated(run_id)

    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(model_name)
    except MlflowException:
        try:
            client.create_registered_model(model_name, description="peagle speculative-decoding heads")
        except MlflowException:  # created concurrently
            client.get_registered_model(model_name)

    meta = head_cfg.get("peagle", {}) or {}
    checksums = (head / CHECKSUMS_FILE).read_bytes()
    vtags: dict[str, str] = {
        "target": str(target or meta.get("target") or meta.get("target_name") or ""),
        "method": "peagle" if parallel_drafting else "eagle3",
        "parallel_drafting": str(bool(parallel_drafting)).lower(),
        "eval_set": eval_set,
        "K": str(int(K)),
        "acceptance_length": f"{float(eval_al):.4f}",
        "head_sha256": hashlib.sha256(checksums).hexdigest(),
        f"al.K{int(K)}": f"{float(eval_al):.4f}",
    }
    for k, al in (al_by_K or {}).items():
        vtags[f"al.K{int(k)}"] = f"{float(al):.4f}"
    for c, k in (K_best or {}).items():
        vtags[f"K_best.c{int(c)}"] = str(int(k))
    vtags |= {k: str(v) for k, v in (tags or {}).items()}
    mv = client.create_model_version(
        model_name, source=f"runs:/{run_id}/{HEAD_ARTIFACT_PATH}", run_id=run_id, tags=vtags,
        description=f"{vtags['method']} head, AL {float(eval_al):.3f} at K={K} on {eval_set}",
    )
    client.set_registered_model_alias(model_name, CHALLENGER, mv.version)
    log.info("registered %s version %s (AL %.3f at K=%d on %s) as %s", model_name, mv.version, eval_al, K,
             eval_set, CHALLENGER)
    return client.get_model_version(model_name, mv.version)


@dataclass
class PromotionDecision:
    """Outcome of the promotion gate.

    ``promoted``: whether ``champion`` now points at ``version``; ``reason``: why (also written to
    the version tags ``promotion_decision``/``promotion_reason`` and, if the version has a run, to the
    run's tags); ``champion_version``: the champion after the decision; ``new_al``/``champion_al``:
    the compared acceptance lengths at ``K``.
    """

    promoted: bool
    reason: str
    version: str
    champion_version: str | None
    K: int
    new_al: float | None = None
    champion_al: float | None = None


def _history(client, model_name: str) -> list[str]:
    raw = (client.get_registered_model(model_name).tags or {}).get(HISTORY_TAG)
    return [str(v) for v in json.loads(raw)] if raw else []


def _current_champion(client, model_name: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(model_name, CHAMPION)
    except MlflowException:
        return None


def _set_champion(client, model_name: str, version: str, *, history: list[str]) -> None:
    client.set_registered_model_alias(model_name, CHAMPION, str(version))
    client.set_registered_model_tag(model_name, HISTORY_TAG, json.dumps(history))


def _record(client, model_name: str, d: PromotionDecision) -> None:
    from mlflow.exceptions import MlflowException

    decision = "promoted" if d.promoted else "kept_champion"
    client.set_model_version_tag(model_name, d.version, "promotion_decision", decision)
    client.set_model_version_tag(model_name, d.version, "promotion_reason", d.reason[:5000])
    run_id = client.get_model_version(model_name, d.version).run_id
    if run_id:
        try:
            client.set_tag(run_id, "promotion_decision", decision)
            client.set_tag(run_id, "promotion_reason", d.reason[:5000])
        except MlflowException as e:  # the run may be gone or read-only; the version tags suffice
            log.warning("could not tag run %s: %s", run_id, e)
    (log.info if d.promoted else log.warning)("%s v%s: %s", model_name, d.version, d.reason)


def maybe_promote(
    model_name: str,
    version: str | int | None = None,
    *,
    K: int,
    promote_margin: float = 0.0,
    eval_set: str | None = None,
    tracking_uri: str | None = None,
) -> PromotionDecision:
    """Promotion gate: move ``champion`` to ``version`` only if its AL at ``K`` beats the champion's.

    Rule: promoted iff there is no champion, or both versions have an AL at ``K`` on the same eval
    set and ``new_al > champion_al + promote_margin``. Otherwise the champion stays; the reason is
    returned and recorded as tags (``promotion_decision``, ``promotion_reason``).

    Args:
        version: candidate version; None = the ``challenger`` alias.
        K: the gate's served K (``RegistryConfig.gate_num_speculative_tokens``).
        promote_margin: required AL improvement (AL units, tokens per target step).
        eval_set: required eval set of both versions; None = the candidate's.
    """
    client = get_client(tracking_uri)
    mv = (client.get_model_version_by_alias(model_name, CHALLENGER) if version is None
          else client.get_model_version(model_name, str(version)))
    v = str(mv.version)
    new_al = _al_at(mv, K)
    new_set = _tag(mv, "eval_set")
    champ = _current_champion(client, model_name)
    history = _history(client, model_name)

    def decide(promoted: bool, reason: str, champ_al: float | None = None) -> PromotionDecision:
        d = PromotionDecision(promoted=promoted, reason=reason, version=v, K=K, new_al=new_al, champion_al=champ_al,
                              champion_version=v if promoted else (str(champ.version) if champ else None))
        if promoted:
            _set_champion(client, model_name, v, history=history + [v])
        _record(client, model_name, d)
        return d

    if eval_set is not None and new_set != eval_set:
        return decide(False, f"version {v} was evaluated on {new_set!r}, the gate requires {eval_set!r}")
    if new_al is None:
        return decide(False, f"version {v} has no acceptance length at K={K} (tags al.K{K}); evaluate it at K={K}")
    if champ is None:
        return decide(True, f"no champion yet; version {v} (AL {new_al:.3f} at K={K} on {new_set}) becomes champion")
    if str(champ.version) == v:
        return decide(False, f"version {v} is already the champion")
    champ_al, champ_set = _al_at(champ, K), _tag(champ, "eval_set")
    if champ_set != new_set:
        return decide(False, f"champion v{champ.version} was evaluated on {champ_set!r}, version {v} on "
                             f"{new_set!r}: ALs are not comparable; re-evaluate both on one eval set")
    if champ_al is None:
        return decide(False, f"champion v{champ.version} has no AL at K={K}; re-evaluate it at K={K} or promote "
                             "by hand (peagle registry promote --force)")
    if new_al > champ_al + promote_margin:
        return decide(True, f"AL {new_al:.3f} > champion v{champ.version} AL {champ_al:.3f} + margin "
                            f"{promote_margin:g} at K={K} on {new_set}", champ_al)
    return decide(False, f"AL {new_al:.3f} does not beat champion v{champ.version} AL {champ_al:.3f} + margin "
                         f"{promote_margin:g} at K={K} on {new_set}; champion stays", champ_al)


def promote(model_name: str, version: str | int, *, reason: str = "forced promotion",
            tracking_uri: str | None = None) -> PromotionDecision:
    """Move ``champion`` to ``version`` without the gate (history kept for :func:`rollback`)."""
    client = get_client(tracking_uri)
    mv = client.get_model_version(model_name, str(version))
    champ = _current_champion(client, model_name)
    history = _history(client, model_name)
    if champ is not None and str(champ.version) == str(mv.version):
        d = PromotionDecision(False, f"version {mv.version} is already the champion", str(mv.version),
                              str(mv.version), int(_tag(mv, "K") or 0))
    else:
        _set_champion(client, model_name, str(mv.version), history=history + [str(mv.version)])
        d = PromotionDecision(True, reason, str(mv.version), str(mv.version), int(_tag(mv, "K") or 0))
    _record(client, model_name, d)
    return d


def rollback(model_name: str, *, tracking_uri: str | None = None):
    """Restore the previous champion (from the ``champion_history`` tag) and return its version.

    Raises:
        ValueError: there is no previous champion to roll back to.
    """
    client = get_client(tracking_uri)
    history = _history(client, model_name)
    champ = _current_champion(client, model_name)
    if champ is not None and (not history or history[-1] != str(champ.version)):
        history.append(str(champ.version))  # alias moved by hand outside peagle
    if len(history) < 2:
        raise ValueError(f"{model_name}: champion history {history} has no previous champion to roll back to")
    dropped, previous = history[-1], history[-2]
    _set_champion(client, model_name, previous, history=history[:-1])
    client.set_model_version_tag(model_name, dropped, "rolled_back", "true")
    log.warning("%s: rolled champion back from v%s to v%s", model_name, dropped, previous)
    return client.get_model_version(model_name, previous)


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
    """Rows ``{name, version, aliases, method, eval_set, K, acceptance_length, promotion_decision, run_id}``."""
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
                "method": _tag(mv, "method"), "eval_set": _tag(mv, "eval_set"), "K": _tag(mv, "K"),
                "acceptance_length": _tag(mv, "acceptance_length"),
                "promotion_decision": _tag(mv, "promotion_decision"), "run_id": mv.run_id,
            })
    rows.sort(key=lambda r: (r["name"], int(r["version"])))
    return rows


__all__ = [
    "CHALLENGER", "CHAMPION", "PromotionDecision", "download", "get_client", "list_versions", "log_run",
    "manifest_hash", "maybe_promote", "parse_model_ref", "promote", "register_head",
    "rollback",
]
