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
