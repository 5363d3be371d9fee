"""Warm start (``training.init_from``) on a tiny random target (vocab 99, hidden 36, 5 layers): the step-0
drafter equals the head, the plan takes the head's d2t/t2d, training continues from the head's loss, and
heads that do not fit raise ValueError naming the field before any training step."""

import math
import shutil

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from peagle_core.contract import WEIGHTS_FILE, HeadContractError, export_head, head_digest
from peagle_core.drafter import Eagle3Drafter
from peagle_core.drafter_config import DrafterConfig
from peagle_core.objectives import objective_class
from peagle_core.vocab import vocab_mapping_from_counts
from peagle_core.warm_start import load_head_weights
from pipelines import train as T
from pipelines.recipe import DrafterSpec, TargetConfig, TrainingConfig
from tests.unit.conftest import plan_without_data

from .conftest import HIDDEN, MASK_ID, VOCAB, tiny_target_config

pytestmark = pytest.mark.unit

DRAFT_VOCAB = 40


@pytest.fixture(scope="module")
def target(module_mktemp) -> TargetConfig:
    """A saved tiny random Llama (untied lm_head) as the recipe's target."""
    from transformers import LlamaForCausalLM

    path = module_mktemp("target")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_target_config()).save_pretrained(path)
    return TargetConfig(model=str(path))


def spec(**kw) -> DrafterSpec:
    return DrafterSpec(**({"num_layers": 1, "num_speculative_tokens": 3, "mask_token_id": MASK_ID,
                           "draft_vocab_size": DRAFT_VOCAB} | kw))


def training(**kw) -> TrainingConfig:
    return TrainingConfig(**({"method": "peagle", "num_epochs": 100, "max_steps": 3, "lr": 1e-2, "warmup_steps": 0,
                              "batch_tokens": 48, "cod_ratio": 0.8, "cod_min_ratio": 0.3, "loss": "kl",
                              "attention": "dense", "checkpoint_every_steps": 1000, "seed": 0} | kw))


def random_head(path, *, seed: int = 5, draft_vocab_size: int | None = DRAFT_VOCAB, **kw) -> Eagle3Drafter:
    """A random head for the tiny target (its own d2t/t2d when pruned), exported to ``path`` in float32."""
    torch.manual_seed(seed)
    target_cfg = kw.pop("target_config", tiny_target_config())
    cfg = DrafterConfig.from_target(target_cfg, num_hidden_layers=kw.pop("num_hidden_layers", 1),
                                    mask_token_id=kw.pop("mask_token_id", MASK_ID), draft_vocab_size=draft_vocab_size)
    head = Eagle3Drafter(cfg)
    if draft_vocab_size is not None and draft_vocab_size < cfg.vocab_size:
        counts = torch.randint(0, 1000, (cfg.vocab_size,), generator=torch.Generator().manual_seed(seed))
        head.set_vocab_mapping(*vocab_mapping_from_counts(counts, draft_vocab_size))
    export_head(head, path, dtype="float32", **kw)
    return head


def samples(num: int = 16, seed: int = 0) -> list[dict]:
    """Learnable captured rows for the tiny target: ``final_hidden`` is a fixed function of ``aux``."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(3 * HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(123)) / math.sqrt(3 * HIDDEN)
    out = []
    for i in range(num):
        n = int(torch.randint(6, 14, (1,), generator=g))
        aux = torch.randn(n, 3 * HIDDEN, generator=g)
        out.append({"sample_id": f"s{i}", "input_ids": torch.randint(0, VOCAB - 3, (n,), generator=g),
                    "loss_mask": torch.ones(n, dtype=torch.bool), "aux": aux, "final_hidden": aux @ proj * 50})
    return out


def fit(plan: T.TrainPlan, rows: list[dict]) -> tuple[T.TrainResult, Eagle3Drafter]:
    torch.manual_seed(plan.training.seed)  # the worker's init seed: the same drafter whatever ran before
    drafter, lm_head = T.build_drafter(plan)
    objective = objective_class(plan.training.method)(plan.objective)
    res = T.train_in_process(lambda epoch: iter(rows), drafter, lm_head, objective, plan.training, device="cpu",
                             log_every_steps=1)
    return res, drafter


def test_step0_drafter_is_the_head(tmp_path, target):
    """init_from = a local head: the plan takes its d2t/t2d (no token counts read: dataset None) and the
    drafter every worker builds holds exactly the head's tensors, mask_hidden and embed_tokens included."""
    head_dir = tmp_path / "head"
    head = random_head(head_dir)
    plan = plan_without_data(training(init_from=str(head_dir)), spec(), target)
    assert plan.init_head.head_sha256 == head_digest(head_dir) and plan.init_head.head_dir == str(head_dir)
    assert torch.equal(plan.d2t, head.d2t) and torch.equal(plan.t2d, head.t2d)

    drafter, _ = T.build_drafter(plan)
    want, got = load_file(str(head_dir / WEIGHTS_FILE)), drafter.state_dict()
    assert set(want) == set(got) and {"mask_hidden", "embed_tokens.weight", "d2t", "t2d"} <= set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert drafter.embed_tokens.weight.requires_grad  # train_embed_tokens: the head's embeddings keep training

    # without init_from the same recipe starts from the target (embeddings) and random layers: not the head
    scratch, _ = T.build_drafter(plan_without_data(training(), spec(draft_vocab_size=None), target))
    assert not torch.equal(scratch.embed_tokens.weight, head.embed_tokens.weight)
    assert not torch.equal(scratch.mask_hidden, head.mask_hidden)


def test_frozen_embeddings_keep_the_targets(tmp_path, target):
    """drafter.train_embed_tokens=false: the head's other weights load, the embeddings stay the target's
    (which vLLM shares with the exported head) and frozen."""
    head_dir = tmp_path / "head"
    head = random_head(head_dir)
    plan = plan_without_data(training(init_from=str(head_dir)), spec(train_embed_tokens=False), target)
    drafter, _ = T.build_drafter(plan)
    assert torch.equal(drafter.embed_tokens.weight, T.load_target_embed(target.model))
    assert not drafter.embed_tokens.weight.requires_grad
    assert torch.equal(drafter.fc.weight, head.fc.weight) and torch.equal(drafter.mask_hidden, head.mask_hidden)


def test_fine_tune_continues_from_the_heads_loss(tmp_path, target):
    """A head trained 24 steps, exported and used as init_from: the warm run's first loss is close to where
    the first run ended, far below a cold start's first loss, and its weights move on from the head."""
    rows = samples()
    cold_plan = plan_without_data(training(max_steps=24), spec(draft_vocab_size=None), target)
    cold, trained = fit(cold_plan, rows)
    export_head(trained, tmp_path / "trained", dtype="float32")
    cold_losses = [h["loss"] for h in cold.history]

    warm_plan = plan_without_data(training(max_steps=3, init_from=str(tmp_path / "trained")),
                                    spec(draft_vocab_size=None), target)
    warm, tuned = fit(warm_plan, rows)
    first_warm = warm.history[0]["loss"]
    print(f"\ncold start: loss {cold_losses[0]:.3f} -> {cold_losses[-1]:.3f} in 24 steps; warm start from it: "
          f"first loss {first_warm:.3f}")
    assert sum(cold_losses[-3:]) / 3 < 0.8 * cold_losses[0], cold_losses
    assert first_warm < 0.8 * cold_losses[0]
    assert first_warm < 1.3 * max(cold_losses[-3:])
    assert warm.step == 3 and not torch.equal(tuned.fc.weight, trained.fc.weight)


def test_optimizer_starts_fresh(tmp_path, target):
    """The head is only weights: a warm-started run's checkpoint after 2 steps has AdamW state of 2 steps."""
    head_dir = tmp_path / "head"
    random_head(head_dir, draft_vocab_size=None)
    plan = plan_without_data(training(max_steps=2, checkpoint_every_steps=2, init_from=str(head_dir)),
                               spec(draft_vocab_size=None), target)
    drafter, lm_head = T.build_drafter(plan)
    res = T.train_in_process(lambda e: iter(samples(8)), drafter, lm_head, objective_class("peagle")(plan.objective),
                             plan.training, checkpoint_dir=tmp_path / "ck", device="cpu")
    saved = torch.load(res.checkpoint / T.OPTIMIZER_FILE, weights_only=True)
    assert {float(s["step"]) for s in saved["state"].values()} == {2.0}


@pytest.mark.parametrize(("head_kw", "spec_kw", "method", "message"), [
    ({"num_hidden_layers": 2}, {}, "peagle", r"num_hidden_layers: head 2, expected 1"),
    ({"draft_vocab_size": None}, {}, "peagle", r"draft_vocab_size: head 99, expected 40"),
    ({"mask_token_id": None}, {}, "peagle", r"method: the head is EAGLE-3"),
    ({}, {}, "eagle3", r"method: the head is P-EAGLE"),
    ({"mask_token_id": 96}, {}, "peagle", r"mask_token_id: head 96, expected 97"),
    ({"target_config": tiny_target_config(hidden_size=48)}, {}, "peagle",
     r"hidden_size: head 48, expected 36.*target_hidden_size: head 48, expected 36"),
    ({"target_config": tiny_target_config(vocab_size=101)}, {}, "peagle", r"vocab_size: head 101, expected 99"),
])
def test_mismatched_head_raises_before_training(tmp_path, target, head_kw, spec_kw, method, message):
    head_dir = tmp_path / "head"
    random_head(head_dir, **head_kw)
    with pytest.raises(ValueError, match=message) as err:
        plan_without_data(training(init_from=str(head_dir), method=method), spec(**spec_kw), target)
    assert f"training.init_from={str(head_dir)!r}" in str(err.value) and "drop training.init_from" in str(err.value)


def test_bad_references(tmp_path, target):
    with pytest.raises(ValidationError, match="NAME@ALIAS"):
        training(init_from="models:/peagle-x")
    with pytest.raises(ValidationError, match="empty"):
        training(init_from="  ")
    assert training(init_from="models:/peagle-x@champion").init_from == "models:/peagle-x@champion"
    with pytest.raises(ValueError, match="is not a directory"):
        plan_without_data(training(init_from=str(tmp_path / "nope")), spec(), target)
    with pytest.raises(ValueError, match="registry head: download it first"):
        plan_without_data(training(init_from="models:/peagle-x@champion"), spec(), target)
    head_dir = tmp_path / "head"
    random_head(head_dir)
    with open(head_dir / WEIGHTS_FILE, "r+b") as f:  # corrupted after export
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(ValueError, match="sha256"):
        plan_without_data(training(init_from=str(head_dir)), spec(), target)


def test_load_head_weights_refuses_another_vocab_mapping(tmp_path):
    head_dir = tmp_path / "head"
    random_head(head_dir, seed=5)
    other = Eagle3Drafter(DrafterConfig.from_target(tiny_target_config(), num_hidden_layers=1, mask_token_id=MASK_ID,
                                                    draft_vocab_size=DRAFT_VOCAB))
    with pytest.raises(HeadContractError, match="d2t differs"):
        load_head_weights(other, head_dir)


def test_train_key_covers_the_head_not_the_path(tmp_path):
    """The train stage keys a local warm start on the head's files: a copy elsewhere keeps the key, another
    head changes it (and every later stage's), no init_from leaves the committed keys alone."""
    from pipelines.pipeline import PipelineRun
    from pipelines.recipe import load_recipe
    from tests.conftest import CONFIGS

    def run(*overrides):
        return PipelineRun(load_recipe(CONFIGS / "smollm2-135m-ci.yaml", list(overrides)), run_dir=tmp_path / "run")

    a, b = tmp_path / "a", tmp_path / "b"
    random_head(a, seed=1)
    shutil.copytree(a, tmp_path / "a-copy")
    random_head(b, seed=2)
    scratch, warm_a = run(), run(f"training.init_from={a}")
    assert "init_from" not in scratch._stages["train"].sections(scratch.recipe)[1]
    assert warm_a._stages["train"].sections(warm_a.recipe)[1]["init_from"] == {"head_sha256": head_digest(a)}
    assert warm_a.key("capture") == scratch.key("capture") and warm_a.key("train") != scratch.key("train")
    assert run(f"training.init_from={tmp_path / 'a-copy'}").key("train") == warm_a.key("train")
    warm_b = run(f"training.init_from={b}")
    assert all(warm_b.key(s) != warm_a.key(s) for s in ("train", "evaluate", "register", "serve"))
    with pytest.raises(ValueError, match="is not a directory"):  # at construction: before any stage runs
        run(f"training.init_from={tmp_path / 'missing'}")
