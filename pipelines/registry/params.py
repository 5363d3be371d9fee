"""Nested parameters as MLflow takes them: flat ``section.field`` keys (the training tracker and the
registry log recipes this way)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["flatten"]


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"training": {"lr": 1e-4}}`` -> ``{"training.lr": 1e-4}`` (mappings at any depth; other values kept)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out |= flatten(v, key + ".")
        else:
            out[key] = v
    return out
