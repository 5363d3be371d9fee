"""Ray Train stage on CPU with real Ray (2 workers, gloo DDP; and FSDP2), real MLflow (sqlite in tmp_path) and
captured SmolLM2-135M-Instruct hidden states: the loss decreases, checkpoints are written, the head
exports through the contract; an FSDP2 run killed after its first checkpoint resumes at that step with
the optimizer state restored and trains the same sample ids per epoch as an uninterrupted DDP run; a
worker process SIGKILLed mid-epoch is restarted by Ray Train (training.max_failures) and the run
finishes by itself with the same steps, samples and weights; a tracking-server outage during training (issue 15):
a real ``mlflow server`` (sqlite backend, loopback) is SIGKILLed after the step-2 checkpoint and restarted later;
training goes on, rank 0 buffers its metrics (one outage, one warning) and they all arrive once the server is
back. One Ray cluster and one capture for all of them; the outage's run is also the uninterrupted run the
others compare with (fixture ``reference``)."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from peagle_core.contract import validate_head
from pipelines import settings
from pipelines import train as T
from pipelines.recipe import CaptureConfig, DataConfig, DrafterSpec, TargetConfig, TrainingConfig
from tests.integration.serve_helpers import MlflowServer

pytestmark = pytest.mark.integration

TOPICS = ["the ocean", "a small robot", "baking bread", "the moon", "learning Python", "a rainy day",
          "mountain hiking", "an old library", "playing chess", "a busy city", "growing tomatoes", "the desert"]


def conversations(num: int) -> list[dict]:
    """Deterministic chat rows {id, messages}; assistant turns of ~40-120 tokens."""
    rows = []
    for i in range(num):
        topic = TOPICS[i % len(TOPICS)]
        answer = (f"Here is a short note about {topic}. " * (1 + i % 3)
                  + f"People often enjoy {topic} because it is calm, simple and full of small surprises. "
                  f"If you want to know more about {topic}, start by asking one clear question every day.")
        rows.append({"id": f"c{i:03d}", "messages": [
            {"role": "user", "content": f"Tell me something about {topic}, please. ({i})"},
            {"role": "assistant", "content": answer}]})
    return rows


@pytest.fixture(scope="module")
def capture(module_mktemp):
    from pipelines.capture import run_capture

    out = module_mktemp("capture")
    res = run_capture(conversations(16), TargetConfig(), CaptureConfig(batch_size=8, dtype="float16",
                                                                       shard_size_samples=8),
                      DataConfig(max_length_tokens=160), out, use_ray=False)
    assert res.num_samples == 16
    return out


@pytest.fixture(scope="module")
def ray_local():
    import ray

    # 4 logical CPUs on the 2-core box: 2 train workers + Ray Data read tasks never starve each other.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


class FailAfterStep(T.TrainCallback):
    """Simulated crash: raises on every worker once the checkpoint of step >= ``step`` is complete (reported)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_checkpoint(self, step: int, metrics: dict) -> None:
        if step >= self.step:
            raise RuntimeError(f"fail_after_step={self.step}: simulated failure at step {step}")


def configs(**kw):
    base = {"method": "peagle", "num_epochs": 20, "max_steps": 8, "lr": 2e-3, "warmup_steps": 2,
            "batch_tokens": 320, "num_workers": 2, "checkpoint_every_steps": 4, "num_partitions": 2,
            "cod_ratio": 0.8, "cod_min_ratio": 0.3, "seed": 0}
    base.update(kw)
    spec = DrafterSpec(num_layers=1, num_speculative_tokens=3, mask_token_id=16, draft_vocab_size=2048)
    return TrainingConfig(**base), spec, TargetConfig()


def run(capture, tmp_path, name, training_kw=None, mlflow_tracking_uri=None, **kw):
    plan = T.plan_from_capture(*configs(**(training_kw or {})), capture)
    return T.run_train(plan, T.OrderedCapture(str(capture)), tmp_path / f"out-{name}",
                       run_name=name, storage_path=tmp_path / "ray_results",
                       mlflow_tracking_uri=mlflow_tracking_uri or f"sqlite:///{tmp_path / 'mlflow.db'}",
                       log_every_steps=2, export_dtype="float32", **kw)


def sample_logs(run_dir: Path) -> dict[str, dict]:
    """``sample_ids/epoch_XXXX.json`` of a Ray Train run directory, by file name."""
    return {p.name: json.loads(p.read_text()) for p in sorted((run_dir / T.SAMPLE_LOG_DIR).glob("epoch_*.json"))}


@pytest.fixture(scope="module")
def mlflow_server(module_mktemp):
    server = MlflowServer(module_mktemp("mlflow-server"))
    server.start()
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


@pytest.fixture(scope="module")
def reference(capture, ray_local, mlflow_server, module_mktemp):
    """The uninterrupted run every fault test compares with: ``(output, run dir, events)``. It is also the run of
    the tracking-server outage (test_mlflow_outage_mid_training_loses_no_metric): a real ``mlflow server`` is
    SIGKILLed after the step-2 checkpoint and restarted once the step-4 checkpoint is written (the ranks wait
    there for it); an outage does not interrupt training, so one Ray Train run serves both (one start-up of ~60 s
    less). Checkpoints every 2 steps (the outage's timing) instead of 4: checkpoint_00000004 and _08 are there as
    in the other runs, and a checkpoint changes no weight (the SIGKILL test's resumed run equals it)."""
    tmp = module_mktemp("reference")
    run_dir = tmp / "ray_results" / "reference"
    up_s = mlflow_server.wait_healthy()
    go, events = tmp / "server-back", {"up_s": up_s}

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
    out = run(capture, tmp, "reference", training_kw={"checkpoint_every_steps": 2},
              mlflow_tracking_uri=mlflow_server.uri, callbacks=[WaitAtStep(4, go)])
    events["total_s"] = time.monotonic() - t0
    thread.join(5)
    logs = sample_logs(run_dir)
    assert out.step == 8 and len(logs) >= 2
    for log in logs.values():  # every rank trained the planned order's prefix, each sample once per epoch
        assert all(r["matches_digest"] for r in log["ranks"]) and log["world_size"] == 2
        ids = [s for r in log["ranks"] for s in r["sample_ids"]]
        assert len(ids) == len(set(ids)) == log["num_samples"] > 0
    return out, run_dir, events


def test_train_kill_resume_loss_decreases_and_export(capture, ray_local, reference, tmp_path):
    """training.parallel_strategy=fsdp (2 CPU workers shard the head with FSDP2 over gloo): run 1 is killed right
    after its step-4 checkpoint; run 2 (same run name and storage) resumes there with the full optimizer state
    restored, finishes at step 8 and exports the head from rank 0's full checkpoint; it trained the same sample ids
    per epoch, in the same order, as the uninterrupted DDP run (the order does not depend on the strategy). DDP's
    resume from a checkpoint: test_sigkill_a_worker_mid_epoch_the_run_recovers_by_itself (same weights as the
    reference). One test for both (2 Ray Train runs less than a test each, ~90 s on the 2-core CI box)."""
    kw = {"parallel_strategy": "fsdp", "max_failures": 0}
    with pytest.raises(Exception, match="fail_after_step"):
        run(capture, tmp_path, "peagle", training_kw=kw, callbacks=[FailAfterStep(4)])
    ck4 = tmp_path / "ray_results" / "peagle" / "checkpoint_00000004"
    state4 = json.loads((ck4 / T.STATE_FILE).read_text())
    assert state4["step"] == 4 and state4["world_size"] == 2 and state4["sharded"] is True
    saved = torch.load(ck4 / T.OPTIMIZER_FILE, weights_only=True)
    assert all(isinstance(k, str) for k in saved["state"])  # full FSDP optimizer state, keyed by name
    assert {float(s["step"]) for s in saved["state"].values()} == {4.0}
    assert not (tmp_path / "out-peagle").exists()  # nothing exported by the failed run

    out = run(capture, tmp_path, "peagle", training_kw=kw)
    assert out.resumed_from_step == 4 and out.step == 8 == reference[0].step
    assert sample_logs(tmp_path / "ray_results" / "peagle") == sample_logs(reference[1])
    # the optimizer the workers resumed with equals the one checkpointed at step 4
    assert out.return_value["resume_optimizer_digest"] == pytest.approx(T.optimizer_digest(saved), rel=1e-12)
    # and AdamW kept counting from there: 8 steps per parameter, not 4
    ck8 = tmp_path / "ray_results" / "peagle" / "checkpoint_00000008"
    final = torch.load(ck8 / T.OPTIMIZER_FILE, weights_only=True)
    assert {float(s["step"]) for s in final["state"].values()} == {8.0}
    assert {T.MODEL_FILE, T.OPTIMIZER_FILE, T.SCHEDULER_FILE, T.STATE_FILE, "rank_0000.pt", "rank_0001.pt"} <= {
        p.name for p in ck8.iterdir()}

    hist = out.return_value["history"]  # rank 0, run 2: windows ending at steps 6 and 8
    assert [h["step"] for h in hist] == [6.0, 8.0]
    last = hist[-1]
    for key in ("acc_d0", "acc_d1", "acc_d2", "loss_d0", "sim_acceptance_length", "tokens_per_s",
                "positions_per_s", "lr", "grad_norm"):
        assert key in last, key
    assert last["positions_per_s"] > last["tokens_per_s"] > 0  # K=3 slots per anchor, COD-thinned
    assert all(h["loss"] > 0 and h["grad_norm"] > 0 for h in hist)

    # MLflow (rank 0): one run across the kill, loss logged every 2 steps, and it decreased
    from mlflow.tracking import MlflowClient

    assert out.mlflow_run_id == state4["mlflow_run_id"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    losses = [m.value for m in sorted(client.get_metric_history(out.mlflow_run_id, "loss"), key=lambda m: m.step)]
    assert len(losses) == 4
    assert sum(losses[-2:]) / 2 < 0.9 * sum(losses[:2]) / 2, losses
    assert client.get_run(out.mlflow_run_id).data.params["training.lr"] == "0.002"
    assert client.get_metric_history(out.mlflow_run_id, "acc_d2")
    print(f"\nCPU, 2 Ray workers, FSDP2 (SmolLM2 states, 1-layer drafter, Vd 2048, K=3, S=2): "
          f"{last['tokens_per_s']:.0f} tokens/s, {last['positions_per_s']:.0f} positions/s; losses {losses}")

    cfg = validate_head(out.head_dir, parallel_drafting=True)
    assert cfg["draft_vocab_size"] == 2048 and cfg["mask_token_id"] == 16
    assert cfg["peagle"]["method"] == "peagle" and cfg["peagle"]["num_speculative_tokens"] == 3
    assert cfg["peagle"]["target"] == "smollm2-135m-instruct" and cfg["peagle"]["step"] == 8
    assert cfg["peagle"]["target_sha256"] == json.loads((capture / "capture_meta.json").read_text())["target_sha256"]


class WritePid(T.TrainCallback):
    """Test harness, not a fault: rank ``rank`` writes its process id to ``path`` at its first checkpoint
    (once: not again after the restart) so that the test can SIGKILL the process."""

    def __init__(self, path: Path, rank: int = 1) -> None:
        self.path, self.rank = Path(path), rank

    def on_checkpoint(self, step: int, metrics: dict) -> None:
        import ray.train

        if ray.train.get_context().get_world_rank() == self.rank and not self.path.exists():
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(str(os.getpid()))
            os.replace(tmp, self.path)


def kill_when_written(pid_file: Path, killed: dict, timeout_s: float = 300) -> threading.Thread:
    """A thread that SIGKILLs the process whose id appears in ``pid_file`` (records pid and time in ``killed``)."""

    def target() -> None:
        deadline = time.monotonic() + timeout_s
        while not pid_file.exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGKILL)
        killed.update(pid=pid, t=time.monotonic())

    thread = threading.Thread(target=target, name="killer", daemon=True)
    thread.start()
    return thread


def test_sigkill_a_worker_mid_epoch_the_run_recovers_by_itself(capture, ray_local, reference, tmp_path):
    """Rank 1's process is SIGKILLed right after the step-4 checkpoint, in the middle of an epoch; Ray Train
    (training.max_failures=2, the default) restarts the workers from that checkpoint and the run finishes
    with the uninterrupted run's final step, sample ids per epoch and weights; the head passes the contract."""
    import psutil
    from safetensors.torch import load_file

    ref, ref_dir, _ = reference
    killed: dict = {}
    killer = kill_when_written(tmp_path / "rank1.pid", killed)
    t0 = time.monotonic()
    out = run(capture, tmp_path, "sigkill", callbacks=[WritePid(tmp_path / "rank1.pid")])
    total_s = time.monotonic() - t0
    killer.join(1)
    assert killed and not psutil.pid_exists(killed["pid"])
    assert out.resumed_from_step == 4 and out.step == ref.step == 8
    run_dir = tmp_path / "ray_results" / "sigkill"
    logs = sample_logs(run_dir)
    assert logs == sample_logs(ref_dir)
    pos = torch.load(run_dir / "checkpoint_00000004" / "rank_0001.pt", weights_only=True)["position"]
    epoch_log = logs[f"epoch_{pos['epoch']:04d}.json"]
    assert 0 < pos["samples_consumed"] < epoch_log["ranks"][1]["num_samples"]  # killed mid-epoch
    a = load_file(str(run_dir / "checkpoint_00000008" / T.MODEL_FILE))
    b = load_file(str(ref_dir / "checkpoint_00000008" / T.MODEL_FILE))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    cfg = validate_head(out.head_dir, parallel_drafting=True)
    assert cfg["peagle"]["step"] == 8
    print(f"\nSIGKILL rank 1 (pid {killed['pid']}) after checkpoint 4 (epoch {pos['epoch']}, "
          f"{pos['samples_consumed']}/{epoch_log['ranks'][1]['num_samples']} samples): killed run {total_s:.0f} s "
          f"(kill -> end {time.monotonic() - killed['t']:.0f} s)")


def test_mlflow_outage_mid_training_loses_no_metric(mlflow_server, reference):
    """The reference run's tracking server was SIGKILLed after the step-2 checkpoint and restarted after the
    step-4 one (fixture ``reference``): training went on, rank 0 buffered its metrics (one outage, one warning)
    and they all arrived once the server was back."""
    from mlflow.tracking import MlflowClient

    out, run_dir, events = reference
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
    print(f"\nMLflow server up in {events['up_s']:.0f} s, SIGKILLed after checkpoint 2, back "
          f"{events['up'] - events['down']:.0f} s later (restart {events['restart_s']:.0f} s); training "
          f"{events['total_s']:.0f} s, 8/8 steps, 4/4 metric windows")
