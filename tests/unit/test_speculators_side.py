"""bench.speculators_side: peagle's capture as speculators' training data, and speculators' heads through peagle's
contract check. The conversions need no speculators; the tests that run speculators' own dataset, trainer and model
skip without it (it is not a dependency of the project's venv: its pins want datasets <= 5.1)."""

import json
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.speculators_data import CaptureTransfer, speculators_sample, write_data
from bench.speculators_heads import flat_config_without_vllm, peagle_head
from bench.speculators_side import (
    BEST_PINNED,
    COMMON_FLAGS,
    CPU_FLAGS,
    RECIPES,
    STRUCTURE,
    best_differs,
    drop_flags,
    flag_values,
    spec_argv,
)
from peagle_core.contract import HeadContractError, load_head, validate_head
from peagle_core.target import final_norm
from peagle_core.vocab import vocab_mapping_from_counts
from pipelines.capture import capture_tokenized, tokenize_rows
from pipelines.recipe.stages import CaptureConfig

from .conftest import HIDDEN, MASK_ID, VOCAB, make_drafter, tiny_target_config

pytestmark = pytest.mark.unit

AUX = (1, 2, 3)
TARGET = {"hidden_size": HIDDEN, "vocab_size": VOCAB, "num_hidden_layers": 5}
ROWS = [{"id": f"c{i}", "messages": [{"role": "user", "content": "hello world " * (i + 1)},
                                     {"role": "assistant", "content": "A V hello " * (2 + i)}]} for i in range(3)]


def _randomize_norm(model) -> None:
    """A non-identity final norm weight: ones would hide a wrong inversion."""
    torch.manual_seed(3)
    final_norm(model).weight.data.uniform_(0.5, 2.0)


def test_sample_holds_aux_and_the_pre_norm_state(tiny_target):
    """The inversion is exact up to the norm's eps / (2 ms(h)), relative: ~1e-8 for SmolLM2's last layer (ms(h)
    339-918 on a regenerated conversation, eps 1e-5), ~1e-3 for this tiny random target's small states, so its eps
    is taken out here."""
    _randomize_norm(tiny_target)
    final_norm(tiny_target).variance_epsilon = 0.0
    ids = torch.arange(5, 22)  # [17]
    mask = np.r_[np.zeros(5), np.ones(12)].astype(np.uint8)
    (s,) = capture_tokenized(tiny_target, [{"sample_id": "a", "input_ids": ids.numpy().astype(np.int32),
                                            "loss_mask": mask}], CaptureConfig(dtype="float32", batch_size=2), AUX)
    seen = {}
    hook = final_norm(tiny_target).register_forward_pre_hook(lambda m, a: seen.update(pre=a[0][0]))
    with torch.no_grad():
        tiny_target(ids[None])
    hook.remove()
    norm = final_norm(tiny_target)
    out = speculators_sample(s, norm.weight.detach())
    assert out["hidden_states"].shape == (17, 4, HIDDEN) and out["token_ids"].dtype == torch.int64
    assert torch.equal(out["token_ids"], ids)
    assert torch.equal(out["hidden_states"][:, :3].reshape(17, -1), s["aux"])
    with torch.no_grad():  # speculators applies the target's norm to layer 3: it must give peagle's final_hidden
        torch.testing.assert_close(norm(out["hidden_states"][:, 3]), s["final_hidden"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(norm(out["hidden_states"][:, 3]), norm(seen["pre"]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="zeros"):
        speculators_sample(s, torch.zeros(HIDDEN))


@pytest.fixture
def spec_data(tmp_path, tiny_target, tiny_chat_tokenizer):
    """speculators' data directory for ROWS (hidden-state files) and the tiny target's directory."""
    _randomize_norm(tiny_target)
    target_dir = tmp_path / "target"
    tiny_target.save_pretrained(target_dir)
    tiny_chat_tokenizer.save_pretrained(target_dir)
    recipe = SimpleNamespace(data=SimpleNamespace(max_length_tokens=40), target=SimpleNamespace(dtype="float32"),
                             capture=CaptureConfig(dtype="float32", batch_size=2, on_too_long="truncate"))
    d2t, t2d = vocab_mapping_from_counts(torch.arange(float(VOCAB)), 64)
    plan = SimpleNamespace(target_dir=target_dir, target_name="tiny", target_sha256="0" * 64, d2t=d2t, t2d=t2d,
                           drafter=SimpleNamespace(draft_vocab_size=64, vocab_size=VOCAB, aux_layer_ids=AUX,
                                                   mask_token_id=MASK_ID, target_num_hidden_layers=5))
    out = tmp_path / "data"
    tokenized = tokenize_rows(tiny_chat_tokenizer, ROWS, max_length_tokens=40, on_too_long="truncate")
    side = write_data(out, tokenized, recipe, plan, tiny_chat_tokenizer, model=tiny_target)
    return out, side, target_dir


def test_data_directory_and_online_capture_agree(spec_data):
    from datasets import load_from_disk

    out, side, _ = spec_data
    assert side["num_conversations"] == 3 and side["aux_layer_ids"] == list(AUX) and side["draft_vocab_size"] == 64
    ds = load_from_disk(str(out))
    assert ds.column_names == ["input_ids", "loss_mask", "seq_len"]
    assert np.load(out / "d2t-64.npy").shape == (64,) and np.load(out / "t2d-64.npy").sum() == 64
    online = pickle.loads(pickle.dumps(CaptureTransfer(out)))  # speculators' workers are spawned: it travels bare
    for i in range(3):
        row, files = ds[i], load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(files["token_ids"], row["input_ids"]) and row["seq_len"] == len(row["input_ids"]) <= 40
        assert row["loss_mask"].dtype == torch.int64 and 0 < int(row["loss_mask"].sum()) < len(row["input_ids"])
        got = online.get_cached(i)  # one sample per forward, the files' samples were batched with padding
        assert torch.equal(got["token_ids"], files["token_ids"])
        torch.testing.assert_close(got["hidden_states"], files["hidden_states"], atol=1e-5, rtol=1e-5)
    assert online.num_captured == 3


def _speculators_dir(tmp_path, kind: str, *, with_mask_hidden: bool = True):
    """A head in speculators' saved format (config fields and tensor names as `speculators train --dry-run` writes
    them, speculators 0.9.0) holding a peagle drafter's weights; returns (dir, drafter)."""
    drafter = make_drafter(mask_token_id=MASK_ID if kind == "peagle" else None, draft_vocab_size=64, aux_layer_ids=AUX,
                           norm_before_fc=kind == "eagle3", norm_before_residual=True)
    d2t, t2d = vocab_mapping_from_counts(torch.arange(float(VOCAB)), 64)
    drafter.set_vocab_mapping(d2t, t2d)
    weights = {k: v.clone() for k, v in drafter.state_dict().items()}
    if kind == "peagle":
        weights["mask_hidden"] = weights["mask_hidden"].reshape(1, 1, -1)
        if not with_mask_hidden:
            del weights["mask_hidden"]
    layer = tiny_target_config(num_hidden_layers=drafter.config.num_hidden_layers).to_diff_dict()
    layer |= {"layer_types": ["sliding_attention"] * drafter.config.num_hidden_layers, "sliding_window": 2048,
              "use_sliding_window": True, "head_dim": drafter.config.head_dim,
              "rms_norm_eps": drafter.config.rms_norm_eps}
    config = {"architectures": ["PEagleDraftModel" if kind == "peagle" else "Eagle3DraftModel"],
              "speculators_model_type": kind, "speculators_version": "0.9.0", "transformer_layer_config": layer,
              "draft_vocab_size": 64, "eagle_aux_hidden_state_layer_ids": list(AUX), "norm_before_residual": True,
              "norm_before_fc": kind == "eagle3", "fc_norm": False, "norm_output": False,
              "embed_requires_grad": False, "target_hidden_size": None,
              "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                                     "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "tiny"}}}
    if kind == "peagle":
        config["mask_token_id"] = MASK_ID
    d = tmp_path / f"spec-{kind}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    save_file(weights, str(d / "model.safetensors"))
    return d, drafter


@pytest.mark.parametrize("kind", ["peagle", "eagle3"])
def test_speculators_head_passes_the_contract_with_the_same_tensors(tmp_path, kind):
    spec_dir, drafter = _speculators_dir(tmp_path, kind)
    config = peagle_head(spec_dir, tmp_path / "head", target_config=TARGET)
    assert config["peagle"]["method"] == kind and config["sliding_window"] == 2048
    assert (config.get("mask_token_id"), config.get("ptd_token_id")) == ((MASK_ID, MASK_ID) if kind == "peagle"
                                                                         else (None, None))
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "head" / "model.safetensors"))  # frozen: vLLM shares
    loaded = load_head(tmp_path / "head", target_embed_tokens=drafter.embed_tokens.weight)
    for name, want in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], want), name
    validate_head(tmp_path / "head", target_config=TARGET, parallel_drafting=kind == "peagle")


def test_peagle_head_without_mask_hidden_is_refused(tmp_path):
    spec_dir, _ = _speculators_dir(tmp_path, "peagle", with_mask_hidden=False)
    with pytest.raises(HeadContractError, match="mask_hidden"):
        peagle_head(spec_dir, tmp_path / "head", target_config=TARGET)


@pytest.mark.parametrize("kind", ["peagle", "eagle3"])
def test_flat_config_is_vllms(tmp_path, kind):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    spec_dir, _ = _speculators_dir(tmp_path, kind)
    spec = json.loads((spec_dir / "config.json").read_text())
    assert flat_config_without_vllm(spec) == SpeculatorsConfig.extract_transformers_pre_trained_config(spec)


def test_argv_has_the_data_and_the_recipe(spec_data):
    out, side, _ = spec_data
    argv = spec_argv("peagle", out, side, out / "save", max_steps=7, init=out / "init")

    def flag(name: str) -> str:  # the value argparse keeps: the last occurrence
        return argv[len(argv) - argv[::-1].index(name)]

    assert flag("--speculator-type") == "peagle" and flag("--max-steps") == "7"
    assert flag("--hidden-states-backend") == "file" and flag("--mask-token-id") == str(MASK_ID)
    assert flag("--d2t-path").endswith("d2t-64.npy") and flag("--num-depths") == "8"
    assert flag("--from-pretrained") == str(out / "init")
    assert "--num-layers" not in argv and "--draft-arch" not in argv  # replaced by the config-only --from-pretrained
    assert argv[argv.index("--target-layer-ids") + 1: argv.index("--target-layer-ids") + 4] == ["1", "2", "3"]


def _flag(argv: list[str], name: str) -> str | None:
    """The value argparse keeps for ``name`` (its last occurrence); None when absent."""
    return argv[len(argv) - argv[::-1].index(name)] if name in argv else None


# what must not differ between the recipes: the heads' structure and the data's plan
STRUCTURE_FLAGS = ("--num-layers", "--draft-arch", "--num-depths", "--ttt-steps", "--total-seq-len",
                   "--target-layer-ids", "--mask-token-id", "--d2t-path", "--t2d-path", "--hidden-states-dtype",
                   "--train-data-ratio", "--max-steps", "--from-pretrained")


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
@pytest.mark.parametrize("init", [False, True])
def test_best_recipe_keeps_the_structure(spec_data, method, init):
    out, side, _ = spec_data
    kw = {"max_steps": 7, "init": out / "init" if init else None}
    defaults = spec_argv(method, out, side, out / "save", **kw)
    best = spec_argv(method, out, side, out / "save", recipe="best", **kw)
    assert defaults == spec_argv(method, out, side, out / "save", recipe="defaults", **kw)
    for name in STRUCTURE_FLAGS:
        assert _flag(best, name) == _flag(defaults, name), name
    assert set(STRUCTURE[method]) <= set(RECIPES["best"][method]) and set(STRUCTURE[method]) <= set(RECIPES[
        "defaults"][method])
    if init:  # the shaping flags come from the config-only init in both
        assert "--num-layers" not in best and "--draft-arch" not in best


def test_best_recipe_flags(spec_data):
    out, side, _ = spec_data
    peagle = spec_argv("peagle", out, side, out / "save", max_steps=7, recipe="best")
    assert (_flag(peagle, "--lr"), _flag(peagle, "--scheduler-type"), _flag(peagle, "--max-anchors")) == (
        "6e-4", "cosine", "4096")
    assert "--no-norm-before-residual" in peagle and "--scheduler-warmup-steps" not in peagle
    eagle3 = spec_argv("eagle3", out, side, out / "save", max_steps=7, recipe="best")
    assert (_flag(eagle3, "--lr"), _flag(eagle3, "--scheduler-type"), _flag(eagle3, "--ttt-step-loss-decay")) == (
        "1e-3", "linear", "1.0")
    assert {"--norm-before-fc", "--norm-output", "--norm-before-residual"} <= set(eagle3)
    defaults = spec_argv("eagle3", out, side, out / "save", max_steps=7)
    assert (_flag(defaults, "--scheduler-warmup-steps"), _flag(defaults, "--ttt-step-loss-decay")) == ("50", "0.8")
    with pytest.raises(ValueError, match="recipe 'tuned'"):
        spec_argv("eagle3", out, side, out / "save", max_steps=7, recipe="tuned")


def test_best_differs_names_what_the_arms_set_differently():
    assert best_differs("peagle") == ["--lr 6e-4", "--no-norm-before-residual", "--max-anchors 4096",
                                      "--scheduler-warmup-steps: default"]
    assert best_differs("eagle3") == ["--scheduler-type linear", "--ttt-step-loss-decay 1.0",
                                      "--scheduler-warmup-steps: default"]
    assert flag_values(("--lr", "6e-4", "--norm-output", "--num-layers", "1")) == {
        "--lr": "6e-4", "--norm-output": None, "--num-layers": "1"}


def test_drop_flags_takes_the_values_and_leaves_switches():
    flags = ("--num-layers", "4", "--no-norm-before-residual", "--draft-arch", "llama", "--lr", "6e-4")
    assert drop_flags(flags, ("--num-layers", "--draft-arch")) == ["--no-norm-before-residual", "--lr", "6e-4"]


def test_every_flag_is_a_speculators_flag():
    """Every flag of both recipes against speculators 0.9.0's own parser (generated from its schema); skipped
    without speculators (not a dependency of the project's venv)."""
    pytest.importorskip("speculators")
    from speculators.train.config.resolution import build_parser

    known = {o for a in build_parser()._actions for o in a.option_strings}
    ours = {t for r in RECIPES.values() for flags in r.values() for t in flags} | set(COMMON_FLAGS) | set(CPU_FLAGS)
    assert {t for t in ours if t.startswith("--")} - known == set()


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_speculators_resolves_the_best_recipe(spec_data, method):
    """speculators' own resolution (argparse, then its pydantic schema) takes the best recipe's command line and
    keeps its values; skipped without speculators."""
    pytest.importorskip("speculators")
    from speculators.train.config import TrainConfig

    out, side, _ = spec_data
    argv = spec_argv(method, out, side, out / "save", max_steps=7, recipe="best")
    cfg = TrainConfig.resolve(argv)
    pinned = flag_values(BEST_PINNED[method])  # they restate 0.9.0's defaults: without them, the same config
    assert TrainConfig.resolve(drop_flags(tuple(argv), tuple(pinned))).flatten() == cfg.flatten()
    assert (cfg.optimizer.optimizer, cfg.loss.loss_fn, cfg.draft.num_layers) == ("muon", "kl_div",
                                                                                 4 if method == "peagle" else 1)
    if method == "peagle":
        assert (cfg.optimizer.lr, cfg.optimizer.muon_lr, cfg.data.max_anchors, cfg.peagle.num_depths) == (
            6e-4, 6e-4, 4096, 8)
        assert not cfg.draft.norm_before_residual and cfg.scheduler.scheduler_warmup_steps is None
    else:
        assert (cfg.optimizer.lr, cfg.optimizer.muon_lr, cfg.loss.ttt_steps, cfg.loss.ttt_step_loss_decay) == (
            1e-3, 1e-3, 7, 1.0)
        assert cfg.draft.norm_before_fc and cfg.draft.norm_output and cfg.draft.norm_before_residual


# ------------------------------------------------------------------------------------------ with speculators


def test_speculators_dataset_reads_both_backends(spec_data):
    pytest.importorskip("speculators")
    from hs_connectors import FileTransfer
    from speculators.train.data import ArrowDataset

    out, _, _ = spec_data
    by_file = ArrowDataset(max_len=64, datapath=out, transfer=FileTransfer(out / "hidden_states"), on_missing="raise")
    online = ArrowDataset(max_len=64, datapath=out, transfer=CaptureTransfer(out), on_missing="raise")
    for i in range(3):
        a, b = by_file[i], online[i]
        n = len(a["input_ids"])
        assert a["hidden_states"].shape == (n, 3 * HIDDEN) and a["verifier_last_hidden_states"].shape == (n, HIDDEN)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        torch.testing.assert_close(a["hidden_states"], b["hidden_states"], atol=1e-5, rtol=1e-5)


def test_speculators_trains_eagle3_and_its_head_drafts_as_peagles(spec_data, tmp_path):
    """speculators' trainer for 2 steps on the converted data (CPU shims), its head through the contract check,
    then the same first-step draft logits from speculators' model and from peagle's drafter on the converted head
    (speculators' positions start at 1 after its shift, peagle's at 0: RoPE only sees differences)."""
    pytest.importorskip("speculators")
    from speculators.models.eagle3.core import Eagle3DraftModel

    from bench.speculators_side import run_speculators

    out, side, _ = spec_data
    save = tmp_path / "save"
    rec = run_speculators(spec_argv("eagle3", out, side, save, max_steps=2,
                                    extra=("--total-seq-len", "96", "--log-freq", "1", "--train-data-ratio", "0.67",
                                           "--epochs", "2")))  # 2 training rows: one packed batch per epoch
    assert [r["step"] for r in rec.rows if "step" in r] == [0, 1] and any("val" in r for r in rec.rows)
    ckpt = save / "1"
    config = peagle_head(ckpt, tmp_path / "head", target_config=TARGET)
    assert config["norm_before_fc"] and config["num_hidden_layers"] == 1

    cfg = Eagle3DraftModel.config_class.from_pretrained(ckpt)
    cfg.transformer_layer_config._attn_implementation = "sdpa"
    spec = Eagle3DraftModel.from_pretrained(ckpt, config=cfg).float().eval()
    ours = load_head(tmp_path / "head", dtype=torch.float32, target_embed_tokens=spec.embed_tokens.weight.detach())
    torch.manual_seed(5)
    t = 9
    aux, ids = torch.randn(1, t, 3 * HIDDEN), torch.randint(0, VOCAB, (1, t))
    seen = []
    hook = spec.lm_head.register_forward_hook(lambda m, a, o: seen.append(o))
    with torch.no_grad():
        spec(hidden_states=aux, input_ids=ids, document_ids=torch.zeros(1, t, dtype=torch.long),
             position_ids=torch.arange(1, t + 1)[None], ttt_steps=1)
        normed, _ = ours(ids, ours.combine_hidden_states(aux), torch.arange(t)[None])
        logits = ours.compute_logits(normed)
    hook.remove()
    torch.testing.assert_close(logits, seen[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_best_recipe_head_passes_the_contract(spec_data, tmp_path, method):
    """The best recipe's initial head (speculators' ``--dry-run``, CPU shims) carries its norm flags in its config
    and passes the contract check as `check` runs it; skipped without speculators."""
    pytest.importorskip("speculators")
    from bench.speculators_side import run_speculators

    out, side, _ = spec_data
    save = tmp_path / "dry"
    run_speculators(spec_argv(method, out, side, save, max_steps=1, recipe="best", extra=("--dry-run",)))
    spec = json.loads((save / "config.json").read_text())
    want = {"peagle": (False, False, False), "eagle3": (True, True, True)}[method]
    assert (spec["norm_before_residual"], spec["norm_before_fc"], spec["norm_output"]) == want
    config = peagle_head(save, tmp_path / "head", target_config=TARGET)
    assert config["norm_before_residual"] is want[0] and config["num_hidden_layers"] == (4 if method == "peagle"
                                                                                           else 1)


def test_record_takes_the_gpu_calls_of_the_same_recipe(tmp_path, monkeypatch):
    import bench.common
    from bench.speculators_side import record

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    train = tmp_path / "spec_train_spec-peagle-best-3k-10s.json"
    train.write_text(json.dumps({"tag": "spec-peagle-best-3k-10s", "method": "peagle", "recipe": "best",
                                 "environment": {"date": "2026-11-29T00:00:00"}}))
    gpu = []
    for recipe, mib in (("defaults", 1024), ("best", 2048)):  # as run_speculators.sh writes them
        gpu.append(tmp_path / f"spec_gpu_{recipe}.jsonl")
        gpu[-1].write_text(json.dumps({"method": "peagle", "recipe": recipe, "mem_used_peak_mib": mib}) + "\n")
    record(SimpleNamespace(files=[str(train)], gpu=[str(g) for g in gpu], note=None, counterpart="peagle-3k-10s#2"))
    (row,) = json.loads((tmp_path / "speculators_train.json").read_text())["rows"]
    assert (row["recipe"], row["gpu_mem_used_peak_gib"], row["date"]) == ("best", 2.0, "2026-11-29")
    assert row["counterpart"] == {"tag": "peagle-3k-10s", "run": 2}  # the peagle run it is set against
