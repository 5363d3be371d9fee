"""The target's weights a drafter needs: its ``lm_head`` (the distillation target) and input
embeddings (the drafter's starting point), read from safetensors only (never ``from_pretrained``:
the target body is not needed to train a head).

Shape legend: V target vocab, Vd draft vocab, Ht target hidden.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from peagle_core.drafter import Eagle3Drafter


def _safetensors_files(target_dir: Path) -> list[Path]:
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"target directory {target_dir} holds no *.safetensors file; point target_dir at an HF "
            "safetensors model directory (pipelines.assets.ensure_target builds one)"
        )
    return files


def load_target_tensor(target_dir: str | os.PathLike, names: Iterable[str]) -> tuple[str, torch.Tensor]:
    """First tensor among ``names`` found in the target's safetensors files (sharded or not).

    Returns:
        ``(name, tensor)`` as stored (dtype unchanged).

    Raises:
        ValueError: none of ``names`` is present (lists the names tried).
    """
    target_dir = Path(target_dir)
    names = list(names)
    files = _safetensors_files(target_dir)
    index = target_dir / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text()).get("weight_map", {}) if index.is_file() else {}
    for name in names:
        candidates = [target_dir / weight_map[name]] if name in weight_map else files
        for path in candidates:
            with safe_open(str(path), framework="pt") as f:
                if name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    return name, f.get_tensor(name)
    raise ValueError(f"target {target_dir}: none of the tensors {names} found in {[p.name for p in files]}")


def load_target_lm_head(target_dir: str | os.PathLike) -> torch.Tensor:
    """The target's output projection ``[V, Ht]``: ``lm_head.weight``, or the tied
    ``model.embed_tokens.weight`` (``tie_word_embeddings``; SmolLM2 is tied)."""
    return load_target_tensor(target_dir, ["lm_head.weight", "model.embed_tokens.weight"])[1]


def load_target_embed(target_dir: str | os.PathLike) -> torch.Tensor:
    """The target's input embedding ``[V, Ht]`` (``model.embed_tokens.weight``)."""
    return load_target_tensor(target_dir, ["model.embed_tokens.weight", "embed_tokens.weight"])[1]


@torch.no_grad()
def init_drafter_from_target(drafter: Eagle3Drafter, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
    """Copy the target's embeddings and (draft-vocabulary rows of its) lm_head into the drafter.

    Why: the drafter predicts the target's own next tokens from the target's own features, so
    starting from the target's input/output embeddings puts the token spaces in place from step 0
    and the head converges much faster than from random rows (EAGLE/EAGLE-3 reuse the target's
    embedding and head; speculators initialises the draft lm_head from the target's rows of the
    draft vocabulary). ``embed_tokens`` stays trainable (P-EAGLE trains embeddings; the mask token's
    row starts as the target's unused row). Requires ``d2t`` to be installed first.

    Args:
        embed: ``[V, Ht]`` target ``embed_tokens``; lm_head: ``[V, Ht]`` target output projection.

    Raises:
        ValueError: shapes do not fit the drafter (``H != Ht`` or a different vocabulary).
    """
    cfg = drafter.config
    want = (cfg.vocab_size, cfg.hidden_size)
    for name, t in (("embed_tokens", embed), ("lm_head", lm_head)):
        if tuple(t.shape) != want:
            raise ValueError(
                f"target {name} has shape {tuple(t.shape)}, the drafter needs {want} (vocab_size, hidden_size);"
                " build the drafter with DrafterConfig.from_target(target config)"
            )
    drafter.embed_tokens.weight.copy_(embed.to(drafter.embed_tokens.weight.dtype))
    target_ids = torch.arange(cfg.draft_vocab_size, device=drafter.d2t.device) + drafter.d2t  # [Vd]
    drafter.lm_head.weight.copy_(lm_head[target_ids.cpu()].to(drafter.lm_head.weight.dtype))


LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")
"""The linear layers of a Llama decoder layer: the same names in the target (``model.layers.N.``) and the drafter."""


@torch.no_grad()
def init_drafter_layers_from_target(drafter: Eagle3Drafter, target_dir: str | os.PathLike) -> int:
    """Start the drafter's layers from the target's (``drafter.init_layers_from_target``); the target layer's index.

    The deepest aux hidden state is the input of target layer ``L = max(aux_layer_ids)`` (vLLM's convention), so
    every drafter layer starts as layer ``L``: its q/k/v/o and MLP ``[out, in]`` weights and its two RMSNorms.
    Layer 0 reads ``[input_layernorm(embedding), hidden_norm(hidden)]`` (``[.., 2H]``): the target's q/k/v go to
    the hidden half (columns ``H:2H``), the embedding half starts at 0, and ``hidden_norm`` is the target's
    ``input_layernorm``. ``fc`` (``[H, 3*Ht]``) starts as the identity on the deepest aux block (so at step 0 layer
    0 sees what target layer ``L`` sees) and the final ``norm`` as the target's ``model.norm``. Call after
    :func:`init_drafter_from_target` (embeddings, lm_head) and before a warm start.

    Why: a drafter trained on little data overfits (the CPU demo's head: 0.81 top-1 on its training batches, 0.31
    acceptance at position 1); starting from the target's own layer puts the features in place at step 0.

    Raises:
        ValueError: the target's layer shapes do not fit the drafter (hidden size, heads, intermediate size), or
            a tensor is missing from the target's safetensors.
    """
    cfg = drafter.config
    H = cfg.hidden_size
    if cfg.target_hidden_size != H:
        raise ValueError(f"target hidden size {cfg.target_hidden_size} != drafter hidden size {H}: the target's "
                         "layers cannot seed this drafter")
    layer = max(cfg.aux_layer_ids)
    target = {name: load_target_tensor(target_dir, [f"model.layers.{layer}.{name}.weight"])[1]  # read once
              for name in (*LAYER_LINEARS, "input_layernorm", "post_attention_layernorm")}
    for i, dl in enumerate(drafter.layers):
        for name in LAYER_LINEARS:
            w, mine = target[name], dl.get_submodule(name).weight
            if i == 0 and name.endswith(("q_proj", "k_proj", "v_proj")):
                want = (w.shape[0], 2 * w.shape[1])
                if tuple(mine.shape) != want:
                    raise ValueError(f"drafter layer 0 {name} is {tuple(mine.shape)}, target layer {layer}'s gives {want}")
                mine.zero_()
                mine[:, H:].copy_(w.to(mine.dtype))
            else:
                if mine.shape != w.shape:
                    raise ValueError(f"drafter layer {i} {name} is {tuple(mine.shape)}, target layer {layer}'s "
                                     f"{tuple(w.shape)}")
                mine.copy_(w.to(mine.dtype))
        dl.input_layernorm.weight.copy_(target["input_layernorm"])
        dl.post_attention_layernorm.weight.copy_(target["post_attention_layernorm"])
        if i == 0:
            dl.hidden_norm.weight.copy_(target["input_layernorm"])
    drafter.norm.weight.copy_(load_target_tensor(target_dir, ["model.norm.weight"])[1])
    block = cfg.aux_layer_ids.index(layer)  # fc's input is the aux states in aux_layer_ids order
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, block * H:(block + 1) * H].copy_(torch.eye(H, dtype=drafter.fc.weight.dtype))
    return layer
