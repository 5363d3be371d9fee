"""Where training progress goes: one log line per metric window (every rank's logs; Ray worker logs,
CI) and, from rank 0, MLflow (Ray Train V2 has no ``MLflowLoggerCallback``). The store and the
experiment follow ``pipelines.settings``.

MLflow never stops training: :class:`MlflowTracker` queues what it is given and returns at once; a
sender thread applies the queue in order through ``MlflowClient``. While the store is unreachable the
queue is kept and retried with exponential backoff (``retry_initial_s`` doubling to ``retry_max_s``),
with one warning when the outage starts and one line when it ends (the buffer then flushed, metrics
with their original steps and timestamps). A call the store rejects (4xx, e.g. a parameter logged
again with another value) is dropped with a warning. At the end the tracker waits up to
``flush_timeout_s`` for the queue; what is still unsent then is written to ``spill_path`` (JSON lines)
when one is set, and counted in a warning. Before each checkpoint the worker waits briefly for the queue
(:meth:`MlflowTracker.flush`) and stores what is still unsent in the checkpoint
(:meth:`MlflowTracker.pending`): a worker killed during an outage re-sends it after its restart.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines import settings
from pipelines.registry.params import flatten

log = logging.getLogger(__name__)

MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limits
MAX_PARAMS_PER_BATCH = 100

__all__ = ["MlflowTracker", "TrackingConfig", "progress_logger"]


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    """Where rank 0 logs a training run: the MLflow store (``settings.tracking_uri``), the experiment
    (``settings.TRAIN_EXPERIMENT``) and the run name (the Ray Train run name); how it rides out outages:
    backoff ``retry_initial_s`` .. ``retry_max_s``, ``request_timeout_s`` per HTTP request, the first
    connection awaited ``start_timeout_s`` (then training goes on and the run is created when the store
    answers), the queue awaited ``flush_timeout_s`` at the end, then spilled to ``spill_path`` (None: not kept)."""

    tracking_uri: str
    experiment: str = settings.TRAIN_EXPERIMENT
    run_name: str
    retry_initial_s: float = 1.0
    retry_max_s: float = 30.0
    request_timeout_s: float = 10.0
    start_timeout_s: float = 30.0
    flush_timeout_s: float = 120.0
    spill_path: str | None = None


def _client(cfg: TrackingConfig) -> Any:
    """An ``MlflowClient`` of ``cfg.tracking_uri``. HTTP stores: MLflow's own retries are turned off in this
    process (``MLFLOW_HTTP_REQUEST_MAX_RETRIES=0`` unless set) so that the tracker's backoff decides."""
    from mlflow import MlflowClient

    local_dir = settings.local_sqlite_dir(cfg.tracking_uri)
    if local_dir is not None:
        local_dir.mkdir(parents=True, exist_ok=True)
    if cfg.tracking_uri.startswith(("http://", "https://")):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(math.ceil(cfg.request_timeout_s)))
    return MlflowClient(tracking_uri=cfg.tracking_uri)


def _rejected(e: Exception) -> bool:
    """True for an error the store answered with (4xx): retrying cannot help."""
    from mlflow.exceptions import MlflowException

    if not isinstance(e, MlflowException):
        return False
    code = e.get_http_status_code()
    return 400 <= code < 500 and code not in (408, 429)


class MlflowTracker:
    """Rank 0's MLflow run (see the module docstring); re-attaches to ``run_id`` on resume (its id is
    stored in the checkpoint). ``run_id`` is None until the store has created the run.

    Args:
        cfg: the store, the run and the outage settings.
        run_id: an existing run to continue (None: a new run named ``cfg.run_name``).
        pending: operations a previous incarnation had not sent (:meth:`pending`), sent first.
        client_factory: ``cfg -> MlflowClient``-like object (tests).
    """

    def __init__(self, cfg: TrackingConfig, run_id: str | None = None, *, pending: list | None = None,
                 client_factory: Callable[[TrackingConfig], Any] = _client) -> None:
        self.cfg, self.run_id = cfg, run_id
        self._client_factory = client_factory
        self._ops: deque[tuple] = deque([("start",), *(tuple(op) for op in pending or ())])
        self._cv = threading.Condition()
        self._started = threading.Event()
        self._closing = self._abandon = False
        self._outage_since: float | None = None
        self.num_outages = 0
        self.num_points_sent = 0
        self._thread = threading.Thread(target=self._send_loop, name="peagle-mlflow", daemon=True)
        self._thread.start()
        if not self._started.wait(cfg.start_timeout_s):
            log.info("MLflow at %s: no run after %.3g s; training goes on, the run is created when the store "
                     "answers", cfg.tracking_uri, cfg.start_timeout_s)

    # -- the training side: queue and return ------------------------------------------------------

    def _put(self, op: tuple) -> None:
        with self._cv:
            self._ops.append(op)
            self._cv.notify()

    def log_params(self, params: dict) -> None:
        """Nested ``params`` as dotted keys (``training.lr``), values as strings of at most 500 characters."""
        self._put(("params", {k: str(v)[:500] for k, v in flatten(params).items()}))

    def log_metrics(self, step: int, metrics: dict) -> None:
        """The finite numeric ``metrics`` at ``step`` (``/`` in names becomes ``_``)."""
        values = {k.replace("/", "_"): float(v) for k, v in metrics.items()
                  if isinstance(v, (int, float)) and math.isfinite(float(v))}
        self._put(("metrics", int(step), values, int(time.time() * 1000)))

    @property
    def num_pending(self) -> int:
        """Operations queued and not yet applied (the start and end included)."""
        with self._cv:
            return len(self._ops)

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the queue to empty, not at all during an outage; True when empty."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._ops or self._outage_since is not None, timeout=timeout_s) \
                and not self._ops

    def pending(self) -> list[list]:
        """The unsent parameter and metric calls, JSON-able (for the checkpoint; ``pending=`` takes them back)."""
        with self._cv:
            return [list(op) for op in self._ops if op[0] in ("params", "metrics")]

    def end(self, status: str = "FINISHED", *, timeout_s: float | None = None, spill: bool = True) -> None:
        """Mark the run ``status`` once the queue is flushed; wait up to ``timeout_s`` (default
        ``flush_timeout_s``), then give up on what is left: spilled to ``spill_path`` with ``spill``, else
        only counted (a failed worker: its checkpoint holds what it had not sent)."""
        timeout_s = self.cfg.flush_timeout_s if timeout_s is None else timeout_s
        self._put(("end", status))
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            with self._cv:
                self._abandon = True
                left = list(self._ops)
                self._ops.clear()
                self._cv.notify_all()
            self._spill(left if spill else [], timeout_s, len(left))

    def _spill(self, ops: list[tuple], waited_s: float, num_left: int) -> None:
        points = sum(len(op[2]) for op in ops if op[0] == "metrics")
        where = "not kept"
        if self.cfg.spill_path and ops:
            path = Path(self.cfg.spill_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                for op in ops:
                    f.write(json.dumps({"run_id": self.run_id, "op": op[0], "args": list(op[1:])}) + "\n")
            where = f"written to {path}"
        log.warning("MLflow at %s still unreachable after %.3g s: %d calls not logged (%d metric points %s)",
                    self.cfg.tracking_uri, waited_s, num_left, points, where)

    # -- the sender thread -------------------------------------------------------------------------

    def _next_batch(self) -> list[tuple] | None:
        """The next operations to apply together (consecutive metric windows up to the batch limit, else
        one operation); None when the tracker is done."""
        with self._cv:
            while not self._ops and not self._closing and not self._abandon:
                self._cv.wait()
            if self._abandon or not self._ops:
                return None
            ops, n = [self._ops[0]], len(self._ops[0][2]) if self._ops[0][0] == "metrics" else 0
            if ops[0][0] == "metrics":
                for op in list(self._ops)[1:]:
                    if op[0] != "metrics" or n + len(op[2]) > MAX_METRICS_PER_BATCH:
                        break
                    ops.append(op)
                    n += len(op[2])
            return ops

    def _send_loop(self) -> None:
        client, delay = None, self.cfg.retry_initial_s
        while (ops := self._next_batch()) is not None:
            try:
                client = client or self._client_factory(self.cfg)
                self._apply(client, ops)
            except Exception as e:  # noqa: BLE001 - any failure of the store must not reach training
                if _rejected(e) and ops[0][0] == "start" and self.run_id is not None:
                    log.warning("MLflow run %s cannot be continued (%s); starting a new run", self.run_id, e)
                    self.run_id = None
                    continue
                if _rejected(e):
                    log.warning("MLflow rejected %s (dropped): %s", ops[0][0], e)
                else:
                    self._on_failure(e)
                    with self._cv:
                        self._cv.notify_all()
                        self._cv.wait_for(lambda: self._abandon, timeout=delay)
                    delay = min(2 * delay, self.cfg.retry_max_s)
                    continue
            with self._cv:
                for _ in ops:
                    self._ops.popleft()
                self._cv.notify_all()
            if ops[0][0] == "start":
                self._started.set()
            if self._outage_since is not None:
                log.info("MLflow at %s is back after %.0f s; buffered metrics flushed", self.cfg.tracking_uri,
                            time.monotonic() - self._outage_since)
                self._outage_since = None
            delay = self.cfg.retry_initial_s

    def _on_failure(self, e: Exception) -> None:
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            self.num_outages += 1
            log.warning("MLflow at %s is unreachable (%s: %s); training goes on, metrics are buffered and retried "
                        "every <= %.3g s", self.cfg.tracking_uri, type(e).__name__, str(e)[:200], self.cfg.retry_max_s)

    def _apply(self, client: Any, ops: list[tuple]) -> None:
        kind = ops[0][0]
        if kind == "start":
            self._start_run(client)
        elif kind == "params":
            from mlflow.entities import Param

            items = sorted(ops[0][1].items())
            for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
                client.log_batch(self.run_id, params=[Param(k, v) for k, v in items[i:i + MAX_PARAMS_PER_BATCH]])
        elif kind == "metrics":
            from mlflow.entities import Metric

            metrics = [Metric(k, v, ts, step) for _, step, values, ts in ops for k, v in values.items()]
            client.log_batch(self.run_id, metrics=metrics)
            self.num_points_sent += len(metrics)
        elif kind == "end":
            client.set_terminated(self.run_id, status=ops[0][1])

    def _start_run(self, client: Any) -> None:
        if self.run_id is not None:
            client.update_run(self.run_id, status="RUNNING")
            return
        exp = client.get_experiment_by_name(self.cfg.experiment)
        if exp is None:
            try:
                exp_id = client.create_experiment(self.cfg.experiment)
            except Exception:  # created concurrently by another process
                exp = client.get_experiment_by_name(self.cfg.experiment)
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
        self.run_id = client.create_run(exp_id, run_name=self.cfg.run_name).info.run_id


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
