"""Warm start from the registry: real MLflow (sqlite in tmp_path), the train stage of a real pipeline run on
Ray Train (1 CPU worker) over captured SmolLM2-135M-Instruct hidden states. ``training.init_from:
models:/NAME@champion`` resolves to the champion's version and head_sha256 when the run is built (the train
key holds them: promoting another version re-keys the stage), the stage downloads that version, trains from
it with its d2t/t2d and records where it started; an unknown alias fails before any stage runs and an
incompatible champion fails before Ray Train starts."""

import time

import pytest
import torch
from safetensors.torch import load_file

from peagle_core.contract import WEIGHTS_FILE, export_head, head_digest, validate_head
from peagle_core.drafter import Eagle3Drafter
from peagle_core.vocab import vocab_mapping_from_counts
from pipelines.pipeline import PipelineRun
from pipelines.recipe import CaptureConfig, DataConfig, TargetConfig, load_recipe
from pipelines.registry import promotion
from pipelines.registry import register as reg
from pipelines.stages.base import STAGE_FILE, StageRecord, write_json
from pipelines.stages.capture import CaptureOutput
from tests.conftest import CONFIGS

from .test_train import conversations

pytestmark = pytest.mark.integration

NAME = "peagle-warm-start-test"
# the CI recipe, smaller: a 1-layer head with a 2048-token draft vocabulary, 2 steps
OVERRIDES = ["drafter.num_layers=1", "drafter.draft_vocab_size=2048", "training.max_steps=2",
             "training.checkpoint_every_steps=2", "training.batch_tokens=512"]


@pytest.fixture(scope="module")
def capture(module_mktemp):
    from pipelines.capture import run_capture

    out = module_mktemp("capture")
    run_capture(conversations(8), TargetConfig(), CaptureConfig(batch_size=8, dtype="float16", shard_size_samples=8),
                DataConfig(max_length_tokens=160), out, use_ray=False)
    return out


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def recipe(uri: str, init_from: str, *extra: str):
    return load_recipe(CONFIGS / "smollm2-135m-ci.yaml", [*OVERRIDES, f"registry.tracking_uri={uri}",
                                                           f"training.init_from={init_from}", *extra])


def register_champion(path, uri: str, *, seed: int, **spec_kw) -> str:
    """A random head that fits the recipe's drafter (its own draft vocabulary), registered and promoted;
    returns its version."""
    from pipelines.assets import resolve_target

    r = recipe(uri, str(path))  # only its drafter and target sections are used
    hf_config = resolve_target(r.target)[1]
    torch.manual_seed(seed)
    head = Eagle3Drafter(r.drafter.model_copy(update=spec_kw).to_drafter_config(hf_config, target=r.target))
    counts = torch.randint(0, 1000, (head.config.vocab_size,), generator=torch.Generator().manual_seed(seed))
    head.set_vocab_mapping(*vocab_mapping_from_counts(counts, head.config.draft_vocab_size))
    export_head(head, path, dtype="float32", include_embed_tokens=False, extra_config={"target": r.target.model})
    mv = reg.register_head(path, model_name=NAME, eval_al=1.2, K=3, eval_set="humaneval", target_config=hf_config,
                           tracking_uri=uri)
    promotion.promote(NAME, mv.version, tracking_uri=uri)
    return str(mv.version)


def run_with_capture(r, run_dir, capture) -> PipelineRun:
    """A pipeline run of the train stage only, its capture recorded as current (the stage reads it)."""
    run = PipelineRun(r, run_dir=run_dir, stages=["train"], say=print)
    out = CaptureOutput(streaming=False, capture_dir=str(capture), num_conversations=8)
    write_json(run.stage_dir("capture") / STAGE_FILE, StageRecord("capture", "ran", 0.0, run.key("capture"),
                                                                  out).to_json())
    return run


def test_train_stage_warm_starts_from_the_champion(tmp_path, uri, capture, ray_local):
    ref = f"models:/{NAME}@champion"
    v1 = register_champion(tmp_path / "v1", uri, seed=1)
    tag = reg.get_client(uri).get_model_version(NAME, v1).tags[reg.HEAD_SHA256_TAG]

    run = run_with_capture(recipe(uri, ref), tmp_path / "run", capture)
    key = run.key("train")
    t0 = time.monotonic()
    run.run()
    seconds = time.monotonic() - t0
    rec = run.records["train"]
    expected = {"ref": ref, "model": NAME, "version": v1, "head_sha256": tag}
    assert rec.status == "ran" and rec.key == key and rec.output.step == 2
    assert rec.output.init_from == expected
    assert head_digest(run.stage_dir("train") / "init_head") == tag  # the pinned version, downloaded

    cfg = validate_head(rec.output.head_dir, parallel_drafting=True)
    assert cfg["peagle"]["init_from"] == expected
    trained, start = load_file(f"{rec.output.head_dir}/{WEIGHTS_FILE}"), load_file(str(tmp_path / "v1" / WEIGHTS_FILE))
    assert set(trained) == set(start) and "embed_tokens.weight" not in trained  # frozen: vLLM shares the target's
    assert torch.equal(trained["d2t"], start["d2t"]) and torch.equal(trained["t2d"], start["t2d"])  # head's vocab
    rel = {k: float((trained[k] - start[k]).norm() / start[k].norm()) for k in trained if k not in ("d2t", "t2d")}
    assert max(rel.values()) > 0 and max(rel.values()) < 0.5, rel  # 2 steps from the head, not from scratch
    print(f"\nwarm-started train stage: {seconds:.0f} s for 2 steps; largest relative change from v{v1}: "
          f"{max(rel, key=rel.get)} {max(rel.values()):.3f}")

    # the same champion: the stage is current and skipped
    again = run_with_capture(recipe(uri, ref), tmp_path / "run", capture)
    assert again.key("train") == key
    again.run()
    assert again.records["train"].status == "skipped"

    # a new champion: the same recipe now keys (and would train) on v2
    v2 = register_champion(tmp_path / "v2", uri, seed=2)
    moved = PipelineRun(recipe(uri, ref), run_dir=tmp_path / "run")
    assert moved._stages["train"]._init_head.version == v2 and moved.key("train") != key
    assert moved.key("capture") == run.key("capture")

    # an unknown alias fails when the run is built, before any stage
    with pytest.raises(ValueError, match="no such model version"):
        PipelineRun(recipe(uri, f"models:/{NAME}@nosuch"), run_dir=tmp_path / "run")

    # an incompatible champion (2 layers) fails at the start of the train stage, before Ray Train
    v3 = register_champion(tmp_path / "v3", uri, seed=3, num_layers=2)
    bad = run_with_capture(recipe(uri, ref), tmp_path / "bad", capture)
    with pytest.raises(ValueError, match=r"num_hidden_layers: head 2, expected 1") as err:
        bad.run()
    assert f"models:/{NAME}/{v3}" in str(err.value)
    assert not (tmp_path / "bad" / "ray_results").exists()
