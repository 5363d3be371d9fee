"""Target-side capture for HF transformers targets: aux hidden states at vLLM's layer ids.

vLLM semantics (``vllm/model_executor/models/llama.py``, EAGLE-3 aux layers): id ``i`` is the
*input* of decoder layer ``i``, i.e. HF ``hidden_states[i]`` (0 = embeddings). Captured with
forward pre-hooks on ``model.model.layers[i]`` so no other layer's states are kept.

Shape legend: B batch, T tokens, Ht target hidden, V target vocab.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of an HF causal LM (``model.model.layers`` for Llama-style models).

    Raises:
        TypeError: the model has no recognizable decoder layer list.
    """
    for path in ("model.layers", "model.decoder.layers", "transformer.h", "layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    raise TypeError(f"{type(model).__name__}: no decoder layer list found (expected model.model.layers)")


def final_norm(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", model)
    norm = getattr(inner, "norm", None)
    if norm is None:
        raise TypeError(f"{type(model).__name__}: no final norm (expected model.model.norm)")
    return norm


@dataclass
class TargetOutput:
    """One target forward. ``aux [B, T, 3*Ht]`` (layer ids in order), ``final_hidden [B, T, Ht]``
    (after the final norm: ``lm_head(final_hidden)`` = logits), ``logits [B, T, V]`` or None,
    ``past_key_values`` when ``use_cache``."""

    aux: torch.Tensor
    final_hidden: torch.Tensor
    logits: torch.Tensor | None
    past_key_values: Any = None


@contextmanager
def capture_aux(model: nn.Module, layer_ids: tuple[int, ...]) -> Iterator[dict[str, Any]]:
    """Context manager: during a forward, records the inputs of ``layers[i]`` for ``i`` in
    ``layer_ids`` and the output of the final norm into the yielded dict (keys ``aux_<i>``,
    ``final``).

    Raises:
        ValueError: a layer id outside ``[0, num_layers)``.
    """
    layers = decoder_layers(model)
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"aux layer ids {bad} outside [0, {len(layers)}) for this target (vLLM: input of layer i)")
    store: dict[str, Any] = {}
    handles = []

    def pre_hook(i: int):
        def fn(module, args, kwargs):
            store[f"aux_{i}"] = args[0] if args else kwargs["hidden_states"]
        return fn

    for i in layer_ids:
        handles.append(layers[i].register_forward_pre_hook(pre_hook(i), with_kwargs=True))
    handles.append(final_norm(model).register_forward_hook(lambda m, a, out: store.__setitem__("final", out)))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def target_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    layer_ids: tuple[int, ...],
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values: Any = None,
    use_cache: bool = False,
    return_logits: bool = True,
) -> TargetOutput:
    """Run the target on ``input_ids [B, T]`` and return its aux hidden states.

    ``return_logits=False`` skips the ``[B, T, V]`` lm_head (capture needs only hidden states).
    """
    with capture_aux(model, layer_ids) as store:
        if return_logits:
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=past_key_values, use_cache=use_cache)
            logits, past = out.logits, getattr(out, "past_key_values", None)
        else:
            inner = getattr(model, "model", model)
            out = inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=past_key_values, use_cache=use_cache)
            logits, past = None, getattr(out, "past_key_values", None)
    aux = torch.cat([store[f"aux_{i}"] for i in layer_ids], dim=-1)  # [B, T, 3*Ht]
    return TargetOutput(aux=aux, final_hidden=store["final"], logits=logits, past_key_values=past)
