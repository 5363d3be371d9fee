"""Where training progress goes: one log line per metric window (every rank's logs; Ray worker logs,
CI) and, from rank 0, MLflow (Ray Train V2 has no ``MLflowLoggerCallback``). The store and the
experiment follow ``pipelines.settings``."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipelines import settings
from pipelines.mlflow_params import flatten

log = logging.getLogger(__name__)

__all__ = ["MlflowTracker", "TrackingConfig", "progress_logger"]


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    """Where rank 0 logs a training run: the MLflow store (``settings.tracking_uri``), the experiment
    (``settings.TRAIN_EXPERIMENT``) and the run name (the Ray Train run name)."""

    tracking_uri: str
    experiment: str = settings.TRAIN_EXPERIMENT
    run_name: str


class MlflowTracker:
    """Logs params and metric windows of one run to MLflow; re-attaches to the same MLflow run on
    resume (its id is stored in the checkpoint)."""

    def __init__(self, cfg: TrackingConfig, run_id: str | None = None) -> None:
        import mlflow

        local_dir = settings.local_sqlite_dir(cfg.tracking_uri)
        if local_dir is not None:
            local_dir.mkdir(parents=True, exist_ok=True)
        self._mlflow = mlflow
        mlflow.set_tracking_uri(cfg.tracking_uri)
        mlflow.set_experiment(cfg.experiment)
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else cfg.run_name)
        self.run_id = self.run.info.run_id

    def log_params(self, params: dict) -> None:
        """Nested ``params`` as dotted keys (``training.lr``), values as strings of at most 500 characters."""
        self._mlflow.log_params({k: str(v)[:500] for k, v in flatten(params).items()})

    def log_metrics(self, step: int, metrics: dict) -> None:
        """The finite numeric ``metrics`` at ``step`` (``/`` in names becomes ``_``)."""
        self._mlflow.log_metrics({k.replace("/", "_"): float(v) for k, v in metrics.items()
                                  if isinstance(v, (int, float)) and math.isfinite(float(v))}, step=step)

    def end(self, status: str = "FINISHED") -> None:
        self._mlflow.end_run(status=status)


def progress_logger(total_steps: int) -> Callable[[int, dict], None]:
    """``f(step, metrics)`` logging one line per metric window: step, epoch, loss, accuracies, lr,
    tokens/s, positions/s and the ETA."""
    t0 = time.perf_counter()

    def fn(step: int, m: dict) -> None:
        elapsed = time.perf_counter() - t0
        eta = elapsed / max(step, 1) * (total_steps - step)
        depth = " ".join(f"{k}={m[k]:.3f}" for k in sorted(m) if k.startswith("acc"))
        log.info("step %d/%d epoch %d loss %.4f %s lr %.2e tok/s %.0f pos/s %.0f eta %.0fs", step, total_steps,
                 int(m.get("epoch", 0)), m.get("loss", float("nan")), depth, m.get("lr", 0.0),
                 m.get("tokens_per_s", 0.0), m.get("positions_per_s", 0.0), eta)

    return fn
