"""Training in this process, no Ray (a GPU box, benchmarks, tests): :func:`train_in_process`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from peagle_core.atomic import recover_dirs_in
from peagle_core.batch import pack_samples
from peagle_core.drafter import Eagle3Drafter
from peagle_core.objectives import Objective
from pipelines.recipe import TrainingConfig
from pipelines.train.checkpoint import latest_checkpoint, save_checkpoint_dir
from pipelines.train.data import PackFn, Sample, estimate_steps_per_epoch, sample_len
from pipelines.train.loop import TrainCallback, Trainer, TrainState
from pipelines.train.order import SAMPLE_LOG_DIR, EpochRecord, epoch_summary, write_epoch_summary
from pipelines.train.plan import total_steps
from pipelines.train.tracking import progress_logger

log = logging.getLogger(__name__)

__all__ = ["TrainResult", "train_in_process"]


@dataclass
class TrainResult:
    """What a run leaves: final step, the last checkpoint directory and the rank-0 metric history."""

    step: int
    checkpoint: Path | None
    history: list[dict]
    resumed_from_step: int | None
    state: TrainState


def train_in_process(
    samples_for_epoch: Callable[[int], Iterable[Sample]],
    drafter: Eagle3Drafter,
    target_lm_head: torch.Tensor,
    objective: Objective,
    config: TrainingConfig,
    *,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = True,
    num_to_keep: int | None = 2,
    steps_per_epoch: int | None = None,
    device: str | torch.device | None = None,
    log_every_steps: int = 10,
    pack_fn: PackFn = pack_samples,
    on_log: Callable[[int, dict], None] | None = None,
    callbacks: Sequence[TrainCallback] = (),
) -> TrainResult:
    """Train ``drafter`` in this process, no Ray (the benchmark GPU box path).

    Args:
        samples_for_epoch: ``epoch -> iterable of samples`` (e.g. ``lambda e:
            peagle_core.shards.iter_samples(capture_dir)``); must give the same order for the same
            epoch so that a resume skips exactly the samples already trained on.
        drafter: the head (vocab mapping and target init already applied).
        target_lm_head: ``[V, Ht]`` (``pipelines.train.target_weights.load_target_lm_head``).
        objective: a ``peagle_core`` objective.
        config: the recipe's ``training`` section; the cosine horizon is ``max_steps`` if set, else
            ``num_epochs * steps_per_epoch`` (``steps_per_epoch`` counted with one pass over
            epoch 0 when not given).
        checkpoint_dir: checkpoints go to ``<checkpoint_dir>/checkpoint_<step>``; with ``resume`` the
            latest one is loaded first. Each epoch's count and digest of the sample ids trained go to
            ``<checkpoint_dir>/sample_ids/epoch_XXXX.json``.
        num_to_keep: most recent checkpoints kept (``None``: all): ``pipelines.train.checkpoint.save_checkpoint_dir``,
            the same directories (``checkpoint_name``) Ray Train keeps under Ray.
        device: default CUDA if available else CPU.
        on_log: ``f(step, metrics)`` per metric window (default: a progress log line).
        callbacks: :class:`~pipelines.train.loop.TrainCallback` s, called after each checkpoint.

    Raises:
        ValueError: neither ``max_steps`` nor ``num_epochs`` gives a positive horizon.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(int(config.seed or 0))
    steps = total_steps(config, steps_per_epoch, count_steps_per_epoch=lambda: estimate_steps_per_epoch(
        (sample_len(s) for s in samples_for_epoch(0)), config.batch_tokens))
    drafter.to(device)
    root = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
        recover_dirs_in(root)  # a checkpoint a killed run left moved aside counts for resume

    def write_checkpoint(step: int, metrics: dict) -> None:
        save_checkpoint_dir(root, step, lambda d: trainer.save_checkpoint(d, extra_state={"metrics": metrics}),
                            num_to_keep=num_to_keep)

    def on_epoch_end(record: EpochRecord) -> None:
        write_epoch_summary(root / SAMPLE_LOG_DIR, epoch_summary([record], seed=int(config.seed or 0)))

    trainer = Trainer(config=config, model=drafter, objective=objective, target_lm_head=target_lm_head.to(device),
                      total_steps=steps, device=device, steps_per_epoch=steps_per_epoch,
                      on_log=on_log or progress_logger(steps),
                      write_checkpoint=write_checkpoint if root is not None else None, callbacks=callbacks,
                      on_epoch_end=on_epoch_end if root is not None else None,
                      log_every_steps=log_every_steps, pack_fn=pack_fn)
    if resume and root is not None and (latest := latest_checkpoint(root)) is not None:
        trainer.load_checkpoint(latest)
        log.info("resumed from %s (step %d)", latest, trainer.state.step)
    st = trainer.fit(samples_for_epoch)
    return TrainResult(step=st.step, checkpoint=latest_checkpoint(root) if root else None,
                       history=st.history, resumed_from_step=st.resumed_from_step, state=st)
