"""The plain (Ray-free) training loop of pipelines/train/: schedule, packing position, resume."""

import itertools
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from peagle_core.batch import pack_samples
from peagle_core.drafter import Eagle3Drafter
from peagle_core.drafter_config import DrafterConfig
from peagle_core.vocab import count_token_ids, vocab_mapping_from_counts
from pipelines import train as T
from pipelines.capture import count_assistant_tokens
from pipelines.recipe import DrafterSpec, TargetConfig, TrainingConfig
from pipelines.train.target_weights import LAYER_LINEARS
from tests.unit.conftest import plan_without_data

from .conftest import HIDDEN, MASK_ID, VOCAB, tiny_target_config

pytestmark = pytest.mark.unit


class StandInObjective:
    """Next-token distillation at depth 0 with a random row subsample (exercises the RNG the
    trainer must checkpoint); the interface of ``peagle_core.objectives.base.Objective``."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def forward_backward(self, drafter, batch, *, target_lm_head, loss_scale_denominator=None, no_sync=None,
                         elements=None):
        d = getattr(drafter, "module", drafter)
        N = batch.num_tokens
        ar = torch.arange(N)
        mask = (batch.doc_ids[:, None] == batch.doc_ids[None, :]) & (ar[:, None] >= ar[None, :])
        hidden = d.combine_hidden_states(batch.aux)[None]
        normed, _ = drafter(batch.input_ids[None], hidden, batch.position_ids[None], attn_mask=mask[None, None])
        # slot p predicts x[p+2]: target distribution = lm_head(final_hidden[p+1])
        valid = (ar[:-1] + 1 < N) & (batch.doc_ids[:-1] == batch.doc_ids[1:])
        keep = valid & (torch.rand(N - 1, generator=self.generator) < 0.9)
        rows = torch.nonzero(keep).flatten()
        logits = d.compute_logits(normed[0, rows])  # [m, Vd]
        tgt = (batch.final_hidden[rows + 1] @ target_lm_head.T)[:, d.t2d]  # [m, Vd]
        logp = torch.log_softmax(logits.float(), -1)
        p_t = torch.softmax(tgt.float(), -1)
        loss = (p_t * (torch.log(p_t + 1e-12) - logp)).sum(-1).sum() / max(len(rows), 1)
        loss.backward()
        acc = (logits.argmax(-1) == tgt.argmax(-1)).float().mean()
        return {"loss": float(loss.detach()), "acc_d0": float(acc), "num_forward_slots": float(N)}


def make_samples(num: int, seed: int = 0) -> list[dict]:
    """Learnable synthetic rows: final_hidden is a fixed function of aux."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(3 * HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(123)) / math.sqrt(3 * HIDDEN)
    out = []
    for i in range(num):
        n = int(torch.randint(5, 14, (1,), generator=g))
        aux = torch.randn(n, 3 * HIDDEN, generator=g)
        out.append({"sample_id": f"s{i}", "input_ids": torch.randint(0, VOCAB - 3, (n,), generator=g),
                    "loss_mask": torch.ones(n, dtype=torch.bool), "aux": aux, "final_hidden": aux @ proj * 3})
    return out


def make_drafter(draft_vocab_size=None) -> Eagle3Drafter:
    torch.manual_seed(1)
    cfg = DrafterConfig.from_target(tiny_target_config(), num_hidden_layers=1, mask_token_id=MASK_ID,
                                    draft_vocab_size=draft_vocab_size)
    return Eagle3Drafter(cfg)


FIELDS = {"method": "peagle", "num_epochs": 3, "max_steps": None, "lr": 3e-3, "betas": (0.9, 0.95),
          "weight_decay": 0.01, "warmup_steps": 2, "batch_tokens": 24, "grad_clip": 1.0,
          "checkpoint_every_steps": 4, "seed": 0}


def config(*, validate: bool = True, **kw) -> TrainingConfig:
    """The recipe's training section; ``validate=False`` builds it unchecked (to reach the trainer's own checks)."""
    fields = FIELDS | kw
    return TrainingConfig(**fields) if validate else TrainingConfig.model_construct(**fields)


class FailAfterStep(T.TrainCallback):
    """Simulated crash: raises on every rank once the checkpoint of step >= ``step`` is complete."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_checkpoint(self, step: int, metrics: dict) -> None:
        if step >= self.step:
            raise RuntimeError(f"fail_after_step={self.step}: simulated failure at step {step}")


LM_HEAD = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(7))


def train(samples, tmp, **kw):
    cfg = config(**{k: v for k, v in kw.items() if k in FIELDS})
    extra = {k: v for k, v in kw.items() if k not in FIELDS}
    return T.train_in_process(lambda epoch: iter(samples), make_drafter(), LM_HEAD, StandInObjective(), cfg,
                              checkpoint_dir=tmp, device="cpu", log_every_steps=1, pack_fn=pack_samples, **extra)


def test_lr_schedule_shape():
    f = [T.lr_multiplier(s, warmup_steps=4, total_steps=20) for s in range(21)]
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(f[4:]))  # cosine decays monotonically
    assert f[12] == pytest.approx(0.5)  # half-way through the decay
    assert f[20] == pytest.approx(0.0, abs=1e-12)
    assert T.lr_multiplier(30, warmup_steps=4, total_steps=20) == pytest.approx(0.0, abs=1e-12)
    assert T.lr_multiplier(20, warmup_steps=0, total_steps=20, min_lr_ratio=0.1) == pytest.approx(0.1)
    # the scheduler applies it to AdamW's lr
    p = torch.nn.Parameter(torch.zeros(2))
    opt = T.build_optimizer(torch.nn.ParameterList([p]), config(lr=1.0))
    sched = T.build_scheduler(opt, warmup_steps=4, total_steps=20)
    lrs = []
    for _ in range(6):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs == pytest.approx(f[:6])


def test_packing_data_position_and_skip():
    samples = make_samples(20)
    batches = list(T.iter_packed_batches(samples, 24, pack_samples))
    counts = [n for _, n in batches]
    assert sum(counts) == 20
    assert all(b.num_tokens <= 24 for b, _ in batches)
    # resuming after k batches = skipping their samples gives the same remaining batches
    k = 3
    rest = list(T.iter_packed_batches(samples, 24, pack_samples, skip_samples=sum(counts[:k])))
    assert len(rest) == len(batches) - k
    for (a, _), (b, _) in zip(batches[k:], rest):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.doc_ids, b.doc_ids)
    # estimate_steps_per_epoch simulates the same greedy packing
    lengths = [len(s["input_ids"]) for s in samples]
    assert T.estimate_steps_per_epoch(lengths, 24) == len(batches)
    assert T.estimate_steps_per_epoch(lengths, 24, num_workers=2) == len(batches) // 2


def test_loss_decreases_and_checkpoints(tmp_path):
    samples = make_samples(24)
    res = train(samples, tmp_path / "ck", num_epochs=6, checkpoint_every_steps=5, lr=1e-2)
    losses = [h["loss"] for h in res.history]
    assert res.step == len(losses) and res.step > 20
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
    assert all(h["tokens_per_s"] > 0 and h["positions_per_s"] > 0 for h in res.history)
    assert "acc_d0" in res.history[-1] and "lr" in res.history[-1] and "grad_norm" in res.history[-1]
    kept = sorted(p.name for p in (tmp_path / "ck").glob("checkpoint_*"))
    assert len(kept) == 2 and kept[-1] == f"checkpoint_{res.step:08d}"  # num_to_keep=2, final one saved
    for name in (T.MODEL_FILE, T.OPTIMIZER_FILE, T.SCHEDULER_FILE, T.STATE_FILE, "rank_0000.pt"):
        assert (tmp_path / "ck" / kept[-1] / name).is_file()


class Steps(T.TrainCallback):
    """Records the step of each on_step and on_checkpoint call."""

    def __init__(self) -> None:
        self.steps, self.checkpoints = [], []

    def on_step(self, step: int) -> None:
        self.steps.append(step)

    def on_checkpoint(self, step: int, metrics: dict) -> None:
        self.checkpoints.append(step)


def test_callbacks_hear_every_step_not_only_checkpoints(tmp_path):
    seen = Steps()
    res = train(make_samples(14), tmp_path / "ck", max_steps=9, checkpoint_every_steps=4, callbacks=[seen])
    assert seen.steps == list(range(1, res.step + 1)) and seen.checkpoints == [4, 8, 9]


def test_step_reporter_sends_rank_zeros_step_at_most_every_second_and_at_checkpoints(monkeypatch):
    from pipelines.train import progress

    class Queue:
        def __init__(self) -> None:
            self.items = []

        def put_nowait(self, item) -> None:
            self.items.append(item)

    class Context:
        rank = 0

        def get_world_rank(self) -> int:
            return self.rank

    clock, ctx = [1000.0], Context()
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr("ray.train.get_context", lambda: ctx)
    reporter = progress.StepReporter(Queue())
    for step in range(1, 8):  # 0.4 s per step
        reporter.on_step(step)
        clock[0] += 0.4
    reporter.on_checkpoint(7, {})
    assert reporter.queue.items == [1, 4, 7, 7]  # steps 1, 4 (1.2 s later), 7 (1.2 s later), the checkpoint
    ctx.rank = 1
    reporter.on_checkpoint(8, {})
    clock[0] += 5
    reporter.on_step(9)
    assert reporter.queue.items == [1, 4, 7, 7]  # other ranks send nothing


def test_resume_is_exact(tmp_path):
    """A run killed after its step-4 checkpoint and resumed ends bit-identical to an uninterrupted
    run: model, optimizer (AdamW moments), scheduler, data position (mid-epoch) and RNG restored."""
    samples = make_samples(14)  # ~4 batches per epoch: step 4 ends epoch 0 or lands mid epoch 1
    full = train(samples, tmp_path / "a", max_steps=9)
    with pytest.raises(RuntimeError, match="fail_after_step"):
        train(samples, tmp_path / "b", max_steps=9, callbacks=[FailAfterStep(6)], checkpoint_every_steps=3)
    assert T.latest_checkpoint(tmp_path / "b").name == "checkpoint_00000006"
    resumed = train(samples, tmp_path / "b", max_steps=9, checkpoint_every_steps=3)
    assert resumed.resumed_from_step == 6 and resumed.step == full.step == 9
    assert [h["loss"] for h in resumed.history] == pytest.approx([h["loss"] for h in full.history[6:]], rel=1e-6)

    def load(ck):
        d = T.latest_checkpoint(ck)
        from safetensors.torch import load_file

        return (load_file(str(d / T.MODEL_FILE)), torch.load(d / T.OPTIMIZER_FILE, weights_only=True),
                torch.load(d / T.SCHEDULER_FILE, weights_only=True), torch.load(d / "rank_0000.pt", weights_only=True))

    (ma, oa, sa, ra), (mb, ob, sb, rb) = load(tmp_path / "a"), load(tmp_path / "b")
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k], rtol=1e-6, atol=1e-7, msg=k)
    assert T.optimizer_digest(oa) == pytest.approx(T.optimizer_digest(ob), rel=1e-9)
    assert sa["last_epoch"] == sb["last_epoch"] == 9
    assert ra["position"] == rb["position"]


def test_load_checkpoint_restores_optimizer_and_position(tmp_path):
    samples = make_samples(10)
    res = train(samples, tmp_path / "ck", max_steps=3, checkpoint_every_steps=3)
    ck = res.checkpoint
    drafter = make_drafter()
    trainer = T.Trainer(config=config(), model=drafter, objective=StandInObjective(), target_lm_head=LM_HEAD,
                        total_steps=10, pack_fn=pack_samples)
    meta = trainer.load_checkpoint(ck)
    assert meta["step"] == trainer.state.step == 3
    saved = torch.load(ck / T.OPTIMIZER_FILE, weights_only=True)
    assert T.optimizer_digest(trainer.optimizer.state_dict()) == pytest.approx(T.optimizer_digest(saved))
    assert trainer.state.position.samples_consumed > 0
    assert trainer.scheduler.last_epoch == 3
    with pytest.raises(ValueError, match="optimizer.pt is missing"):
        (ck / T.OPTIMIZER_FILE).unlink()
        trainer.load_checkpoint(ck)


def test_target_weights_and_init(tmp_path):
    embed = torch.randn(VOCAB, HIDDEN)
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(HIDDEN)},
              str(tmp_path / "model.safetensors"))
    # tied target: lm_head falls back to embed_tokens
    assert torch.equal(T.load_target_lm_head(tmp_path), embed)
    assert torch.equal(T.load_target_embed(tmp_path), embed)
    head = torch.randn(VOCAB, HIDDEN)
    d2 = tmp_path / "untied"
    d2.mkdir()
    save_file({"model.embed_tokens.weight": embed}, str(d2 / "model-00001-of-00002.safetensors"))
    save_file({"lm_head.weight": head}, str(d2 / "model-00002-of-00002.safetensors"))
    assert torch.equal(T.load_target_lm_head(d2), head)

    counts = torch.arange(VOCAB, dtype=torch.int64)  # the highest ids are the most frequent
    d2t, t2d = vocab_mapping_from_counts(counts, 40, always_keep=[0])
    drafter = make_drafter(draft_vocab_size=40)
    drafter.set_vocab_mapping(d2t, t2d)
    T.init_drafter_from_target(drafter, embed, head)
    assert torch.equal(drafter.embed_tokens.weight, embed)
    assert drafter.embed_tokens.weight.requires_grad
    target_ids = torch.nonzero(t2d).flatten()
    assert torch.equal(drafter.lm_head.weight, head[target_ids])
    assert target_ids[0] == 0 and target_ids[-1] == VOCAB - 1
    with pytest.raises(ValueError, match="vocab_size, hidden_size"):
        T.init_drafter_from_target(drafter, embed[:, :10], head)
    with pytest.raises(ValueError, match="none of the tensors"):
        T.load_target_tensor(tmp_path, ["lm_head.weight"])


def test_count_tokens_assistant_only():
    s = [{"input_ids": torch.tensor([1, 2, 2, 3]), "loss_mask": torch.tensor([0, 1, 1, 0])}]
    c = count_assistant_tokens(s, 5)
    assert c.tolist() == [0, 0, 2, 0, 0]
    assert count_token_ids([s[0]["input_ids"]], 5).tolist() == [0, 1, 2, 1, 0]


def test_bad_config_raises_before_compute():
    with pytest.raises(ValueError, match="set either"):
        T.train_in_process(lambda e: iter([]), make_drafter(), LM_HEAD, StandInObjective(),
                           config(validate=False, num_epochs=0, max_steps=None), pack_fn=pack_samples)
    with pytest.raises(ValueError, match="batch_tokens"):
        T.Trainer(config=config(batch_tokens=1), model=make_drafter(), objective=StandInObjective(),
                  target_lm_head=LM_HEAD, total_steps=5, pack_fn=pack_samples)


def test_plain_path_does_not_import_ray():
    code = ("import sys, pipelines.train as t; assert 'ray' not in sys.modules, 'ray imported'; "
            "assert 'mlflow' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_real_objective_loss_decreases(tmp_path, method):
    """The plain loop with peagle_core's objectives (P-EAGLE K=3, S=2 partitions; EAGLE-3 TTT 3 steps)."""
    from peagle_core.objectives import objective_class

    training = config(method=method, num_epochs=4, lr=1e-2, cod_ratio=0.8, cod_min_ratio=0.3, num_partitions=2,
                      ttt_steps=3, ttt_decay=0.8, loss="kl", attention="dense")
    objective = objective_class(method)(training.objective_config(num_speculative_tokens=3))
    torch.manual_seed(1)
    cfg = DrafterConfig.from_target(tiny_target_config(), num_hidden_layers=1,
                                    mask_token_id=MASK_ID if method == "peagle" else None)
    res = T.train_in_process(lambda e: iter(make_samples(16)), Eagle3Drafter(cfg), LM_HEAD, objective, training,
                             checkpoint_dir=tmp_path, device="cpu", log_every_steps=4, pack_fn=pack_samples)
    losses = [h["loss"] for h in res.history]
    assert losses[-1] < 0.8 * losses[0], losses
    last = res.history[-1]
    assert {"acc_d0", "acc_d1", "acc_d2", "sim_acceptance_length"} <= set(last)
    assert last["positions_per_s"] > 0


def test_run_train_rejects_bad_input_before_any_worker(tmp_path):
    """Config mistakes raise ValueError naming the field when the driver plans the run, before Ray starts
    (no ray.init here)."""
    from transformers import LlamaForCausalLM

    from peagle_core import shards

    LlamaForCausalLM(tiny_target_config()).save_pretrained(tmp_path / "target")
    target = TargetConfig(model=str(tmp_path / "target"))
    spec = DrafterSpec(num_layers=1, num_speculative_tokens=3, mask_token_id=MASK_ID, draft_vocab_size=None)
    with pytest.raises(ValueError, match="parallel_strategy='zero3'"):  # an unchecked copy of the section
        plan_without_data(config().model_copy(update={"parallel_strategy": "zero3"}), spec, target)
    with pytest.raises(ValueError, match="mask_token_id"):
        plan_without_data(config(), spec.model_copy(update={"mask_token_id": None}), target)
    cap = tmp_path / "capture"
    cap.mkdir()
    shards.write_capture_meta(cap, {"aux_layer_ids": [1, 2, 3], "hidden_size": HIDDEN, "vocab_size": VOCAB})
    shards.write_manifest(cap, [{"sample_id": "a", "shard": "s", "offset": 0, "length": 7, "checksum": "x"}])
    with pytest.raises(ValueError, match=r"aux_layer_ids=\[1, 2, 3\]"):  # the default is (2, 2, 2) for 5 layers
        T.plan_from_capture(config(), spec, target, cap)
    assert not (tmp_path / "out").exists()


# -- the planned sample order (pipelines/train/order.py) -------------------------------------------------


def test_epoch_order_is_a_pure_function_of_seed_epoch_rank_world():
    ids = [f"c{i:03d}" for i in range(23)]
    a = T.epoch_order(ids, seed=0, epoch=0, rank=1, world_size=2)
    # pinned: the order may not depend on the process, the library versions or the id list's order
    assert a[:4] == ["c012", "c006", "c009", "c011"], a[:4]
    assert T.epoch_order(reversed(ids), seed=0, epoch=0, rank=1, world_size=2) == a
    assert T.epoch_order(ids, seed=0, epoch=1, rank=1, world_size=2) != a
    assert T.epoch_order(ids, seed=1, epoch=0, rank=1, world_size=2) != a
    for world in (1, 2, 3):
        ranks = [T.epoch_order(ids, seed=0, epoch=2, rank=r, world_size=world) for r in range(world)]
        assert all(len(r) == len(ids) // world for r in ranks)  # equal slices: the n % W rest sits out
        flat = [s for r in ranks for s in r]
        assert len(set(flat)) == len(flat) and set(flat) <= set(ids)
    # each epoch leaves out other samples: over a few epochs every sample is trained
    left_out = set()
    for epoch in range(6):
        left_out |= set(ids) - {s for r in range(2) for s in T.epoch_order(ids, seed=0, epoch=epoch, rank=r,
                                                                           world_size=2)}
    assert len(left_out) > 1
    with pytest.raises(ValueError, match="rank=2"):
        T.epoch_order(ids, seed=0, epoch=0, rank=2, world_size=2)


def test_chain_digest_is_resumable_and_order_sensitive():
    ids = ["a", "b", "c", "d"]
    assert T.chain_digest(ids) == T.chain_digest(ids[2:], start=T.chain_digest(ids[:2]))
    assert T.chain_digest(ids) != T.chain_digest(["b", "a", "c", "d"])
    assert T.chain_digest([]) == ""


@pytest.fixture
def capture_dir(tmp_path):
    """A finished capture of 14 ``make_samples`` rows in 3 shards (manifest and shards as capture writes them)."""
    from peagle_core import shards

    d = tmp_path / "capture"
    samples = [{**s, "input_ids": s["input_ids"].int()} for s in make_samples(14)]  # int32 as capture writes
    rows = []
    for k, lo in enumerate(range(0, 14, 5)):
        rows += shards.write_shard(d / shards.shard_name(k), samples[lo:lo + 5])
    shards.write_manifest(d, rows)
    return d


def test_capture_reader_reads_samples_by_id_and_checks_them(capture_dir):
    from peagle_core import shards

    want = {s["sample_id"]: s for s in shards.iter_samples(capture_dir)}
    reader = T.OrderedCapture(str(capture_dir)).open()
    assert reader.sample_ids == list(want)
    for sid in ("s13", "s0", "s7"):
        got = reader.read(sid)
        assert got["sample_id"] == sid and got["input_ids"].dtype == torch.int64
        torch.testing.assert_close(got["aux"], want[sid]["aux"].float(), rtol=0, atol=0)
        assert torch.equal(got["loss_mask"], want[sid]["loss_mask"])
    samples = T.OrderedCapture.epoch(reader, seed=0, epoch=0, rank=0, world_size=2)
    assert len(samples) == 7 and samples.sample_ids == T.epoch_order(list(want), seed=0, epoch=0, world_size=2)
    assert samples[2:].sample_ids == samples.sample_ids[2:]
    shard = capture_dir / "shard-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF  # a bit flip in the last sample's final_hidden
    shard.write_bytes(bytes(raw))
    with pytest.raises(shards.ShardError, match="checksum mismatch for sample 's9'"):
        T.OrderedCapture(str(capture_dir)).open().read("s9")


class RecordingCapture:
    """``epoch -> OrderedCapture.epoch(...)`` that records the ids it reads (a resume must read none it skips)."""

    def __init__(self, capture_dir) -> None:
        self.reader = T.OrderedCapture(str(capture_dir)).open()
        self.read_ids: list[str] = []
        read = self.reader.read

        def recorded(sid, *a):
            self.read_ids.append(sid)
            return read(sid, *a)

        self.reader.read = recorded

    def __call__(self, epoch: int):
        return T.OrderedCapture.epoch(self.reader, seed=0, epoch=epoch)


def test_ordered_capture_resume_trains_the_same_sample_ids(capture_dir, tmp_path):
    """Killed after its step-5 checkpoint and resumed, a run over a capture trains the same ids in the same
    order per epoch as an uninterrupted one; the resume reads no sample it skips."""
    import json

    def run(ck, data, **kw):
        cfg = config(max_steps=11, checkpoint_every_steps=5, **kw)
        return T.train_in_process(data, make_drafter(), LM_HEAD, StandInObjective(), cfg, checkpoint_dir=ck,
                                  device="cpu", log_every_steps=1, pack_fn=pack_samples)

    full = run(tmp_path / "a", RecordingCapture(capture_dir))
    with pytest.raises(RuntimeError, match="fail_after_step"):
        T.train_in_process(RecordingCapture(capture_dir), make_drafter(), LM_HEAD, StandInObjective(),
                           config(max_steps=11, checkpoint_every_steps=5), checkpoint_dir=tmp_path / "b",
                           device="cpu", log_every_steps=1, pack_fn=pack_samples, callbacks=[FailAfterStep(5)])
    pos = torch.load(T.latest_checkpoint(tmp_path / "b") / "rank_0000.pt", weights_only=True)["position"]
    assert pos["samples_consumed"] > 0  # the kill is mid-epoch
    recording = RecordingCapture(capture_dir)
    resumed = run(tmp_path / "b", recording)
    assert resumed.resumed_from_step == 5 and resumed.step == full.step == 11
    assert [h["loss"] for h in resumed.history] == pytest.approx([h["loss"] for h in full.history[5:]], rel=1e-6)
    files = sorted(p.name for p in (tmp_path / "a" / T.SAMPLE_LOG_DIR).iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b" / T.SAMPLE_LOG_DIR).iterdir()) and len(files) >= 2
    for name in files:
        a, b = (json.loads((tmp_path / x / T.SAMPLE_LOG_DIR / name).read_text()) for x in "ab")
        assert a == b and a["ranks"][0]["sha256"] and a["num_samples"] > 0
    # the digests are of the ids actually trained: the planned order's prefix
    first = json.loads((tmp_path / "a" / T.SAMPLE_LOG_DIR / files[0]).read_text())
    ids = T.epoch_order(recording.reader.sample_ids, seed=0, epoch=0)
    assert first["ranks"][0]["sha256"] == T.chain_digest(ids[:first["num_samples"]])
    # resumed mid-epoch: the first sample read is the first one not trained, nothing before it is read
    planned = T.epoch_order(recording.reader.sample_ids, seed=0, epoch=pos["epoch"])
    assert recording.read_ids[0] == planned[pos["samples_consumed"]]


def test_drafter_layers_start_as_the_target_layer_that_reads_the_deepest_aux_state(tmp_path, tiny_target):
    """drafter.init_layers_from_target: every layer gets target layer max(aux_layer_ids)'s weights (layer 0's
    q/k/v on the hidden half, 0 on the embedding half), fc passes the deepest aux state through, the final norm is
    the target's; a drafter of another width is refused."""
    tiny_target.save_pretrained(tmp_path, safe_serialization=True)
    torch.manual_seed(1)
    drafter = Eagle3Drafter(DrafterConfig.from_target(tiny_target_config(), num_hidden_layers=2, mask_token_id=MASK_ID))
    cfg, sd = drafter.config, tiny_target.state_dict()
    L = max(cfg.aux_layer_ids)
    assert T.init_drafter_layers_from_target(drafter, tmp_path) == L
    for i, dl in enumerate(drafter.layers):
        for name in LAYER_LINEARS:
            w, mine = sd[f"model.layers.{L}.{name}.weight"], dl.get_submodule(name).weight
            if i == 0 and name.endswith(("q_proj", "k_proj", "v_proj")):
                assert torch.equal(mine[:, HIDDEN:], w) and not mine[:, :HIDDEN].any()
            else:
                assert torch.equal(mine, w)
        assert torch.equal(dl.post_attention_layernorm.weight, sd[f"model.layers.{L}.post_attention_layernorm.weight"])
    assert torch.equal(drafter.layers[0].hidden_norm.weight, sd[f"model.layers.{L}.input_layernorm.weight"])
    assert torch.equal(drafter.norm.weight, sd["model.norm.weight"])
    aux = [torch.randn(3, HIDDEN) for _ in cfg.aux_layer_ids]
    assert torch.allclose(drafter.fc(torch.cat(aux, dim=-1)), aux[cfg.aux_layer_ids.index(L)])
    wide = Eagle3Drafter(DrafterConfig.from_target(tiny_target_config(hidden_size=2 * HIDDEN), num_hidden_layers=1,
                                                    mask_token_id=MASK_ID))
    with pytest.raises(ValueError, match="cannot seed|is \\("):
        T.init_drafter_layers_from_target(wide, tmp_path)


def test_mask_hidden_aux_mean_starts_at_the_first_batchs_assistant_aux_mean():
    """training.mask_hidden_init=aux_mean: before the first step, mask_hidden = the mean of the first packed batch's
    aux rows at its assistant tokens (loss_mask); lr ~0 leaves it there. Without the field it stays N(0, 0.02)."""
    samples = make_samples(6)
    for s in samples:  # the aux rows outside the loss mask must not count
        s["loss_mask"][:2] = False
        s["aux"][:2] = 1e3
    first = pack_samples(samples, FIELDS["batch_tokens"])[0]
    want = first.aux[first.loss_mask].mean(0)
    steps = {}
    for init in ("aux_mean", None):
        drafter = make_drafter()
        before = drafter.mask_hidden.detach().clone()
        T.train_in_process(lambda e: iter(samples), drafter, LM_HEAD, StandInObjective(),
                           config(lr=1e-12, warmup_steps=0, max_steps=1, mask_hidden_init=init), device="cpu",
                           pack_fn=pack_samples)
        steps[init] = (before, drafter.mask_hidden.detach())
    assert torch.allclose(steps["aux_mean"][1], want, atol=1e-5), (steps["aux_mean"][1][:4], want[:4])
    assert torch.allclose(steps[None][1], steps[None][0], atol=1e-6) and steps[None][1].norm() < 0.1 * want.norm()


def test_mask_hidden_init_refused_where_there_is_no_mask_hidden_to_set():
    with pytest.raises(ValueError, match="method 'eagle3' has none"):
        config(method="eagle3", mask_hidden_init="aux_mean")
    with pytest.raises(ValueError, match="brings its own mask_hidden"):
        config(mask_hidden_init="aux_mean", init_from="models:/head@champion")
    with pytest.raises(ValueError, match="EAGLE-3 head"):
        Eagle3Drafter(DrafterConfig.from_target(tiny_target_config(), num_hidden_layers=1)).set_mask_hidden_(
            torch.zeros(3 * HIDDEN))
    with pytest.raises(ValueError, match="expected"):
        make_drafter().set_mask_hidden_(torch.zeros(HIDDEN))
