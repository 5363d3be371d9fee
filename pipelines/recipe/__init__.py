"""Typed recipe: one pydantic model per stage, each stage receives only its section.

A recipe is a YAML file (see ``configs/``) loaded with :func:`load_recipe`. Everything that can be
checked without the target's weights is checked at load time (K >= 1, aux layer ids inside the
target, mask_token_id / draft_vocab_size inside the vocab, ...); checks that need the real target
(chat template, real layer count) live in :func:`validate_against_target`, which stages call right
after loading the target and before spending compute. Errors name the field and the fix.

Aux layer ids use vLLM's meaning, "input of layer i" = HF ``hidden_states[i]``; vLLM's default is
(2, N // 2, N - 3) (vllm/model_executor/models/llama_eagle3.py).

Modules: ``base`` (the section base class, dtype literals), ``target``, ``data`` (prompt sources),
``stages`` (regenerate, capture, drafter, training, evaluation, registry, serving), ``traffic`` (the
Serve traffic log and the traffic source), ``load`` (the whole
:class:`Recipe` and loading it), ``checks`` (:func:`validate_against_target`). This package's names are
its interface: import them from ``pipelines.recipe``.
"""

from pipelines.recipe.base import Dtype, OnBadRow, Section
from pipelines.recipe.checks import chat_template_token_ids, validate_against_target
from pipelines.recipe.data import (
    FILE_KINDS,
    PACKAGED_KINDS,
    DataConfig,
    SelfInstructConfig,
    SourceConfig,
    SourceKind,
)
from pipelines.recipe.load import Recipe, load_recipe, parse_overrides, recipe_from_dict
from pipelines.recipe.stages import (
    CaptureConfig,
    DrafterSpec,
    EvalConfig,
    RegenerateConfig,
    RegistryConfig,
    ServeConfig,
    ServeDeployment,
    TrainingConfig,
)
from pipelines.recipe.target import TargetConfig, check_aux_layer_ids
from pipelines.recipe.traffic import TrafficLogConfig, TrafficSourceConfig

__all__ = [
    "FILE_KINDS",
    "PACKAGED_KINDS",
    "CaptureConfig",
    "DataConfig",
    "DrafterSpec",
    "Dtype",
    "EvalConfig",
    "OnBadRow",
    "Recipe",
    "RegenerateConfig",
    "RegistryConfig",
    "Section",
    "SelfInstructConfig",
    "ServeConfig",
    "ServeDeployment",
    "SourceConfig",
    "SourceKind",
    "TargetConfig",
    "TrafficLogConfig",
    "TrafficSourceConfig",
    "TrainingConfig",
    "chat_template_token_ids",
    "check_aux_layer_ids",
    "load_recipe",
    "parse_overrides",
    "recipe_from_dict",
    "validate_against_target",
]
