import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle_core.contract import (
    MASK_TOKEN_KEYS,
    VLLM_SPEC,
    HeadContractError,
    drafter_config_from_head,
    export_head,
    head_mask_token_id,
    load_head,
    mask_token_keys,
    upgrade_head,
    validate_head,
    vllm_release,
    vllm_supported,
    write_checksums,
)
from peagle_core.vocab import vocab_mapping_from_counts

from .conftest import make_drafter

pytestmark = pytest.mark.unit

TARGET = {"hidden_size": 36, "vocab_size": 99, "num_hidden_layers": 5}


@pytest.fixture
def head(tmp_path):
    d = make_drafter(draft_vocab_size=64)
    d2t, t2d = vocab_mapping_from_counts(torch.arange(99.0), 64)
    d.set_vocab_mapping(d2t, t2d)
    return d, export_head(d, tmp_path / "head", dtype="float32")


def test_round_trip_is_bit_exact(head):
    d, path = head
    back = load_head(path)
    sd, sb = d.state_dict(), back.state_dict()
    assert sd.keys() == sb.keys()
    for k in sd:
        assert torch.equal(sd[k], sb[k]), k
    assert back.config == d.config


def test_config_json_has_vllm_keys(head):
    _, path = head
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["mask_token_id"] == 97
    assert cfg["draft_vocab_size"] == 64 and cfg["target_hidden_size"] == 36
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 2, 2]
    names = set(load_file(str(path / "model.safetensors")))
    assert {"mask_hidden", "d2t", "t2d", "fc.weight", "layers.0.hidden_norm.weight",
            "layers.0.self_attn.q_proj.weight", "embed_tokens.weight", "lm_head.weight"} <= names
    assert load_file(str(path / "model.safetensors"))["layers.0.self_attn.q_proj.weight"].shape == (36, 72)


def test_full_vocab_head_has_no_d2t(tmp_path):
    """vLLM refuses d2t when draft_vocab_size == vocab_size (no draft_id_to_target_id parameter)."""
    path = export_head(make_drafter(), tmp_path / "h", dtype="float32")
    names = set(load_file(str(path / "model.safetensors")))
    assert "d2t" not in names and "t2d" not in names
    assert load_head(path).draft_to_target(torch.tensor([5])).item() == 5
    _rewrite(path, tensors={"d2t": torch.zeros(99, dtype=torch.long)})
    with pytest.raises(HeadContractError, match="pruned vocabulary"):
        validate_head(path)


def test_bfloat16_export_keeps_index_dtypes(tmp_path):
    d = make_drafter(draft_vocab_size=50)
    path = export_head(d, tmp_path / "h", dtype="bfloat16")
    t = load_file(str(path / "model.safetensors"))
    assert t["fc.weight"].dtype == torch.bfloat16 and t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    validate_head(path, dtype="bfloat16")
    with pytest.raises(HeadContractError, match="dtype"):
        validate_head(path, dtype="float32")


def test_export_refuses_to_overwrite(head, tmp_path):
    d, path = head
    with pytest.raises(ValueError, match="exists"):
        export_head(d, path)


# --- validator: one test per rule ------------------------------------------------------------

def _rewrite(path, *, config=None, drop=None, tensors=None):
    if config is not None:
        cfg = json.loads((path / "config.json").read_text())
        config(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    if drop or tensors:
        t = load_file(str(path / "model.safetensors"))
        for k in drop or ():
            t.pop(k)
        t.update(tensors or {})
        save_file(t, str(path / "model.safetensors"))
    write_checksums(path)


def test_rule_target_hidden_size(head):
    with pytest.raises(HeadContractError, match="target_hidden_size=36"):
        validate_head(head[1], target_config={**TARGET, "hidden_size": 40})


def test_rule_vocab(head):
    with pytest.raises(HeadContractError, match="vocab_size"):
        validate_head(head[1], target_config={**TARGET, "vocab_size": 100})


def test_rule_aux_layer_ids(head):
    _rewrite(head[1], config=lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 3, 4]))
    with pytest.raises(HeadContractError, match="eagle_aux_hidden_state_layer_ids"):
        validate_head(head[1], target_config={**TARGET, "num_hidden_layers": 4})


def test_rule_missing_mask_hidden(head):
    _rewrite(head[1], drop=["mask_hidden"])
    with pytest.raises(HeadContractError, match="mask_hidden"):
        validate_head(head[1], parallel_drafting=True)
    validate_head(head[1], parallel_drafting=False)  # fine as an EAGLE-3 head


def test_rule_missing_mask_token_id(head):
    _rewrite(head[1], config=lambda c: [c.pop(k.name, None) for k in MASK_TOKEN_KEYS])
    with pytest.raises(HeadContractError, match="no mask token id .*'mask_token_id', 'ptd_token_id', 'pard_token'"):
        validate_head(head[1], parallel_drafting=True)


# ---------------------------------------------------------------------------------------------- vLLM releases


def test_head_exported_today_has_both_mask_token_keys(head):
    cfg = json.loads((head[1] / "config.json").read_text())
    assert cfg["mask_token_id"] == cfg["ptd_token_id"] == 97 and "pard_token" not in cfg
    for version in ("0.26.0", "0.29.1", "0.32.0+cpu", "0.33.0"):
        validate_head(head[1], vllm_version=version)
    validate_head(head[1])  # every release of the range


def test_mask_token_keys_per_vllm_release():
    assert mask_token_keys("0.26.0") == ("ptd_token_id", "pard_token")
    assert mask_token_keys("0.31.2") == ("ptd_token_id", "pard_token")  # not checked: held to 0.26's rule
    assert mask_token_keys("0.32.0+cpu") == ("mask_token_id", "ptd_token_id", "pard_token")
    assert mask_token_keys("0.33.1.dev4+g1a2b") == mask_token_keys("0.32.0")
    assert vllm_release("0.32.0+cpu") == (0, 32) and vllm_supported("0.26.0") and not vllm_supported("0.34.0")
    for outside, why in (("0.25.1", "older than"), ("0.34.0", "removed P-EAGLE"), ("1.0.0", "removed P-EAGLE")):
        with pytest.raises(ValueError, match=rf"vLLM {outside}: .*{why}.*install vllm>=0.26,<0.34"):
            mask_token_keys(outside)
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        vllm_release("nightly")


def test_old_head_with_only_mask_token_id(head):
    """A head exported before ptd_token_id was written: vLLM 0.32 loads it, 0.26 refuses it; the error names the
    missing key and the one command that adds it, and that command fixes the head."""
    _rewrite(head[1], config=lambda c: c.pop("ptd_token_id"))
    validate_head(head[1], vllm_version="0.32.0")
    with pytest.raises(HeadContractError, match=r"as \['mask_token_id'\] only, but vLLM 0.26 reads it from "
                       r"\['ptd_token_id', 'pard_token'\].*add \['ptd_token_id'\] with `peagle head upgrade"):
        validate_head(head[1], vllm_version="0.26.0")
    with pytest.raises(HeadContractError, match="vLLM 0.26"):
        validate_head(head[1])  # None: every supported release
    validate_head(head[1], for_vllm=False)  # peagle's own loader does not care
    assert load_head(head[1]).config.mask_token_id == 97
    assert upgrade_head(head[1]) == ["ptd_token_id"]
    validate_head(head[1], vllm_version="0.26.0")
    assert upgrade_head(head[1]) == []  # current: nothing to add


def test_mask_token_keys_that_disagree_raise(head):
    _rewrite(head[1], config=lambda c: c.update(ptd_token_id=3))
    with pytest.raises(HeadContractError, match=r"disagree: \{'mask_token_id': 97, 'ptd_token_id': 3\}"):
        validate_head(head[1], vllm_version="0.32.0")
    with pytest.raises(HeadContractError, match="disagree"):
        drafter_config_from_head(json.loads((head[1] / "config.json").read_text()))
    with pytest.raises(HeadContractError, match="an integer token id"):
        head_mask_token_id({"pard_token": "97"})
    assert head_mask_token_id({"mask_token_id": None}) is None  # null = absent: an EAGLE-3 head
    _rewrite(head[1], config=lambda c: c.update(ptd_token_id=None))
    with pytest.raises(HeadContractError, match=r"\['ptd_token_id'\] set to null"):
        validate_head(head[1], vllm_version="0.32.0")


def test_imported_head_with_only_pard_token(head):
    """speculators-style import: only pard_token, which both 0.26 and 0.32 read."""
    _rewrite(head[1], config=lambda c: [c.pop("mask_token_id"), c.pop("ptd_token_id"), c.update(pard_token=97)])
    cfg = json.loads((head[1] / "config.json").read_text())
    assert drafter_config_from_head(cfg).mask_token_id == 97
    validate_head(head[1])
    assert load_head(head[1]).parallel_drafting
    assert upgrade_head(head[1]) == ["mask_token_id", "ptd_token_id"]  # what an export writes, same token
    cfg = json.loads((head[1] / "config.json").read_text())
    assert cfg["mask_token_id"] == cfg["ptd_token_id"] == cfg["pard_token"] == 97


def test_vllm_range_matches_the_gpu_extra():
    import tomllib

    from tests.conftest import REPO

    gpu = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert f"vllm{VLLM_SPEC}" in gpu


def test_rule_shape_mismatch(head):
    _rewrite(head[1], tensors={"fc.weight": torch.zeros(36, 100)})
    with pytest.raises(HeadContractError, match="fc.weight"):
        validate_head(head[1])


def test_rule_unknown_tensor(head):
    _rewrite(head[1], tensors={"layers.9.mlp.up_proj.weight": torch.zeros(2)})
    with pytest.raises(HeadContractError, match="does not expect"):
        validate_head(head[1])


def test_rule_d2t_out_of_vocab(head):
    _rewrite(head[1], tensors={"d2t": torch.full((64,), 50, dtype=torch.long)})
    with pytest.raises(HeadContractError, match="d2t"):
        validate_head(head[1])


def test_rule_architecture(head):
    _rewrite(head[1], config=lambda c: c.update(architectures=["LlamaForCausalLM"]))
    with pytest.raises(HeadContractError, match="architectures"):
        validate_head(head[1])


def test_rule_checksum_catches_corruption(head):
    p = head[1] / "model.safetensors"
    raw = bytearray(p.read_bytes())
    raw[-5] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(HeadContractError, match="sha256"):
        validate_head(head[1])


def test_rule_not_a_head(tmp_path):
    with pytest.raises(HeadContractError, match="config.json is missing"):
        validate_head(tmp_path)


def test_head_without_embed_tokens_shares_the_target_embeddings(tmp_path):
    d = make_drafter()
    path = export_head(d, tmp_path / "h", dtype="float32", include_embed_tokens=False)
    assert "embed_tokens.weight" not in load_file(str(path / "model.safetensors"))
    validate_head(path, target_config=TARGET)
    with pytest.raises(HeadContractError, match="target_embed_tokens"):
        load_head(path)
    back = load_head(path, target_embed_tokens=d.embed_tokens.weight)
    assert torch.equal(back.embed_tokens.weight, d.embed_tokens.weight)
