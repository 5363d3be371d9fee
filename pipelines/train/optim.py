"""Optimizer and learning-rate schedule of drafter training: AdamW (fused where the device has it)
with linear warm-up and cosine decay, both read from the recipe's ``training`` section."""

from __future__ import annotations

import math
from functools import partial

import torch

from pipelines.recipe import TrainingConfig


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Linear warmup from ``1/warmup_steps`` to 1 over ``warmup_steps``, then cosine decay to
    ``min_lr_ratio`` at ``total_steps``. ``step`` counts optimizer steps already taken (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: TrainingConfig) -> torch.optim.AdamW:
    """AdamW with the recipe's ``lr``, ``betas``, ``weight_decay``; no decay on norms, biases,
    ``mask_hidden`` and embeddings (1-D tensors and ``embed_tokens``). Build it after the model is
    on its device (the fused implementation is picked when the device has one)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "embed_tokens" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": float(cfg.weight_decay)},
              {"params": no_decay, "weight_decay": 0.0}]
    kw = {"lr": float(cfg.lr), "betas": tuple(cfg.betas)}
    try:  # fused kernels (CPU and CUDA): ~4x faster than foreach on a 2-core CPU for a SmolLM2 head
        return torch.optim.AdamW(groups, fused=True, **kw)
    except (RuntimeError, TypeError, ValueError):  # a device/dtype without a fused AdamW
        return torch.optim.AdamW(groups, **kw)


def build_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                    min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` over :func:`lr_multiplier` (its state dict holds only counters)."""
    fn = partial(lr_multiplier, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
