"""The Ray Train worker: ``TorchTrainer(train_loop_per_worker, train_loop_config={"worker": WorkerConfig})``.

Each worker builds the drafter from the plan (vocabulary mapping, target init), wraps it with
``ray.train.torch.prepare_model`` (DDP; gloo on CPU, NCCL on GPU) or shards it with FSDP2, feeds
:class:`~pipelines.train.loop.Trainer`, turns checkpoints into
``ray.train.report(..., checkpoint=Checkpoint.from_directory(d))`` and resumes from
``ray.train.get_checkpoint()`` when re-run with the same ``RunConfig(name, storage_path)`` or restarted
by Ray Train after a failure (``FailureConfig(max_failures)``).

Data: a materialized capture (:class:`~pipelines.train.order.OrderedCapture`) is read by each worker in
its slice of the seeded per-epoch order (``pipelines.train.order``): a resume is sample-exact. Any other
source is a Ray Dataset split by Ray Train (``get_dataset_shard("train")``, e.g. streaming capture): its
rows come in Ray Data's order, so a resume skips as many samples of the restarted epoch as were trained
(step-exact, not sample-exact; the logged digests show which samples were trained). At every epoch end
the ranks' :class:`~pipelines.train.order.EpochRecord` s are gathered and rank 0 writes
``sample_ids/epoch_XXXX.json`` and logs the digest to MLflow (``sample_order.epoch_XXXX.*`` params).

FSDP: ``training.parallel_strategy: fsdp`` shards the drafter with FSDP2 (``fully_shard``, one unit per
decoder layer plus the root; ``peagle_core.fsdp.shard_drafter``) instead of replicating it with DDP.
Ray's ``prepare_model(parallel_strategy="fsdp")`` is FSDP1 and GPU-only, so the worker moves the drafter
with ``prepare_model(parallel_strategy=None)`` and shards it itself. The objectives run their whole
forward-to-loss inside the sharded root's forward (``peagle_core.fsdp.run_in_forward``), and the
sequence partition defers the gradient reduce-scatter to the last segment (``ShardedDrafter.no_sync``);
gradients equal DDP's. Checkpoints hold the full model and optimizer (``pipelines.train.checkpoint``),
so the export is unchanged. When to use it: DDP is the default, a drafter is small (one layer plus
embeddings and a draft-vocabulary ``lm_head``); FSDP divides parameter, gradient and AdamW memory by
the number of workers, for 8B+ targets with large vocabularies (Llama-3.1-8B, V=128k, H=4096: a
1-layer head is ~0.8 B parameters, ~13 GB with float32 AdamW state per DDP worker). Activation memory
is cut by sequence partitioning (``num_partitions``) under either strategy.

Shape legend: V target vocab, Ht target hidden.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from peagle_core import fsdp
from peagle_core.drafter import Eagle3Drafter
from peagle_core.objectives import Objective, objective_class
from pipelines.train.checkpoint import checkpoint_name, optimizer_digest
from pipelines.train.data import row_to_sample
from pipelines.train.loop import TrainCallback, Trainer
from pipelines.train.order import (
    CaptureReader,
    EpochRecord,
    OrderedCapture,
    epoch_orders,
    epoch_summary,
    write_epoch_summary,
)
from pipelines.train.plan import TrainPlan
from pipelines.train.target_weights import (
    init_drafter_from_target,
    init_drafter_layers_from_target,
    load_target_embed,
    load_target_lm_head,
)
from pipelines.train.tracking import MlflowTracker, TrackingConfig, progress_logger
from pipelines.train.warm_start import load_init_weights

log = logging.getLogger(__name__)

WORKER_CONFIG_KEY = "worker"  # the one key of train_loop_config
FLUSH_BEFORE_CHECKPOINT_S = 5.0  # rank 0 waits this long for MLflow before a checkpoint (not during an outage)

__all__ = ["WORKER_CONFIG_KEY", "WorkerConfig", "build_drafter", "collectives", "train_loop_per_worker"]


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """What every worker receives (pickled whole by Ray): the plan, the metric window, where rank 0
    tracks the run (None: no MLflow), the user's :class:`~pipelines.train.loop.TrainCallback` s, the
    materialized capture read in planned order (None: the Ray Dataset ``"train"``) and the directory of
    the per-epoch sample-id files (None: not written)."""

    plan: TrainPlan
    log_every_steps: int = 10
    tracking: TrackingConfig | None = None
    callbacks: tuple[TrainCallback, ...] = ()
    capture: OrderedCapture | None = None
    sample_log_dir: str | None = None


def build_drafter(plan: TrainPlan) -> tuple[Eagle3Drafter, torch.Tensor]:
    """The drafter of ``plan`` on CPU (vocabulary mapping installed, initialized from the target (its layers too
    with ``drafter.init_layers_from_target``), then from the warm-start head ``plan.init_head`` if any, ``embed_tokens`` frozen unless
    ``drafter.train_embed_tokens``) and the target's ``lm_head [V, Ht]``."""
    drafter = Eagle3Drafter(plan.drafter)
    if plan.d2t is not None:
        drafter.set_vocab_mapping(plan.d2t, plan.t2d)
    lm_head = load_target_lm_head(plan.target_dir)
    init_drafter_from_target(drafter, load_target_embed(plan.target_dir), lm_head)
    if plan.drafter_spec.init_layers_from_target:
        init_drafter_layers_from_target(drafter, plan.target_dir)
    if plan.init_head is not None:  # every weight the head has; the optimizer and schedule start fresh
        load_init_weights(drafter, plan.init_head, train_embed_tokens=plan.drafter_spec.train_embed_tokens)
    if not plan.drafter_spec.train_embed_tokens:
        # frozen target embeddings: no [V, H] gradient and AdamW state (the largest tensors of a
        # small head); the exported head then omits embed_tokens and vLLM shares the target's
        drafter.embed_tokens.weight.requires_grad_(False)
    return drafter, lm_head


def collectives(world: int, device: torch.device) -> tuple[Callable[[bool], bool], Callable[[list[float]], list[float]]]:
    """``(all_true, all_sum)`` for :class:`~pipelines.train.loop.Trainer`: a MIN all-reduce of a flag and a
    float64 SUM all-reduce of a vector; identities with one worker or no process group."""
    import torch.distributed as dist

    if world == 1 or not dist.is_initialized():
        return (lambda flag: flag), (lambda values: values)

    def all_true(flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def all_sum(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()

    return all_true, all_sum


def _objective(plan: TrainPlan, rank: int) -> Objective:
    """The plan's objective with a per-rank COD stream (seed + rank: each rank samples other slots)."""
    return objective_class(plan.training.method)(dataclasses.replace(plan.objective, seed=plan.objective.seed + rank))


def _wrap(drafter: Eagle3Drafter, strategy: str, world: int) -> torch.nn.Module:
    import ray.train.torch

    if strategy == "fsdp" and world > 1:
        # Ray's prepare_model("fsdp") wraps with FSDP1 and only on GPU: move with it, shard with FSDP2
        return fsdp.shard_drafter(ray.train.torch.prepare_model(drafter, parallel_strategy=None))
    return ray.train.torch.prepare_model(drafter, parallel_strategy=strategy if world > 1 else None)


class _RankZero:
    """Rank 0's outputs: the progress line, MLflow (the tracker starts after a resume, which tells it the
    MLflow run to re-attach to) and the per-epoch sample-id files; :meth:`extra_state` goes into every
    checkpoint (the MLflow run id, the epoch summaries without ids)."""

    def __init__(self, rank: int, cfg: WorkerConfig) -> None:
        self.rank, self.cfg = rank, cfg
        self.progress = progress_logger(cfg.plan.total_steps)
        self.tracker: MlflowTracker | None = None
        self.epochs: dict[str, dict] = {}  # "epoch" -> summary without the id lists

    def extra_state(self) -> dict[str, Any]:
        """For the checkpoint: the MLflow run id, what MLflow has not received yet (sent again after a
        restart; the queue is given ``FLUSH_BEFORE_CHECKPOINT_S`` to drain first) and the epoch summaries."""
        state: dict[str, Any] = {"mlflow_run_id": None, "mlflow_pending": [], "epochs": self.epochs}
        if self.tracker is not None:
            self.tracker.flush(FLUSH_BEFORE_CHECKPOINT_S)
            state.update(mlflow_run_id=self.tracker.run_id, mlflow_pending=self.tracker.pending())
        return state

    def start(self, meta: dict, resumed: bool, world: int) -> None:
        self.epochs = dict(meta.get("epochs") or {})
        if self.rank != 0 or self.cfg.tracking is None:
            return
        self.tracker = MlflowTracker(self.cfg.tracking, run_id=meta.get("mlflow_run_id"),
                                     pending=meta.get("mlflow_pending"))
        if not resumed:
            plan = self.cfg.plan
            self.tracker.log_params({"training": plan.training.model_dump(mode="json"),
                                     "drafter": plan.drafter.to_dict(), "world_size": world,
                                     "total_steps": plan.total_steps})

    def on_log(self, step: int, metrics: dict) -> None:
        if self.rank == 0:
            self.progress(step, metrics)
            if self.tracker is not None:
                self.tracker.log_metrics(step, metrics)

    def on_epoch(self, records: list[EpochRecord], planned: list[list[str]] | None) -> None:
        """Rank 0: the epoch's summary to ``sample_ids/epoch_XXXX.json``, MLflow and the checkpoints."""
        summary = epoch_summary(records, seed=self.cfg.plan.training.seed, planned=planned)
        if not all(r.get("matches_digest", True) for r in summary["ranks"]):
            log.error("epoch %d: the samples trained differ from the planned order (digest mismatch): %s",
                      summary["epoch"], [r["rank"] for r in summary["ranks"] if not r["matches_digest"]])
        if self.cfg.sample_log_dir:
            write_epoch_summary(self.cfg.sample_log_dir, summary)
        e = int(summary["epoch"])
        self.epochs[str(e)] = {k: v for k, v in summary.items() if k != "ranks"}
        if self.tracker is not None:
            self.tracker.log_params({f"sample_order.epoch_{e:04d}": {
                "sha256": summary["sha256"], "num_samples": summary["num_samples"]}})

    def end(self, failed: bool = False) -> None:
        """Close the MLflow run; a failed worker waits only briefly (its checkpoint holds what is unsent)."""
        if self.tracker is None:
            return
        if failed:
            self.tracker.end("FAILED", timeout_s=FLUSH_BEFORE_CHECKPOINT_S, spill=False)
        else:
            self.tracker.end("FINISHED")


def _gather(record: EpochRecord, world: int) -> list[EpochRecord]:
    """Every rank's record, in rank order (a collective: every rank calls it at the same epoch end)."""
    import torch.distributed as dist

    if world == 1 or not dist.is_initialized():
        return [record]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, record)
    return sorted(out, key=lambda r: r.rank)


def _resume(trainer: Trainer, rank: int) -> tuple[dict, float | None, bool]:
    """Load ``ray.train.get_checkpoint()`` if there is one: ``(trainer_state.json, digest of the restored
    optimizer (rank 0), resumed)``."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return {}, None, False
    with checkpoint.as_directory() as d:
        meta = trainer.load_checkpoint(d)
    full_opt = trainer.full_optimizer_state()  # a collective under FSDP2 ({} off rank 0)
    if rank == 0:
        log.info("resumed from step %d (epoch %d, %d samples into it)", trainer.state.step,
                 trainer.state.position.epoch, trainer.state.position.samples_consumed)
    return meta, (optimizer_digest(full_opt) if full_opt else None), True


def _epoch_source(reader: CaptureReader | None, seed: int, rank: int, world: int) -> Callable[[int], Iterable[dict]]:
    """``epoch -> this rank's samples``: its slice of the planned order of the capture ``reader`` reads (a
    sequence: a resume enters it at the saved position), else the rows of the Ray Dataset shard ``"train"``."""
    if reader is not None:
        return lambda epoch: OrderedCapture.epoch(reader, seed=seed, epoch=epoch, rank=rank, world_size=world)
    import ray.train

    shard = ray.train.get_dataset_shard("train")

    def rows(epoch: int) -> Iterator[dict]:
        return (row_to_sample(row, torch.float32) for row in shard.iter_rows())

    return rows


def train_loop_per_worker(config: dict) -> dict:
    """Ray Train worker function; ``config[WORKER_CONFIG_KEY]`` is a :class:`WorkerConfig`.

    Returns (rank 0's value becomes ``Result.return_value``): ``{"step", "resumed_from_step",
    "resume_optimizer_digest", "history", "mlflow_run_id", "mlflow_outages"}`` (outages of the tracking
    server this incarnation of rank 0 rode out).
    """
    import ray.train
    import ray.train.torch

    cfg: WorkerConfig = config[WORKER_CONFIG_KEY]
    plan, training = cfg.plan, cfg.plan.training
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        # Ray gives a CPU worker OMP_NUM_THREADS=1; a worker's share of the node's cores is what the
        # matmuls can use (2x faster training on the 2-core demo box than 1 thread)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, ctx.get_local_world_size())))
    torch.manual_seed(training.seed)  # identical init on every rank (DDP also broadcasts rank 0's weights; FSDP2 does not)
    drafter, lm_head = build_drafter(plan)
    lm_head = lm_head.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(training.seed + 1000 * (rank + 1))  # per-rank stream for COD sampling
    model = _wrap(drafter, training.parallel_strategy, world)
    all_true, all_sum = collectives(world, device)
    out = _RankZero(rank, cfg)

    def write_checkpoint(step: int, metrics: dict) -> None:
        # ray.train.report is a barrier: every rank reaches it at the same steps because the
        # steps are kept equal (all_true) and the checkpoint steps are a function of the step.
        with tempfile.TemporaryDirectory() as tmp:
            trainer.save_checkpoint(tmp, extra_state=out.extra_state())
            ray.train.report({**metrics, "step": step}, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                             checkpoint_dir_name=checkpoint_name(step))
        # A worker's report queue holds one report: this metrics-only one returns once the controller has
        # taken the checkpoint's, so a process killed from here on restarts from this checkpoint (else
        # the controller can miss it and restart from the one before).
        ray.train.report({**metrics, "step": step})

    reader = cfg.capture.open() if cfg.capture is not None else None

    def on_epoch_end(record: EpochRecord) -> None:
        records = _gather(record, world)
        if rank == 0:
            planned = (epoch_orders(reader.sample_ids, seed=training.seed, epoch=record.epoch, world_size=world)
                       if reader is not None else None)
            out.on_epoch(records, planned)

    trainer = Trainer(config=training, model=model, objective=_objective(plan, rank), target_lm_head=lm_head,
                      total_steps=plan.total_steps, device=device, steps_per_epoch=plan.fixed_steps_per_epoch,
                      rank=rank, world_size=world, all_true=all_true, all_sum=all_sum, on_log=out.on_log,
                      write_checkpoint=write_checkpoint, callbacks=cfg.callbacks, on_epoch_end=on_epoch_end,
                      log_every_steps=cfg.log_every_steps)
    meta, resume_digest, resumed = _resume(trainer, rank)
    out.start(meta, resumed, world)
    samples_for_epoch = _epoch_source(reader, training.seed, rank, world)
    try:
        st = trainer.fit(samples_for_epoch)
    except BaseException:
        out.end(failed=True)
        raise
    out.end()
    return {"step": st.step, "resumed_from_step": st.resumed_from_step, "resume_optimizer_digest": resume_digest,
            "history": st.history, "mlflow_run_id": out.tracker.run_id if out.tracker else None,
            "mlflow_outages": out.tracker.num_outages if out.tracker else 0}
