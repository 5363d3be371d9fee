"""A checkpoint returned in parts (``bench.scale_train.return_checkpoint``, ``pipelines.train.compact``) and
unpacked on another machine (another directory: ``restore_checkpoint``) resumes the run: the full form
bit-exactly, the default compact form within ``COMPACT_RTOL``; forms that lose (part of) the optimizer state
fail these checks (so they can fail)."""

import math

import pytest
import torch

from bench import scale_train
from peagle_core.batch import pack_samples
from peagle_core.drafter import Eagle3Drafter
from peagle_core.drafter_config import DrafterConfig
from peagle_core.objectives import objective_class
from pipelines import train as T
from pipelines.recipe import TrainingConfig
from pipelines.train.compact import compact_checkpoint

from .conftest import HIDDEN, MASK_ID, VOCAB, tiny_target_config

pytestmark = pytest.mark.unit

STEPS, STOP = 8, 4
# the default form (bf16 weights and exp_avg, factored exp_avg_sq) here: <= 0.13 % over the 4 steps after the resume;
# without exp_avg (bf16-weights-bf16-v) 1 %, without any moment (fp32-weights) 2.4 %
COMPACT_RTOL = 3e-3
TRAINING = TrainingConfig(method="peagle", max_steps=STEPS, num_epochs=100, lr=3e-3, warmup_steps=2, batch_tokens=40,
                          checkpoint_every_steps=STOP, cod_ratio=0.8, cod_min_ratio=0.3, loss="kl",
                          attention="dense", seed=0)
LM_HEAD = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(7))


def samples(num: int = 12) -> list[dict]:
    """Learnable captured samples: final_hidden a fixed function of aux."""
    g = torch.Generator().manual_seed(0)
    proj = torch.randn(3 * HIDDEN, HIDDEN, generator=g) / math.sqrt(3 * HIDDEN)
    out = []
    for i in range(num):
        n = int(torch.randint(6, 14, (1,), generator=g))
        aux = torch.randn(n, 3 * HIDDEN, generator=g)
        out.append({"sample_id": f"s{i}", "input_ids": torch.randint(0, VOCAB - 3, (n,), generator=g),
                    "loss_mask": torch.ones(n, dtype=torch.bool), "aux": aux, "final_hidden": aux @ proj * 3})
    return out


class StopAt(T.TrainCallback):
    def on_checkpoint(self, step: int, metrics: dict) -> None:
        if step >= STOP:
            raise RuntimeError(f"stopped at {step}")


def run(ckpt, **kw) -> list[float]:
    """The product's trainer on a fresh drafter (embeddings frozen, as the scaling heads); losses per step."""
    torch.manual_seed(1)
    drafter = Eagle3Drafter(DrafterConfig.from_target(tiny_target_config(), num_hidden_layers=1,
                                                      mask_token_id=MASK_ID))
    drafter.embed_tokens.weight.requires_grad_(False)
    objective = objective_class("peagle")(TRAINING.objective_config(num_speculative_tokens=3))
    data = samples()
    res = T.train_in_process(lambda e: data, drafter, LM_HEAD, objective, TRAINING, checkpoint_dir=ckpt,
                             device="cpu", log_every_steps=1, pack_fn=pack_samples, **kw)
    return [h["loss"] for h in res.history]


@pytest.fixture(scope="module")
def runs(module_mktemp):
    """``(losses of the uninterrupted run, checkpoint root of the run stopped at step STOP)``."""
    root = module_mktemp("runs")
    full = run(root / "full")
    with pytest.raises(RuntimeError, match="stopped at"):
        run(root / "stopped", callbacks=[StopAt()])
    return full, root / "stopped"


def resume_from_parts(stopped, tmp_path, monkeypatch, form: str) -> list[float]:
    """Return the checkpoint in ``form`` as several parts, restore them into another keep dir, resume there."""
    monkeypatch.setattr(scale_train, "PART_BYTES", 32 * 1024)  # several parts even for a tiny head
    parts = scale_train.return_checkpoint(stopped, tmp_path / "out", "t", form)
    assert len(parts) > 1 and all(p.stat().st_size <= 32 * 1024 for p in parts)
    (tmp_path / "out" / "scale_train_t.json").write_text('{"calls": [{}]}')
    keep = tmp_path / "new-machine"
    assert scale_train.restore_checkpoint([tmp_path / "out"], keep, "t") == STOP
    assert (keep / "scale_train_t.json").is_file()
    return run(keep / "ckpt-t")


def test_full_form_resumes_exactly(runs, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    full, stopped = runs
    # the checkpoint leaves the frozen embeddings out; the resumed run builds them as the first run did
    assert "embed_tokens.weight" not in load_file(str(T.latest_checkpoint(stopped) / T.MODEL_FILE))
    assert resume_from_parts(stopped, tmp_path, monkeypatch, "full") == pytest.approx(full[STOP:], rel=1e-6)


def test_default_form_resumes_within_tolerance(runs, tmp_path, monkeypatch):
    full, stopped = runs
    got = resume_from_parts(stopped, tmp_path, monkeypatch, scale_train.DEFAULT_FORM)
    assert got == pytest.approx(full[STOP:], rel=COMPACT_RTOL)


def test_dropped_optimizer_state_is_detected(runs, tmp_path, monkeypatch):
    """Without AdamW's moments the first resumed step is the same (same weights), the next ones are not: the
    exact comparison above would fail if the full form lost the optimizer state, and the tolerance of the
    compact one if it lost ``exp_avg``."""
    full, stopped = runs
    got = resume_from_parts(stopped, tmp_path / "a", monkeypatch, "fp32-weights")
    assert got[0] == pytest.approx(full[STOP], rel=1e-6)
    assert got[1:] != pytest.approx(full[STOP + 1:], rel=1e-4)
    got = resume_from_parts(stopped, tmp_path / "b", monkeypatch, "bf16-weights-bf16-v")
    assert got != pytest.approx(full[STOP:], rel=COMPACT_RTOL)


def test_restore_keeps_a_newer_checkpoint_and_checks_parts(runs, tmp_path, monkeypatch):
    _, stopped = runs
    monkeypatch.setattr(scale_train, "PART_BYTES", 32 * 1024)
    parts = scale_train.return_checkpoint(stopped, tmp_path / "out", "t", "full")
    keep = tmp_path / "warm-machine"
    (keep / "ckpt-t").mkdir(parents=True)
    newer = T.latest_checkpoint(stopped)
    compact_checkpoint(newer, keep / "ckpt-t" / "checkpoint_00000006", "full")  # a later step already here
    state = keep / "ckpt-t" / "checkpoint_00000006" / T.STATE_FILE
    state.write_text(state.read_text().replace(f'"step": {STOP}', '"step": 6'))
    assert scale_train.restore_checkpoint([tmp_path / "out"], keep, "t") is None
    assert T.latest_checkpoint(keep / "ckpt-t").name == "checkpoint_00000006"
    parts[1].unlink()
    with pytest.raises(ValueError, match="expected .part00"):
        scale_train.restore_checkpoint([tmp_path / "out"], tmp_path / "other", "t")


def test_checkpoint_that_lacks_a_trainable_weight_is_refused(runs, tmp_path):
    _, stopped = runs
    d = compact_checkpoint(T.latest_checkpoint(stopped), tmp_path / "c" / "checkpoint_00000004", "trainable")
    with pytest.raises(ValueError, match="form 'nope'"):
        compact_checkpoint(d, tmp_path / "x", "nope")
    from safetensors.torch import load_file, save_file

    state = load_file(str(d / T.MODEL_FILE))
    assert "embed_tokens.weight" not in state  # frozen: rebuilt by the resuming run
    del state["fc.weight"]
    save_file(state, str(d / T.MODEL_FILE))
    with pytest.raises(ValueError, match="fc.weight"):
        run(tmp_path / "c")


def test_parts_over_one_return_are_held_back(tmp_path, monkeypatch):
    """A call returns <= RETURN_PARTS files and <= RETURN_BYTES together, or none of the files over: the parts
    past that stay in <keep>/return-rest for `run_scale.sh rest`, the first ones whole; return_groups (whose
    length bench.resume_state reports as calls) groups them the same way."""
    monkeypatch.setattr(scale_train, "RETURN_PARTS", 3)
    monkeypatch.setattr(scale_train, "RETURN_BYTES", 100)
    out, keep = tmp_path / "out", tmp_path / "keep"
    out.mkdir()
    parts = []
    for i, size in enumerate([40, 40, 40, 10, 10]):
        parts.append(out / f"ckpt-x.tar.part{i:02d}")
        parts[-1].write_bytes(b"x" * size)
    moved = scale_train.hold_back(parts, keep)
    assert sorted(p.name for p in out.iterdir()) == ["ckpt-x.tar.part00", "ckpt-x.tar.part01"]  # 80 <= 100
    assert [p.name for p in moved] == [f"ckpt-x.tar.part0{i}" for i in (2, 3, 4)]
    assert sorted(p.name for p in (keep / scale_train.REST_DIR / "1").iterdir()) == [p.name for p in moved]
    assert len(scale_train.return_groups([40, 40, 40, 10, 10])) == 2
    assert len(scale_train.return_groups([10] * 7)) == 3  # 3 files a call
    assert scale_train.hold_back(parts[:2], keep) == [] and not (keep / scale_train.REST_DIR).exists()
    # parts for 3 calls: one folder per later call, in order (run_scale.sh rest returns the lowest-numbered one)
    many = []
    for i in range(8):
        many.append(out / f"ckpt-y.tar.part{i:02d}")
        many[-1].write_bytes(b"y" * 10)
    scale_train.hold_back(many, keep)
    rest = keep / scale_train.REST_DIR
    assert sorted(d.name for d in rest.iterdir()) == ["1", "2"]
    assert [sorted(p.name for p in (rest / d).iterdir()) for d in ("1", "2")] == [
        [f"ckpt-y.tar.part0{i}" for i in (3, 4, 5)], [f"ckpt-y.tar.part0{i}" for i in (6, 7)]]


def test_a_part_carried_twice_is_one_part(runs, tmp_path, monkeypatch):
    """A new machine that kept parts 00-02 in ~/keep and is carried parts 03-05 twice (once kept, once in the
    checkout) restores; a part of another checkpoint under the same name is refused."""
    _, stopped = runs
    monkeypatch.setattr(scale_train, "PART_BYTES", 32 * 1024)
    parts = scale_train.return_checkpoint(stopped, tmp_path / "out", "t", "full")
    again = tmp_path / "again"
    again.mkdir()
    for p in parts[1:]:
        (again / p.name).write_bytes(p.read_bytes())
    assert scale_train.restore_checkpoint([tmp_path / "out", again], tmp_path / "keep", "t") == STOP
    (again / parts[-1].name).write_bytes(b"x" + parts[-1].read_bytes()[1:])
    with pytest.raises(ValueError, match="parts of two checkpoints"):
        scale_train.restore_checkpoint([tmp_path / "out", again], tmp_path / "keep2", "t")
