"""Recipe schema: every recipe in configs/ loads; each validation rule fails with field + fix."""

from __future__ import annotations

import pytest
import yaml

from peagle_core.drafter_config import default_aux_layer_ids
from pipelines.recipe import (
    DrafterSpec,
    Recipe,
    SourceConfig,
    TargetConfig,
    load_recipe,
    recipe_from_dict,
    validate_against_target,
)
from tests.conftest import CONFIGS

pytestmark = pytest.mark.unit

RECIPES = sorted(CONFIGS.glob("*.yaml"))


def test_configs_dir_has_the_issue_recipes():
    names = {p.name for p in RECIPES}
    for want in ("smollm2-135m-cpu.yaml", "smollm2-135m-ci.yaml", "smollm2-135m-gpu.yaml",
                 "gpt-oss-20b-b200.yaml", "qwen3-coder-30b-a3b-b200.yaml", "llama-3.1-8b-h100.yaml"):
        assert want in names


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_loads_and_round_trips(path):
    r = load_recipe(path)
    assert r.name == path.stem
    n = r.target.known("num_hidden_layers")
    assert n is not None, "every shipped recipe declares or knows the target's layer count"
    aux = r.resolved_aux_layer_ids()
    assert all(0 <= i < n for i in aux)
    assert 0 <= r.drafter.mask_token_id < r.target.known("vocab_size")
    again = recipe_from_dict(yaml.safe_load(r.dump_resolved()))
    assert again == r.model_copy(update={"target": r.target.model_copy(update={"aux_layer_ids": aux})})


@pytest.mark.parametrize(
    "path,layers,hidden,vocab,mask,aux",
    [
        ("gpt-oss-20b-b200.yaml", 24, 2880, 201088, 200017, None),
        ("qwen3-coder-30b-a3b-b200.yaml", 48, 2048, 151936, 151669, None),
        ("llama-3.1-8b-h100.yaml", 32, 4096, 128256, 128002, None),
        ("smollm2-135m-cpu.yaml", 30, 576, 49152, 16, None),
    ],
)
def test_cluster_recipes_match_public_configs(path, layers, hidden, vocab, mask, aux):
    r = load_recipe(CONFIGS / path)
    t = r.target
    assert (t.known("num_hidden_layers"), t.known("hidden_size"), t.known("vocab_size")) == (layers, hidden, vocab)
    assert r.resolved_aux_layer_ids() == (aux or (2, layers // 2, layers - 3))
    assert r.drafter.mask_token_id == mask


def test_defaults_resolve_for_embedded_target():
    r = Recipe(name="x")
    assert r.drafter.mask_token_id == 16
    assert r.resolved_aux_layer_ids() == (2, 15, 27) == default_aux_layer_ids(30)


def test_norm_before_residual_reaches_the_head_config():
    """``drafter.norm_before_residual`` (speculators' heads set it) is the exported head's vLLM flag."""
    from peagle_core.contract import drafter_config_from_head, head_config_dict

    hf = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
          "intermediate_size": 1536, "vocab_size": 49152, "rope_theta": 100000.0}
    for flag in (False, True):
        spec = recipe_from_dict({"name": "t"}, [f"drafter.norm_before_residual={str(flag).lower()}"]).drafter
        cfg = spec.to_drafter_config(hf, target=TargetConfig())
        head = head_config_dict(cfg, dtype="float32")
        assert head["norm_before_residual"] is flag
        assert drafter_config_from_head(head).norm_before_residual is flag


def test_depth_decay_reaches_the_objective_and_only_peagle():
    """``training.depth_decay`` (None = uniform) is the P-EAGLE objective's depth weight; EAGLE-3 refuses it."""
    assert recipe_from_dict({"name": "t"}).training.objective_config(5).depth_decay == 1.0
    cfg = recipe_from_dict({"name": "t"}, ["training.depth_decay=0.5"]).training.objective_config(5)
    assert cfg.depth_decay == 0.5
    assert "training.depth_decay" in _err({}, "training.depth_decay=0")
    msg = _err({}, "training.method=eagle3", "training.depth_decay=0.5")
    assert "training.depth_decay" in msg and "ttt_decay" in msg


@pytest.mark.parametrize("overrides, build", [
    ([], "compiled"),
    (["training.num_partitions=2"], "blockwise"),  # the compiled build stalls a 2-partition segment on CUDA
    (["training.num_partitions=2", "training.block_mask=compiled"], "compiled"),
    (["training.block_mask=blockwise"], "blockwise"),
    (["training.method=eagle3", "training.num_partitions=2"], "compiled"),  # EAGLE-3 does not partition
    (["training.num_workers=4"], "blockwise"),  # four ranks compiling at once stalled on 4 H200s
    (["training.method=eagle3", "training.num_workers=2"], "blockwise"),
])
def test_block_mask_auto_resolves_by_partitions(overrides, build):
    """``training.block_mask: auto`` (the default) reaches the objective as blockwise where P-EAGLE partitions or
    several workers train."""
    assert recipe_from_dict({"name": "t"}, overrides).training.objective_config(5).block_mask == build
    assert "training.block_mask" in _err({}, "training.block_mask=eager")


def _err(data, *overrides) -> str:
    with pytest.raises(ValueError) as e:
        recipe_from_dict({"name": "t", **data}, list(overrides))
    return str(e.value)


def test_k_below_one():
    msg = _err({}, "drafter.num_speculative_tokens=0")
    assert "drafter.num_speculative_tokens" in msg and ">= 1" in msg


def test_aux_layer_id_beyond_target_layers():
    msg = _err({}, "target.aux_layer_ids=[2,15,30]")
    assert "target.aux_layer_ids" in msg and "30" in msg and "[2, 15, 27]" in msg  # the fix: vLLM default


def test_aux_layer_id_negative():
    assert "target.aux_layer_ids" in _err({}, "target.aux_layer_ids=[-1,15,27]")
    # unknown layer count: negative ids are still caught at load time
    assert "target.aux_layer_ids" in _err(
        {"target": {"model": "org/m", "aux_layer_ids": [-1, 2, 3]}, "drafter": {"mask_token_id": 5}})


def test_aux_layer_ids_checked_against_declared_layers():
    msg = _err({"target": {"model": "org/m", "num_hidden_layers": 8, "aux_layer_ids": [2, 4, 8]},
                "drafter": {"mask_token_id": 5}})
    assert "num_hidden_layers=8" in msg


def test_mask_token_outside_vocab():
    msg = _err({}, "drafter.mask_token_id=49152")
    assert "drafter.mask_token_id=49152" in msg and "[0, 49152)" in msg
    assert "drafter.mask_token_id" in _err({}, "drafter.mask_token_id=-3")


def test_mask_token_emitted_by_embedded_chat_template():
    msg = _err({}, "drafter.mask_token_id=2")
    assert "chat template" in msg and "16" in msg


def test_mask_token_required_for_unknown_target():
    msg = _err({"target": {"model": "org/m"}})
    assert "drafter.mask_token_id is required" in msg


def test_draft_vocab_larger_than_vocab():
    msg = _err({}, "drafter.draft_vocab_size=50000")
    assert "drafter.draft_vocab_size=50000" in msg and "49152" in msg


def test_unknown_field_is_rejected():
    msg = _err({"training": {"learning_rate": 1e-3}})
    assert "training.learning_rate" in msg


def test_other_section_rules():
    assert "cod_min_ratio" in _err({}, "training.cod_min_ratio=0.9", "training.cod_ratio=0.5")
    assert "min_replicas" in _err({}, "serving.min_replicas=3", "serving.max_replicas=2")
    assert "target_ongoing_requests" in _err({}, "serving.target_ongoing_requests=9", "serving.max_ongoing_requests=8")
    assert "num_speculative_tokens_sweep" in _err({}, "evaluation.num_speculative_tokens_sweep=[0]")
    assert "path" in _err({"data": {"sources": [{"kind": "openai_jsonl"}]}})
    assert "drop `path`" in _err({"data": {"sources": [{"kind": "sharegpt", "path": "x.json"}]}})
    assert "section.field=value" in _err({}, "training.lr")


def test_load_recipe_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_recipe(bad)


def test_stage_sections_are_independent():
    # each stage receives only its section; sections are constructible on their own
    assert DrafterSpec(num_speculative_tokens=7).num_layers == 4
    assert TargetConfig().resolve_aux_layer_ids(32) == (2, 16, 29)
    assert SourceConfig(kind="openai_jsonl", path="$HOME/x.jsonl").resolved_path().is_absolute()
    with pytest.raises(ValueError, match="num_hidden_layers is unknown"):
        TargetConfig(model="org/m").resolve_aux_layer_ids()


# --- checks against the real target (tiny tokenizer from tests/conftest.py) ---


def _tiny_recipe(**drafter) -> Recipe:
    return Recipe(name="t", target={"model": "org/tiny"}, drafter={"mask_token_id": 3, **drafter})


TINY_CONFIG = {"num_hidden_layers": 6, "hidden_size": 36, "vocab_size": 17}


def test_validate_against_target_accepts_reserved_token(tiny_chat_tokenizer):
    validate_against_target(_tiny_recipe(), TINY_CONFIG, tiny_chat_tokenizer)
    # an unused embedding row past the tokenizer (as 151669 for Qwen3) is fine too
    validate_against_target(_tiny_recipe(mask_token_id=16), TINY_CONFIG, tiny_chat_tokenizer)


@pytest.mark.parametrize(
    "mask,needle",
    [(1, "bos/eos/pad/unk"), (13, "ordinary text token"), (17, "outside the target embedding")],
)
def test_validate_against_target_rejects_bad_mask(tiny_chat_tokenizer, mask, needle):
    with pytest.raises(ValueError, match=needle):
        validate_against_target(_tiny_recipe(mask_token_id=mask), TINY_CONFIG, tiny_chat_tokenizer)


def test_validate_against_target_rejects_template_token(tiny_chat_tokenizer):
    tok = tiny_chat_tokenizer
    saved = tok.chat_template
    tok.chat_template = saved.replace("'<|im_end|>'", "'<reserved_1><|im_end|>'")
    try:
        with pytest.raises(ValueError, match="emitted by the chat template"):
            validate_against_target(_tiny_recipe(mask_token_id=4), TINY_CONFIG, tok)
    finally:
        tok.chat_template = saved


def test_validate_against_target_layers_and_declared_sizes(tiny_chat_tokenizer):
    r = Recipe(name="t", target={"model": "org/tiny", "aux_layer_ids": [2, 3, 6], "hidden_size": 40},
               drafter={"mask_token_id": 3, "draft_vocab_size": 20})
    with pytest.raises(ValueError) as e:
        validate_against_target(r, TINY_CONFIG, tiny_chat_tokenizer)
    msg = str(e.value)
    assert "target.hidden_size=40" in msg and "target.aux_layer_ids" in msg and "draft_vocab_size=20" in msg


def test_provenance_git_sha_from_env_wins_over_git(monkeypatch, tmp_path):
    from pipelines.registry.provenance import provenance

    monkeypatch.delenv("PEAGLE_GIT_SHA", raising=False)
    assert provenance(repo_dir=tmp_path)["git_sha"] is None  # an uploaded working dir: no .git
    monkeypatch.setenv("PEAGLE_GIT_SHA", "abc123")
    monkeypatch.setenv("PEAGLE_GIT_DIRTY", "1")
    p = provenance(repo_dir=tmp_path)
    assert (p["git_sha"], p["git_dirty"]) == ("abc123", True)


def test_an_override_names_a_list_item_by_its_index():
    """``--set data.sources.1.path=...`` changes one source of a recipe's list and leaves the others and the
    caller's mapping as they were (the device runs the 300k recipe with its ShareGPT source read from a file)."""
    data = yaml.safe_load((CONFIGS / "smollm2-135m-300k.yaml").read_text())
    r = recipe_from_dict(data, ["data.sources.0.kind=openai_jsonl", "data.sources.0.path=/x/sharegpt.jsonl"])
    kinds = [s.kind for s in r.data.sources]
    assert kinds == ["openai_jsonl", "self_instruct", "self_instruct", "self_instruct"]
    assert r.data.sources[0].path == "/x/sharegpt.jsonl" and r.data.sources[0].weight == 1
    assert r.data.sources[1].self_instruct.num_prompts == 205000
    assert data["data"]["sources"][0] == {"kind": "sharegpt", "weight": 1}
    with pytest.raises(ValueError, match=r"'4' is not an item of the 4 in data.sources \(0..3\)"):
        recipe_from_dict(data, ["data.sources.4.path=/x"])
    with pytest.raises(ValueError, match="'lr' is not a section"):
        recipe_from_dict({"name": "t", "training": {"lr": 1.0}}, ["training.lr.x=2"])
