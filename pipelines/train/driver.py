"""The Ray driver of training: :func:`run_train` runs a :class:`~pipelines.train.plan.TrainPlan` on Ray
Train V2 (``TorchTrainer`` over :func:`~pipelines.train.worker.train_loop_per_worker`) and exports the
final head through ``peagle_core.contract.export_head`` into ``<out_dir>/head``."""

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
from pipelines.train.checkpoint import MODEL_FILE, STATE_FILE
from pipelines.train.loop import TrainCallback
from pipelines.train.plan import TrainPlan
from pipelines.train.tracking import TrackingConfig
from pipelines.train.worker import WORKER_CONFIG_KEY, WorkerConfig, train_loop_per_worker

log = logging.getLogger(__name__)

__all__ = ["TrainOutput", "run_train"]


@dataclass
class TrainOutput:
    """Result of :func:`run_train`."""

    head_dir: Path
    checkpoint_path: str | None
    step: int
    resumed_from_step: int | None
    metrics: dict
    return_value: dict | None
    mlflow_run_id: str | None


def run_train(
    plan: TrainPlan,
    dataset: Any,
    out_dir: str | os.PathLike,
    *,
    run_name: str,
    storage_path: str | os.PathLike,
    max_failures: int = 0,
    num_to_keep: int | None = 2,
    resources_per_worker: dict | None = None,
    log_every_steps: int = 10,
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str = settings.TRAIN_EXPERIMENT,
    export_dtype: str = "bfloat16",
    recipe_text: str | None = None,
    callbacks: Sequence[TrainCallback] = (),
) -> TrainOutput:
    """Train the drafter of ``plan`` with Ray Train V2 and export the head to ``<out_dir>/head``.

    Args:
        plan: from ``pipelines.train.plan`` (``plan_from_capture`` / ``plan_from_conversations`` /
            ``plan_from_dataset``); ``training.num_workers`` workers, one GPU each with ``training.use_gpu``.
        dataset: ``ray.data.Dataset`` of captured rows (``pipelines.capture.captured_dataset`` or the
            streaming ``capture_stream``); split over workers by Ray Train (``get_dataset_shard``).
        out_dir: the exported head goes to ``<out_dir>/head`` (replaced if present).
        run_name, storage_path: ``RunConfig(name, storage_path)``; re-running with the same pair resumes
            from the latest checkpoint (the pipeline uses ``<run dir>/ray_results``).
        max_failures: ``FailureConfig(max_failures)``: worker failures recovered from the latest
            checkpoint (0 = stop at the first failure).
        num_to_keep: ``CheckpointConfig(num_to_keep)``.
        resources_per_worker: ``ScalingConfig(resources_per_worker)``, e.g. ``{"CPU": 1}``.
        log_every_steps: metric window (log line and MLflow point).
        mlflow_tracking_uri: rank 0's MLflow store; None = ``pipelines.settings.tracking_uri()``, ``""`` disables.
        mlflow_experiment: its experiment.
        export_dtype: dtype of the exported weights.
        recipe_text: saved as ``recipe.yaml`` beside the head.
        callbacks: :class:`~pipelines.train.loop.TrainCallback` s run on every worker (they must pickle).

    Returns:
        :class:`TrainOutput`.

    Raises:
        ray.train.TrainingFailedError: the run failed more than ``max_failures`` times.
        RuntimeError: the run finished without a checkpoint.
    """
    import ray.train
    from ray.train.torch import TorchTrainer

    uri = settings.tracking_uri() if mlflow_tracking_uri is None else mlflow_tracking_uri
    tracking = TrackingConfig(tracking_uri=uri, experiment=mlflow_experiment, run_name=run_name) if uri else None
    worker = WorkerConfig(plan=plan, log_every_steps=log_every_steps, tracking=tracking, callbacks=tuple(callbacks))
    training = plan.training
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={WORKER_CONFIG_KEY: worker},
        scaling_config=ray.train.ScalingConfig(num_workers=training.num_workers, use_gpu=training.use_gpu,
                                               resources_per_worker=resources_per_worker),
        run_config=ray.train.RunConfig(
            name=run_name, storage_path=str(storage_path),
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=num_to_keep)),
        datasets={"train": dataset},
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"run {run_name} finished without a checkpoint under {storage_path}")
    with result.checkpoint.as_directory() as d:
        head, state = _export(plan, Path(d), Path(out_dir) / "head", run_name=run_name, dtype=export_dtype,
                              recipe_text=recipe_text)
    rv = result.return_value or {}
    return TrainOutput(head_dir=head, checkpoint_path=result.checkpoint.path, step=int(state["step"]),
                       resumed_from_step=rv.get("resumed_from_step"), metrics=dict(result.metrics or {}),
                       return_value=result.return_value, mlflow_run_id=state.get("mlflow_run_id"))


def _export(plan: TrainPlan, checkpoint_dir: Path, head_dir: Path, *, run_name: str, dtype: str,
            recipe_text: str | None) -> tuple[Path, dict]:
    """Export the checkpoint's model as a vLLM head; returns ``(head dir, trainer_state.json)``."""
    drafter = Eagle3Drafter(plan.drafter)
    drafter.load_state_dict(load_file(str(checkpoint_dir / MODEL_FILE)), strict=True)
    state = json.loads((checkpoint_dir / STATE_FILE).read_text())
    spec, training = plan.drafter_spec, plan.training
    extra = {"method": training.method, "num_speculative_tokens": spec.num_speculative_tokens,
             "target": plan.target_name, "target_sha256": plan.target_sha256, "step": state["step"],
             "tokens_seen": state.get("tokens_seen"), "run_name": run_name,
             "recipe": {"training": training.model_dump(mode="json"), "drafter": spec.model_dump(mode="json")}}
    head = export_head(drafter, head_dir, dtype=dtype, extra_config=extra,
                       extra_files={"recipe.yaml": recipe_text} if recipe_text else None, overwrite=True,
                       include_embed_tokens=spec.train_embed_tokens)
    return head, state
