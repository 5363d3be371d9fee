"""Rank 0's MLflow tracker (pipelines/train/tracking.py) against a stand-in store that goes down and comes
back: training calls never block, one warning per outage, everything buffered arrives in order."""

import json
import logging
import threading
import time
from types import SimpleNamespace

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from pipelines.train import MlflowTracker, TrackingConfig

pytestmark = pytest.mark.unit


class Store:
    """A stand-in MLflow client: ``up`` False makes every call fail as a refused connection does (an
    ``MlflowException`` with INTERNAL_ERROR); ``reject`` makes ``log_batch`` answer 400."""

    def __init__(self, up: bool = True) -> None:
        self.up, self.reject = up, False
        self.runs: dict[str, dict] = {}
        self.calls = 0
        self.lock = threading.Lock()

    def _call(self) -> None:
        with self.lock:
            self.calls += 1
        if not self.up:
            raise MlflowException("API request to http://127.0.0.1:1/api/2.0/mlflow/runs/log-batch failed with "
                                  "exception ConnectionError(Connection refused)")

    def get_experiment_by_name(self, name):
        self._call()
        return SimpleNamespace(experiment_id="1") if name == "exists" else None

    def create_experiment(self, name):
        self._call()
        return "2"

    def create_run(self, experiment_id, run_name=None):
        self._call()
        run_id = f"run{len(self.runs)}"
        self.runs[run_id] = {"name": run_name, "status": "RUNNING", "metrics": [], "params": {}}
        return SimpleNamespace(info=SimpleNamespace(run_id=run_id))

    def update_run(self, run_id, status=None):
        self._call()
        self.runs[run_id]["status"] = status

    def log_batch(self, run_id, metrics=(), params=()):
        self._call()
        if self.reject:
            raise MlflowException("Changing param values is not allowed", error_code=INVALID_PARAMETER_VALUE)
        run = self.runs[run_id]
        run["metrics"] += [(m.key, m.value, m.step) for m in metrics]
        run["params"].update({p.key: p.value for p in params})

    def set_terminated(self, run_id, status=None):
        self._call()
        self.runs[run_id]["status"] = status


def tracker(store: Store, **kw) -> MlflowTracker:
    cfg = {"tracking_uri": "http://127.0.0.1:1", "experiment": "exp", "run_name": "r", "retry_initial_s": 0.01,
           "retry_max_s": 0.05, "start_timeout_s": 5.0, "flush_timeout_s": 5.0} | kw
    return MlflowTracker(TrackingConfig(**cfg), client_factory=lambda cfg: store)


def outage_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "is unreachable" in r.getMessage()]


def test_outage_buffers_warns_once_and_flushes_in_order(caplog):
    caplog.set_level(logging.INFO, logger="pipelines.train.tracking")
    store = Store()
    t = tracker(store)
    assert t.run_id == "run0"  # the run is created before training starts while the store answers
    t.log_params({"training": {"lr": 0.002}})
    t.log_metrics(1, {"loss": 5.0, "note": "text", "nan": float("nan")})
    assert t.flush(5.0)
    store.up = False
    t0 = time.perf_counter()
    for step in range(2, 42):
        t.log_metrics(step, {"loss": 1.0 / step, "acc/d0": 0.5})
    assert time.perf_counter() - t0 < 0.5  # training never waits for the store
    time.sleep(0.3)  # several retries fail meanwhile
    assert store.calls > 3 and len(outage_warnings(caplog)) == 1
    assert not t.flush(0.1) and t.num_pending > 0
    store.up = True
    t.end()
    run = store.runs["run0"]
    assert run["status"] == "FINISHED" and run["params"] == {"training.lr": "0.002"}
    losses = [(step, v) for k, v, step in run["metrics"] if k == "loss"]
    assert losses == [(1, 5.0)] + [(s, 1.0 / s) for s in range(2, 42)]  # nothing lost, in order
    assert {k for k, _, _ in run["metrics"]} == {"loss", "acc_d0"}
    assert t.num_outages == 1 and len(outage_warnings(caplog)) == 1
    assert any("is back" in r.getMessage() for r in caplog.records)


def test_store_down_from_the_start_then_pending_survives_a_restart(tmp_path, caplog):
    """The run cannot be created: training goes on; at the end what is unsent is spilled; a restarted worker
    given :meth:`pending` (as the checkpoint stores it) sends it once the store answers."""
    store = Store(up=False)
    t = tracker(store, start_timeout_s=0.1, flush_timeout_s=0.3, spill_path=str(tmp_path / "unsent.jsonl"))
    assert t.run_id is None
    t.log_params({"a": 1})
    for step in (2, 4):
        t.log_metrics(step, {"loss": float(step)})
    pending = json.loads(json.dumps(t.pending()))  # what a checkpoint keeps
    assert [op[0] for op in pending] == ["params", "metrics", "metrics"]
    t.end()
    spilled = [json.loads(line) for line in (tmp_path / "unsent.jsonl").read_text().splitlines()]
    assert [s["op"] for s in spilled] == ["start", "params", "metrics", "metrics", "end"]
    assert len(outage_warnings(caplog)) == 1
    assert any("not logged" in r.getMessage() for r in caplog.records)

    store.up = True
    again = MlflowTracker(t.cfg, pending=pending, client_factory=lambda cfg: store)
    again.log_metrics(6, {"loss": 6.0})
    again.end()
    run = store.runs[again.run_id]
    assert [(k, v, s) for k, v, s in run["metrics"]] == [("loss", 2.0, 2), ("loss", 4.0, 4), ("loss", 6.0, 6)]
    assert run["params"] == {"a": "1"} and run["status"] == "FINISHED"


def test_rejected_call_is_dropped_not_retried(caplog):
    store = Store()
    t = tracker(store)
    store.reject = True
    t.log_params({"training": {"lr": 0.1}})
    assert t.flush(5.0)
    store.reject = False
    t.log_metrics(1, {"loss": 1.0})
    t.end()
    assert store.runs["run0"]["metrics"] == [("loss", 1.0, 1)]
    assert sum("rejected" in r.getMessage() for r in caplog.records) == 1
    assert not outage_warnings(caplog)


def test_resume_reattaches_to_the_run():
    store = Store()
    first = tracker(store)
    first.end("FAILED")
    again = MlflowTracker(first.cfg, run_id=first.run_id, client_factory=lambda cfg: store)
    assert again.run_id == "run0" and store.runs["run0"]["status"] == "RUNNING"
    again.end()
    assert store.runs["run0"]["status"] == "FINISHED" and len(store.runs) == 1
