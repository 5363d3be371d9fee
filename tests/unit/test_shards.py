"""peagle_core.shards / samples / storage / vocab token counts: shard round trip, checksums, manifest,
validation errors, capacity, token counts."""

import json

import numpy as np
import pytest
import torch

from peagle_core import atomic, shards, storage, vocab
from peagle_core.samples import dtype_name, sample_checksum, validate_sample
from peagle_core.shards import ShardError

pytestmark = pytest.mark.unit
HT = 36


def make_sample(sid: str, n: int, dtype=torch.float16, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[n // 2:] = True
    return {
        "sample_id": sid,
        "input_ids": torch.randint(0, 99, (n,), generator=g, dtype=torch.int32),
        "loss_mask": mask,
        "aux": torch.randn(n, 3 * HT, generator=g).to(dtype),
        "final_hidden": torch.randn(n, HT, generator=g).to(dtype),
    }


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip(tmp_path, dtype):
    samples = [make_sample(f"s{i}", n, dtype, seed=i) for i, n in enumerate([5, 1, 13])]
    rows = shards.write_shard(tmp_path / shards.shard_name(0), samples, metadata={"target": {"sha": "x"}})
    assert [r["offset"] for r in rows] == [0, 5, 6] and [r["length"] for r in rows] == [5, 1, 13]
    shard = shards.read_shard(tmp_path / "shard-00000.safetensors")
    assert json.loads(shard.metadata["target"]) == {"sha": "x"}
    assert shard.rows() == rows
    for want, got in zip(samples, shard.samples()):
        assert got["sample_id"] == want["sample_id"]
        assert got["input_ids"].dtype == torch.int32 and got["loss_mask"].dtype == torch.uint8
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["loss_mask"].bool(), want["loss_mask"])
        assert got["aux"].dtype == dtype and torch.equal(got["aux"], want["aux"])
        assert torch.equal(got["final_hidden"], want["final_hidden"])
        assert sample_checksum(got) == sample_checksum(want)  # bool and uint8 masks hash alike
    shards.write_manifest(tmp_path, rows)
    back = list(shards.iter_samples(tmp_path, as_numpy=True))
    assert [s["sample_id"] for s in back] == ["s0", "s1", "s2"]
    assert isinstance(back[2]["aux"], np.ndarray) and back[2]["aux"].shape == (13, 3 * HT)
    np.testing.assert_array_equal(back[2]["aux"], samples[2]["aux"].float().numpy())


def test_empty_shard_is_valid(tmp_path):
    assert shards.write_shard(tmp_path / "shard-00003.safetensors", [], metadata={"dropped": [["a", "empty"]]}) == []
    shard = shards.read_shard(tmp_path / "shard-00003.safetensors")
    assert len(shard) == 0 and json.loads(shard.metadata["dropped"]) == [["a", "empty"]]


def test_corrupted_shard_names_file(tmp_path):
    path = tmp_path / "shard-00000.safetensors"
    shards.write_shard(path, [make_sample("a", 7), make_sample("b", 9, seed=1)])
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF  # flip bits inside b's final_hidden... or lengths: either way caught
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="shard-00000.safetensors"):
        shards.read_shard(path)


def test_flipped_hidden_byte_caught_by_checksum(tmp_path):
    path = tmp_path / "shard-00001.safetensors"
    s = make_sample("a", 7)
    shards.write_shard(path, [s])
    raw = path.read_bytes()
    # find the aux bytes and flip one of them: structure stays valid, only the checksum can tell
    aux_bytes = s["aux"].contiguous().view(torch.uint8).numpy().tobytes()
    at = raw.index(aux_bytes[:64]) + 10
    data = bytearray(raw)
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    shards.read_shard(path, verify=False)  # structurally fine
    with pytest.raises(ShardError, match=r"shard-00001.safetensors: checksum mismatch for sample 'a'"):
        shards.read_shard(path)


def test_truncated_shard_names_file(tmp_path):
    path = tmp_path / "shard-00002.safetensors"
    shards.write_shard(path, [make_sample("a", 7)])
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ShardError, match="shard-00002.safetensors.*truncated or corrupt"):
        shards.read_shard(path)


def test_manifest_disagreeing_with_shard(tmp_path):
    rows = shards.write_shard(tmp_path / "shard-00000.safetensors", [make_sample("a", 4)])
    rows[0]["checksum"] = "0" * 64
    shards.write_manifest(tmp_path, rows)
    with pytest.raises(ShardError, match="manifest row for 'a' does not match"):
        list(shards.iter_samples(tmp_path))


def test_missing_manifest(tmp_path):
    with pytest.raises(ShardError, match="did not finish"):
        shards.load_manifest(tmp_path)


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "shard-00000.safetensors"
    shards.write_shard(path, [make_sample("old", 3)])

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(atomic.os, "replace", boom)  # the rename of peagle_core.atomic.atomic_write_bytes
    with pytest.raises(RuntimeError):
        shards.write_shard(path, [make_sample("new", 3)])
    assert shards.read_shard(path).sample_ids == ["old"]  # old file intact
    assert [p.name for p in tmp_path.iterdir()] == ["shard-00000.safetensors"]  # no temp file left


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda s: s.pop("aux"), r"missing \['aux'\]"),
        (lambda s: s.update(sample_id=""), "sample_id must be a non-empty str"),
        (lambda s: s.update(input_ids=s["input_ids"].float()), "input_ids must be a non-empty 1-D integer"),
        (lambda s: s.update(loss_mask=s["loss_mask"][:-1]), "loss_mask shape"),
        (lambda s: s.update(loss_mask=torch.zeros_like(s["loss_mask"])), "no assistant tokens"),
        (lambda s: s.update(loss_mask=s["loss_mask"].to(torch.uint8) * 2), "other than 0/1"),
        (lambda s: s.update(aux=s["aux"][:, :-1]), "aux width 107 != 3 x hidden 36"),
        (lambda s: s.update(final_hidden=s["final_hidden"][:-1]), r"final_hidden shape \(5, 36\); expected \[6"),
        (lambda s: s.update(aux=s["aux"].to(torch.float64)), "aux dtype torch.float64"),
        (lambda s: s.update(final_hidden=s["final_hidden"].float()), "aux dtype torch.float16 != final_hidden"),
        (lambda s: s["aux"].__setitem__((2, 3), float("nan")), "aux holds 1 NaN/Inf"),
        (lambda s: s["final_hidden"].__setitem__((0, 0), float("inf")), "final_hidden holds 1 NaN/Inf"),
    ],
)
def test_validation_errors(mutate, match):
    s = make_sample("bad", 6)
    mutate(s)
    with pytest.raises(ValueError, match=match):
        validate_sample(s)


def test_validation_context_errors():
    s = make_sample("x", 6)
    with pytest.raises(ValueError, match="6 tokens > max_length_tokens=5"):
        validate_sample(s, max_length=5)
    with pytest.raises(ValueError, match="width 36 != target hidden_size 40"):
        validate_sample(s, hidden_size=40)
    with pytest.raises(ValueError, match="!= capture dtype bfloat16"):
        validate_sample(s, dtype="bfloat16")
    with pytest.raises(ValueError, match="not supported"):
        dtype_name("int8")


def test_write_shard_rejects_bad_batches(tmp_path):
    with pytest.raises(ValueError, match="duplicate sample ids"):
        shards.write_shard(tmp_path / "s.safetensors", [make_sample("a", 3), make_sample("a", 4)])
    with pytest.raises(ValueError, match="one shard, one layout"):
        shards.write_shard(tmp_path / "s.safetensors", [make_sample("a", 3), make_sample("b", 4, torch.float32)])
    with pytest.raises(ValueError, match="reserved"):
        shards.write_shard(tmp_path / "s.safetensors", [make_sample("a", 3)], metadata={"sample_ids": "x"})
    assert not (tmp_path / "s.safetensors").exists()


def test_capacity():
    # SmolLM2 (Ht=576) bf16: 4 B id + 1 B mask + 4 x 576 x 2 B
    assert storage.bytes_per_token(576, "bfloat16") == 4613
    assert storage.bytes_per_token(4096, torch.float16) == 5 + 32 * 1024  # REFERENCES: 32 KiB/token for 8B
    assert storage.estimate_storage_bytes(10, 100.5, 576, "float32") == round(10 * 100.5 * (5 + 4 * 576 * 4))
    # SpecForge comparison: 30k GPT-OSS-120B samples at 64k context, bf16 -> tens of TB
    tb = storage.estimate_storage_bytes(30_000, 65_536, 2880, "bfloat16") / 1e12
    assert 40 < tb < 50
    assert storage.format_bytes(1536) == "1.5 KiB"
    with pytest.raises(ValueError, match="hidden_size > 0"):
        storage.estimate_storage_bytes(1, 1, 0)


def test_token_counts(tmp_path):
    counts = vocab.count_token_ids([[1, 2, 2], np.array([2, 5])], vocab_size=7, masks=[[0, 1, 1], [1, 0]])
    assert counts.tolist() == [0, 0, 3, 0, 0, 0, 0]
    vocab.save_token_counts(tmp_path / "token_counts.safetensors", counts, {"n": 3})
    assert torch.equal(vocab.load_token_counts(tmp_path / "token_counts.safetensors"), counts)
    with pytest.raises(ValueError, match="outside"):
        vocab.count_token_ids([[7]], vocab_size=7)
