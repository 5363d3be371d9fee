"""The Ray driver of training: :func:`run_train` runs a :class:`~pipelines.train.plan.TrainPlan` on Ray
Train V2 (``TorchTrainer`` over :func:`~pipelines.train.worker.train_loop_per_worker`) and exports the
final head through ``peagle_core.contract.export_head`` into ``<out_dir>/head``.

Faults: a worker that dies (an exception, a killed process, a lost node) fails the worker group; Ray
Train restarts it from the latest reported checkpoint up to ``training.max_failures`` times
(``FailureConfig``), and the restarted workers resume their data position (sample-exact on a
materialized capture: ``pipelines.train.order``). Rank 0's MLflow tracker buffers through tracking-server
outages (``pipelines.train.tracking``)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from peagle_core.contract import export_head
from peagle_core.drafter import Eagle3Drafter
from pipelines import settings
from pipelines.train.checkpoint import FROZEN_KEY, MODEL_FILE, STATE_FILE, load_model_state
from pipelines.train.loop import TrainCallback
from pipelines.train.order import SAMPLE_LOG_DIR, OrderedCapture
from pipelines.train.plan import TrainPlan
from pipelines.train.tracking import TrackingConfig
from pipelines.train.worker import WORKER_CONFIG_KEY, WorkerConfig, train_loop_per_worker

log = logging.getLogger(__name__)

__all__ = ["TrainRunResult", "run_train"]


@dataclass
class TrainRunResult:
    """Result of :func:`run_train` (the ``train`` stage keeps the parts it needs in its record,
    ``pipelines.stages.train.TrainOutput``)."""

    head_dir: Path
    checkpoint_path: str | None
    step: int
    resumed_from_step: int | None
    metrics: dict
    return_value: dict | None
    mlflow_run_id: str | None


def run_train(
    plan: TrainPlan,
    data: OrderedCapture | Any,
    out_dir: str | os.PathLike,
    *,
    run_name: str,
    storage_path: str | os.PathLike,
    num_to_keep: int | None = 2,
    resources_per_worker: dict | None = None,
    log_every_steps: int = 10,
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str = settings.TRAIN_EXPERIMENT,
    export_dtype: str = "bfloat16",
    recipe_text: str | None = None,
    callbacks: Sequence[TrainCallback] = (),
) -> TrainRunResult:
    """Train the drafter of ``plan`` with Ray Train V2 and export the head to ``<out_dir>/head``.

    Args:
        plan: from ``pipelines.train.plan`` (``plan_from_capture`` / ``plan_from_conversations``);
            ``training.num_workers`` workers, one GPU each with ``training.use_gpu``.
        data: a materialized capture, :class:`~pipelines.train.order.OrderedCapture` (each worker reads its
            slice of the seeded per-epoch order: sample-exact resume), or a ``ray.data.Dataset`` of captured
            rows (the streaming ``capture_stream``), split over workers by Ray Train (``get_dataset_shard``).
        out_dir: the exported head goes to ``<out_dir>/head`` (replaced if present).
        run_name, storage_path: ``RunConfig(name, storage_path)``; re-running with the same pair resumes
            from the latest checkpoint (the pipeline uses ``<run dir>/ray_results``). A local
            ``storage_path`` also gets ``<run_name>/sample_ids/epoch_XXXX.json`` (the ids trained per epoch)
            and, if MLflow stayed unreachable past the end, ``<run_name>/mlflow_unsent.jsonl``.
        num_to_keep: ``CheckpointConfig(num_to_keep)``.
        resources_per_worker: ``ScalingConfig(resources_per_worker)``, e.g. ``{"CPU": 1}``.
        log_every_steps: metric window (log line and MLflow point).
        mlflow_tracking_uri: rank 0's MLflow store; None = ``pipelines.settings.tracking_uri()``, ``""`` disables.
        mlflow_experiment: its experiment.
        export_dtype: dtype of the exported weights.
        recipe_text: saved as ``recipe.yaml`` beside the head.
        callbacks: :class:`~pipelines.train.loop.TrainCallback` s run on every worker (they must pickle).

    Returns:
        :class:`TrainRunResult`.

    Raises:
        ray.train.TrainingFailedError: the run failed more than ``training.max_failures`` times
            (``FailureConfig(max_failures)``: failures recovered from the latest checkpoint).
        RuntimeError: the run finished without a checkpoint.
    """
    import ray.train
    from ray.train.torch import TorchTrainer

    uri = settings.tracking_uri() if mlflow_tracking_uri is None else mlflow_tracking_uri
    local_run_dir = None if "://" in str(storage_path) else Path(storage_path) / run_name
    spill = str(local_run_dir / "mlflow_unsent.jsonl") if local_run_dir else None
    tracking = (TrackingConfig(tracking_uri=uri, experiment=mlflow_experiment, run_name=run_name, spill_path=spill)
                if uri else None)
    capture = data if isinstance(data, OrderedCapture) else None
    worker = WorkerConfig(plan=plan, log_every_steps=log_every_steps, tracking=tracking, callbacks=tuple(callbacks),
                          capture=capture, sample_log_dir=str(local_run_dir / SAMPLE_LOG_DIR) if local_run_dir else None)
    training = plan.training
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={WORKER_CONFIG_KEY: worker},
        scaling_config=ray.train.ScalingConfig(num_workers=training.num_workers, use_gpu=training.use_gpu,
                                               resources_per_worker=resources_per_worker),
        run_config=ray.train.RunConfig(
            name=run_name, storage_path=str(storage_path),
            failure_config=ray.train.FailureConfig(max_failures=training.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=num_to_keep)),
        datasets=None if capture is not None else {"train": data},
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"run {run_name} finished without a checkpoint under {storage_path}")
    with result.checkpoint.as_directory() as d:
        head, state = _export(plan, Path(d), Path(out_dir) / "head", run_name=run_name, dtype=export_dtype,
                              recipe_text=recipe_text)
    rv = result.return_value or {}
    return TrainRunResult(head_dir=head, checkpoint_path=result.checkpoint.path, step=int(state["step"]),
                       resumed_from_step=rv.get("resumed_from_step"), metrics=dict(result.metrics or {}),
                       return_value=result.return_value, mlflow_run_id=state.get("mlflow_run_id"))


def _export(plan: TrainPlan, checkpoint_dir: Path, head_dir: Path, *, run_name: str, dtype: str,
            recipe_text: str | None) -> tuple[Path, dict]:
    """Export the checkpoint's model as a vLLM head; returns ``(head dir, trainer_state.json)``.

    Raises:
        ValueError: the model file lacks a parameter the head exports (only the frozen ones listed under
            ``FROZEN_KEY`` may be absent, and are not exported) or has one the drafter does not know
            (:func:`~pipelines.train.checkpoint.load_model_state`).
    """
    drafter = Eagle3Drafter(plan.drafter)
    state = json.loads((checkpoint_dir / STATE_FILE).read_text())
    # the frozen ones are the target's embeddings: not exported (include_embed_tokens below)
    load_model_state(drafter, load_file(str(checkpoint_dir / MODEL_FILE)), frozen=set(state.get(FROZEN_KEY, ())),
                     checkpoint_dir=checkpoint_dir)
    spec, training = plan.drafter_spec, plan.training
    extra = {"method": training.method, "num_speculative_tokens": spec.num_speculative_tokens,
             "target": plan.target_name, "target_sha256": plan.target_sha256, "step": state["step"],
             "tokens_seen": state.get("tokens_seen"), "run_name": run_name,
             "recipe": {"training": training.model_dump(mode="json"), "drafter": spec.model_dump(mode="json")}}
    if plan.init_head is not None:  # provenance: the head this one was fine-tuned from
        extra["init_from"] = {"ref": plan.init_head.ref, **plan.init_head.key()}
    head = export_head(drafter, head_dir, dtype=dtype, extra_config=extra,
                       extra_files={"recipe.yaml": recipe_text} if recipe_text else None, overwrite=True,
                       include_embed_tokens=spec.train_embed_tokens)
    return head, state
