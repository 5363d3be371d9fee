"""Tiny random models with odd sizes for unit tests (vocab 99, hidden 36, 3-5 layers)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from peagle_core.drafter import Eagle3Drafter
from peagle_core.drafter_config import DrafterConfig

VOCAB, HIDDEN, MASK_ID = 99, 36, 97


def tiny_target_config(**kw) -> LlamaConfig:
    base = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 50, "num_hidden_layers": 5,
                "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 256,
                "tie_word_embeddings": False}
    base.update(kw)
    return LlamaConfig(**base)


@pytest.fixture
def tiny_target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_target_config()).eval()


def make_drafter(mask_token_id: int | None = MASK_ID, **kw) -> Eagle3Drafter:
    torch.manual_seed(1)
    cfg = DrafterConfig.from_target(tiny_target_config(), num_hidden_layers=kw.pop("num_hidden_layers", 2),
                                    mask_token_id=mask_token_id, **kw)
    return Eagle3Drafter(cfg).eval()


def plan_without_data(training, drafter, target, *, init_head=None):
    """A ``TrainPlan`` from the recipe sections alone, what the product's plan builders decide before they read
    any data (``pipelines.train.plan._Sizing``): the run's horizon is ``training.max_steps`` and the draft
    vocabulary is whole or the warm-start head's (nothing to count). Raises what the builders raise for a bad
    configuration or a warm-start head that does not fit."""
    from pipelines.train.plan import _Sizing

    sizes = _Sizing(training, drafter, target, init_head)
    assert training.max_steps and not sizes.needs_counts, "a plan without data needs max_steps and no counting"
    return sizes.plan([], None, ())


@pytest.fixture
def tiny_drafter() -> Eagle3Drafter:
    return make_drafter()


@pytest.fixture
def uri(tmp_path, monkeypatch) -> str:
    """A fresh sqlite MLflow store (tracking and registry) in ``tmp_path``; ``$PEAGLE_HOME`` and the working
    directory in ``tmp_path`` too, so nothing lands in the repo's ``./mlruns``."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return f"sqlite:///{tmp_path / 'mlflow.db'}"
