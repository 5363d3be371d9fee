"""The champion/challenger promotion gate over the MLflow registry's aliases.

Stages are deprecated in MLflow 3; the registry uses aliases:

- ``challenger``: the newest registered version (set by :func:`pipelines.register.register_head`);
- ``champion``: the version served (``models:/NAME@champion``), moved only by :func:`maybe_promote`
  (gate: new acceptance length (AL) at the gate K beats the champion's on the same eval set by
  ``promote_margin``), :func:`promote` (forced) and :func:`rollback`.

Every champion move appends to the registered model tag ``champion_history`` (JSON list of
versions), so :func:`rollback` can restore the previous champion. A gate's outcome is written to the
version tags ``promotion_decision``/``promotion_reason`` (and to its run's tags).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from pipelines.register import CHALLENGER, get_client, version_tag

log = logging.getLogger(__name__)

CHAMPION = "champion"
HISTORY_TAG = "champion_history"


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
    """Past champion versions, oldest first (registered model tag ``champion_history``)."""
    raw = (client.get_registered_model(model_name).tags or {}).get(HISTORY_TAG)
    return [str(v) for v in json.loads(raw)] if raw else []


def _current_champion(client, model_name: str):
    """The ``champion`` model version, or None when no version holds the alias."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(model_name, CHAMPION)
    except MlflowException:
        return None


def _set_champion(client, model_name: str, version: str, *, history: list[str]) -> None:
    """Point ``champion`` at ``version`` and store ``history`` (ending with the new champion)."""
    client.set_registered_model_alias(model_name, CHAMPION, str(version))
    client.set_registered_model_tag(model_name, HISTORY_TAG, json.dumps(history))


def _record(client, model_name: str, d: PromotionDecision) -> None:
    """Write the decision to the version's tags and, when it still exists, its run's tags; log it."""
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

    Raises:
        mlflow.exceptions.MlflowException: unknown model or version, or no ``challenger`` when ``version``
            is None.
    """
    client = get_client(tracking_uri)
    mv = (client.get_model_version_by_alias(model_name, CHALLENGER) if version is None
          else client.get_model_version(model_name, str(version)))
    v = str(mv.version)
    new_al = _al_at(mv, K)
    new_set = version_tag(mv, "eval_set")
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
    champ_al, champ_set = _al_at(champ, K), version_tag(champ, "eval_set")
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
    """Move ``champion`` to ``version`` without the gate (history kept for :func:`rollback`).

    Raises:
        mlflow.exceptions.MlflowException: unknown model or version.
    """
    client = get_client(tracking_uri)
    mv = client.get_model_version(model_name, str(version))
    champ = _current_champion(client, model_name)
    history = _history(client, model_name)
    if champ is not None and str(champ.version) == str(mv.version):
        d = PromotionDecision(False, f"version {mv.version} is already the champion", str(mv.version),
                              str(mv.version), int(version_tag(mv, "K") or 0))
    else:
        _set_champion(client, model_name, str(mv.version), history=history + [str(mv.version)])
        d = PromotionDecision(True, reason, str(mv.version), str(mv.version), int(version_tag(mv, "K") or 0))
    _record(client, model_name, d)
    return d


def rollback(model_name: str, *, tracking_uri: str | None = None):
    """Restore the previous champion (from the ``champion_history`` tag) and return its version.

    Raises:
        ValueError: there is no previous champion to roll back to.
        mlflow.exceptions.MlflowException: unknown model.
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


def _al_at(mv, K: int) -> float | None:
    """AL of a model version at served ``K`` (tag ``al.K<K>``, else ``acceptance_length`` when its
    ``K`` tag is ``K``), else None."""
    v = version_tag(mv, f"al.K{K}")
    if v is None and version_tag(mv, "K") == str(K):
        v = version_tag(mv, "acceptance_length")
    return float(v) if v is not None else None
