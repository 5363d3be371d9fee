"""Idempotent register lookup, serialized champion moves and the tracking-server guard, on a real sqlite
MLflow store in ``tmp_path`` (versions are created straight through ``MlflowClient``: no head needed)."""

import json
import os
import threading
import time

import pytest

from pipelines import settings
from pipelines.ports import free_port
from pipelines.registry import client as mlflow_client
from pipelines.registry import promotion
from pipelines.registry import register as reg

pytestmark = pytest.mark.unit

NAME = "peagle-tiny"


def _versions(client, n: int, tmp_path, name: str = NAME, **tags) -> list[str]:
    """``n`` versions of ``name`` gated at K=5 on eval set ``x`` (AL 2.0 + i/10), with ``tags``."""
    if not client.search_registered_models(f"name = '{name}'"):
        client.create_registered_model(name)
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    return [str(client.create_model_version(name, source=str(src), tags={"eval_set": "x", "al.K5": f"{2 + i / 10}",
                                                                             **tags}).version) for i in range(n)]


def test_find_registered_by_stage_key(uri, tmp_path):
    client = reg.get_client(uri)
    assert reg.find_registered(NAME, "k1", tracking_uri=uri) == reg.Registered(None, None)
    # interrupted after the run was logged, before the version: the run is found
    exp = reg._experiment_id(client, settings.EXPERIMENT)
    run = client.create_run(exp, tags={reg.PIPELINE_KEY_TAG: "k1"}).info.run_id
    client.create_run(exp, tags={reg.PIPELINE_KEY_TAG: "k2"})
    assert reg.find_registered(NAME, "k1", tracking_uri=uri) == reg.Registered(None, run)
    # interrupted after the version was registered: the version and its run
    _versions(client, 1, tmp_path, **{reg.PIPELINE_KEY_TAG: "k0"})
    _versions(client, 1, tmp_path, name="peagle-other", **{reg.PIPELINE_KEY_TAG: "k1"})
    src = tmp_path / "src"
    v = str(client.create_model_version(NAME, source=str(src), run_id=run, tags={reg.PIPELINE_KEY_TAG: "k1"}).version)
    found = reg.find_registered(NAME, "k1", tracking_uri=uri)
    assert str(found.version.version) == v == "2" and found.run_id == run
    assert found.version.tags[reg.PIPELINE_KEY_TAG] == "k1"
    # another head under the same key (a --force retrain) is not that version, and v's run is not free
    assert reg.find_registered(NAME, "k1", head_sha="f" * 64, tracking_uri=uri) == reg.Registered(None, None)
    client.set_model_version_tag(NAME, v, reg.HEAD_SHA256_TAG, "f" * 64)
    assert str(reg.find_registered(NAME, "k1", head_sha="f" * 64, tracking_uri=uri).version.version) == v
    assert reg.find_registered(NAME, "k3", tracking_uri=uri) == reg.Registered(None, None)
    with pytest.raises(ValueError, match="quotes"):
        reg.find_registered(NAME, "k' OR name != '", tracking_uri=uri)


def test_concurrent_promotions_keep_every_entry(uri, tmp_path):
    client = reg.get_client(uri)
    versions = _versions(client, 8, tmp_path)
    barrier, errors = threading.Barrier(8), []

    def go(v: str) -> None:
        try:
            barrier.wait(30)
            promotion.promote(NAME, v, tracking_uri=uri)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(v,)) for v in versions]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    history = promotion._history(client, NAME)
    assert sorted(history, key=int) == versions  # all 8 entries, each once
    champion = str(client.get_model_version_by_alias(NAME, promotion.CHAMPION).version)
    assert champion == history[-1]  # serialized: the last move is the champion
    entries = promotion.history_entries(client, NAME)
    assert len(entries) == 8 and all(k.startswith(promotion.HISTORY_ENTRY_PREFIX) for k, _ in entries)
    assert all(client.get_model_version(NAME, v).tags["promotion_decision"] == "promoted" for v in versions)
    # rollback walks the same history back, one entry at a time
    assert str(promotion.rollback(NAME, tracking_uri=uri).version) == history[-2]
    assert promotion._history(client, NAME) == history[:-1]
    print(f"\n8 concurrent promotions in {time.monotonic() - t0:.1f} s; history {history}")


def test_old_single_tag_history_still_read(uri, tmp_path):
    client = reg.get_client(uri)
    v1, v2, v3 = _versions(client, 3, tmp_path)
    client.set_registered_model_tag(NAME, promotion.HISTORY_TAG, json.dumps([v1, v2]))  # written by peagle before
    client.set_registered_model_alias(NAME, promotion.CHAMPION, v2)
    d = promotion.maybe_promote(NAME, v3, K=5, tracking_uri=uri)
    assert d.promoted and promotion._history(client, NAME) == [v1, v2, v3]
    assert str(promotion.rollback(NAME, tracking_uri=uri).version) == v2
    assert str(promotion.rollback(NAME, tracking_uri=uri).version) == v1
    with pytest.raises(ValueError, match="no previous champion"):
        promotion.rollback(NAME, tracking_uri=uri)
    assert json.loads(client.get_registered_model(NAME).tags[promotion.HISTORY_TAG]) == [v1, v2]  # never rewritten
    # the entries keep the whole story: the promotion of v3 and both rollbacks
    assert [e["event"] for _, e in promotion.history_entries(client, NAME)] == [
        "promote", "promote", "promote", "rollback", "rollback"]


def test_interrupted_promotion_is_completed_not_reversed(uri, tmp_path):
    client = reg.get_client(uri)
    v1, v2 = _versions(client, 2, tmp_path)
    promotion.promote(NAME, v1, tracking_uri=uri)
    # a gate moved the alias to v2 and died before its history entry and decision tags
    client.set_registered_model_alias(NAME, promotion.CHAMPION, v2)
    assert promotion.recorded_decision(NAME, v2, K=5, tracking_uri=uri) is None
    d = promotion.maybe_promote(NAME, v2, K=5, tracking_uri=uri)
    assert d.promoted and d.champion_version == v2 and "interrupted" in d.reason
    assert promotion._history(client, NAME) == [v1, v2]
    again = promotion.recorded_decision(NAME, v2, K=5, tracking_uri=uri)
    assert again.promoted and again.reason == d.reason and again.champion_version == v2


def test_guard_fails_fast_on_a_dead_server(monkeypatch):
    for k in mlflow_client.BOUNDED_HTTP_ENV:
        monkeypatch.delenv(k, raising=False)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(reg.TrackingUnreachableError) as e, reg.tracking_guard(dead, hint="re-run later"):
        pytest.fail("the body must not run against a dead server")
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert msg == f"MLflow tracking server {dead} is not reachable (no answer from /health in 3 tries); re-run later"
    assert not any(k in os.environ for k in mlflow_client.BOUNDED_HTTP_ENV)  # nothing left behind


def test_guard_passes_local_store_errors_through(uri):
    with pytest.raises(KeyError), reg.tracking_guard(uri) as resolved:
        assert resolved == uri
        raise KeyError("not an outage")
