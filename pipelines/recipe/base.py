"""Base of every recipe section: unknown keys are errors, assignments are validated."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Dtype = Literal["float32", "bfloat16", "float16"]
OnBadRow = Literal["skip", "fail"]


class Section(BaseModel):
    """A recipe section: ``extra="forbid"`` (a misspelt key is an error), ``validate_assignment``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class _KeyNeutralWhenNone:
    """The type of :data:`KEY_NEUTRAL_WHEN_NONE` (one instance)."""

    def __repr__(self) -> str:
        return "KEY_NEUTRAL_WHEN_NONE"


KEY_NEUTRAL_WHEN_NONE = _KeyNeutralWhenNone()
"""Field marker, ``name: Annotated[T | None, KEY_NEUTRAL_WHEN_NONE] = Field(None, ...)``: a field added after the
stage keys were fixed. A stage key (``pipelines.stages.base.stage_key``) leaves it out while it is None (its
default), so a recipe that does not use it keeps its key and its run directory. The marker sits on the field,
not in a list of class names: renaming a section class changes no key."""


def is_key_neutral_when_none(field_info) -> bool:
    """Whether a pydantic ``FieldInfo`` carries :data:`KEY_NEUTRAL_WHEN_NONE`."""
    return any(m is KEY_NEUTRAL_WHEN_NONE for m in field_info.metadata)
