"""Training checkpoints: the same files whether the drafter is whole on every rank or FSDP2-sharded.

One directory per checkpoint (under Ray the per-worker directories are merged by ``ray.train.report``)::

    model.safetensors    rank 0: the drafter's state dict (incl. d2t/t2d buffers); whole-drafter checkpoints
                         leave out the frozen parameters (the target's embeddings, rebuilt on resume)
    optimizer.pt         rank 0: AdamW state dict (FSDP2: the full one, keyed by parameter name)
    scheduler.pt         rank 0: LR scheduler state dict
    trainer_state.json   rank 0: step, counters, world size, strategy, frozen parameters, training config,
                         extra state
    rank_XXXX.pt         every rank: its data position and RNG states

:class:`Checkpointer` handles a model that is whole on every rank (one process, DDP): rank 0 writes
it. :class:`ShardedCheckpointer` handles an FSDP2-sharded one: saving gathers the full states to
rank 0 and loading scatters them (collectives: call on every rank). A checkpoint resumes only under
the strategy that wrote it (FSDP2 optimizer state is keyed by parameter name, DDP's by index).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file, save_file

from peagle_core import fsdp

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
STATE_FILE = "trainer_state.json"
RANK_FILE = "rank_{rank:04d}.pt"
FROZEN_KEY = "frozen_parameters"  # trainer_state.json: names of the parameters the optimizer does not update
_REQUIRED_FILES = (MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, STATE_FILE)

__all__ = [
    "FROZEN_KEY", "MODEL_FILE", "OPTIMIZER_FILE", "RANK_FILE", "SCHEDULER_FILE", "STATE_FILE", "Checkpointer",
    "Restored", "ShardedCheckpointer", "checkpoint_name", "frozen_parameters", "latest_checkpoint",
    "load_model_state", "make_checkpointer", "optimizer_digest", "rng_state", "save_checkpoint_dir", "set_rng_state",
]


def frozen_parameters(drafter: torch.nn.Module) -> set[str]:
    """Names of the drafter's parameters the optimizer does not update (listed under :data:`FROZEN_KEY`)."""
    return {n for n, p in drafter.named_parameters() if not p.requires_grad}


def load_model_state(drafter: torch.nn.Module, state: dict[str, torch.Tensor], *, frozen: set[str],
                     checkpoint_dir: str | os.PathLike) -> None:
    """Load a checkpoint's ``model.safetensors`` ``state`` into ``drafter`` (cast to the parameters' dtype). The
    ``frozen`` parameters may be missing (whole-drafter checkpoints and compact copies leave them out): they keep
    the values the drafter was built with.

    Raises:
        ValueError: another parameter or buffer is missing, or a key is unknown (names them).
    """
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    absent = [k for k in missing if k not in frozen]
    if absent or unexpected:
        raise ValueError(f"checkpoint {checkpoint_dir}: {MODEL_FILE} lacks {absent} / has unknown {unexpected}: it "
                         "was written for another drafter (compare drafter.* and train_embed_tokens of the recipe)")
    if missing:
        log.info("checkpoint %s: frozen %s kept as built (not in the checkpoint)", checkpoint_dir, missing)


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint of ``step``: ``checkpoint_00000042`` (sorts by step)."""
    return f"checkpoint_{step:08d}"


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete ``checkpoint_*`` directory under ``root`` (one with ``trainer_state.json``), else None."""
    found = sorted(p for p in Path(root).glob("checkpoint_*") if (p / STATE_FILE).is_file())
    return found[-1] if found else None


def save_checkpoint_dir(root: str | os.PathLike, step: int, write: Callable[[Path], Any], *,
                        num_to_keep: int | None = None) -> Path:
    """``<root>/checkpoint_<step>`` (:func:`checkpoint_name`) written crash-safely by ``write(directory)`` (into a
    temporary sibling, fsynced and renamed into place: ``peagle_core.atomic.replace_dir``), then the oldest
    checkpoints beyond ``num_to_keep`` removed (None: all kept). Under Ray, Ray Train does the same for a run
    (``ray.train.CheckpointConfig(num_to_keep)``); this is the one home of it without Ray."""
    from peagle_core.atomic import replace_dir, temp_dir_for

    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = temp_dir_for(final)
    try:
        write(tmp)
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if num_to_keep:
        for old in sorted(root.glob("checkpoint_*"))[:-num_to_keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def optimizer_digest(state_dict: dict) -> float:
    """A float that changes with any AdamW moment: sum over params of ``|exp_avg| + exp_avg_sq``
    plus step counters (used to check that a resume restored the optimizer)."""
    total = 0.0
    for st in state_dict["state"].values():
        for k, v in st.items():
            if torch.is_tensor(v):
                total += float(v.double().abs().sum()) if k != "step" else float(v)
            elif isinstance(v, (int, float)):
                total += float(v)
    return total


def rng_state() -> dict:
    """This process's torch (CPU and CUDA) and Python RNG states."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Restored:
    """What :meth:`Checkpointer.load` read besides the weights: the ``trainer_state.json`` dict and this
    rank's ``rank_XXXX.pt`` (None when the checkpoint was written by another number of workers: then
    the epoch ``restart_epoch`` restarts from its beginning)."""

    meta: dict[str, Any]
    rank_state: dict[str, Any] | None
    restart_epoch: int = 0


class Checkpointer:
    """Writes and reads checkpoints of a drafter that is whole on every rank (one process or DDP).

    Args:
        model: the drafter, possibly DDP-wrapped (``model.module``).
        optimizer, scheduler: saved and restored beside it.
        rank, world_size: rank 0 writes the shared files; every rank its ``rank_XXXX.pt``.
        device: where the optimizer state is loaded to.
    """

    sharded: ClassVar[bool] = False

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, *, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu") -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.drafter = getattr(model, "module", model)
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)

    # -- what differs between the strategies --------------------------------------------------

    def full_optimizer_state(self) -> dict:
        """The optimizer state dict to save (on every rank)."""
        return self.optimizer.state_dict()

    def _full_states(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        """``(model state on CPU, optimizer state)`` on rank 0, None on the other ranks. The frozen parameters
        (``embed_tokens`` when ``drafter.train_embed_tokens`` is false: the target's, ``[V, H]`` in float32,
        113 MB for SmolLM2, 2.1 GB for Llama-3.1-8B) are left out: every run builds them from the target."""
        if self.rank != 0:
            return None
        frozen = frozen_parameters(self.drafter)
        model_state = {k: v.detach().cpu().contiguous() for k, v in self.drafter.state_dict().items()
                       if k not in frozen}
        return model_state, self.optimizer.state_dict()

    def _load_states(self, d: Path) -> None:
        self._load_model(d, load_file(str(d / MODEL_FILE), device="cpu"))
        self.optimizer.load_state_dict(torch.load(d / OPTIMIZER_FILE, map_location=self.device, weights_only=True))

    def _load_model(self, d: Path, state: dict[str, torch.Tensor]) -> None:
        load_model_state(self.drafter, state, frozen=frozen_parameters(self.drafter), checkpoint_dir=d)

    # -- the format -----------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike, *, meta: dict[str, Any], rank_state: dict[str, Any]) -> Path:
        """Write this rank's part of a checkpoint into ``directory``: rank 0 the model (safetensors),
        optimizer, scheduler and ``trainer_state.json`` (``meta`` plus ``world_size`` and ``sharded``);
        every rank ``rank_state`` to ``rank_XXXX.pt``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        states = self._full_states()
        if states is not None:
            model_state, opt_state = states
            save_file(model_state, str(d / MODEL_FILE), metadata={"format": "pt"})
            torch.save(opt_state, d / OPTIMIZER_FILE)
            torch.save(self.scheduler.state_dict(), d / SCHEDULER_FILE)
            frozen = sorted(frozen_parameters(self.drafter))
            meta = {**meta, "world_size": self.world_size, "sharded": self.sharded, FROZEN_KEY: frozen}
            (d / STATE_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
        torch.save(rank_state, d / RANK_FILE.format(rank=self.rank))
        return d

    def load(self, directory: str | os.PathLike) -> Restored:
        """Restore model, optimizer and scheduler from ``directory``; return its metadata and this
        rank's state.

        A compact copy (``pipelines.train.compact``, after its ``expand_checkpoint``) loads too: frozen
        parameters it lacks keep the values the drafter was built with, bf16 weights and moments are cast to
        the parameters' dtype, an optimizer state without per-parameter entries restarts AdamW's moments.

        Raises:
            ValueError: the directory is not a training checkpoint (names the missing file), it was
                written under the other parallel strategy, or its model file does not fit the drafter.
        """
        d = Path(directory)
        for name in _REQUIRED_FILES:
            if not (d / name).is_file():
                raise ValueError(f"{d} is not a training checkpoint: {name} is missing")
        meta = json.loads((d / STATE_FILE).read_text())
        self._check_strategy(d, meta)
        self._load_states(d)
        self.scheduler.load_state_dict(torch.load(d / SCHEDULER_FILE, weights_only=True))
        rank_file = d / RANK_FILE.format(rank=self.rank)
        if rank_file.is_file() and int(meta.get("world_size", 1)) == self.world_size:
            return Restored(meta, torch.load(rank_file, weights_only=True))
        log.warning("checkpoint %s was written by %s workers, this run has %d: restarting its epoch "
                    "from the beginning", d, meta.get("world_size"), self.world_size)
        other = sorted(d.glob("rank_*.pt"))
        epoch = int(torch.load(other[0], weights_only=True)["position"]["epoch"]) if other else 0
        return Restored(meta, None, restart_epoch=epoch)

    def _check_strategy(self, d: Path, meta: dict[str, Any]) -> None:
        if bool(meta.get("sharded", False)) == self.sharded:
            return
        written, now = ("fsdp", "ddp") if meta.get("sharded") else ("ddp", "fsdp")
        raise ValueError(f"checkpoint {d} was written with parallel_strategy={written!r} "
                         f"({meta.get('world_size')} workers); this run is {now!r} ({self.world_size} "
                         f"workers): resume it with parallel_strategy={written!r} and > 1 workers for fsdp, "
                         "or start a new run (another run_name)")


class ShardedCheckpointer(Checkpointer):
    """Checkpoints of an FSDP2-sharded drafter (``peagle_core.fsdp.shard_drafter``): the same files as
    :class:`Checkpointer`, frozen parameters included (the sharded load is strict); the full model and optimizer
    states are gathered to rank 0 on save and broadcast from it on load, so every rank must call :meth:`save` /
    :meth:`load`."""

    sharded: ClassVar[bool] = True

    def full_optimizer_state(self) -> dict:
        """The full optimizer state keyed by parameter name on rank 0 (``{}`` elsewhere; a collective)."""
        return fsdp.full_optimizer_state_dict(self.model, self.optimizer)

    def _full_states(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        model_state = fsdp.full_model_state_dict(self.model)  # collectives on every rank
        opt_state = self.full_optimizer_state()
        return (model_state, opt_state) if self.rank == 0 else None

    def _load_states(self, d: Path) -> None:
        # rank 0 reads, the helpers broadcast and each rank keeps its shard
        state = load_file(str(d / MODEL_FILE), device="cpu") if self.rank == 0 else {}
        fsdp.load_full_model_state_dict(self.model, state)
        opt_state = torch.load(d / OPTIMIZER_FILE, map_location="cpu", weights_only=True) if self.rank == 0 else {}
        fsdp.load_full_optimizer_state_dict(self.model, self.optimizer, opt_state)


def make_checkpointer(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      scheduler: torch.optim.lr_scheduler.LRScheduler, **kw: Any) -> Checkpointer:
    """:class:`ShardedCheckpointer` for an FSDP2-sharded model, else :class:`Checkpointer` (``kw``: rank,
    world_size, device)."""
    cls = ShardedCheckpointer if fsdp.is_sharded(model) else Checkpointer
    return cls(model, optimizer, scheduler, **kw)
