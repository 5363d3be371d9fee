"""Fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``) for a drafter head.

Why a wrapper: the objectives (``peagle_core.objectives``: ``peagle``, ``eagle3``) use drafter
parameters outside ``Eagle3Drafter.forward``: ``combine_hidden_states`` (``fc``, the input norms)
and ``mask_slot_hidden`` (``mask_hidden`` through ``fc``) build the hidden states before it, and the
chunked loss (``peagle_core.loss.linear_distill_loss``) reads ``lm_head.weight`` after it. FSDP2
gathers a unit's parameters only inside that unit's forward, so outside it they are sharded
``DTensor`` s. :class:`ShardedDrafter` owns the drafter and its ``forward(fn, *args)`` runs
``fn(drafter, *args)``, the whole objective computation up to the scalar loss, so every
parameter use happens inside a forward FSDP hooks:

* each decoder layer is its own FSDP unit (gathered per layer, resharded after its forward and
  again after its backward);
* the root unit (the wrapper) holds the rest: ``embed_tokens``, ``fc`` (and ``input_norm`` /
  ``fc_norm``), ``mask_hidden``, ``norm``, ``lm_head``; gathered for the whole objective forward.

Gradients are reduce-scattered with an average over ranks, as DDP all-reduces with an average, so
the objectives' ``loss_scale_denominator = global_loss_elements / W`` gives the same step under
both. The P-EAGLE sequence partition (Algorithm 1) runs one forward+backward per segment:
:meth:`ShardedDrafter.no_sync` (FSDP2 ``set_requires_gradient_sync(False)``) keeps the gradients
unsharded and unreduced for all but the last segment, which reduce-scatters the accumulated sum
once; it is the ``no_sync`` hook the objectives already take for DDP.

Autocast: inside the wrapper's forward, autocast's cache of casted weights is off
(``torch.set_autocast_cache_enabled(False)``; FSDP1's docs give the same advice). With the cache, the
second P-EAGLE segment's forward reuses the bf16 casts made in the first one, autograd nodes with
older sequence numbers that the engine runs after the layer's FSDP2 post-backward hook has already
reduced and resharded its gradient: that segment's weight gradients were lost (relative error
~0.7-0.8 measured on CPU and on 2 H200s, bf16 autocast, S=2). Without the cache each forward casts
the weights anew (a copy per use; small next to a head's activations).

When to use it: a drafter is small (one layer of the target's width plus its embeddings and a
draft-vocabulary ``lm_head``), so DDP is the default. FSDP cuts parameter, gradient and AdamW
state memory by the number of ranks, which matters for 8B+ targets with large vocabularies
(Llama-3.1-8B, V=128k, H=4096: ~0.8 B parameters, ~13 GB in float32 with AdamW state, per rank
under DDP). The root unit's embeddings and ``lm_head`` are gathered in full during a step.

Checkpoints: :func:`full_model_state_dict` / :func:`full_optimizer_state_dict` gather the full
(unsharded) state into rank 0's CPU memory (collectives: call them on every rank) through
``torch.distributed.checkpoint.state_dict``; the ``load_*`` helpers broadcast rank 0's copy; the model dict has exactly ``Eagle3Drafter``'s
``state_dict`` keys, so ``peagle_core.contract.export_head`` exports it unchanged.

Shape legend: H drafter hidden, Vd draft vocab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from peagle_core.drafter import Eagle3Drafter

R = TypeVar("R")
PREFIX = "module."  # ShardedDrafter's name for the drafter in state dict keys


class ShardedDrafter(nn.Module):
    """Owns an ``Eagle3Drafter``; ``forward(fn, *args, **kwargs)`` returns ``fn(drafter, *args, **kwargs)``.

    Build it with :func:`shard_drafter`. ``.module`` is the drafter (as with DDP), so
    ``peagle_core.drafter.unwrap`` finds it. Inside ``fn`` the root unit's parameters are
    gathered (plain tensors) and calling ``drafter(...)`` gathers each layer in turn.
    """

    def __init__(self, drafter: Eagle3Drafter) -> None:
        super().__init__()
        self.module = drafter

    def forward(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        with _autocast_cache_disabled():  # see the module docstring, "Autocast"
            return fn(self.module, *args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate unsharded gradients without reduce-scatter; the first
        backward outside reduces the accumulated sum (FSDP2 ``set_requires_gradient_sync``)."""
        set_sync = getattr(self, "set_requires_gradient_sync", None)
        if set_sync is None:  # not sharded (shard_drafter not applied): nothing to defer
            yield
            return
        set_sync(False)
        try:
            yield
        finally:
            set_sync(True)


@contextlib.contextmanager
def _autocast_cache_disabled() -> Iterator[None]:
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def run_in_forward(model: nn.Module, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """``fn(model, *args, **kwargs)``, or inside ``model.forward`` when ``model`` is a
    :class:`ShardedDrafter` (``fn`` then receives the drafter with its parameters gathered).

    The objectives call their forward-to-loss computation through this, so the same code runs on a
    plain, DDP-wrapped (``fn`` calls ``model(...)``, DDP's forward) or FSDP-sharded drafter.
    """
    if isinstance(model, ShardedDrafter):
        return model(fn, *args, **kwargs)
    return fn(model, *args, **kwargs)


def shard_drafter(
    drafter: Eagle3Drafter,
    *,
    mesh: Any = None,
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
) -> ShardedDrafter:
    """Shard ``drafter`` in place with FSDP2 over ``mesh`` (default: all ranks of the default
    process group) and return its :class:`ShardedDrafter` (the root FSDP unit).

    Call after ``torch.distributed.init_process_group`` and after the drafter is on its device and
    initialized identically on every rank (FSDP2 keeps each rank's own slice; it broadcasts nothing).
    Build the optimizer afterwards, over the returned module's (``DTensor``) parameters.

    Args:
        drafter: the head; its decoder layers become one FSDP unit each.
        mesh: a 1-D ``DeviceMesh``; default ``init_device_mesh(device type, (world size,))``.
        reshard_after_forward: free each layer's gathered parameters after its forward (and gather
            again for its backward): lower peak memory, one more all-gather per layer.
        mp_policy: optional ``torch.distributed.fsdp.MixedPrecisionPolicy`` (default: none; the
            trainer's bf16 autocast on CUDA does the casting, as under DDP).

    Raises:
        TypeError: ``drafter`` is not an ``Eagle3Drafter``.
        RuntimeError: no default process group.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not isinstance(drafter, Eagle3Drafter):
        raise TypeError(f"shard_drafter expects an Eagle3Drafter, got {type(drafter).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("shard_drafter needs torch.distributed.init_process_group first")
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device = next(drafter.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kw: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for layer in drafter.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
    model = ShardedDrafter(drafter)
    fully_shard(model, **kw)
    return model


def is_sharded(model: nn.Module) -> bool:
    """True for a :class:`ShardedDrafter` (FSDP2-sharded drafter)."""
    return isinstance(model, ShardedDrafter)


def _options(**kw: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_model_state_dict(model: ShardedDrafter) -> dict[str, torch.Tensor]:
    """The full drafter state dict (``Eagle3Drafter.state_dict`` keys, CPU tensors) on rank 0;
    an empty dict on the other ranks.

    A collective (all-gathers every parameter): call it on every rank.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd = get_model_state_dict(model, options=_options(cpu_offload=True))
    return {k.removeprefix(PREFIX): v for k, v in sd.items()}


def load_full_model_state_dict(model: ShardedDrafter, state: dict[str, torch.Tensor]) -> None:
    """Load a full drafter state dict (``Eagle3Drafter.state_dict`` keys) into the sharded drafter.

    A collective: rank 0's ``state`` is broadcast (the other ranks may pass ``{}``) and each rank
    keeps its slice. Strict: missing or extra keys raise ``RuntimeError``.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, {PREFIX + k: v for k, v in state.items()},
                         options=_options(strict=True, broadcast_from_rank0=True))


def full_optimizer_state_dict(model: ShardedDrafter, optimizer: torch.optim.Optimizer) -> dict:
    """The full optimizer state dict (keyed by parameter names, CPU tensors) on rank 0; an empty
    dict on the other ranks.

    A collective: call it on every rank.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))


def load_full_optimizer_state_dict(model: ShardedDrafter, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a full optimizer state dict from :func:`full_optimizer_state_dict`.

    A collective: rank 0's ``state`` is broadcast (the other ranks may pass ``{}``).
    """
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=_options(broadcast_from_rank0=True))


__all__ = [
    "ShardedDrafter",
    "full_model_state_dict",
    "full_optimizer_state_dict",
    "is_sharded",
    "load_full_model_state_dict",
    "load_full_optimizer_state_dict",
    "run_in_forward",
    "shard_drafter",
]
