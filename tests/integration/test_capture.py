"""Capture stage with real Ray Data and SmolLM2-135M-Instruct on 16 ShareGPT conversations:
hidden states equal a direct transformers forward; a run that crashes mid-way resumes to the
manifest of an uninterrupted run; streaming and read-back datasets give the same rows."""

import json
import time

import numpy as np
import pytest
import torch

from peagle_core import shards
from peagle_core.vocab import TOKEN_COUNTS_NAME, load_token_counts
from pipelines import capture
from pipelines.capture import materialize
from pipelines.prompts import load_conversations
from pipelines.recipe import CaptureConfig, DataConfig, SourceConfig, TargetConfig
from tests.unit.test_capture import CrashBeforeThirdShard

pytestmark = pytest.mark.integration
MAX_LEN = 256


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def convos():
    ds = load_conversations(SourceConfig(kind="sharegpt", num_samples=16), seed=0)
    assert len(ds) == 16
    return ds


def cfgs(**kw):
    c = {"batch_size": 4, "dtype": "float32", "shard_size_samples": 4, "num_workers": 1}
    c.update(kw)
    return TargetConfig(), CaptureConfig(**c), DataConfig(max_length_tokens=MAX_LEN)


@pytest.fixture(scope="module")
def reference(ray_local, convos, tmp_path_factory):
    out = tmp_path_factory.mktemp("capture-ref")
    t0 = time.perf_counter()
    res = capture.run_capture(convos, *cfgs(), out, num_cpus_per_worker=2)
    print(f"\ncapture (Ray, 1 actor x 2 CPUs): {res.num_tokens} tokens in {time.perf_counter() - t0:.1f} s wall, "
          f"{res.tokens_per_s:.0f} tokens/s incl. actor start, {res.meta['forward_tokens_per_s']:.0f} tokens/s in "
          f"the model step, {res.bytes_per_token:.0f} B/token on disk, "
          f"dropped {res.dropped}, truncated {res.num_truncated}")
    return out, res


def test_hidden_states_equal_direct_forward(reference):
    out, res = reference
    assert res.num_shards == 4 and res.num_samples + sum(res.dropped.values()) == 16
    meta = shards.load_capture_meta(out)
    assert meta["aux_layer_ids"] == [2, 15, 27] and meta["hidden_size"] == 576 and meta["dtype"] == "float32"
    model, _tok = capture.load_target(meta["target_path"], "float32")
    n = 0
    for s in shards.iter_samples(out):
        assert len(s["input_ids"]) <= MAX_LEN and s["loss_mask"].any()
        with torch.inference_mode():
            o = model(s["input_ids"].long()[None], output_hidden_states=True)
        hs = o.hidden_states
        want = torch.cat([hs[i] for i in (2, 15, 27)], -1)[0]
        torch.testing.assert_close(s["aux"], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        torch.testing.assert_close(s["final_hidden"], hs[-1][0], rtol=1e-5, atol=1e-5 * hs[-1].abs().max().item())
        # the loss's target distribution: lm_head(final_hidden) = the target's logits
        torch.testing.assert_close(model.lm_head(s["final_hidden"]), o.logits[0], rtol=1e-4, atol=1e-3)
        n += 1
    assert n == res.num_samples
    counts = load_token_counts(out / TOKEN_COUNTS_NAME)
    assert counts.shape == (49152,) and int(counts.sum()) == res.num_loss_tokens


def test_crash_and_resume_gives_the_same_manifest(reference, convos, tmp_path, monkeypatch):
    ref_dir, _ = reference
    out = tmp_path / "crashed"
    with monkeypatch.context() as m:  # the Ray actor (another process) imports the test class by name
        m.setattr(materialize, "CaptureShardActor", CrashBeforeThirdShard)
        with pytest.raises(Exception, match="injected crash"):
            capture.run_capture(convos, *cfgs(), out, num_cpus_per_worker=2)
    written = sorted(p.name for p in out.glob("shard-*.safetensors"))
    assert written == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert not (out / shards.MANIFEST_NAME).exists()
    kept = (out / written[0]).stat().st_mtime_ns
    res = capture.run_capture(convos, *cfgs(), out, num_cpus_per_worker=2)
    assert res.num_shards_reused == 2 and (out / written[0]).stat().st_mtime_ns == kept
    assert shards.load_manifest(out).to_pylist() == shards.load_manifest(ref_dir).to_pylist()
    assert not list(out.glob(".*"))


def test_streaming_and_read_back_match(reference, convos):
    ref_dir, _ = reference
    want = {s["sample_id"]: s for s in shards.iter_samples(ref_dir, as_numpy=True)}
    rows = convos.select(range(4))
    streamed = capture.capture_stream(rows, *cfgs(batch_size=4), num_cpus_per_worker=1).take_all()
    assert {r["sample_id"] for r in streamed} == {r["id"] for r in rows} & set(want)
    for r in streamed:
        w = want[r["sample_id"]]
        np.testing.assert_array_equal(r["input_ids"], w["input_ids"])
        np.testing.assert_array_equal(r["loss_mask"], w["loss_mask"])
        np.testing.assert_allclose(r["aux"], w["aux"], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(r["final_hidden"], w["final_hidden"], rtol=1e-5, atol=1e-4)
    back = capture.captured_dataset(ref_dir).take_all()  # Ray Data does not keep block order by default
    assert sorted(r["sample_id"] for r in back) == sorted(want)
    for r in back:
        np.testing.assert_array_equal(r["aux"], want[r["sample_id"]]["aux"])


def test_corrupt_shard_fails_read_naming_file(reference, tmp_path):
    import shutil

    ref_dir, _ = reference
    out = tmp_path / "copy"
    shutil.copytree(ref_dir, out)
    p = out / "shard-00002.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    with pytest.raises(shards.ShardError, match="shard-00002.safetensors"):
        list(shards.iter_samples(out))
    with pytest.raises(Exception, match="shard-00002.safetensors"):
        capture.captured_dataset(out).take_all()
    assert json.loads((out / shards.META_NAME).read_text())["num_shards"] == 4
