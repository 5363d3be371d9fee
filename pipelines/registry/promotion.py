"""The champion/challenger promotion gate over the MLflow registry's aliases.

Stages are deprecated in MLflow 3; the registry uses aliases:

- ``challenger``: the newest registered version (set by :func:`pipelines.registry.register.register_head`);
- ``champion``: the version served (``models:/NAME@champion``), moved only by :func:`maybe_promote`
  (gate: new acceptance length (AL) at the gate K beats the champion's on the same eval set by
  ``promote_margin``), :func:`promote` (forced) and :func:`rollback`.

The champion's AL the gate compares with is, by preference, the one measured in the challenger's own
evaluate run (:class:`MeasuredChampion`: same prompts, K sweep and engine settings; the evaluate stage
does this when ``evaluation.compare_champion`` is on, by default for a warm start from the registry);
otherwise the AL tagged on the champion when it was registered, on the same eval set.

Champion history (what :func:`rollback` restores): every champion move adds its own registered model
tag ``champion_history.<time_ns>-v<version>-<random>`` (JSON ``{"event": "promote"|"rollback", ...}``);
the history is those entries replayed in key order, after the versions of the single JSON-list tag
``champion_history`` that registries written before kept (read, never rewritten). Writers never
rewrite a shared value, so concurrent moves cannot drop each other's entries. A gate's outcome is
written to the version tags ``promotion_decision``/``promotion_reason`` (and to its run's tags).

Concurrency: :func:`maybe_promote`, :func:`promote` and :func:`rollback` hold an exclusive file lock
per (store, model) for their read-decide-write (``settings.locks_dir``: beside a local sqlite
database, else ``$PEAGLE_HOME/locks``), so on one host (or on hosts sharing a sqlite file) champion
moves are serialized and the champion is the newest entry. Across hosts of one tracking server the
lock does not reach: the per-entry tags still keep every entry, but two gates may decide against the
same champion.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pipelines import settings
from pipelines.registry.register import CHALLENGER, get_client, version_tag

log = logging.getLogger(__name__)

CHAMPION = "champion"
HISTORY_TAG = "champion_history"  # legacy: one JSON list of versions (read, never written)
HISTORY_ENTRY_PREFIX = HISTORY_TAG + "."  # one tag per champion move, keys ordered by time
LOCK_TIMEOUT_S = 120.0  # longest wait for another process's champion move


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


@dataclass(frozen=True)
class MeasuredChampion:
    """The champion as the challenger's evaluate run measured it (``evaluation.compare_champion``).

    ``version``: the champion version measured (None: there was no champion when the run started);
    ``al``: its AL at the gate K on the gate eval set (None: not measured at that K); ``eval_set``: that set.
    """

    version: str | None
    al: float | None
    eval_set: str


@contextmanager
def champion_lock(model_name: str, tracking_uri: str | None = None, *,
                  timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the exclusive champion lock of ``model_name`` in the store ``tracking_uri`` (``fcntl.flock`` on
    a file under ``settings.locks_dir``; per open file, so threads of one process exclude each other too).

    Raises:
        TimeoutError: not acquired within ``timeout_s`` (the lock file is named).
    """
    uri = settings.tracking_uri(tracking_uri)
    d = settings.locks_dir(uri)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"champion-{hashlib.sha256(f'{uri}|{model_name}'.encode()).hexdigest()[:16]}.lock"
    deadline = time.monotonic() + timeout_s
    with open(path, "a") as f:
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{model_name}: champion lock {path} still held after {timeout_s:g} s by "
                                       "another promote/rollback; retry, or delete the file if no such process "
                                       "runs") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def history_entries(client, model_name: str) -> list[tuple[str, dict]]:
    """The champion-history entries ``(tag key, event)`` of ``model_name``, oldest first: the legacy
    ``champion_history`` list's versions as promote events (keys ``champion_history[i]``), then the
    per-move tags in key order."""
    tags = client.get_registered_model(model_name).tags or {}
    legacy = json.loads(tags[HISTORY_TAG]) if tags.get(HISTORY_TAG) else []
    entries = [(f"{HISTORY_TAG}[{i}]", {"event": "promote", "version": str(v)}) for i, v in enumerate(legacy)]
    return entries + [(k, json.loads(tags[k])) for k in sorted(tags) if k.startswith(HISTORY_ENTRY_PREFIX)]


def _history(client, model_name: str) -> list[str]:
    """Past champion versions, oldest first (the last one the current champion): the entries replayed,
    a promote pushing its version, a rollback popping its version when it is on top."""
    stack: list[str] = []
    for _, e in history_entries(client, model_name):
        if e.get("event") == "promote":
            stack.append(str(e["version"]))
        elif e.get("event") == "rollback" and stack and stack[-1] == str(e["version"]):
            stack.pop()
    return stack


def _add_entry(client, model_name: str, event: dict) -> None:
    """Add one history entry under a key no other writer uses (time-ordered, random suffix)."""
    key = f"{HISTORY_ENTRY_PREFIX}{time.time_ns():020d}-v{event['version']}-{secrets.token_hex(4)}"
    client.set_registered_model_tag(model_name, key, json.dumps(event, separators=(",", ":")))


def current_champion(client, model_name: str):
    """The ``champion`` model version (``ModelVersion``, tags included) of ``model_name``, or None when no
    version holds the alias (or the model does not exist)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(model_name, CHAMPION)
    except MlflowException:
        return None


def _set_champion(client, model_name: str, version: str, *, history: list[str]) -> None:
    """Point ``champion`` at ``version``, then add its history entry unless ``history`` (the current one)
    already ends with it (a move interrupted between the two, repeated)."""
    client.set_registered_model_alias(model_name, CHAMPION, str(version))
    if not history or history[-1] != str(version):
        _add_entry(client, model_name, {"event": "promote", "version": str(version)})


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
    measured: MeasuredChampion | None = None,
    tracking_uri: str | None = None,
) -> PromotionDecision:
    """Promotion gate: move ``champion`` to ``version`` only if its AL at ``K`` beats the champion's.

    Rule: promoted iff there is no champion, or both versions have an AL at ``K`` on the same eval
    set and ``new_al > champion_al + promote_margin``. Otherwise the champion stays; the reason is
    returned and recorded as tags (``promotion_decision``, ``promotion_reason``).

    With ``measured`` the champion's AL is the one measured in the candidate's evaluate run (same
    prompts and engine settings), not its registered tag, and the reason says so with both ALs. The
    champion must still be ``measured.version``: a champion that moved since (another refresh promoted,
    a rollback), or appeared since, refuses the candidate (re-run evaluate: its key holds the champion
    version, so it measures the new one).

    Args:
        version: candidate version; None = the ``challenger`` alias.
        K: the gate's served K (``RegistryConfig.gate_num_speculative_tokens``).
        promote_margin: required AL improvement (AL units, tokens per target step).
        eval_set: required eval set of both versions; None = the candidate's.
        measured: the champion as the candidate's evaluate run measured it; None = use the champion's tags.

    The read-decide-move runs under :func:`champion_lock`. A version that already holds ``champion`` but
    has no recorded decision (a promotion interrupted after the alias moved) is reported promoted, and
    its history entry added if missing.

    Raises:
        mlflow.exceptions.MlflowException: unknown model or version, or no ``challenger`` when ``version``
            is None.
        TimeoutError: the champion lock was not acquired in ``LOCK_TIMEOUT_S``.
    """
    with champion_lock(model_name, tracking_uri):
        return _gate(model_name, version, K=K, promote_margin=promote_margin, eval_set=eval_set,
                     measured=measured, tracking_uri=tracking_uri)


def _gate(model_name: str, version: str | int | None, *, K: int, promote_margin: float, eval_set: str | None,
          measured: MeasuredChampion | None, tracking_uri: str | None) -> PromotionDecision:
    """:func:`maybe_promote` without the lock."""
    client = get_client(tracking_uri)
    mv = (client.get_model_version_by_alias(model_name, CHALLENGER) if version is None
          else client.get_model_version(model_name, str(version)))
    v = str(mv.version)
    new_al = _al_at(mv, K)
    new_set = version_tag(mv, "eval_set")
    champ = current_champion(client, model_name)
    history = _history(client, model_name)

    def decide(promoted: bool, reason: str, champ_al: float | None = None) -> PromotionDecision:
        d = PromotionDecision(promoted=promoted, reason=reason, version=v, K=K, new_al=new_al, champion_al=champ_al,
                              champion_version=v if promoted else (str(champ.version) if champ else None))
        if promoted:
            _set_champion(client, model_name, v, history=history)
        _record(client, model_name, d)
        return d

    if eval_set is not None and new_set != eval_set:
        return decide(False, f"version {v} was evaluated on {new_set!r}, the gate requires {eval_set!r}")
    if new_al is None:
        return decide(False, f"version {v} has no acceptance length at K={K} (tags al.K{K}); evaluate it at K={K}")
    if champ is not None and str(champ.version) == v:
        if version_tag(mv, "promotion_decision") is None:  # alias moved, then interrupted before the record
            return decide(True, f"version {v} already holds {CHAMPION} (an interrupted promotion); decision recorded")
        return decide(False, f"version {v} is already the champion")
    if measured is not None:
        return _gate_measured(decide, champ, measured, v=v, new_al=new_al, new_set=new_set, K=K,
                              promote_margin=promote_margin)
    if champ is None:
        return decide(True, f"no champion yet; version {v} (AL {new_al:.3f} at K={K} on {new_set}) becomes champion")
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


def _gate_measured(decide, champ, measured: MeasuredChampion, *, v: str, new_al: float, new_set: str | None, K: int,
                   promote_margin: float) -> PromotionDecision:
    """The gate's rule against the champion measured in the candidate's evaluate run (``champ``: the current
    champion version or None; ``decide(promoted, reason, champion_al)`` records the outcome)."""
    current = str(champ.version) if champ is not None else None
    if current != measured.version:
        then = f"v{measured.version}" if measured.version is not None else "no champion"
        return decide(False, f"the champion is {f'v{current}' if current else 'unset'} now but version {v}'s "
                             f"evaluate run measured {then}: the ALs are not comparable; re-run evaluate "
                             "(its key holds the champion version) and register")
    if measured.version is None:
        return decide(True, f"no champion yet; version {v} (AL {new_al:.3f} at K={K} on {new_set}) becomes champion")
    if measured.eval_set != new_set:
        return decide(False, f"champion v{measured.version} was measured on {measured.eval_set!r}, version {v} on "
                             f"{new_set!r}: ALs are not comparable; measure both on the gate eval set")
    if measured.al is None:
        return decide(False, f"champion v{measured.version} has no AL at K={K} in this evaluate run; add K={K} to "
                             "evaluation.num_speculative_tokens_sweep")
    both = (f"AL {new_al:.3f} vs champion v{measured.version} AL {measured.al:.3f} (both measured in this evaluate "
            f"run) + margin {promote_margin:g} at K={K} on {new_set}")
    if new_al > measured.al + promote_margin:
        return decide(True, f"promoted: {both}", measured.al)
    return decide(False, f"champion stays: {both}", measured.al)


def promote(model_name: str, version: str | int, *, reason: str = "forced promotion",
            tracking_uri: str | None = None) -> PromotionDecision:
    """Move ``champion`` to ``version`` without the gate (history kept for :func:`rollback`).

    Serialized with the other champion moves (:func:`champion_lock`): concurrent calls each add their
    history entry; the champion afterwards is the last entry.

    Raises:
        mlflow.exceptions.MlflowException: unknown model or version.
        TimeoutError: the champion lock was not acquired in ``LOCK_TIMEOUT_S``.
    """
    with champion_lock(model_name, tracking_uri):
        client = get_client(tracking_uri)
        mv = client.get_model_version(model_name, str(version))
        champ = current_champion(client, model_name)
        history = _history(client, model_name)
        if champ is not None and str(champ.version) == str(mv.version):
            d = PromotionDecision(False, f"version {mv.version} is already the champion", str(mv.version),
                                  str(mv.version), int(version_tag(mv, "K") or 0))
        else:
            _set_champion(client, model_name, str(mv.version), history=history)
            d = PromotionDecision(True, reason, str(mv.version), str(mv.version), int(version_tag(mv, "K") or 0))
        _record(client, model_name, d)
        return d


def rollback(model_name: str, *, tracking_uri: str | None = None):
    """Restore the previous champion (from the champion history) and return its version.

    Adds a ``rollback`` history entry (the replayed history drops the rolled-back version; the entry
    that promoted it stays) and tags the dropped version ``rolled_back``; under :func:`champion_lock`.

    Raises:
        ValueError: there is no previous champion to roll back to.
        mlflow.exceptions.MlflowException: unknown model.
        TimeoutError: the champion lock was not acquired in ``LOCK_TIMEOUT_S``.
    """
    with champion_lock(model_name, tracking_uri):
        client = get_client(tracking_uri)
        history = _history(client, model_name)
        champ = current_champion(client, model_name)
        if champ is not None and (not history or history[-1] != str(champ.version)):
            history.append(str(champ.version))  # alias moved by hand outside peagle: not in the entries
        if len(history) < 2:
            raise ValueError(f"{model_name}: champion history {history} has no previous champion to roll back to")
        dropped, previous = history[-1], history[-2]
        # entry first: interrupted before the alias moved, a repeated rollback still ends at ``previous``
        _add_entry(client, model_name, {"event": "rollback", "version": dropped, "to": previous})
        client.set_registered_model_alias(model_name, CHAMPION, previous)
        client.set_model_version_tag(model_name, dropped, "rolled_back", "true")
        log.warning("%s: rolled champion back from v%s to v%s", model_name, dropped, previous)
        return client.get_model_version(model_name, previous)


def recorded_decision(model_name: str, version: str | int, *, K: int,
                      tracking_uri: str | None = None) -> PromotionDecision | None:
    """The gate decision already recorded on ``version`` (tags ``promotion_decision``/``promotion_reason``),
    with the current champion; None when the version has none. The register stage re-reads it on a
    re-run instead of deciding again.

    Raises:
        mlflow.exceptions.MlflowException: unknown model or version.
    """
    client = get_client(tracking_uri)
    mv = client.get_model_version(model_name, str(version))
    decision = version_tag(mv, "promotion_decision")
    if decision is None:
        return None
    champ = current_champion(client, model_name)
    return PromotionDecision(promoted=decision == "promoted", reason=version_tag(mv, "promotion_reason") or "",
                             version=str(mv.version), champion_version=str(champ.version) if champ else None, K=K,
                             new_al=_al_at(mv, K))


def _al_at(mv, K: int) -> float | None:
    """AL of a model version at served ``K`` (tag ``al.K<K>``, else ``acceptance_length`` when its
    ``K`` tag is ``K``), else None."""
    v = version_tag(mv, f"al.K{K}")
    if v is None and version_tag(mv, "K") == str(K):
        v = version_tag(mv, "acceptance_length")
    return float(v) if v is not None else None
