"""Registry integration: real MLflow (sqlite in tmp_path), tiny random heads exported via the contract."""

from pathlib import Path

import pytest
import torch

from peagle_core.contract import HeadContractError, export_head
from peagle_core.drafter import Eagle3Drafter
from peagle_core.drafter_config import DrafterConfig
from pipelines import settings
from pipelines.registry import promotion
from pipelines.registry import register as reg

pytestmark = pytest.mark.integration

# Odd tiny target (not SmolLM2): registration needs no target weights, only its config.
TARGET = {"hidden_size": 36, "num_hidden_layers": 5, "num_attention_heads": 6, "num_key_value_heads": 2,
          "intermediate_size": 50, "vocab_size": 99, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152}


def _head(path: Path, seed: int, mask_token_id: int | None = 97, target=TARGET) -> Path:
    torch.manual_seed(seed)
    d = Eagle3Drafter(DrafterConfig.from_target(target, num_hidden_layers=1, mask_token_id=mask_token_id))
    return export_head(d, path, dtype="float32", extra_config={"target": "tiny-llama"})


def test_gate_rollback_download(tmp_path, uri):
    name = settings.model_name("tiny-llama")
    h1, h2, h3 = (_head(tmp_path / f"h{i}", seed=i) for i in (1, 2, 3))
    run = reg.log_run(config={"training": {"lr": 1e-4}}, training_curves=[{"step": s, "loss": 2.0 - s / 10}
                      for s in range(5)], eval_table=[{"method": "peagle", "K": 5, "concurrency": 1,
                      "acceptance_length": 2.1, "tokens_per_s": 10.0}], data_manifest={"a": 1}, tracking_uri=uri)

    v1 = reg.register_head(h1, model_name=name, run_id=run, eval_al=2.1, K=5, eval_set="humaneval",
                           al_by_K={3: 1.9, 5: 2.1}, K_best={1: 5, 8: 3}, target_config=TARGET, tracking_uri=uri)
    assert v1.aliases == [reg.CHALLENGER] and v1.tags["K_best.c8"] == "3" and v1.tags["al.K3"] == "1.9000"
    d1 = promotion.maybe_promote(name, v1.version, K=5, promote_margin=0.05, tracking_uri=uri)
    assert d1.promoted and d1.champion_version == str(v1.version)

    # A worse challenger: the gate keeps v1 and says why.
    v2 = reg.register_head(h2, model_name=name, eval_al=2.12, K=5, eval_set="humaneval", tracking_uri=uri)
    d2 = promotion.maybe_promote(name, K=5, promote_margin=0.05, tracking_uri=uri)
    assert not d2.promoted and d2.champion_version == str(v1.version) and "does not beat" in d2.reason
    client = reg.get_client(uri)
    assert client.get_model_version_by_alias(name, promotion.CHAMPION).version == v1.version
    assert client.get_model_version(name, v2.version).tags["promotion_decision"] == "kept_champion"
    assert client.get_model_version_by_alias(name, reg.CHALLENGER).version == v2.version

    # Another eval set is not comparable.
    v3 = reg.register_head(h3, model_name=name, eval_al=3.0, K=5, eval_set="mtbench", tracking_uri=uri)
    assert not promotion.maybe_promote(name, v3.version, K=5, tracking_uri=uri).promoted
    # A better one on the same set moves champion; rollback restores v1.
    v4 = reg.register_head(h3, model_name=name, eval_al=2.5, K=5, eval_set="humaneval", tracking_uri=uri)
    d4 = promotion.maybe_promote(name, v4.version, K=5, promote_margin=0.05, tracking_uri=uri)
    assert d4.promoted and client.get_model_version_by_alias(name, promotion.CHAMPION).version == v4.version
    assert str(promotion.rollback(name, tracking_uri=uri).version) == str(v1.version)
    assert client.get_model_version_by_alias(name, promotion.CHAMPION).version == v1.version
    with pytest.raises(ValueError, match="no previous champion"):
        promotion.rollback(name, tracking_uri=uri)

    # Download reproduces the files of v1 byte for byte (checksums verified inside download too).
    out = reg.download(f"{name}@champion", tmp_path / "dl", tracking_uri=uri)
    for f in ("config.json", "model.safetensors", "peagle_checksums.json"):
        assert (out / f).read_bytes() == (h1 / f).read_bytes()
    rows = reg.list_versions(name, tracking_uri=uri)
    assert [r["version"] for r in rows] == ["1", "2", "3", "4"] and "champion" in rows[0]["aliases"]
    assert not (tmp_path / "mlruns").exists()
    run_data = client.get_run(run).data
    assert run_data.params["data_manifest_sha256"] and "git_sha" in run_data.params
    assert run_data.metrics["eval.peagle.K5.c1.acceptance_length"] == 2.1


def test_download_detects_corruption(tmp_path, uri):
    name = "peagle-tiny"
    h = _head(tmp_path / "h", seed=0)
    mv = reg.register_head(h, model_name=name, eval_al=1.5, K=3, eval_set="x", tracking_uri=uri)
    promotion.promote(name, mv.version, tracking_uri=uri)
    good = reg.download(f"{name}@champion", tmp_path / "dst", tracking_uri=uri)
    # Corrupt the stored artifact (local artifact store) and download again: refused, dst intact.
    client = reg.get_client(uri)
    root = Path(client.get_run(mv.run_id).info.artifact_uri.removeprefix("file://")) / "head"
    with open(root / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(HeadContractError, match="sha256"):
        reg.download(f"{name}@champion", good, tracking_uri=uri)
    assert (good / "model.safetensors").read_bytes() == (h / "model.safetensors").read_bytes()


def test_incompatible_head_refused(tmp_path, uri):
    name = "peagle-smollm2-135m-instruct"
    tiny = _head(tmp_path / "tiny", seed=0)
    with pytest.raises(HeadContractError, match="target_hidden_size"):
        reg.register_head(tiny, model_name=name, eval_al=2.0, K=5, eval_set="humaneval", target_config=SMOLLM2,
                          tracking_uri=uri)
    eagle3 = _head(tmp_path / "e3", seed=0, mask_token_id=None)  # no mask_hidden: cannot parallel-draft
    with pytest.raises(HeadContractError, match="mask_token_id"):
        reg.register_head(eagle3, model_name=name, eval_al=2.0, K=5, eval_set="humaneval", parallel_drafting=True,
                          tracking_uri=uri)
    client = reg.get_client(uri)
    assert client.search_model_versions(f"name='{name}'") == []
    with pytest.raises(ValueError, match="NAME@ALIAS"):
        reg.download("no-alias", tmp_path / "x", tracking_uri=uri)
