"""peagle side by side with speculators (vllm-project/speculators, PyPI 0.9.0; issue 26 item 5): speculators'
own EAGLE-3 and P-EAGLE trainers on the same conversations, target, GPU kind and GPU-seconds as
``bench.scale``'s heads, their heads evaluated by the same evaluate stage after the same contract check.

speculators' trainer reads, per conversation ``i`` of a ``datasets`` dataset on disk (``input_ids``, ``loss_mask``,
``seq_len``), a hidden-state sample ``{"hidden_states": [N, 4, Ht], "token_ids": [N]}`` through an
``hs_connectors`` transfer (``get_cached(i)``; the ``file`` backend reads ``hidden_states/hs_<i>.safetensors``).
Layers 0-2 are the aux layers (vLLM ids: input of layer i, as peagle's ``aux``), layer 3 the target's last layer
BEFORE its final norm (speculators applies the target norm itself, ``verifier_norm``). peagle's capture stores
the last layer AFTER the norm (``final_hidden = h / rms(h) * w``), so the conversion divides by the norm weight:
RMSNorm is scale-invariant, ``norm(final_hidden / w) = final_hidden`` up to eps and rounding
(:func:`bench.speculators_data.speculators_sample`). Nothing else changes: same token ids, loss mask, aux tensors and dtype.

The 99k set's hidden states would be ~200 GB on disk (43M tokens after 1024-token truncation x 4 x 576 x 2 B): more
than the GPU machine's 64 GiB. So on the GPU the trainer is fed online, like peagle's own runs: :class:`bench.speculators_data.CaptureTransfer` is a transfer
(registered as speculators backend ``peagle-capture``) that runs peagle's capture (``capture_tokenized``, the
target on the GPU) for the sample asked for, in speculators' data-loader workers. ``data --hidden-states files``
writes the ``file`` backend's files instead (small sets, tests).

    python -m bench.speculators_side data --keep ~/keep --size 99000 --out ~/keep/spec-data      # tokens, d2t/t2d
    python -m bench.speculators_side train --method peagle --data ~/keep/spec-data --train-s 300 --out ~/keep
    python -m bench.speculators_side check ~/keep/spec-peagle/final --out ~/keep/head-spec-peagle-99k-300s
    python -m bench.speculators_side record DIR/r/spec_train_spec-peagle-99k-300s.json --gpu DIR/r/spec_gpu_peagle.jsonl

``train``: speculators' ``train`` command (``speculators.train.cli.main``) with the recipe of :data:`RECIPE` and
the draft vocabulary of peagle's plan; a calibration run measures its seconds per step after warm-up, then the run
trains ``train_s / s_per_step`` steps (its schedule's horizon), over one or more calls (``--calib-only``,
``--resume``). It writes ``spec_train_<tag>.json`` (tokens/s, peak memory, steps, speculators' last training and
validation metrics). ``check``: the head speculators saved -> a peagle head
directory (flat ``config.json`` as vLLM's speculators config loader derives it, the same tensors) validated by
``peagle_core.contract.validate_head`` against the target, ready for ``bench.eval_gpu_heads``.

Two arms (``train --recipe``, issue 42 item 3): ``defaults`` (:data:`RECIPE`) and ``best`` (:data:`RECIPE_BEST`),
the maintainers' own settings as read on 2026-11-29 (vllm-project/speculators at 2026-08-20 and later files, its
issues and PRs, RedHatAI's heads). The best arm differs from the defaults arm in:

- P-EAGLE: lr 6e-4 for both optimizer groups (defaults 1e-3), cosine with speculators' 1% warm-up (not 50 steps),
  ``--no-norm-before-residual`` (speculators' default norms before the residual), ``--max-anchors 4096``
  (defaults 512). Sources: docs/user_guide/tutorials/train.md, examples/train/peagle_qwen3_8b_*_5k.sh, the nightly
  test_peagle_qwen3_8b_sharegpt (2026-08-19), the card of RedHatAI/Qwen3-8B-speculator.peagle (lr); anchors:
  issue 567 (2026-06-29: 1024 anchors per 4096-token step best at depth 0, 512 starved depth 7), PR 687, PR 995.
- EAGLE-3: linear schedule with 1% warm-up (every EAGLE-3 example leaves speculators' default) and TTT loss decay
  1.0 (speculators' default) instead of peagle's cosine / 50 / 0.8. Its lr (muon and AdamW 1e-3: PR 746, PR 1148
  of 2026-09-18), kl_div (docs/user_guide/loss_functions.md: "best-tested"), the Eagle 3.1 norms (PR 610: +7.2%
  AL on Qwen3-8B; PR 692 made them the eagle3 defaults) and Llama layers (PR 692, after issue 563) are already
  speculators' 0.9.0 defaults: passed explicitly, so the arm does not move with them.
- Both: COD 0.7 / 0.2, muon, kl_div, frozen embeddings as in the defaults arm.

Kept at peagle's structure, against the maintainers' choice where it differs: K=8 depths (their examples use 4,
0.9.0's default is 8), TTT 7 steps (default 3), draft vocabulary 8192 of 49152 (32000 of Qwen3's 151936 in their
examples), peagle's aux layers, 1024-token conversations in 16384-token steps (their total-seq-len 4096-8192), the
same conversations and GPU-seconds: they train ~500k regenerated samples for 2-3 epochs (issue 751), a data
amount and epoch count this comparison fixes by design. Not adopted: ``--fc-norm`` (PR 670: +1.1% on
Qwen3-30B-A3B, left off by default in PR 692) and ``--draft-arch qwen3`` (issue 563: +3-7% for Eagle 3, below
Eagle 3.1 on Llama layers in PR 610).

Shape legend: N tokens of one conversation, Ht target hidden, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from bench.speculators_data import BACKEND, SIDE_FILE, register_backend, write_data
from bench.speculators_heads import SPEC_TYPES, peagle_head

SPECULATORS_VERSION = "0.9.0"

# speculators' flags per recipe and method. Both recipes keep the structure of bench.scale's heads (STRUCTURE: layers,
# K, TTT steps; COMMON_FLAGS: 16384 packed tokens per step of 1024-token conversations; spec_argv: the plan's aux
# layers, mask token and 8192-token draft vocabulary; `train --frozen-embeddings`: the target's embeddings).
# --loss-implementation eager: its fused Triton loss does not trace under the image's torch 2.11 (dynamo's
# "ListVariable(length=21) is already tracked for mutation" on loss_forward_kernel/loss_backward_kernel.configs,
# the first GPU call of 2026-11-25); the eager loss is the same objective.
COMMON_FLAGS = ("--epochs", "1", "--total-seq-len", "16384", "--train-data-ratio", "0.999", "--on-missing", "raise",
                "--hidden-states-dtype", "bfloat16", "--log-freq", "10", "--loss-implementation", "eager")
STRUCTURE = {"peagle": ("--num-layers", "4", "--draft-arch", "llama", "--num-depths", "8"),
             "eagle3": ("--num-layers", "1", "--draft-arch", "llama", "--ttt-steps", "7")}
# defaults: optimizer, loss, COD ratios, anchors cap and norm flags at speculators' defaults (muon lr 1e-3, kl_div,
# r 0.7 / 0.2, max_anchors 512; eagle3: norm_before_fc, norm_output; peagle: neither); schedule and EAGLE-3's TTT
# loss decay as peagle's (cosine, 50 warm-up steps; 0.8^i).
RECIPE = {"peagle": (*STRUCTURE["peagle"], "--scheduler-type", "cosine", "--scheduler-warmup-steps", "50"),
          "eagle3": (*STRUCTURE["eagle3"], "--ttt-step-loss-decay", "0.8", "--scheduler-type", "cosine",
                     "--scheduler-warmup-steps", "50")}
# best: the maintainers' own recipe per method, as their docs, examples, nightly regression tests, published heads
# and issues give it (read 2026-11-29; the module docstring lists the sources). BEST_PINNED: the parts of it that
# restate 0.9.0's defaults, passed anyway so the arm does not move with speculators' defaults (their D-PACE
# best-practices script does the same). Warm-up is left at speculators' default (1% of --max-steps, the horizon).
BEST_PINNED = {"peagle": ("--optimizer", "muon", "--down-sample-ratio", "0.7", "--down-sample-ratio-min", "0.2",
                          "--loss-fn", "kl_div"),
               "eagle3": ("--optimizer", "muon", "--lr", "1e-3", "--norm-before-residual", "--norm-before-fc",
                          "--norm-output", "--loss-fn", "kl_div")}
RECIPE_BEST = {
    # docs/user_guide/tutorials/train.md (P-EAGLE tab), examples/train/peagle_qwen3_8b_*_5k.sh (the 0.9-era `-m
    # speculators.train` one too), tests/e2e/regression test_peagle_qwen3_8b_sharegpt: lr 6e-4 (in 0.9.0 muon_lr = lr:
    # both groups), cosine, --no-norm-before-residual, COD 0.7 / 0.2; the card of RedHatAI/Qwen3-8B-speculator.peagle
    # shows lr 6e-4 (the rest of its command was cut off). max_anchors: issue 567 (2026-06-29) found 1024 anchors per
    # 4096-token step best at depth 0 (+3.1 pp over no cap, deep depths lower; 512 starved depth 7), PR 687 then left
    # P-EAGLE uncapped; 0.9.0's 512 came from PR 995 (step time, DFlash). 1024 per 4096 tokens is 4096 per this run's
    # 16384.
    "peagle": (*STRUCTURE["peagle"], "--lr", "6e-4", "--scheduler-type", "cosine", "--no-norm-before-residual",
               "--max-anchors", "4096", *BEST_PINNED["peagle"]),
    # Eagle 3.1 norms (PR 610: +7.2% AL for Qwen3-8B over Eagle 3; PR 692 made them eagle3's defaults), muon at
    # lr 1e-3 for both groups (PR 746; PR 1148, 2026-09-18: AdamW's 1e-4 "regularly too small"), kl_div (docs
    # loss_functions.md: "the best-tested option"), linear schedule (every EAGLE-3 example and regression test
    # leaves speculators' default), TTT loss decay 1.0 (speculators' default; no example changes it).
    "eagle3": (*STRUCTURE["eagle3"], "--scheduler-type", "linear", "--ttt-step-loss-decay", "1.0",
               *BEST_PINNED["eagle3"]),
}
RECIPES = {"defaults": RECIPE, "best": RECIPE_BEST}


def flag_values(flags: tuple[str, ...]) -> dict[str, str | None]:
    """``{flag: value}`` of a flag tuple (None for a switch such as ``--norm-output``), the last occurrence."""
    out: dict[str, str | None] = {}
    for i, tok in enumerate(flags):
        if tok.startswith("--"):
            nxt = flags[i + 1] if i + 1 < len(flags) else "--"
            out[tok] = None if nxt.startswith("--") else nxt
    return out


def best_differs(method: str) -> list[str]:
    """Where the best arm's flags for ``method`` differ from the defaults arm's: each flag of :data:`RECIPE_BEST`
    outside :data:`BEST_PINNED` that the defaults arm does not pass with the same value (``--lr 6e-4``,
    ``--no-norm-before-residual``), and ``--flag: default`` for a flag the defaults arm passes and the best arm
    leaves at speculators' default."""
    pinned = flag_values(BEST_PINNED[method])
    best, defaults = flag_values(RECIPE_BEST[method]), flag_values(RECIPE[method])
    out = [k if v is None else f"{k} {v}" for k, v in best.items()
           if k not in pinned and (k not in defaults or defaults[k] != v)]
    return out + [f"{k}: default" for k in defaults if k not in best]
CKPT_EVERY_STEPS = 100  # the run's mid-epoch checkpoints (bench.scale_train: training.checkpoint_every_steps=100)
SHAPE_FLAGS = ("--num-layers", "--draft-arch")  # what --from-pretrained (a config-only directory) replaces
CPU_FLAGS = ("--draft-attn-impl", "sdpa", "--hidden-states-dtype", "float32", "--num-workers", "0")


# ----------------------------------------------------------------------------------------------
# train: speculators' trainer, time-boxed as bench.scale's heads


@contextmanager
def cpu_shims():
    """speculators' trainer is accelerator-only: it moves the model to ``get_local_rank()`` (an int: cuda:N), its
    step timer calls ``torch.accelerator.synchronize()`` and a resume loads the checkpoint onto
    ``get_current_device()`` ("cuda:0" without an accelerator). Without an accelerator (tests on this CPU box) the
    three are patched for the duration: the model and checkpoints stay on the CPU, the timer's syncs are no-ops.
    A no-op with CUDA."""
    if torch.accelerator.is_available():
        yield
        return
    import speculators.train.checkpointer as ckpt_mod
    import speculators.train.trainer as trainer_mod

    saved = trainer_mod.get_local_rank, ckpt_mod.get_current_device, torch.accelerator.synchronize
    trainer_mod.get_local_rank = ckpt_mod.get_current_device = lambda: "cpu"
    torch.accelerator.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        trainer_mod.get_local_rank, ckpt_mod.get_current_device, torch.accelerator.synchronize = saved


class MetricsRecorder(logging.Handler):
    """Collects speculators' metric records (logger ``speculators.metrics``, every ``--log-freq`` steps): the wall
    time of each, its step, training metrics and step profile (tokens of the packed batch, accelerator memory)."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.rows: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if isinstance(msg, dict) and "global_step" in msg:
            prof = msg.get("profile") or {}
            self.rows.append({"t": time.perf_counter(), "step": msg["global_step"], "train": msg.get("train", {}),
                              "tokens": (prof.get("tokens_per_s", 0) * prof.get("step_ms", 0) / 1000) or None,
                              "memory_mb": prof.get("memory_mb")})
        elif isinstance(msg, dict) and "val" in msg:
            self.rows.append({"t": time.perf_counter(), "val": msg["val"]})


def drop_flags(flags: tuple[str, ...], names: tuple[str, ...]) -> list[str]:
    """``flags`` without the flags in ``names`` and their values (the tokens up to the next ``--flag``)."""
    out, skip = [], False
    for tok in flags:
        if tok.startswith("--"):
            skip = tok in names
        if not skip:
            out.append(tok)
    return out


def spec_argv(method: str, data: Path, side: dict, save: Path, *, max_steps: int, init: Path | None = None,
              extra: tuple[str, ...] = (), resume: bool = False, recipe: str = "defaults") -> list[str]:
    """speculators ``train`` flags for ``method`` on the data directory ``data`` (:data:`COMMON_FLAGS`, the
    ``recipe`` of :data:`RECIPES`, the data's target, aux ids, mask token and draft vocabulary; :data:`CPU_FLAGS`
    without CUDA), from the config-only directory ``init`` when given (its decoder shape replaces the shaping
    flags); ``resume``: from the last checkpoint under ``save`` (else speculators is told not to).

    Raises:
        ValueError: ``recipe`` is not one of :data:`RECIPES`.
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: use one of {sorted(RECIPES)}")
    vd = side["draft_vocab_size"]
    argv = ["--speculator-type", SPEC_TYPES[method], "--verifier-name-or-path", side["target_dir"],
            "--data-path", str(data), "--hidden-states-backend", BACKEND if side["hidden_states"] == "online" else
            "file", "--save-path", str(save), "--max-steps", str(max_steps),
            "--target-layer-ids", *map(str, side["aux_layer_ids"]), "--mask-token-id", str(side["mask_token_id"]),
            "--num-workers", "4", "--prefetch-factor", "4", *COMMON_FLAGS,
            *(() if resume else ("--no-resume-from-checkpoint",))]
    if (data / f"d2t-{vd}.npy").exists():
        argv += ["--d2t-path", str(data / f"d2t-{vd}.npy"), "--t2d-path", str(data / f"t2d-{vd}.npy")]
    flags = RECIPES[recipe][method]
    if init is not None:  # --from-pretrained excludes the decoder-shaping flags
        flags = drop_flags(flags, SHAPE_FLAGS)
        argv += ["--from-pretrained", str(init)]
    argv += list(flags)
    if not torch.cuda.is_available():
        argv += list(CPU_FLAGS)
    return argv + list(extra)


def run_speculators(argv: list[str]) -> MetricsRecorder:
    """``speculators train`` with ``argv`` in this process (:data:`BACKEND` registered, :func:`cpu_shims`), its
    metric records collected."""
    from speculators.train import cli
    from speculators.train.config import TrainConfig

    register_backend()
    rec, setup = MetricsRecorder(), cli.setup_metric_logger

    def setup_and_record(*args, **kwargs):  # its dictConfig drops handlers added before: add ours after it
        setup(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(rec)

    cli.setup_metric_logger = setup_and_record
    try:
        with cpu_shims():
            cli.main(TrainConfig.resolve(argv))
    finally:
        cli.setup_metric_logger = setup
        logging.getLogger("speculators.metrics").removeHandler(rec)
    return rec


def frozen_embeddings_init(method: str, data: Path, side: dict, out: Path, extra: tuple[str, ...] = (),
                           recipe: str = "defaults") -> Path:
    """A config-only directory (``--from-pretrained``) of ``method``'s head with ``embed_requires_grad: false``:
    speculators' P-EAGLE config always trains the embeddings (its ``from_training_args`` ignores
    ``--no-embed-requires-grad``); bench.scale's heads keep the target's. Made by ``--dry-run`` (config and
    initial weights; the recipe's norm flags included), then the weights removed."""
    run_speculators(spec_argv(method, data, side, out, max_steps=1, extra=("--dry-run", *extra), recipe=recipe))
    cfg = json.loads((out / "config.json").read_text())
    cfg["embed_requires_grad"] = False
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in out.glob("*.safetensors"):
        f.unlink()
    return out


def step_stats(rec: MetricsRecorder, *, warmup_steps: int) -> dict:
    """Seconds per step, tokens per step and per second between the first logged step at or after
    ``warmup_steps`` and the last (the logged steps' packed tokens, averaged: speculators profiles only logged
    steps), the last training metrics, the highest accelerator memory a logged step saw."""
    steps = [r for r in rec.rows if "step" in r]
    timed = [r for r in steps if r["step"] >= warmup_steps] or steps[-1:]
    first, last = timed[0], steps[-1]
    span_steps, span_s = last["step"] - first["step"], last["t"] - first["t"]
    tokens = [r["tokens"] for r in steps if r["tokens"]]
    tok_per_step = float(np.mean(tokens)) if tokens else None
    s_per_step = span_s / span_steps if span_steps else None
    mem = [max(r["memory_mb"].values()) for r in steps if r.get("memory_mb")]
    return {"timed_steps": span_steps, "timed_s": span_s, "s_per_step": s_per_step, "tokens_per_step": tok_per_step,
            "tokens_per_s": tok_per_step / s_per_step if tok_per_step and s_per_step else None,
            "last_step": last["step"] + 1, "final": last["train"],
            "logged_peak_mem_gib": max(mem) / 1024 if mem else None,
            "val": next((r["val"] for r in reversed(rec.rows) if "val" in r), None)}


def steps_per_epoch(data: Path, argv: list[str]) -> int:
    """Training batches of one epoch as speculators packs them: its sampler
    (``MultipackDistributedBatchSamplerV2``, one replica) over the training split's ``seq_len`` with the
    ``--total-seq-len`` and ``--train-data-ratio`` of ``argv`` (the last occurrence, as argparse keeps)."""
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    def flag(name: str) -> str:
        return argv[len(argv) - argv[::-1].index(name)]

    lengths = list(load_from_disk(str(data)).with_format(None)["seq_len"])
    lengths = lengths[: int(len(lengths) * float(flag("--train-data-ratio")))]
    return len(MultipackDistributedBatchSamplerV2(batch_max_length=int(flag("--total-seq-len")), lengths=lengths,
                                                  num_replicas=1, rank=0, seed=0))


def _checkpoints(run_dir: Path) -> list[Path]:
    """speculators' checkpoint directories under ``run_dir`` (named by epoch), oldest first."""
    if not run_dir.is_dir():
        return []
    return sorted((p for p in run_dir.iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit()),
                  key=lambda p: int(p.name))


def calibrate(args, data: Path, side: dict, root: Path, extra: tuple[str, ...]) -> dict:
    """The config-only init (``--frozen-embeddings``), a calibration run of ``--warmup-steps`` +
    ``--calib-steps`` steps, the horizon ``train_s / s_per_step`` and the steps of one epoch: the run's state."""
    shutil.rmtree(root, ignore_errors=True)
    init = (frozen_embeddings_init(args.method, data, side, root / "init", extra, recipe=args.recipe)
            if args.frozen_embeddings else None)
    t0 = time.perf_counter()
    calib = step_stats(run_speculators(spec_argv(args.method, data, side, root / "calib", init=init,
                                                 max_steps=args.warmup_steps + args.calib_steps, extra=extra,
                                                 recipe=args.recipe)),
                       warmup_steps=args.warmup_steps)
    if args.max_steps is None and not calib["s_per_step"]:
        raise SystemExit("the calibration timed no step: --calib-steps must span two logged steps after warm-up "
                         "(speculators logs every --log-freq steps, 10 here)")
    horizon = args.max_steps or max(1, int(args.train_s / calib["s_per_step"]))
    per_epoch = steps_per_epoch(data, spec_argv(args.method, data, side, root / "run", max_steps=horizon, extra=extra,
                                                recipe=args.recipe))
    return {"init": str(init) if init else None, "calib": calib | {"wall_s": time.perf_counter() - t0},
            "horizon": horizon, "steps_per_epoch": per_epoch, "calls": []}


def train(args) -> None:
    """speculators' trainer on ``--data`` for ``--train-s`` GPU-seconds after warm-up, in one or more calls.

    The first call (alone with ``--calib-only``) makes ``<out>/spec-<method>/`` (``spec-<method>-best/`` for
    ``--recipe best``): the config-only init, a calibration run for the seconds per step after warm-up,
    ``state.json`` (the horizon ``train_s / s_per_step``: speculators' schedule decays over ``--max-steps``; the
    epochs it needs). A later call with the same data, ``--train-s`` and
    flags reuses them. The run checkpoints every ``--ckpt-every-steps`` steps; a call cut short (the device's
    time limit: ``timeout`` sends SIGTERM, speculators saves an unresumable ``interrupted`` copy) leaves them, and
    ``--resume`` continues from the last (speculators' mid-epoch resume: same batches, schedule and optimizer).
    Each call's timing is a row of the state's ``calls``; when the run reaches its horizon the head is copied to
    ``final/`` beside it and the record written to ``<out>/spec_train_<tag>.json``.
    """
    from bench.common import environment

    data, out = Path(args.data).expanduser(), Path(args.out).expanduser()
    side = json.loads((data / SIDE_FILE).read_text())
    arm = f"spec-{args.method}" + ("" if args.recipe == "defaults" else f"-{args.recipe}")
    tag = f"{arm}-{side['num_conversations'] // 1000}k-{int(args.train_s)}s"
    root, extra = out / arm, tuple(args.spec_args or ())
    key = {"data": str(data), "conversations": side["num_conversations"], "train_s": args.train_s,
           "max_steps": args.max_steps, "frozen_embeddings": args.frozen_embeddings, "extra": list(extra)}
    state_path = root / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else None
    if state is None or state["key"] != key:
        if args.resume:
            raise SystemExit(f"--resume: {root} holds no calibrated run of these settings ({key})")
        state = {"key": key, "tag": tag} | calibrate(args, data, side, root, extra)
        state_path.write_text(json.dumps(state, indent=2, default=str))
    print(json.dumps({"tag": tag, "calib_s_per_step": state["calib"]["s_per_step"], "horizon": state["horizon"],
                      "steps_per_epoch": state["steps_per_epoch"], "calls": len(state["calls"])}))
    if args.calib_only:
        return
    init, horizon, per_epoch = state["init"] and Path(state["init"]), state["horizon"], state["steps_per_epoch"]
    run_dir = root / "run"
    resume = bool(args.resume and _checkpoints(run_dir))
    shutil.rmtree(run_dir / "interrupted" if resume else run_dir, ignore_errors=True)
    # enough epochs for the horizon and no more (after --max-steps speculators still starts every remaining epoch:
    # one step and a validation pass each); a mid-epoch checkpoint every --ckpt-every-steps steps
    run_extra = extra + ("--epochs", str(-(-horizon // per_epoch)),
                         "--checkpoint-freq", str(min(1.0, args.ckpt_every_steps / per_epoch)))
    argv = spec_argv(args.method, data, side, run_dir, init=init, max_steps=horizon, extra=run_extra, resume=resume,
                     recipe=args.recipe)
    t0 = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    rec = run_speculators(argv)
    first = min((r["step"] for r in rec.rows if "step" in r), default=0)
    call = step_stats(rec, warmup_steps=first + args.warmup_steps) | {
        "first_step": first, "wall_s": time.perf_counter() - t0, "resumed": resume,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}
    state["calls"].append(call)
    state_path.write_text(json.dumps(state, indent=2, default=str))
    ckpts = _checkpoints(run_dir)
    steps = json.loads((ckpts[-1] / "training_state.json").read_text())["global_step"] if ckpts else 0
    if (run_dir / "interrupted").exists() or steps < horizon:
        print(json.dumps({"tag": tag, "stopped_at": steps, "horizon": horizon, "next": "the same call with --resume"}))
        return
    final = root / "final"
    shutil.rmtree(final, ignore_errors=True)
    shutil.copytree(ckpts[-1], final)
    calls = state["calls"]
    timed_s, timed_steps = sum(c["timed_s"] for c in calls), sum(c["timed_steps"] for c in calls)
    tokens = [c["tokens_per_step"] * c["timed_steps"] for c in calls if c["tokens_per_step"]]
    record = {"tag": tag, "method": args.method, "recipe": args.recipe,
              "trainer": f"speculators {SPECULATORS_VERSION}",
              "conversations": side["num_conversations"], "tokens_per_epoch": side["num_tokens"],
              "train_s_goal": args.train_s, "horizon": horizon, "steps": steps, "steps_per_epoch": per_epoch,
              "epochs": steps / per_epoch, "calib_s_per_step": state["calib"]["s_per_step"],
              "timed_s": timed_s, "timed_steps": timed_steps, "s_per_step": timed_s / max(1, timed_steps),
              "tokens_per_s": sum(tokens) / timed_s if tokens and timed_s else None,
              "peak_mem_gib": max((c["peak_mem_gib"] or 0) for c in calls) or None,
              "final": calls[-1]["final"], "val": calls[-1]["val"], "calib": state["calib"], "calls": calls,
              "argv": argv, "environment": environment(), "head": str(final)}
    (out / f"spec_train_{tag}.json").write_text(json.dumps(record, indent=2, default=str))
    print(json.dumps({k: record[k] for k in ("tag", "steps", "horizon", "s_per_step", "tokens_per_s", "peak_mem_gib",
                                             "head")}, default=str))


def check(args) -> None:
    """``peagle_head`` of ``args.head`` against ``--target`` (default: the verifier the head was trained for, its
    ``speculators_config.verifier.name_or_path``)."""
    spec = json.loads((Path(args.head) / "config.json").read_text())
    target_dir = args.target or spec["speculators_config"]["verifier"]["name_or_path"]
    target = json.loads((Path(target_dir) / "config.json").read_text())
    config = peagle_head(args.head, args.out, target_config=target,
                         keep_embed={"auto": None, "yes": True, "no": False}[args.embed])
    print(json.dumps({"head": args.out, "method": config["peagle"]["method"], "architectures": config["architectures"],
                      "num_hidden_layers": config["num_hidden_layers"], "draft_vocab_size": config["draft_vocab_size"],
                      "mask_token_id": config.get("mask_token_id"), "valid": True}))


def data(args) -> None:
    """``--size`` regenerated conversations of ``--keep`` -> speculators' data directory ``--out``: peagle's
    plan (the recipe of ``bench.scale_train`` for ``--method``: its draft vocabulary, aux ids, mask token)."""
    from bench.common import keep_dir
    from bench.harness import bench_recipe, load_recipe_target, special_ids, tokenize_in_parallel
    from bench.scale import RECIPE as SCALE_RECIPE
    from bench.scale import regenerated
    from bench.scale_train import train_overrides
    from pipelines.assets import resolve_target
    from pipelines.train import plan_from_tokenized

    rows = regenerated(keep_dir(args.keep))[: args.size]
    if len(rows) < args.size:
        raise SystemExit(f"only {len(rows)} regenerated conversations under {args.keep}/regen, asked for {args.size}")
    recipe = bench_recipe(SCALE_RECIPE, train_overrides("peagle", list(args.set or [])))
    target_dir = str(resolve_target(recipe.target)[0].path)
    if args.hidden_states == "files":
        model, tok = load_recipe_target(recipe)
    else:  # the target runs in the trainer's workers: only its tokenizer here
        from transformers import AutoTokenizer

        model, tok = None, AutoTokenizer.from_pretrained(target_dir)
    t0 = time.perf_counter()  # tokenized once, for the plan and the data set
    tokenized = tokenize_in_parallel(target_dir, rows, max_length_tokens=recipe.data.max_length_tokens,
                                     on_too_long=recipe.capture.on_too_long)
    tokenize_s = time.perf_counter() - t0
    plan = plan_from_tokenized(recipe.training, recipe.drafter, recipe.target, tokenized,
                               always_keep_token_ids=special_ids(tok))
    side = write_data(Path(args.out).expanduser(), tokenized, recipe, plan, tok, model=model, tokenize_s=tokenize_s)
    print(json.dumps({k: side[k] for k in ("num_conversations", "num_tokens", "aux_layer_ids", "mask_token_id",
                                           "draft_vocab_size", "hidden_states", "tokenize_s")}))


def record(args) -> None:
    """Returned ``spec_train_<tag>.json`` files -> rows of ``bench/results/speculators_train.json`` (replacing the
    row of the same tag), with the GPU's busy share and peak memory of every process (``spec_gpu_<method>.jsonl``
    from run_speculators.sh, when given)."""
    from bench.common import RESULTS

    path = RESULTS / "speculators_train.json"
    data = json.loads(path.read_text()) if path.exists() else {"benchmark": "speculators_train", "rows": []}
    smi = {}
    for f in args.gpu or []:
        lines = [json.loads(x) for x in Path(f).read_text().splitlines() if x.strip()]
        smi[lines[0]["method"], lines[0].get("recipe", "defaults")] = lines
    for f in args.files:
        rec = json.loads(Path(f).read_text())
        env = rec.pop("environment", {})
        row = {"tag": rec["tag"], "date": env.get("date", "")[:10], "device": env.get("device"),
               "versions": {k: env.get(k) for k in ("torch", "transformers", "triton", "cuda")}} | rec
        if args.note:
            row["note"] = args.note
        if args.counterpart:  # peagle's run this one is set against (bench.report_speculators.peagle_counterpart)
            tag, _, run = args.counterpart.partition("#")
            row["counterpart"] = {"tag": tag, "run": int(run or 1)}
        calls = smi.get((rec["method"], rec.get("recipe", "defaults")))
        if calls:
            row["gpu_smi_calls"] = calls
            row["gpu_mem_used_peak_gib"] = max(c["mem_used_peak_mib"] for c in calls) / 1024
        data["rows"] = [r for r in data["rows"] if r["tag"] != row["tag"]] + [row]
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"{len(args.files)} row(s) in {path}")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.speculators_side", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("data", help="regenerated conversations -> speculators' data directory")
    p.add_argument("--keep", default="~/keep", help="directory with regen/chunk-*.jsonl.xz (bench.scale)")
    p.add_argument("--size", type=int, required=True, help="the first SIZE conversations (bench.scale's set)")
    p.add_argument("--out", required=True, help="speculators' --data-path")
    p.add_argument("--hidden-states", choices=["online", "files"], default="online",
                   help="online: captured in the trainer (peagle-capture backend); files: hs_<i>.safetensors now")
    p.add_argument("--set", action="append", help="recipe override (section.field=value) for the plan")
    p.set_defaults(fn=data)
    p = sub.add_parser("train", help="speculators' trainer, calibrated to --train-s GPU-seconds")
    p.add_argument("--method", choices=sorted(SPEC_TYPES), required=True)
    p.add_argument("--data", required=True, help="a directory made by `data`")
    p.add_argument("--train-s", type=float, required=True, help="GPU-seconds of training after warm-up")
    p.add_argument("--out", default="~/keep", help="where spec-<method>[-best]/ and spec_train_<tag>.json go")
    p.add_argument("--warmup-steps", type=int, default=20, help="steps excluded from timing (compilation)")
    p.add_argument("--calib-steps", type=int, default=30, help="timed steps of the calibration run")
    p.add_argument("--max-steps", type=int, help="train this many steps instead of train_s / s_per_step")
    p.add_argument("--calib-only", action="store_true", help="stop after the calibration (state.json)")
    p.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    p.add_argument("--ckpt-every-steps", type=int, default=CKPT_EVERY_STEPS, help="the run's mid-epoch checkpoints")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="defaults",
                   help="speculators' defaults or its maintainers' best settings (RECIPE_BEST), at the same "
                   "structure; best runs under <out>/spec-<method>-best/, tag spec-<method>-best-...")
    p.add_argument("--frozen-embeddings", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the target's embeddings frozen (as bench.scale's heads); speculators' P-EAGLE "
                   "default trains them")
    p.add_argument("spec_args", nargs="*", help="after --: more speculators train flags (override the recipe)")
    p.set_defaults(fn=train)
    p = sub.add_parser("check", help="a speculators head -> a peagle head directory, validated")
    p.add_argument("head", help="a directory speculators saved (config.json, model.safetensors)")
    p.add_argument("--out", required=True, help="the peagle head directory to write")
    p.add_argument("--target", help="the target's HF directory (default: the verifier the head names)")
    p.add_argument("--embed", choices=["auto", "yes", "no"], default="auto",
                   help="keep embed_tokens: auto = only when speculators trained them")
    p.set_defaults(fn=check)
    p = sub.add_parser("record", help="returned spec_train_<tag>.json files -> bench/results/speculators_train.json")
    p.add_argument("files", nargs="+")
    p.add_argument("--gpu", action="append", help="spec_gpu_<method>.jsonl returned beside them")
    p.add_argument("--note", help="what the record alone does not say (calls lost, flags changed)")
    p.add_argument("--counterpart", metavar="TAG[#RUN]", help="the bench.scale run to set it against (e.g. "
                   "peagle's best recipe); default: the last of its method, tokens per epoch and GPU-second goal")
    p.set_defaults(fn=record)
    args = ap.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
