"""The target model of capture: where it lives (materialized once under PEAGLE_HOME), loading it,
and which capture backends this machine can run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pipelines.recipe import CaptureConfig, TargetConfig


def resolve_target(target_cfg: TargetConfig) -> tuple[Any, dict[str, Any]]:
    """``(TargetAsset, config.json dict)`` of the target (materialized once under PEAGLE_HOME); for a
    multimodal config the text model's section (``text_config``)."""
    from pipelines.assets import ensure_target

    asset = ensure_target(target_cfg.model, target_cfg.dtype)
    config = json.loads((Path(asset.path) / "config.json").read_text())
    config = config.get("text_config", config) if "num_hidden_layers" not in config else config
    return asset, config


def load_target(path: str | Path, dtype: str = "float32", num_threads: int | None = None):
    """``(model, tokenizer)`` from an HF directory; the model in eval mode at ``dtype`` (on CUDA if present).

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if num_threads:
        torch.set_num_threads(num_threads)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"target tokenizer at {path} has no chat_template; capture needs the target's template")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
    if torch.cuda.is_available():
        model = model.to("cuda")
    return model.eval(), tokenizer


def check_backend(capture_cfg: CaptureConfig) -> None:
    """Refuse a ``capture.backend`` this machine cannot run, before any compute.

    Raises:
        ValueError: ``vllm`` without a CUDA GPU (vLLM's ``extract_hidden_states`` is CUDA-only).
        NotImplementedError: ``vllm`` on a GPU (the documented cluster path, not wired yet).
    """
    if capture_cfg.backend == "vllm" and not torch.cuda.is_available():
        raise ValueError(
            "capture.backend=vllm uses vLLM's extract_hidden_states method (vLLM >= 0.18), which is CUDA-only; "
            "this machine has no CUDA GPU: use capture.backend=transformers"
        )
    if capture_cfg.backend == "vllm":
        raise NotImplementedError(
            "capture.backend=vllm (extract_hidden_states + ExampleHiddenStatesConnector) is the documented GPU-"
            "cluster path and is not wired yet; use capture.backend=transformers (same output contract)"
        )
