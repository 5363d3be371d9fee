"""Ray Train stage on CPU with real Ray (2 workers, gloo DDP), real MLflow (sqlite in tmp_path) and
captured SmolLM2-135M-Instruct hidden states: the loss decreases, checkpoints are written, the head
exports through the contract; a run killed after its first checkpoint resumes at that step with
the optimizer state restored."""

import json
import os

import pytest
import torch

from peagle_core.contract import validate_head
from pipelines import train as T
from pipelines.recipe import CaptureConfig, DataConfig, DrafterSpec, TargetConfig, TrainingConfig

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
def capture(tmp_path_factory):
    from pipelines.capture import run_capture

    out = tmp_path_factory.mktemp("capture")
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


def configs(**kw):
    base = {"method": "peagle", "num_epochs": 20, "max_steps": 8, "lr": 2e-3, "warmup_steps": 2,
            "batch_tokens": 320, "num_workers": 2, "checkpoint_every_steps": 4, "num_partitions": 2,
            "cod_ratio": 0.8, "cod_min_ratio": 0.3, "seed": 0}
    base.update(kw)
    spec = DrafterSpec(num_layers=1, num_speculative_tokens=3, mask_token_id=16, draft_vocab_size=2048)
    return TrainingConfig(**base), spec, TargetConfig()


def run(capture, tmp_path, name, training_kw=None, **kw):
    from pipelines.capture import captured_dataset

    return T.run_train(configs(**(training_kw or {})), captured_dataset(capture), tmp_path / f"out-{name}",
                       capture_dir=capture, run_name=name, storage_path=tmp_path / "ray_results",
                       mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", log_every_steps=2,
                       export_dtype="float32", **kw)


def test_train_two_workers_loss_decreases_and_exports(capture, ray_local, tmp_path):
    out = run(capture, tmp_path, "smoke")
    assert out.step == 8 and out.resumed_from_step is None
    hist = out.return_value["history"]
    losses = [h["loss"] for h in hist]
    assert len(losses) == 4
    assert sum(losses[-2:]) / 2 < 0.9 * sum(losses[:2]) / 2, losses
    last = hist[-1]
    for key in ("acc_d0", "acc_d1", "acc_d2", "loss_d0", "tokens_per_s", "positions_per_s", "lr", "grad_norm"):
        assert key in last, key
    assert last["positions_per_s"] > last["tokens_per_s"] > 0  # K=3 slots per anchor, COD-thinned
    print(f"\nCPU 2 workers (SmolLM2 states, 1-layer drafter, Vd 2048, K=3): "
          f"{last['tokens_per_s']:.0f} tokens/s, {last['positions_per_s']:.0f} positions/s; losses {losses}")

    ckpts = sorted((tmp_path / "ray_results" / "smoke").glob("checkpoint_0*"))
    assert [c.name for c in ckpts] == ["checkpoint_00000004", "checkpoint_00000008"]
    files = {p.name for p in ckpts[-1].iterdir()}
    assert {T.MODEL_FILE, T.OPTIMIZER_FILE, T.SCHEDULER_FILE, T.STATE_FILE, "rank_0000.pt", "rank_0001.pt"} <= files

    cfg = validate_head(out.head_dir, parallel_drafting=True)
    assert cfg["draft_vocab_size"] == 2048 and cfg["mask_token_id"] == 16
    assert cfg["peagle"]["method"] == "peagle" and cfg["peagle"]["num_speculative_tokens"] == 3
    assert cfg["peagle"]["target"] == "smollm2-135m-instruct" and cfg["peagle"]["step"] == 8

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlrun = client.get_run(out.mlflow_run_id)
    assert mlrun.data.params["training.lr"] == "0.002"
    assert len(client.get_metric_history(out.mlflow_run_id, "loss")) == 4
    assert client.get_metric_history(out.mlflow_run_id, "acc_d2")


def test_killed_run_resumes_with_optimizer_state(capture, ray_local, tmp_path):
    with pytest.raises(Exception, match="fail_after_step"):
        run(capture, tmp_path, "resume", training_kw={"max_steps": 4, "checkpoint_every_steps": 2},
            debug={"fail_after_step": 2})
    ck2 = tmp_path / "ray_results" / "resume" / "checkpoint_00000002"
    assert json.loads((ck2 / T.STATE_FILE).read_text())["step"] == 2
    saved = torch.load(ck2 / T.OPTIMIZER_FILE, weights_only=True)
    mlflow_run = json.loads((ck2 / T.STATE_FILE).read_text())["mlflow_run_id"]

    out = run(capture, tmp_path, "resume", training_kw={"max_steps": 4, "checkpoint_every_steps": 2})
    assert out.resumed_from_step == 2 and out.step == 4
    # the optimizer the workers resumed with equals the one checkpointed at step 2
    assert out.return_value["resume_optimizer_digest"] == pytest.approx(T.optimizer_digest(saved), rel=1e-12)
    # and AdamW kept counting from there: 4 steps per parameter, not 2
    final = torch.load(tmp_path / "ray_results" / "resume" / "checkpoint_00000004" / T.OPTIMIZER_FILE,
                       weights_only=True)
    assert {float(s["step"]) for s in final["state"].values()} == {4.0}
    assert out.mlflow_run_id == mlflow_run  # the same MLflow run continues
    assert [h["step"] for h in out.return_value["history"]] == [4.0]
    assert os.path.isdir(out.head_dir)
