"""``python -m bench.scale train`` and ``record``: one head of the scaling table, trained through the product
(:mod:`bench.harness`: ``configs/smollm2-135m-scale.yaml`` with :data:`TRAIN_OVERRIDES`, the train stage's plan,
drafter, objective and ``train_in_process``) in resumable, time-boxed calls.

Time boxes exclude warm-up: the first ``--warmup-steps-excluded`` steps of every call (compilation of the
flex-attention kernels) are not counted against ``--box-s``, and the horizon (cosine schedule, total steps) is
``--train-s`` divided by the seconds per step measured after warm-up before the first call trains. A call that
reaches its box stops right after a checkpoint; the next call resumes from it (same sample order, same
schedule). When the horizon is reached the head is exported and returned in parts < 16 MiB.

State lives in ``--keep`` as ``scale_train_<head>.json`` (one run); ``record STATE`` adds it to
``bench/results/scale_train.json`` as a row (``tag``, ``run``, the resolved recipe, the calls, date, device).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench.common import RESULTS, environment, keep_dir
from bench.scale import LAYERS, PART_BYTES, RECIPE, head_name, regenerated, scale_tag

# The table's recipe: configs/smollm2-135m-scale.yaml with these overrides (plus the method's and LAYERS').
# 8192-token draft vocabulary and frozen target embeddings: heads small enough to come back through the
# device's 64 MiB return path and to be served with the target's embeddings.
TRAIN_OVERRIDES = ("drafter.draft_vocab_size=8192", "drafter.train_embed_tokens=false", "training.batch_tokens=16384",
                   "training.lr=6e-4", "training.warmup_steps=50", "training.checkpoint_every_steps=100",
                   "training.num_epochs=1000", "data.max_length_tokens=1024")
RESULT = "scale_train"


class BoxExpired(Exception):
    """Raised after a checkpoint once this call's post-warm-up time box is spent."""


def train_overrides(method: str, extra: list[str]) -> list[str]:
    return [f"training.method={method}", f"drafter.num_layers={LAYERS[method]}", *TRAIN_OVERRIDES, *extra]


class _Clock:
    """Step timing of one call: the first step, the time after ``warmup`` steps, the last step."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.marks = warmup, {}

    def on_step(self, step: int) -> None:
        m = self.marks
        m.setdefault("first_step", step)
        if step - m["first_step"] >= self.warmup and "t_warm" not in m:
            m["t_warm"], m["step_warm"] = time.perf_counter(), step
        m["t_last"], m["step_last"] = time.perf_counter(), step

    def timed_s(self) -> float:
        return self.marks["t_last"] - self.marks["t_warm"] if "t_warm" in self.marks else 0.0

    def timed_steps(self) -> int:
        return self.marks["step_last"] - self.marks["step_warm"] if "step_warm" in self.marks else 0

    def since_warm_s(self) -> float | None:
        return time.perf_counter() - self.marks["t_warm"] if "t_warm" in self.marks else None


def train(args) -> None:
    from bench.harness import bench_recipe, prepare, resolved

    keep = keep_dir(args.keep)
    tag = scale_tag(args.method, args.size, args.variant)
    name = head_name(tag, args.run)
    state_path, ckpt = keep / f"scale_train_{name}.json", keep / f"ckpt-{name}"
    state = json.loads(state_path.read_text()) if state_path.exists() else {"calls": []}
    if state.get("done"):
        print(f"{name} already trained: {state['head_dir']}")
        return
    recipe = bench_recipe(args.recipe or RECIPE, train_overrides(args.method, args.set))
    rows = regenerated(keep)
    if len(rows) < args.size:
        raise SystemExit(f"only {len(rows)} regenerated conversations in {keep}/regen, --size {args.size}")
    run = prepare(recipe, rows[: args.size], chunk=args.chunk)
    if "horizon" not in state:  # calibrate on a throwaway copy: warm-up steps, then timed steps
        s_per_step = run.seconds_per_step(warmup_steps=args.warmup_steps_excluded, timed_steps=args.calib_steps)
        state.update(tag=tag, run=args.run, method=args.method, size=args.size, variant=args.variant,
                     overrides=list(args.set), recipe=resolved(recipe), environment=environment(),
                     calib_steps=args.calib_steps, warmup_steps_excluded=args.warmup_steps_excluded,
                     horizon=max(1, int(args.train_s / s_per_step)), calib_s_per_step=s_per_step,
                     train_s_goal=args.train_s, steps_per_epoch=run.plan.steps_per_epoch,
                     tokens_per_epoch=run.plan.num_tokens)
        state_path.write_text(json.dumps(state, indent=2))
    call, res = _train_call(run, state["horizon"], ckpt, args)
    state["calls"].append(call)
    if res is not None:
        head = run.export(keep / f"head-{name}", step=res.step, extra={"conversations": args.size, "run": args.run})
        state.update(done=True, steps=res.step, epochs=res.step / max(1, state["steps_per_epoch"]), head_dir=str(head))
        if args.out:
            return_tar(head, Path(args.out) / f"head-{name}.tar")
    state_path.write_text(json.dumps(state, indent=2))
    print(json.dumps({k: v for k, v in state.items() if k != "calls"} | {"call": call}))


def _train_call(run, horizon: int, ckpt: Path, args) -> tuple[dict, object | None]:
    """Train (resuming from ``ckpt``) until the horizon or this call's box; the call's record and the result
    (None when the box stopped it)."""
    from pipelines.train import TrainCallback

    clock, history = _Clock(args.warmup_steps_excluded), []

    class Box(TrainCallback):
        def on_checkpoint(self, step: int, metrics: dict) -> None:
            spent = clock.since_warm_s()
            if spent is not None and spent > args.box_s:
                raise BoxExpired(step)

    def on_log(step: int, m: dict) -> None:
        clock.on_step(step)
        if step % args.log_every == 0:
            history.append({"step": step, **{k: float(v) for k, v in m.items() if isinstance(v, (int, float))}})
            print(json.dumps(history[-1]), flush=True)

    t0, stopped, res = time.perf_counter(), None, None
    try:
        res = run.train(horizon, checkpoint_dir=ckpt, log_every_steps=1, on_log=on_log, callbacks=[Box()])
    except BoxExpired as e:
        stopped = int(str(e))
    m = clock.marks
    call = {"wall_s": time.perf_counter() - t0, "box_s": args.box_s, "first_step": m.get("first_step"),
            "last_step": m.get("step_last"), "stopped_at_checkpoint": stopped, "timed_s": clock.timed_s(),
            "timed_steps": clock.timed_steps(),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "final": history[-1] if history else None}
    return call, res


def return_tar(src: Path, dst: Path) -> None:
    """``src`` as an uncompressed tar cut in ``<dst>.partNN`` files < 16 MiB (few files: a call returns <= 8).

    Here: ``cat DIR/head-X.tar.part* | tar x -C outputs/scale-heads``."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(src, arcname=src.name)
    data = buf.getvalue()
    dst.parent.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(data), PART_BYTES):
        Path(f"{dst}.part{i // PART_BYTES:02d}").write_bytes(data[i:i + PART_BYTES])
    print(f"{src} -> {dst}.part* ({len(data) / 2**20:.1f} MiB)")


def record(args) -> None:
    """A returned ``scale_train_<head>.json`` -> a row of ``bench/results/scale_train.json`` (replacing the row of
    the same ``tag`` and ``run``): the run's resolved recipe and calls, its date and device."""
    state = json.loads(Path(args.state).read_text())
    if not state.get("done"):
        raise SystemExit(f"{args.state}: the run has not finished (no 'done'); record it once its head is exported")
    env = state.pop("environment", {})
    row = {"tag": state.pop("tag"), "run": state.pop("run"), "date": env.get("date", "")[:10],
           "device": env.get("device"), "data_build": args.data_build, **state}
    if args.note:
        row["note"] = args.note
    path = RESULTS / f"{RESULT}.json"
    data = json.loads(path.read_text()) if path.exists() else {"benchmark": RESULT, "rows": []}
    rows = [r for r in data["rows"] if (r["tag"], r["run"]) != (row["tag"], row["run"])]
    data["rows"] = rows + [row]
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"recorded {row['tag']} run {row['run']} in {path}")
