"""The whole recipe (:class:`Recipe`, one section per stage, cross-section checks) and loading it from
YAML, a mapping, and ``section.field=value`` overrides."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from pipelines.recipe.base import Section
from pipelines.recipe.data import DataConfig
from pipelines.recipe.stages import (
    CaptureConfig,
    DrafterSpec,
    EvalConfig,
    RegenerateConfig,
    RegistryConfig,
    ServeConfig,
    TrainingConfig,
)
from pipelines.recipe.target import TargetConfig, check_aux_layer_ids


class Recipe(Section):
    """A whole pipeline run: one section per stage."""

    name: str = Field(..., min_length=1, description="Recipe name (run names, registry tags).")
    target: TargetConfig = Field(default_factory=TargetConfig, description="Target model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt sources and split.")
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig, description="Response regeneration.")
    capture: CaptureConfig = Field(default_factory=CaptureConfig, description="Hidden-state capture.")
    drafter: DrafterSpec = Field(default_factory=DrafterSpec, description="Drafter architecture.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Drafter training.")
    evaluation: EvalConfig = Field(default_factory=EvalConfig, description="Acceptance-length evaluation.")
    registry: RegistryConfig = Field(default_factory=RegistryConfig, description="MLflow registry.")
    serving: ServeConfig = Field(default_factory=ServeConfig, description="Ray Serve deployment.")

    @model_validator(mode="after")
    def _cross_checks(self):
        t, d = self.target, self.drafter
        if not self.regenerate.enabled and any(s.kind == "self_instruct" for s in self.data.sources):
            raise ValueError("data.sources has a self_instruct source but regenerate.enabled is false: its prompts "
                             "have no answers until the target writes them; enable regenerate or drop the source")
        n = t.known("num_hidden_layers")
        if t.aux_layer_ids is not None and n is not None:
            check_aux_layer_ids(t.aux_layer_ids, n)
        elif t.aux_layer_ids is not None and any(i < 0 for i in t.aux_layer_ids):
            raise ValueError(f"target.aux_layer_ids={list(t.aux_layer_ids)}: ids must be >= 0")
        if d.mask_token_id is None:
            reserved = t.reserved_mask_token_id()
            if reserved is None:
                raise ValueError(
                    f"drafter.mask_token_id is required for target.model={t.model!r}: set it to a reserved, "
                    "unused special token id of the target tokenizer (e.g. 128002 for Llama-3, 151669 for Qwen3)"
                )
            d = d.model_copy(update={"mask_token_id": reserved})  # never mutate the caller's object
            object.__setattr__(self, "drafter", d)  # bypass validate_assignment (no re-validation loop)
        t.check_token_id(d.mask_token_id, "drafter.mask_token_id")
        if t.embedded is not None and d.mask_token_id in t.embedded.template_token_ids:
            raise ValueError(
                f"drafter.mask_token_id={d.mask_token_id} is a token the {t.model} chat template emits "
                f"(template/bos/eos/pad/unk ids {sorted(t.embedded.template_token_ids)}); use a reserved id "
                f"such as {t.embedded.reserved_token_id} ({t.embedded.reserved_token})"
            )
        v = t.known("vocab_size")
        if d.draft_vocab_size is not None and v is not None and d.draft_vocab_size > v:
            raise ValueError(
                f"drafter.draft_vocab_size={d.draft_vocab_size} > target vocab_size={v}; use <= {v} or null "
                "for the full vocab"
            )
        return self

    def resolved_aux_layer_ids(self) -> tuple[int, int, int] | None:
        """Aux layer ids if the target's layer count is known without loading it, else None."""
        return self.target.resolve_aux_layer_ids() if self.target.known("num_hidden_layers") else None

    def dump_resolved(self) -> str:
        """YAML of the recipe with every default filled in (aux_layer_ids and mask_token_id resolved
        where known): loading it gives an equal recipe."""
        data = self.model_dump(mode="json")
        aux = self.resolved_aux_layer_ids()
        if aux is not None:
            data["target"]["aux_layer_ids"] = list(aux)
        return yaml.safe_dump(data, sort_keys=False)


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    """Set ``dotted`` (``training.lr``; a number names an item of a list: ``data.sources.0.path``) in ``data``.

    Raises:
        ValueError: a key through a value that is neither a section nor a list, or a list index out of range.
    """
    keys = dotted.split(".")
    node: Any = data
    for i, k in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not (k.isdigit() and int(k) < len(node)):
                raise ValueError(f"override {dotted!r}: {k!r} is not an item of the {len(node)} in "
                                 f"{'.'.join(keys[:i])} (0..{len(node) - 1})")
            if last:
                node[int(k)] = value
            else:
                node = node[int(k)]
        elif isinstance(node, dict):
            if last:
                node[k] = value
            else:
                node = node.setdefault(k, {})
        else:
            raise ValueError(f"override {dotted!r}: {keys[i - 1]!r} is not a section")  # noqa: TRY004 (config mistake)


def parse_overrides(overrides: list[str] | None) -> list[tuple[str, Any]]:
    """``["training.lr=3e-4", "target.aux_layer_ids=[2,4,6]"]`` -> [(key, YAML-parsed value)]."""
    out = []
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} must look like section.field=value (e.g. training.lr=3e-4)")
        out.append((key.strip(), yaml.safe_load(raw)))
    return out


def recipe_from_dict(data: dict[str, Any], overrides: list[str] | None = None, source: str = "<dict>") -> Recipe:
    """Validate a recipe mapping (plus dotted overrides).

    Raises:
        ValueError: with every offending field path and the fix.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a recipe must be a YAML mapping, got {type(data).__name__}")  # noqa: TRY004
    data = copy.deepcopy(data)  # overrides into its lists must not reach the caller's mapping
    for key, value in parse_overrides(overrides):
        _set_dotted(data, key, value)
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "<recipe>"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {loc}: {msg}" + (f" (got {err['input']!r})" if err["type"] != "value_error" and
                                               not isinstance(err.get("input"), dict) else ""))
        raise ValueError(f"invalid recipe {source}:\n" + "\n".join(lines)) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Load and validate a YAML recipe. ``overrides``: ``section.field=value`` strings (YAML values).

    Raises:
        ValueError: missing file, bad YAML, or invalid fields (every one named with its fix).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"recipe file {path} does not exist; see configs/ for examples")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"recipe {path} is not valid YAML: {e}") from None
    return recipe_from_dict(data, overrides, source=str(path))
