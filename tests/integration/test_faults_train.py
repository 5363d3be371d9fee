"""A tracking-server outage during training (issue 15): a real ``mlflow server`` (sqlite backend, loopback)
is SIGKILLed after the step-2 checkpoint of a 2-worker Ray Train run and restarted later; training goes
on, rank 0 buffers its metrics (one outage, one warning) and they all arrive once the server is back."""

import signal
import time
from pathlib import Path

import pytest

from peagle_core.contract import validate_head
from pipelines import settings
from pipelines import train as T
from tests.integration.serve_helpers import MlflowServer
from tests.integration.test_train import capture, ray_local, run  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(tmp_path / "mlflow-server")
    server.start()  # starts while the capture fixture and Ray come up
    yield server
    server.stop()


class WaitAtStep(T.TrainCallback):
    """Test harness, not a fault: every rank waits at the checkpoint of ``step`` until ``path`` exists
    (at most ``timeout_s``), so that the server restart happens while training still has steps to go."""

    def __init__(self, step: int, path: Path, timeout_s: float = 240) -> None:
        self.step, self.path, self.timeout_s = step, Path(path), timeout_s

    def on_checkpoint(self, step: int, metrics: dict) -> None:
        deadline = time.monotonic() + self.timeout_s
        while step == self.step and not self.path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)


def wait_for(path: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout_s} s")
        time.sleep(0.05)


def test_mlflow_outage_mid_training_loses_no_metric(mlflow_server, capture, ray_local, tmp_path):  # noqa: F811
    import threading

    from mlflow.tracking import MlflowClient

    up_s = mlflow_server.wait_healthy()
    run_dir = tmp_path / "ray_results" / "outage"
    go, events = tmp_path / "server-back", {}

    def controller() -> None:
        wait_for(run_dir / "checkpoint_00000002" / T.STATE_FILE)
        mlflow_server.stop(signal.SIGKILL)
        events["down"] = time.monotonic()
        wait_for(run_dir / "checkpoint_00000004" / T.STATE_FILE)  # steps 3-4 trained during the outage
        mlflow_server.start()
        events["restart_s"] = mlflow_server.wait_healthy()
        events["up"] = time.monotonic()
        go.write_text("go")

    thread = threading.Thread(target=controller, name="outage", daemon=True)
    thread.start()
    t0 = time.monotonic()
    out = run(capture, tmp_path, "outage", training_kw={"checkpoint_every_steps": 2},
              mlflow_tracking_uri=mlflow_server.uri, callbacks=[WaitAtStep(4, go)])
    total_s = time.monotonic() - t0
    thread.join(5)
    assert {"down", "up"} <= set(events) and out.step == 8
    assert out.return_value["mlflow_outages"] == 1  # one outage seen (and warned about once) by rank 0

    client = MlflowClient(mlflow_server.uri)
    runs = client.search_runs([client.get_experiment_by_name(settings.TRAIN_EXPERIMENT).experiment_id])
    assert [r.info.run_id for r in runs] == [out.mlflow_run_id] and runs[0].info.status == "FINISHED"
    for key in ("loss", "acc_d0", "tokens_per_s"):
        steps = [m.step for m in client.get_metric_history(out.mlflow_run_id, key)]
        assert sorted(steps) == [2, 4, 6, 8], (key, steps)  # the window of step 4 was buffered, none lost
    params = runs[0].data.params
    assert params["training.lr"] == "0.002" and params["sample_order.epoch_0000.sha256"]
    assert not (run_dir / "mlflow_unsent.jsonl").exists()
    validate_head(out.head_dir, parallel_drafting=True)
    print(f"\nMLflow server up in {up_s:.0f} s, SIGKILLed after checkpoint 2, back {events['up'] - events['down']:.0f} s "
          f"later (restart {events['restart_s']:.0f} s); training {total_s:.0f} s, 8/8 steps, 4/4 metric windows")
