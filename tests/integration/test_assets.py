"""Embedded target: `peagle assets` yields an HF dir that transformers loads and that generates
greedily; the second call is a no-op; the manifest catches corruption.

Uses the real PEAGLE_HOME (default ~/.cache/peagle) so the one-time conversion (~40 s on 2 cores)
is shared with the other integration tests.
"""

from __future__ import annotations

import json
import shutil

import pytest

from pipelines.assets import (
    EMBEDDED_TARGETS,
    MANIFEST_NAME,
    check_manifest,
    ensure_target,
    humaneval_path,
    sharegpt_path,
)
from pipelines.recipe import load_recipe, validate_against_target
from tests.conftest import CONFIGS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def target():
    return ensure_target("smollm2-135m-instruct", "float32")


def test_peagle_assets_cli_prints_dir_and_checksum(target):
    from typer.testing import CliRunner

    from pipelines.cli import app

    res = CliRunner().invoke(app, ["assets", "--recipe", str(CONFIGS / "smollm2-135m-ci.yaml")],
                             env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert str(target.path) in res.output and target.sha256 in res.output
    assert "sharegpt" in res.output and "humaneval" in res.output


def test_second_call_is_a_noop(target, monkeypatch):
    mtime = (target.path / "model.safetensors").stat().st_mtime_ns
    # No conversion and no re-hash of the weights (a wall-clock bound would depend on the machine's load).
    from pipelines import assets

    def refuse(*a, **k):
        raise AssertionError("the second call converted or hashed a weight file again")

    monkeypatch.setattr(assets, "_convert", refuse)
    monkeypatch.setattr(assets, "sha256_file", refuse)
    again = ensure_target("smollm2-135m-instruct", "float32")
    assert again.path == target.path and again.sha256 == target.sha256
    assert (target.path / "model.safetensors").stat().st_mtime_ns == mtime


def test_converted_model_matches_public_release_and_generates(target):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = EMBEDDED_TARGETS["smollm2-135m-instruct"]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors", MANIFEST_NAME):
        assert (target.path / name).is_file(), name
    cfg = AutoConfig.from_pretrained(target.path)
    assert "quantization_config" not in cfg.to_dict()
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (30, 576, 9, 3, 1536, 49152)
    assert cfg.tie_word_embeddings is True
    rope = cfg.to_dict().get("rope_parameters") or {}
    assert rope.get("rope_theta", getattr(cfg, "rope_theta", None)) == 100000.0

    tok = AutoTokenizer.from_pretrained(target.path)
    assert tok.chat_template == spec.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")

    model = AutoModelForCausalLM.from_pretrained(target.path).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = tok.apply_chat_template([{"role": "user", "content": "List three colors and describe each."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    new = out[0, ids["input_ids"].shape[1]:]
    assert len(new) >= 20
    assert tok.decode(new, skip_special_tokens=True).strip()


def test_embedded_mask_token_fits_the_real_tokenizer(target):
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target.path)
    assert tok.convert_ids_to_tokens(16) == "<empty_output>" and 16 in tok.added_tokens_decoder
    for path in ("smollm2-135m-cpu.yaml", "smollm2-135m-ci.yaml", "smollm2-135m-gpu.yaml"):
        validate_against_target(load_recipe(CONFIGS / path), AutoConfig.from_pretrained(target.path), tok)
    bad = load_recipe(CONFIGS / "smollm2-135m-ci.yaml", ["drafter.mask_token_id=1000"])
    with pytest.raises(ValueError, match="ordinary text token"):
        validate_against_target(bad, AutoConfig.from_pretrained(target.path), tok)


def test_manifest_detects_corruption_and_local_dir(target, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(target.path, copy)
    assert ensure_target(str(copy)).sha256 == target.sha256  # a local HF dir with a peagle manifest
    cfg = copy / "config.json"
    data = cfg.read_bytes()
    cfg.write_bytes(data.replace(b'"hidden_size": 576', b'"hidden_size": 577'))  # same size
    assert check_manifest(copy) is not None  # the cheap check trusts sizes
    assert check_manifest(copy, verify=True) is None
    cfg.write_bytes(data + b"\n")
    assert check_manifest(copy) is None
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    assert manifest["source_sha256"] and manifest["check_generation"]["num_new_tokens"] >= 20
    with pytest.raises(ValueError, match="no config.json"):
        ensure_target(str(tmp_path))
    with pytest.raises(ValueError, match="neither an embedded asset"):
        ensure_target(str(tmp_path / "missing"))


def test_packaged_prompt_files_resolve():
    assert sharegpt_path().name == "ShareGPT_V3_unfiltered_cleaned_split.json" and sharegpt_path().is_file()
    assert humaneval_path().name == "HumanEval.jsonl.gz" and humaneval_path().is_file()
