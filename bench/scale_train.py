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
import shutil
import time
from pathlib import Path

import torch

from bench.common import RESULTS, environment, keep_dir
from bench.scale import LAYERS, PART_BYTES, RECIPE, checkpoint_head_name, head_name, regenerated, scale_tag
from pipelines.train.compact import FORMS

# The table's recipe: configs/smollm2-135m-scale.yaml with these overrides (plus the method's and LAYERS').
# 8192-token draft vocabulary and frozen target embeddings: heads small enough to come back through the
# device's 64 MiB return path and to be served with the target's embeddings.
TRAIN_OVERRIDES = ("drafter.draft_vocab_size=8192", "drafter.train_embed_tokens=false", "training.batch_tokens=16384",
                   "training.lr=6e-4", "training.warmup_steps=50", "training.checkpoint_every_steps=100",
                   "training.num_epochs=1000", "data.max_length_tokens=1024")
RESULT = "scale_train"
# What a call that stops at a checkpoint returns so that a new machine resumes: the latest checkpoint in this
# form of pipelines.train.compact.FORMS, as ckpt-<name>.tar.partNN (chosen by bench/resume_state.py).
DEFAULT_FORM = "bf16-weights-bf16-m-factored-v"
RETURN_PARTS = 7                         # a call returns <= 8 files: the parts and scale_train_<name>.json
RETURN_BYTES = 63 * 2**20                # ... and <= 64 MiB together: the parts and the json (a few KiB)
CARRY_BYTES = 64 * 2**20 - 10 * 2**20    # a call carries <= 64 MiB, the ~9 MiB working tree included
REST_DIR = "return-rest"                 # <keep>/return-rest: parts over one call's return (run_scale.sh rest)


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
        m.setdefault("t_first", time.perf_counter())
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
    form = args.return_form or DEFAULT_FORM
    if form not in FORMS:
        raise SystemExit(f"--return-form {form!r}: choose one of {sorted(FORMS)}")
    phases, t = {}, time.perf_counter()  # seconds of this call outside its box, per phase (in the call's record)

    def lap(phase: str) -> None:
        nonlocal t
        phases[phase], t = round(time.perf_counter() - t, 1), time.perf_counter()

    restore_checkpoint([Path(d).expanduser() for d in args.from_parts], keep, name)  # a new machine's resume
    lap("restore_parts_s")
    state = json.loads(state_path.read_text()) if state_path.exists() else {"calls": []}
    if state.get("done"):
        print(f"{name} already trained: {state['head_dir']}")
        return
    recipe = bench_recipe(args.recipe or RECIPE, train_overrides(args.method, args.set))
    rows = regenerated(keep)
    if len(rows) < args.size:
        raise SystemExit(f"only {len(rows)} regenerated conversations in {keep}/regen, --size {args.size}")
    lap("read_set_s")
    run = prepare(recipe, rows[: args.size], chunk=args.chunk)
    lap("tokenize_and_plan_s")
    if "horizon" not in state:  # calibrate on a throwaway copy: warm-up steps, then timed steps
        s_per_step = run.seconds_per_step(warmup_steps=args.warmup_steps_excluded, timed_steps=args.calib_steps)
        state.update(tag=tag, run=args.run, method=args.method, size=args.size, variant=args.variant,
                     overrides=list(args.set), recipe=resolved(recipe), environment=environment(),
                     calib_steps=args.calib_steps, warmup_steps_excluded=args.warmup_steps_excluded,
                     horizon=max(1, int(args.train_s / s_per_step)), calib_s_per_step=s_per_step,
                     train_s_goal=args.train_s, steps_per_epoch=run.plan.steps_per_epoch,
                     tokens_per_epoch=run.plan.num_tokens)
        state_path.write_text(json.dumps(state, indent=2))
        lap("calibration_s")
    call, res = _train_call(run, state["horizon"], ckpt, args)
    t = time.perf_counter()
    call["phases"] = phases
    state["calls"].append(call)
    if res is None and args.out:  # stopped at a checkpoint: what a new machine resumes from
        parts = return_checkpoint(ckpt, Path(args.out), name, form)
        call["returned"] = {"form": form, "parts": len(parts), "bytes": sum(p.stat().st_size for p in parts),
                            "held_back": len(hold_back(parts, keep))}
        lap("return_checkpoint_s")
    if res is not None:
        head = run.export(keep / f"head-{name}", step=res.step, extra={"conversations": args.size, "run": args.run})
        state.update(done=True, steps=res.step, epochs=res.step / max(1, state["steps_per_epoch"]), head_dir=str(head))
        if args.out:
            hold_back(return_tar(head, Path(args.out) / f"head-{name}.tar"), keep)
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
            # before the first step ends: the checkpoint loaded, the first batch captured, its kernels compiled
            "to_first_step_s": round(m["t_first"] - t0, 1) if "t_first" in m else None,
            "warmup_s": round(m["t_warm"] - m["t_first"], 1) if "t_warm" in m else None,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "final": history[-1] if history else None}
    return call, res


def return_tar(src: Path, dst: Path) -> list[Path]:
    """``src`` (a directory) as an uncompressed tar cut in ``<dst>.partNN`` files of at most ``PART_BYTES``
    (few files: a call returns <= 8); returns the parts.

    Here: ``cat DIR/head-X.tar.part* | tar x -C outputs/scale-heads``."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(src, arcname=src.name)
    data = buf.getvalue()
    dst.parent.mkdir(parents=True, exist_ok=True)
    for old in dst.parent.glob(f"{dst.name}.part*"):
        old.unlink()
    parts = [Path(f"{dst}.part{i // PART_BYTES:02d}") for i in range(0, len(data), PART_BYTES)]
    for i, part in enumerate(parts):
        part.write_bytes(data[i * PART_BYTES:(i + 1) * PART_BYTES])
    print(f"{src} -> {dst}.part* ({len(data) / 2**20:.1f} MiB in {len(parts)} parts)")
    return parts


def untar_parts(parts: list[Path], dst: Path) -> list[Path]:
    """Join ``parts`` (in name order) into one tar and extract it under ``dst``; returns the top-level paths
    it held.

    Raises:
        ValueError: no parts, or a missing part (numbers not 00..N-1).
        tarfile.TarError: a truncated tar, or a member that would land outside ``dst`` (``FilterError``).
    """
    import io
    import tarfile

    parts = sorted(parts, key=lambda p: p.name)
    want = [f".part{i:02d}" for i in range(len(parts))]
    if not parts or [p.name[p.name.rindex(".part"):] for p in parts] != want:
        raise ValueError(f"parts {[p.name for p in parts]}: expected .part00 .. .part{len(parts) - 1:02d}")
    dst.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts)), mode="r") as tf:
        names = tf.getnames()
        tf.extractall(dst, filter="data")  # "data": refuses absolute paths, .. and links out of dst
    return sorted({dst / n.split("/")[0] for n in names})


def return_groups(part_bytes: list[int]) -> list[list[int]]:
    """Parts of these sizes (in order) grouped by the call that returns them: each call at most
    :data:`RETURN_PARTS` files and :data:`RETURN_BYTES` together, filled in order."""
    groups: list[list[int]] = [[]]
    for b in part_bytes:
        if len(groups[-1]) == RETURN_PARTS or sum(groups[-1]) + b > RETURN_BYTES:
            groups.append([])
        groups[-1].append(b)
    return groups


def hold_back(parts: list[Path], keep: Path) -> list[Path]:
    """Move the parts past one call's return (:data:`RETURN_PARTS` files, :data:`RETURN_BYTES` together, in
    name order) to ``<keep>/return-rest/<i>/``, one folder per later call (:func:`return_groups`), for the next
    calls (``run_scale.sh rest``, once per folder) and say so; returns the moved paths. The device returns none of
    a call's files over its limits, so this keeps the first parts whole instead (2026-11-25: a P-EAGLE checkpoint
    of 78 MiB came back without its part 04)."""
    rest = keep / REST_DIR
    shutil.rmtree(rest, ignore_errors=True)  # an earlier call's leftovers are of an older checkpoint
    parts = sorted(parts)
    groups = return_groups([p.stat().st_size for p in parts])
    moved, at = [], len(groups[0])
    for i, group in enumerate(groups[1:], start=1):
        (rest / str(i)).mkdir(parents=True)
        for p in parts[at:at + len(group)]:
            moved.append(Path(p.replace(rest / str(i) / p.name)))
        at += len(group)
    if moved:
        print(f"{len(moved)} of {len(parts)} parts are over one call's return: held in {rest} for {len(groups) - 1} "
              f"more call(s); return them with `run_scale.sh rest` (once per call) before the machine goes back")
    return moved


def return_checkpoint(ckpt_root: Path, out: Path, name: str, form: str = DEFAULT_FORM) -> list[Path]:
    """The latest checkpoint under ``ckpt_root`` in ``form`` (``pipelines.train.compact``), with the run's
    per-epoch sample-id records, as ``<out>/ckpt-<name>.tar.partNN``; returns the parts.

    Raises:
        ValueError: no checkpoint under ``ckpt_root``, or ``form`` unknown / not applicable
            (``compact_checkpoint``).
    """
    import tempfile

    from pipelines.train import SAMPLE_LOG_DIR, latest_checkpoint
    from pipelines.train.compact import compact_checkpoint

    latest = latest_checkpoint(ckpt_root)
    if latest is None:
        raise ValueError(f"no checkpoint under {ckpt_root} to return")
    with tempfile.TemporaryDirectory(dir=ckpt_root.parent) as tmp:
        stage = Path(tmp) / f"ckpt-{name}"
        compact_checkpoint(latest, stage / latest.name, form)
        if (ckpt_root / SAMPLE_LOG_DIR).is_dir():
            shutil.copytree(ckpt_root / SAMPLE_LOG_DIR, stage / SAMPLE_LOG_DIR)
        return return_tar(stage, out / f"ckpt-{name}.tar")


def restore_checkpoint(dirs: list[Path], keep: Path, name: str) -> int | None:
    """A new machine's resume: ``ckpt-<name>.tar.part*`` found in ``dirs`` (returned by
    :func:`return_checkpoint`) unpacked into ``<keep>/ckpt-<name>/``, and ``scale_train_<name>.json`` (in a
    dir or its ``r/``) copied to ``keep`` with it, unless ``keep`` already holds a checkpoint of that step or
    a later one (the machine did not go back). Parts under ``keep`` are removed afterwards.

    Returns:
        The step of the restored checkpoint, None when nothing was restored.

    Raises:
        ValueError: parts missing or of two checkpoints mixed (``untar_parts``), or no checkpoint in them.
    """
    import tempfile

    from pipelines.train import STATE_FILE, latest_checkpoint
    from pipelines.train.compact import expand_checkpoint

    parts = _unique_parts([p for d in dirs for p in Path(d).glob(f"ckpt-{name}.tar.part*")])
    if not parts:
        return None
    keep.mkdir(parents=True, exist_ok=True)
    root = keep / f"ckpt-{name}"
    have = latest_checkpoint(root) if root.is_dir() else None
    with tempfile.TemporaryDirectory(dir=keep) as tmp:
        top = untar_parts(parts, Path(tmp))
        got = latest_checkpoint(top[0]) if len(top) == 1 else None
        if got is None:
            raise ValueError(f"{[p.name for p in parts]} hold no checkpoint of ckpt-{name}")
        expand_checkpoint(got)  # a form whose moments were factored or dropped: full-shape again
        step = int(json.loads((got / STATE_FILE).read_text())["step"])
        old = int(json.loads((have / STATE_FILE).read_text())["step"]) if have else -1
        if old >= step:
            print(f"{root} has step {old} >= the carried step {step}: carried checkpoint not used")
            step = None
        else:
            shutil.rmtree(root, ignore_errors=True)
            shutil.move(str(top[0]), root)
            states = [s for d in dirs for s in (Path(d) / f"scale_train_{name}.json",
                                                Path(d) / "r" / f"scale_train_{name}.json")
                      if s.is_file() and s.resolve() != (keep / s.name).resolve()]  # one kept here is in place
            if states:
                shutil.copy2(states[0], keep / states[0].name)
            print(f"restored {root} at step {step}" + (f" and {states[0]}" if states else ""))
    for p in parts:
        if p.parent.resolve() == keep.resolve():
            p.unlink()
    return step


def _unique_parts(parts: list[Path]) -> list[Path]:
    """One path per part name: the same part carried twice (kept in ``~/keep`` by an earlier call and carried
    again, 2026-11-26) is one part, not a gap in the numbering.

    Raises:
        ValueError: two parts of one name with different bytes (two checkpoints' parts mixed).
    """
    by_name: dict[str, Path] = {}
    for p in parts:
        seen = by_name.setdefault(p.name, p)
        if seen is not p and seen.read_bytes() != p.read_bytes():
            raise ValueError(f"{seen} and {p} differ: parts of two checkpoints of one run")
    return list(by_name.values())


def record(args) -> None:
    """A returned ``scale_train_<head>.json`` -> a row of ``bench/results/scale_train.json`` (replacing the row of
    the same ``tag`` and ``run``): the run's resolved recipe and calls, its date and device. A run that will not
    finish is recorded only with ``--stopped-at STEP`` (its ``steps``; ``done`` false; say why in ``--note``)."""
    state = json.loads(Path(args.state).read_text())
    if not state.get("done"):
        if args.stopped_at is None:
            raise SystemExit(f"{args.state}: the run has not finished (no 'done'); record it once its head is "
                             "exported, or with --stopped-at STEP when it will not go on")
        state.update(done=False, stopped_at=args.stopped_at, steps=args.stopped_at,
                     epochs=args.stopped_at / max(1, state["steps_per_epoch"]))
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


def export_checkpoint(args) -> None:
    """A head from a run's checkpoint when the run cannot go on (e.g. its returned optimizer state is incomplete):
    the run's plan rebuilt from its state json and the regenerated set under ``--keep`` (the first ``size``
    conversations, as training used them), the checkpoint's ``model.safetensors`` loaded into that drafter, and
    the head exported as the run's would be (``OnlineRun.export``), with ``step`` and ``from_checkpoint`` in its
    ``config.json``. Its schedule did not finish: say so wherever it is reported.

    Raises:
        SystemExit: fewer conversations than the run trained on, a weight missing or unexpected (the frozen
            ``embed_tokens`` may be absent), or a draft vocabulary (``d2t``) other than the rebuilt plan's: then the
            set is not the run's.
    """
    from safetensors.torch import load_file

    from bench.harness import bench_recipe, build_head, load_recipe_target, online_run, special_ids
    from pipelines.recipe import load_recipe

    state, ckpt = json.loads(Path(args.state).read_text()), Path(args.checkpoint)
    step = int(ckpt.name.rsplit("_", 1)[-1])
    weights = load_file(str(ckpt / "model.safetensors"))  # before the plan's minutes: a missing file fails here
    rows = regenerated(keep_dir(args.keep))
    if len(rows) < state["size"]:
        raise SystemExit(f"only {len(rows)} regenerated conversations under {args.keep}, the run used {state['size']}")
    overrides = train_overrides(state["method"], state["overrides"])
    # the recipe as the run resolved it: a GPU run's target dtype and attention, not this machine's CPU overrides
    # (target_sha256 in the head is this machine's conversion at that dtype: the asset checksum covers its
    # config files, so it may differ from the training machine's)
    recipe = load_recipe(RECIPE, overrides) if state.get("environment", {}).get("cuda") else bench_recipe(RECIPE, overrides)
    model, tok = load_recipe_target(recipe)
    h = build_head(recipe, rows[: state["size"]], always_keep=special_ids(tok))
    if not torch.equal(weights["d2t"], h.drafter.d2t.cpu()):
        raise SystemExit(f"{ckpt}: its draft vocabulary is not the rebuilt plan's: not trained on this set")
    missing, unexpected = h.drafter.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if not k.startswith("embed_tokens")]:
        raise SystemExit(f"{ckpt}: missing {missing}, unexpected {unexpected}")
    run = online_run(recipe, h, model, tok, state["size"])
    name = head_name(state["tag"], state["run"])
    head = run.export(Path(args.out) / f"head-{checkpoint_head_name(name, step)}", step=step,
                      extra={"conversations": state["size"], "run": state["run"], "from_checkpoint": str(ckpt.name),
                             "horizon": state["horizon"]})
    print(f"{head}: step {step} of {state['horizon']}")
