"""Base of every recipe section: unknown keys are errors, assignments are validated."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Dtype = Literal["float32", "bfloat16", "float16"]
OnBadRow = Literal["skip", "fail"]


class Section(BaseModel):
    """A recipe section: ``extra="forbid"`` (a misspelt key is an error), ``validate_assignment``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
