"""One worker's training loop, Ray-free: :class:`Trainer`.

Per step: a ``PackedBatch`` of at most ``batch_tokens`` tokens, the objective's forward and backward
under bf16 autocast on CUDA (float32 on CPU), gradient clipping, an AdamW step and the LR schedule
(``pipelines.train.optim``). Every ``log_every_steps`` a metric window (loss and accuracy per depth,
positions/s, tokens/s) goes to ``on_log``; every ``checkpoint_every_steps`` and at the end a checkpoint
(model, optimizer, scheduler, data position = epoch + samples consumed + the digest of their ids, RNG;
``pipelines.train.checkpoint``) goes to ``write_checkpoint``, then to the :class:`TrainCallback` s.
At the end of each epoch (and of the run) an :class:`~pipelines.train.order.EpochRecord` (samples trained,
the chained sha256 of their ids) goes to ``on_epoch_end``.

Resume: an epoch's samples come in the same order on every call for that epoch (a materialized capture:
``pipelines.train.order``), so a restarted worker skips the ``samples_consumed`` it trained before: a
sequence (``len``, ``[i]``) is entered at that position without reading the samples before it, any
other iterable is advanced past them.

Equal step counts across workers: ``ray.train.report`` is a barrier and DDP all-reduces every step, so
before each step the workers agree (``all_true``: one tiny all-reduce, MIN) whether *all* of them
still have a batch; the epoch ends for everyone when any shard runs out (the tail of the longest
shards is dropped, at most one batch per worker per epoch on balanced shards). ``steps_per_epoch``
can also be fixed up front.

Shape legend: N tokens of a packed batch, V target vocab, Ht target hidden.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peagle_core.batch import PackedBatch, pack_samples
from peagle_core.drafter import Eagle3Drafter
from peagle_core.objectives import NUM_FORWARD_SLOTS_KEY, Objective
from pipelines.recipe import TrainingConfig
from pipelines.train.checkpoint import make_checkpointer, rng_state, set_rng_state
from pipelines.train.data import PackFn, Sample, iter_packed_batches, sample_len
from pipelines.train.optim import build_optimizer, build_scheduler
from pipelines.train.order import SAMPLE_ID, EpochRecord, chain_digest

__all__ = ["DataPosition", "TrainCallback", "TrainState", "Trainer"]


@dataclass
class DataPosition:
    """Where a worker is in its data: ``epoch``, samples of that epoch already trained on and the
    :func:`~pipelines.train.order.chain_digest` of their ids."""

    epoch: int = 0
    samples_consumed: int = 0
    epoch_step: int = 0  # optimizer steps taken in this epoch (equal on all workers)
    sample_ids_sha256: str = ""


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    positions_seen: int = 0
    position: DataPosition = field(default_factory=DataPosition)
    resumed_from_step: int | None = None
    history: list[dict] = field(default_factory=list)  # logged metric windows (rank-local)


class TrainCallback:
    """Extension point of :class:`Trainer`: subclass it, override the hooks you need and pass instances
    as ``callbacks=`` (to ``Trainer``, ``train_in_process`` or ``run_train``; under Ray they travel to
    every worker inside the worker config, so they must pickle)."""

    def on_checkpoint(self, step: int, metrics: dict[str, float]) -> None:
        """Called on every rank at each checkpoint step (every ``checkpoint_every_steps`` and the last),
        once every rank has written the checkpoint of ``step`` (under Ray: reported it). ``metrics`` is the
        last logged window. An exception raised here ends ``fit`` on every rank (a worker failure: Ray
        restarts from this checkpoint when ``max_failures`` allows)."""

    def on_step(self, step: int) -> None:
        """Called on every rank after each optimizer step (``step`` counts from 1, a resumed run from its
        checkpoint's step), before any log or checkpoint of that step; keep it cheap (the progress bar:
        :class:`pipelines.train.progress.StepReporter`)."""


class Trainer:
    """One worker's training loop, Ray-free.

    Args:
        config: the recipe's ``training`` section (``lr``, ``betas``, ``weight_decay``, ``warmup_steps``,
            ``batch_tokens``, ``grad_clip``, ``num_epochs``, ``checkpoint_every_steps``).
        model: the drafter, possibly DDP-wrapped or FSDP2-sharded (``peagle_core.fsdp.shard_drafter``);
            ``model.module`` is the ``Eagle3Drafter``.
        objective: runs forward and backward of one batch and returns float metrics.
        target_lm_head: ``[V, Ht]`` target output projection (on ``device``).
        total_steps: optimizer steps of the whole run (cosine horizon; also a hard stop).
        device: where batches go. bf16 autocast on CUDA, float32 on CPU.
        optimizer: default :func:`~pipelines.train.optim.build_optimizer` over ``model``.
        steps_per_epoch: fixed steps per epoch (``None``: until a shard runs out).
        rank, world_size: for logs and the per-rank checkpoint file.
        all_true: distributed AND over workers of "I still have a batch" (identity when alone).
        all_sum: distributed sum of a float vector (identity when alone) for global throughput.
        on_log: ``f(step, metrics)`` called every ``log_every_steps`` on every rank.
        write_checkpoint: ``f(step, metrics)`` called at checkpoint steps on every rank; it calls
            :meth:`save_checkpoint` into a directory of its choice (None: no checkpoints written).
        callbacks: :class:`TrainCallback` s, called after each step and each checkpoint.
        on_epoch_end: ``f(EpochRecord)`` on every rank when an epoch ends and when the run ends (its
            last, possibly partial, epoch); a collective may run in it (all ranks call it together).
        log_every_steps: metric window.
        pack_fn: ``pack_samples(samples, max_tokens) -> list[PackedBatch]``.

    Raises:
        ValueError: ``total_steps < 1`` or ``batch_tokens < 2``.
    """

    def __init__(
        self,
        *,
        config: TrainingConfig,
        model: torch.nn.Module,
        objective: Objective,
        target_lm_head: torch.Tensor,
        total_steps: int,
        device: torch.device | str = "cpu",
        optimizer: torch.optim.Optimizer | None = None,
        steps_per_epoch: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        all_true: Callable[[bool], bool] | None = None,
        all_sum: Callable[[list[float]], list[float]] | None = None,
        on_log: Callable[[int, dict], None] | None = None,
        write_checkpoint: Callable[[int, dict], None] | None = None,
        callbacks: Sequence[TrainCallback] = (),
        on_epoch_end: Callable[[EpochRecord], None] | None = None,
        log_every_steps: int = 10,
        pack_fn: PackFn = pack_samples,
    ) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps={total_steps} must be >= 1 (set max_steps or num_epochs)")
        if config.batch_tokens < 2:
            raise ValueError(f"batch_tokens={config.batch_tokens} must be >= 2")
        self.config, self.model, self.objective = config, model, objective
        self.drafter: Eagle3Drafter = getattr(model, "module", model)
        self.device = torch.device(device)
        self.target_lm_head = target_lm_head
        self.total_steps, self.steps_per_epoch = int(total_steps), steps_per_epoch
        self.batch_tokens = int(config.batch_tokens)
        self.num_epochs = int(config.num_epochs or 1)
        self.grad_clip = float(config.grad_clip or 0.0)
        self.checkpoint_every = int(config.checkpoint_every_steps or 0)
        self.optimizer = optimizer or build_optimizer(model, config)
        self.scheduler = build_scheduler(self.optimizer, warmup_steps=int(config.warmup_steps or 0),
                                         total_steps=self.total_steps)
        self.checkpointer = make_checkpointer(model, self.optimizer, self.scheduler, rank=rank,
                                              world_size=world_size, device=self.device)
        self.rank, self.world_size = rank, world_size
        self._all_true = all_true or (lambda x: x)
        self._all_sum = all_sum or (lambda v: v)
        self.on_log, self.write_checkpoint, self.callbacks = on_log, write_checkpoint, tuple(callbacks)
        self.on_epoch_end = on_epoch_end
        self._pending_ids: deque[str] = deque()  # ids of samples read for packing, not yet trained
        self.log_every = max(1, int(log_every_steps))
        self.pack_fn = pack_fn
        self.state = TrainState()
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                         else nullcontext())
        self._no_sync = getattr(model, "no_sync", None)  # DDP and ShardedDrafter (FSDP2) have one
        self._window: dict[str, list[float]] = defaultdict(list)
        self._t_window = time.perf_counter()
        self._last_checkpoint_step = -1

    # -- one step --------------------------------------------------------------------------------

    def _to_device(self, batch: PackedBatch) -> PackedBatch:
        if self.device.type == "cuda":  # hidden states in bf16
            return batch.to(self.device, torch.bfloat16)
        return batch.to(self.device)

    def train_step(self, batch: PackedBatch) -> dict[str, float]:
        """One optimizer step on one ``PackedBatch``; returns the objective's metrics plus ``lr``,
        ``grad_norm``, ``num_tokens``."""
        self.model.train()
        batch = self._to_device(batch)
        self.optimizer.zero_grad(set_to_none=True)
        kw: dict[str, Any] = {}
        if self.world_size > 1:
            # DDP and FSDP2 average gradients over W ranks: scale by global_loss_elements / W so the step is
            # the exact mean over all ranks' loss elements (not a mean of per-rank means).
            elements = self.objective.build_elements(batch, self.model)
            total = self._all_sum([float(self.objective.loss_count(batch, elements))])[0]
            kw = {"elements": elements, "loss_scale_denominator": max(total, 1.0) / self.world_size}
        with self.autocast:
            metrics = dict(self.objective.forward_backward(
                self.model, batch, target_lm_head=self.target_lm_head, no_sync=self._no_sync, **kw))
        if self.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
                grad_norm = grad_norm.full_tensor()
            metrics["grad_norm"] = float(grad_norm)
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        metrics["num_tokens"] = float(batch.num_tokens)
        return metrics

    # -- the loop --------------------------------------------------------------------------------

    def fit(self, samples_for_epoch: Callable[[int], Iterable[Sample]]) -> TrainState:
        """Train until ``total_steps`` or ``num_epochs`` is reached.

        Args:
            samples_for_epoch: ``epoch -> iterable of samples`` (the same order for the same epoch,
                so a resume can skip the samples already consumed; a sequence is entered at the
                position without reading what it skips).

        Returns:
            The final :class:`TrainState` (also ``self.state``).
        """
        st = self.state
        self._window, self._t_window = defaultdict(list), time.perf_counter()
        self._last_checkpoint_step = st.step if st.resumed_from_step is not None else -1
        done = st.step >= self.total_steps
        while not done and st.position.epoch < self.num_epochs:
            done = self._run_epoch(samples_for_epoch(st.position.epoch))
            if not done:
                self._end_epoch()
                st.position = DataPosition(epoch=st.position.epoch + 1)
        if done and st.position.samples_consumed:
            self._end_epoch()  # the run's last epoch, possibly partial
        if self._last_checkpoint_step != st.step:  # ran out of data/epochs between checkpoints
            if self._window:
                self._log_window()
            self._checkpoint()
        return st

    def _end_epoch(self) -> None:
        pos = self.state.position
        if self.on_epoch_end is not None:
            self.on_epoch_end(EpochRecord(epoch=pos.epoch, rank=self.rank, num_samples=pos.samples_consumed,
                                          sha256=pos.sample_ids_sha256))

    def _remaining(self, samples: Iterable[Sample], skip: int) -> Iterator[Sample]:
        """``samples`` after the first ``skip`` (a sequence is indexed from ``skip``: nothing before it is
        read); each non-empty sample's id is queued for the digest as packing reads it."""
        if isinstance(samples, Sequence):
            it: Iterator[Sample] = (samples[i] for i in range(skip, len(samples)))
        else:
            it = itertools.islice(iter(samples), skip, None)
        self._pending_ids.clear()
        for s in it:
            if sample_len(s) > 0:  # packing drops empty samples without counting them
                self._pending_ids.append(str(s.get(SAMPLE_ID, "")))
            yield s

    def _run_epoch(self, samples: Iterable[Sample]) -> bool:
        """Steps over one epoch's samples from the saved position; True when ``total_steps`` is reached."""
        pos = self.state.position
        batches = iter_packed_batches(self._remaining(samples, pos.samples_consumed), self.batch_tokens,
                                      self.pack_fn)
        while True:
            item = None
            if self.steps_per_epoch is None or pos.epoch_step < self.steps_per_epoch:
                item = next(batches, None)
            if not self._all_true(item is not None):
                return False
            batch, num_samples = item
            if self._step(batch, num_samples):
                return True

    def _step(self, batch: PackedBatch, num_samples: int) -> bool:
        """Train on one batch, advance the counters, log and checkpoint when due; True when done."""
        st = self.state
        if st.step == 0 and self.config.mask_hidden_init == "aux_mean":
            self._mask_hidden_from_aux(batch)
        metrics = self.train_step(batch)
        st.step += 1
        st.position.epoch_step += 1
        st.position.samples_consumed += num_samples
        st.position.sample_ids_sha256 = chain_digest(
            (self._pending_ids.popleft() for _ in range(num_samples)), st.position.sample_ids_sha256)
        st.tokens_seen += int(metrics["num_tokens"])
        st.positions_seen += int(metrics.get(NUM_FORWARD_SLOTS_KEY, 0))  # drafter slots run: "positions"
        for k, v in metrics.items():
            self._window[k].append(float(v))
        for cb in self.callbacks:
            cb.on_step(st.step)
        done = st.step >= self.total_steps
        if st.step % self.log_every == 0 or done:
            self._log_window()
        if (self.checkpoint_every and st.step % self.checkpoint_every == 0) or done:
            t_ckpt = time.perf_counter()
            self._checkpoint()
            self._t_window += time.perf_counter() - t_ckpt  # throughput excludes checkpoint I/O
        return done

    def _mask_hidden_from_aux(self, batch: PackedBatch) -> None:
        """``training.mask_hidden_init: aux_mean``: ``mask_hidden`` = the mean of ``batch.aux [N, 3*Ht]`` over its
        assistant tokens (all its tokens when it has none), summed over every rank's first batch (a collective:
        every rank steps its first batch together), so every replica starts from the same value."""
        rows = batch.aux[batch.loss_mask] if bool(batch.loss_mask.any()) else batch.aux
        summed = self._all_sum(rows.double().sum(0).tolist() + [float(rows.shape[0])])
        self.drafter.set_mask_hidden_(torch.tensor(summed[:-1]) / max(summed[-1], 1.0))

    def _log_window(self) -> None:
        window, seconds = self._window, time.perf_counter() - self._t_window
        m = {k: sum(v) / len(v) for k, v in window.items() if v}
        tokens = sum(window.get("num_tokens", []))
        positions = sum(window.get(NUM_FORWARD_SLOTS_KEY, []))
        keys = sorted(m)
        if self.world_size > 1:  # rank means -> mean over ranks; throughput -> sum over ranks
            summed = self._all_sum([tokens, positions] + [m[k] for k in keys])
            tokens, positions = summed[0], summed[1]
            m = {k: v / self.world_size for k, v in zip(keys, summed[2:])}
        m.pop("num_tokens", None)
        m.pop(NUM_FORWARD_SLOTS_KEY, None)
        seconds = max(seconds, 1e-9)
        m.update({"tokens_per_s": tokens / seconds, "positions_per_s": positions / seconds,
                  "epoch": float(self.state.position.epoch), "step": float(self.state.step),
                  "tokens_seen": float(self.state.tokens_seen)})
        self.state.history.append(m)  # tokens_seen counts this worker's tokens
        self._window, self._t_window = defaultdict(list), time.perf_counter()
        if self.on_log is not None:
            self.on_log(self.state.step, m)

    def _checkpoint(self) -> None:
        step = self.state.step
        metrics = self.state.history[-1] if self.state.history else {}
        self._last_checkpoint_step = step
        if self.write_checkpoint is not None:
            self.write_checkpoint(step, metrics)
        if self.callbacks:
            # A collective first: under Ray every rank has then returned from its report (upload done,
            # result queued), so the checkpoint is complete and registered before any callback acts.
            self._all_true(True)
            for cb in self.callbacks:
                cb.on_checkpoint(step, metrics)

    # -- checkpoints -----------------------------------------------------------------------------

    def full_optimizer_state(self) -> dict:
        """The optimizer state dict: ``optimizer.state_dict()``, or under FSDP2 the full one keyed by
        parameter name on rank 0 (``{}`` on other ranks; a collective, call it on every rank)."""
        return self.checkpointer.full_optimizer_state()

    def save_checkpoint(self, directory: str | os.PathLike, *, extra_state: dict | None = None) -> Path:
        """Write this rank's part of a checkpoint into ``directory`` (``pipelines.train.checkpoint``):
        rank 0 the model, optimizer, scheduler and ``trainer_state.json`` (counters, training config,
        ``extra_state``); every rank its data position, RNG states and the objective's COD stream.
        Under FSDP2 every rank must call it (the full states are gathered to rank 0)."""
        st = self.state
        meta = {"step": st.step, "tokens_seen": st.tokens_seen, "positions_seen": st.positions_seen,
                "total_steps": self.total_steps, "training_config": self.config.model_dump(mode="json"),
                **(extra_state or {})}
        rank_state = {"position": vars(st.position).copy(), "rng": rng_state(), "step": st.step,
                      "objective_generator": self.objective.rng_state()}
        return self.checkpointer.save(directory, meta=meta, rank_state=rank_state)

    def load_checkpoint(self, directory: str | os.PathLike) -> dict:
        """Restore model, optimizer, scheduler, this rank's data position and RNG from ``directory``.

        A checkpoint written by a different number of workers restarts the saved epoch from its
        beginning on every rank (warned): data positions are per worker shard.

        Returns:
            The ``trainer_state.json`` dict.

        Raises:
            ValueError: the directory is not a checkpoint of this stage (names the missing file), or it
                was written under the other parallel strategy.
        """
        restored = self.checkpointer.load(directory)
        meta, st = restored.meta, self.state
        st.step = st.resumed_from_step = int(meta["step"])
        st.tokens_seen, st.positions_seen = int(meta.get("tokens_seen", 0)), int(meta.get("positions_seen", 0))
        rs = restored.rank_state
        if rs is None:
            st.position = DataPosition(epoch=restored.restart_epoch)
            return meta
        st.position = DataPosition(**rs["position"])
        set_rng_state(rs["rng"])
        if "objective_generator" in rs:
            self.objective.set_rng_state(rs["objective_generator"])
        return meta

