"""Sections of ``docs/benchmarks.md`` on each stage run alone at 1, 2 and 4 GPUs through
``bench/device/run_multi_gpu.sh stage STAGE multi_gpu_<stage>_<label>``: regeneration (with vLLM's own scheduler
sweep), capture (and where its time goes), training (tokens/s and loss curves); every run compared with the 1-GPU
run of its own machine."""

from __future__ import annotations

import re
import statistics
from typing import Any, NamedTuple

from bench.common import RESULTS
from bench.report_data import regen_batches
from bench.report_fmt import f, job_sets, load, met, span, table, training_setting

TRAIN_HEADING = "### Training on 1, 2 and 4 GPUs through the train stage"
REGEN_HEADING = "### Regeneration on 1, 2 and 4 GPUs through the regenerate stage (one or more vLLM engines a GPU)"
CAPTURE_HEADING = "### Capture on 1, 2 and 4 GPUs through the capture stage (one actor per GPU)"
SCALE_GOAL = 0.90  # issue goal: tokens/s scaling efficiency at 4 GPUs
REGEN_GOAL_TOK_S = 45_000  # output tokens/s per H100 for SmolLM2 (datatrove's tuned public figure)
CAPTURE_STEADY_GOAL = 0.50  # issue goal: the capture stage's steady tokens/s against its model step on one GPU


def train_tok_s(history: list[dict]) -> float | None:
    """Median tokens/s of the logged training windows after the first (compilation and warm-up)."""
    vals = [h["tokens_per_s"] for h in history[1:] if h.get("tokens_per_s")]
    return statistics.median(vals) if vals else None


class StageRun(NamedTuple):
    """One run of a stage alone through ``bench/device/run_multi_gpu.sh stage STAGE multi_gpu_<stage>_<label>``."""

    name: str  # the result file's name
    gpus: int  # the GPUs the stage used (its placement)
    device: str  # the GPU kind ("NVIDIA H200")
    machine: str  # the lease it ran on: "4x NVIDIA H200, 2026-11-28" (compare only within one)
    outputs: dict
    record: dict  # the whole result file


LEASE_GAP_S = 45 * 60  # a lease holds its machine <= 30 minutes: records of one kind further apart are two machines


def leases() -> dict[str, str]:
    """``{result name: machine}`` for every ``multi_gpu_*.json`` of ``bench.multi_gpu record``, e.g. ``2x NVIDIA
    H200, 2026-11-28 13:18`` (the lease's first record, UTC): records of one GPU count and kind belong to one
    lease while each follows the one before within :data:`LEASE_GAP_S` (two 2x H200 leases fell on 2026-11-28)."""
    from datetime import UTC, datetime

    recs = []
    for path in RESULTS.glob("multi_gpu_*.json"):
        r = load(path.stem)
        if r and r.get("stage_records") is not None:
            gpus = r.get("gpus") or [r["environment"]["device"]]
            t = datetime.fromisoformat(r["environment"]["date"])
            recs.append((f"{len(gpus)}x {gpus[0]}", t if t.tzinfo else t.replace(tzinfo=UTC), path.stem))
    out: dict[str, str] = {}
    last: dict[str, tuple] = {}  # kind -> (time of its latest record, its lease's label)
    for kind, t, name in sorted(recs, key=lambda x: x[1]):
        prev = last.get(kind)
        label = prev[1] if prev and (t - prev[0]).total_seconds() <= LEASE_GAP_S else f"{kind}, {t:%Y-%m-%d %H:%M}"
        last[kind] = (t, label)
        out[name] = label
    return out


def stage_runs(stage: str) -> list[StageRun]:
    """Every ``multi_gpu_<stage>_*.json`` whose stage ran and did not stream its capture into training (those are
    :mod:`bench.report_streaming`'s), by machine (:func:`leases`) then GPUs."""
    machines = leases()
    runs = []
    for path in RESULTS.glob(f"multi_gpu_{stage}_*.json"):
        r = load(path.stem)
        rec = r.get("stage_records", {}).get(stage) or {}
        if rec.get("status") != "ran" or (rec.get("outputs") or {}).get("streaming"):
            continue  # streamed capture: bench.report_streaming
        gpus = r.get("gpus") or [r["environment"]["device"]]
        runs.append(StageRun(path.stem, (rec.get("placement") or {}).get("num_gpus") or 1, gpus[0],
                             machines[path.stem], rec.get("outputs") or {}, r))
    return sorted(runs, key=lambda x: (x.machine, x.gpus, x.name))


def _baseline(run: StageRun, runs: list[StageRun], same=lambda a, b: True,
              value=lambda x: 0.0) -> tuple[StageRun | None, bool]:
    """``(the 1-GPU run to compare run with, whether it ran on the same machine)``: the same lease's first, else
    the one on the same kind of GPU with the highest ``value`` (the strictest; marked in the table); ``same(a,
    b)``: further conditions (e.g. the method, the engines a GPU)."""
    ones = [x for x in runs if x.gpus == 1 and same(x, run)]
    here = [x for x in ones if x.machine == run.machine]
    if here:
        return here[0], True
    kind = [x for x in ones if x.device == run.device]
    return (max(kind, key=lambda x: value(x) or 0.0) if kind else None), False


def _per_gpus(lines: list[str], stage: str, heading: str, metrics: list[tuple[str, Any]], scaled: str,
              extra: list[tuple[str, Any]] = (), same=lambda a, b: True) -> list[StageRun]:
    """``stage`` alone at 1, 2 and 4 GPUs: ``metrics`` (column, fn(StageRun) -> tok/s), ``extra`` columns
    (column, fn(StageRun) -> text), and the efficiency of the column ``scaled`` against ``gpus`` times its value
    on the 1-GPU run of the same machine (:func:`_baseline`; the issue's goal: >= 0.9, i.e. 3.6x at 4 GPUs)."""
    lines += [heading, ""]
    runs = stage_runs(stage)
    if not runs:
        lines += ["not run", ""]
        return runs
    col = dict(metrics)[scaled]
    rows = []
    for run in runs:
        base, here = _baseline(run, runs, same, col)
        value, ref = col(run), base and col(base)
        eff = "-" if not (value and ref) else f(value / (run.gpus * ref), 2) + ("" if here else " (1 GPU: another machine)")
        rows.append([run.gpus, f"`{run.name}.json`", run.machine, *[fn(run) for _, fn in extra],
                     *[f"{v:,.0f}" if (v := fn(run)) else "-" for _, fn in metrics], eff])
    lines += table(["GPUs", "run", "machine", *[c for c, _ in extra], *[c for c, _ in metrics],
                    f"efficiency vs 1 GPU (goal >= {SCALE_GOAL})"], rows)
    lines += [""]
    return runs


def _profile(o: dict, key: str) -> float | None:
    return (o.get("profile") or {}).get(key)


def _steady(o: dict) -> float | None:
    """The capture pool's tokens/s once its actors started (``pipelines.capture.materialize.steady_tokens_per_s``,
    recomputed from the record's profile: records before 2026-11-28 stored another definition)."""
    from pipelines.capture.materialize import steady_tokens_per_s

    return steady_tokens_per_s(o["profile"], o.get("num_tokens", 0)) if o.get("profile") else None


def _forward_tok_s(o: dict) -> float | None:
    """The capture actors' model step alone (forward and copy to host), all actors: tokens / (forward seconds /
    actors)."""
    fwd, actors = _profile(o, "forward_s"), _profile(o, "num_actors")
    return o.get("num_tokens", 0) / (fwd / actors) if fwd and actors else None


def data_path(lines: list[str]) -> None:
    """Regeneration and capture at 1, 2 and 4 GPUs, the engine's scheduler sweep, where capture time goes."""
    regen = _per_gpus(lines, "regenerate", REGEN_HEADING, [
        # RegenerateResult.tokens_per_s is per engine (tokens / engine seconds summed): n engines decode n times it
        ("tok/s in the engines (all)", lambda x: (x.outputs.get("tokens_per_s") or 0) * _engines(x)),
        ("tok/s per engine", lambda x: x.outputs.get("tokens_per_s")),
        ("tok/s a GPU, first engine ready to last answer", _gpu_decode),
        ("tok/s over the stage", lambda x: x.outputs.get("wall_tokens_per_s"))], "tok/s in the engines (all)",
        extra=[("engines", lambda x: f"{_engines(x)} ({_engines_per_gpu(x)} a GPU)"),
               ("conversations", lambda x: f"{x.outputs.get('num_conversations', 0):,}")],
        same=lambda a, b: _engines_per_gpu(a) == _engines_per_gpu(b))  # 2 engines a GPU against 2 on one GPU
    regen_sweep(lines)
    regen_reading(lines, regen)
    regen_batches(lines)
    capture = _per_gpus(lines, "capture", CAPTURE_HEADING, [
        ("tok/s over the stage", lambda x: x.outputs.get("tokens_per_s")),
        ("tok/s once started", lambda x: _steady(x.outputs)),
        ("tok/s of the model step alone", lambda x: _forward_tok_s(x.outputs))], "tok/s over the stage")
    capture_profile(lines, capture)


def regen_sweep(lines: list[str]) -> None:
    """vLLM's own ``LLM.generate`` on the same prompts, one engine per GPU at once (``bench.regen_throughput
    --per-gpu``): the ceiling the regenerate stage's engines can reach, by scheduler setting."""
    r = load("multi_gpu_regen_sweep")
    if r is None:
        return
    lines += [(f"vLLM alone ({r.get('prompts')} ShareGPT first turns in one `generate` call, at most "
               f"{r.get('max_new_tokens')} new tokens, {(r.get('environment') or {}).get('device', '')}, "
               f"{r['environment']['date'][:10]}, vLLM {(r.get('vllm') or {}).get('vllm', '')}; "
               "`multi_gpu_regen_sweep.json`):"), ""]
    rows = [[x.get("scheduler_max_num_seqs", "-"), x.get("scheduler_max_num_batched_tokens", "-"),
             "vLLM's default" if not x.get("max_num_seqs") else "set", x.get("engines_at_once", 1),
             f"{x['tokens_per_s']:,.0f}" if x.get("tokens_per_s") else x.get("error", "-"),
             f(x.get("engine_start_s"), 0)] for x in r.get("vllm_sweep", [])]
    lines += table(["max_num_seqs", "max_num_batched_tokens", "", "engines at once", "tok/s per engine",
                    "engine start s"], rows) + [""]


def regen_reading(lines: list[str], runs: list[StageRun]) -> None:
    """What the regenerate rows say, in a few sentences: one engine against vLLM alone (what bounds it), the best
    GPU of engines sharing it against the goal, the engines a GPU on one machine side by side, and the engines'
    start. Each run's own story (its commands, what went wrong) is in ``bench/device/README.md``."""
    sweep = load("multi_gpu_regen_sweep")
    alone = [x for x in runs if _engines_per_gpu(x) == 1 and x.outputs.get("tokens_per_s")]
    if not (alone and sweep):
        return
    tried = [x for x in sweep["vllm_sweep"] if x.get("tokens_per_s")]
    per = [x.outputs["tokens_per_s"] for x in alone]
    text = [(f"Reading: one vLLM engine decodes {min(per):,.0f}-{max(per):,.0f} tok/s of SmolLM2 in the stage, as "
            f"fast as vLLM alone on these prompts ({min(x['tokens_per_s'] for x in tried):,.0f}-"
            f"{max(x['tokens_per_s'] for x in tried):,.0f} over {len(tried)} scheduler settings; the public tuned "
            "512 sequences / 32,768 batched tokens is no faster): a 135M target is bound by each engine's host work "
            "per step, not by the GPU, so `regenerate.engines_per_gpu` runs several engines on one GPU.")]
    timed = [x for x in runs if _gpu_decode(x)]
    if timed:
        top = max(timed, key=_gpu_decode)
        text.append(f"The best GPU decoded {_gpu_decode(top):,.0f} tok/s, from the first engine ready to the last "
                    f"answer, with {_engines_per_gpu(top)} engines a GPU (`{top.name}.json`; goal "
                    f"{REGEN_GOAL_TOK_S:,} a GPU: {met(_gpu_decode(top) >= REGEN_GOAL_TOK_S)}).")
        ones = {}
        for x in (y for y in timed if y.gpus == 1):
            ones.setdefault(x.machine, {})[_engines_per_gpu(x)] = x
        machine, series = max(ones.items(), key=lambda kv: (len(kv[1]), kv[0]), default=(None, {}))
        if len(series) > 1:
            ks = sorted(series)
            text.append(f"On one GPU ({machine}), {' / '.join(map(str, ks))} engines decoded "
                        f"{' / '.join(f'{_gpu_decode(series[k]):,.0f}' for k in ks)} tok/s and the stage took "
                        f"{' / '.join(f'{_regen_s(series[k]):.0f}' for k in ks)} s.")
    starts = [e["start_s"] for x in runs for e in x.outputs.get("engines") or []]
    text.append(f"Each engine's start (median {statistics.median(starts):.0f} s, up to {max(starts):.0f} s: "
                "compilation and CUDA graphs; a machine's first start is the longest, later ones reuse vLLM's "
                "compile cache) is paid once per engine, so on these few thousand conversations it is a large part "
                "of the stage; over a build of 300k conversations it is a small share.")
    lines += [" ".join(text), ""]


def _gpu_decode(run: StageRun) -> float | None:
    """tok/s a GPU of a regenerate run from its first engine ready to its last answer (``decode_tokens_per_s``,
    recorded since 2026-11-28 19:43) over the GPUs its engines answered on; ``None`` for earlier runs."""
    together = run.outputs.get("decode_tokens_per_s")
    return together / (len(_engine_gpus(run)) or run.gpus) if together else None


def _engines_per_gpu(run: StageRun) -> int:
    return int(job_sets(run.record).get("regenerate.engines_per_gpu", 1))


def _regen_s(run: StageRun) -> float:
    """The regenerate stage's seconds in a run."""
    return run.record["stage_records"]["regenerate"]["seconds"]


def _engine_gpus(run: StageRun) -> set[str]:
    """The GPUs (``<node>/<device>``) the run's engines answered on (its ``engines`` reports; empty without)."""
    return {e["gpu"] for e in run.outputs.get("engines") or []}


def disk_mib_s(run: StageRun) -> float:
    """MiB/s a capture run put on disk: its shards' bytes over the actor pool's wall time."""
    return run.outputs.get("bytes_on_disk", 0) / run.outputs["profile"]["run_s"] / 2**20


def capture_profile(lines: list[str], runs: list[StageRun]) -> None:
    """Where the capture stage's time went in each run with a profile (``capture_meta`` ``profile``)."""
    runs = [x for x in runs if x.outputs.get("profile")]
    if not runs:
        return
    rows = []
    for x in runs:
        o, prof = x.outputs, x.outputs["profile"]
        rows.append([x.gpus, x.machine, f"{o.get('num_tokens', 0):,}", f"{o.get('bytes_per_token', 0):,.0f}",
                     *[f(prof.get(k), 1) for k in ("actor_start_s", "wait_s", "forward_s", "write_s", "run_s")],
                     f"{disk_mib_s(x):,.0f}"])
    lines += [("Where the capture time went (seconds summed over the actors; `run s` is the actor pool's wall "
               "time; MiB/s: the shards' bytes over it):"), ""]
    lines += table(["GPUs", "machine", "tokens", "bytes/token on disk", "actor start s", "waiting for input s",
                    "forward + copy to host s", "shard writes s", "run s", "MiB/s to disk"], rows) + [""]
    lines += [_capture_reading(runs), ""]


def _capture_reading(runs: list[StageRun]) -> str:
    """What the capture rows say, in a few sentences: the 1-GPU goal (steady state >= 50% of the model step) on
    every machine that ran one GPU, then what bounds the wider runs (the node's disk) against the 1-GPU run of the
    machine that ran both. Each run's own story (its commands, what went wrong) is in ``bench/device/README.md``."""
    ones = [x for x in runs if x.gpus == 1 and _forward_tok_s(x.outputs)]
    text = []
    if ones:
        shares = [100 * _steady(x.outputs) / _forward_tok_s(x.outputs) for x in ones]
        starts = [x.outputs["profile"]["actor_start_s"] for x in ones]
        text.append(f"Reading: on one GPU the stage captures {span(shares, 0, '%')} of its model step's tokens/s once "
                    f"its actor has started ({len(ones)} machines; goal >= {CAPTURE_STEADY_GOAL:.0%}: "
                    f"{met(min(shares) >= 100 * CAPTURE_STEADY_GOAL)}): the actor writes one shard while it captures "
                    f"the next (`CaptureShardActor.SHARDS_IN_FLIGHT`). Start-up ({span(starts, 0, ' s')}) is apart.")
    pairs = [(x, y) for x in ones for y in runs if y.machine == x.machine and y.gpus > x.gpus]
    if pairs:
        one, wide = max(pairs, key=lambda p: (p[1].gpus, p[1].record["environment"]["date"]))
        rates = [disk_mib_s(x) for x in runs]
        text.append(f"On {wide.gpus} GPUs of one machine the stage ran {wide.outputs['tokens_per_s'] / one.outputs['tokens_per_s']:.2f}x "
                    f"one GPU (goal {SCALE_GOAL * wide.gpus:.1f}x: not met): materialized capture writes "
                    f"{wide.outputs.get('bytes_per_token', 0):,.0f} bytes a token (three aux hidden states and the "
                    f"final one), and every run put {min(rates):,.0f}-{max(rates):,.0f} MiB/s on the node's disk, "
                    "so the disk bounds it, not the GPUs." + _shard_write_note() + " Streaming capture into "
                    "training (`capture.streaming`) writes no shards: see the next table.")
    return " ".join(text)


def _shard_write_note() -> str:
    """The shard writer alone (``bench.shard_write``) on the CPU box and on a GPU machine's disk, where run."""
    rates = []
    for name, where in (("shard_write_gpu", "the GPU machine"), ("shard_write", "the CPU box")):
        r = load(name)
        if r is not None:
            rate = {x["path"]: x["mib_per_s"] for x in r["rows"]}
            rates.append(f"{rate['writer']:,.0f} MiB/s on {where} ({r['environment']['date'][:10]})")
    return (" One shard writer alone (`python -m bench.shard_write`, a 479 MiB shard, fsync included) wrote "
            + " and ".join(rates) + ".") if rates else ""


def _engines(run: StageRun) -> int:
    """The regenerate stage's vLLM engines that answered in a run: those it recorded (``engines``, since
    2026-11-28 16:40), else its ``regenerate.num_workers`` override (one per GPU without it), at most as many as
    its placement's GPUs hold at ``regenerate.engines_per_gpu`` a GPU (4 of 8 engines asked for were placed on
    4x H200, 2026-11-28 16:11)."""
    if run.outputs.get("engines"):
        return len(run.outputs["engines"])
    return min(_asked(run), run.gpus * _engines_per_gpu(run))


def _asked(run: StageRun) -> int:
    """The engines a regenerate run asked for: its ``regenerate.num_workers`` override, else one per GPU."""
    return int(job_sets(run.record).get("regenerate.num_workers", run.gpus))


def _batch(run: StageRun) -> tuple[int | None, int]:
    """(workers, tokens per worker per step) of a train run: its job's overrides, else its recipe's (workers:
    None)."""
    workers = job_sets(run.record).get("training.num_workers")
    return (int(workers) if workers else None), int(training_setting(run.record, "batch_tokens"))


def _method_cell(run: StageRun) -> str:
    """``peagle, ddp``: a train run's method and parallel strategy."""
    return f"{training_setting(run.record, 'method')}, {training_setting(run.record, 'parallel_strategy')}"


def _batch_cell(run: StageRun) -> str:
    workers, per = _batch(run)
    return f"{workers or run.gpus} x {per:,}"


def training(lines: list[str]) -> None:
    runs = _per_gpus(lines, "train", TRAIN_HEADING, [
        ("training tok/s", lambda x: train_tok_s(_history(x)))], "training tok/s",
        extra=[("method, strategy", _method_cell), ("workers x tokens a step", _batch_cell)],
        same=lambda a, b: training_setting(a.record, "method") == training_setting(b.record, "method"))
    loss_curves(lines, runs)
    training_reading(lines, runs)
    progress_reading(lines, runs)


def _history(run: StageRun) -> list[dict]:
    return run.outputs.get("history") or []


def loss_curves(lines: list[str], runs: list[StageRun]) -> None:
    """The loss of each logged window of each run, with its global batch (the issue: at equal global batch the
    curve matches one GPU's), one table per machine."""
    for machine in dict.fromkeys(x.machine for x in runs):
        here = [x for x in runs if x.machine == machine and _history(x)]
        if len(here) < 2:
            continue
        hist = {x.name: {int(h["step"]): h for h in _history(x)} for x in here}
        header = ["step", *[f"loss, {x.gpus} GPU{'s' if x.gpus > 1 else ''} ({_method_cell(x)}, {_batch_cell(x)})"
                            for x in here]]
        steps = sorted(set().union(*[h.keys() for h in hist.values()]))
        rows = [[s, *[f(hist[x.name].get(s, {}).get("loss"), 3) for x in here]] for s in steps]
        lines += [f"Loss per logged window, {machine} (training stage records; EAGLE-3's loss sums its TTT steps):",
                  ""]
        lines += table(header, rows) + [""]


LONG_RUN_STEPS = 100  # past this a run's windows are its steady state (60-step runs were still speeding up)


def _window_effs(a: dict, b: dict, gpus: int) -> str:
    """Per-GPU efficiency of the last three common windows of two runs (``{step: window}``)."""
    steps = sorted(a.keys() & b.keys())[-3:]
    return ", ".join(f"step {s}: {b[s]['tokens_per_s'] / gpus / a[s]['tokens_per_s']:.0%}" for s in steps)


def training_reading(lines: list[str], runs: list[StageRun]) -> None:
    """The 4-GPU runs against the same machine's 1-GPU run at the same global batch."""
    peagle = [x for x in runs if training_setting(x.record, "method") == "peagle" and _history(x)]
    for wide in [x for x in peagle if x.gpus > 1 and training_setting(x.record, "parallel_strategy") == "ddp"]:
        base, here = _baseline(wide, peagle)
        if base is None or not here:
            continue
        a = {int(h["step"]): h for h in _history(base)}
        b = {int(h["step"]): h for h in _history(wide)}
        gap = max(abs(b[k]["loss"] / a[k]["loss"] - 1) for k in a.keys() & b.keys())
        last = max(a.keys() & b.keys())
        eff = train_tok_s(_history(wide)) / wide.gpus / train_tok_s(_history(base))
        last_eff = b[last]["tokens_per_s"] / wide.gpus / a[last]["tokens_per_s"]
        first = _history(wide)[1]["tokens_per_s"]  # the first window after compilation
        equal = _batch(base)[1] == wide.gpus * _batch(wide)[1]
        lines += [(f"Reading ({wide.machine}, P-EAGLE, DDP on {wide.gpus} GPUs against 1): "
                   f"{'at equal global batch ' if equal else 'at another global batch (the 1-GPU run has more tokens a worker) '}"
                   f"the losses agree within {gap:.1%} at every logged window. Per GPU, {wide.gpus} workers keep "
                   f"{eff:.0%} of one GPU's tokens/s over the run (median window after the first; goal "
                   f"{SCALE_GOAL:.0%}: {'met' if eff >= SCALE_GOAL else 'not met'}), {last_eff:.0%} in the last "
                   f"window (step {last})" + (
                       f": the {wide.gpus}-worker run was still speeding up ({first:,.0f} -> "
                       f"{b[last]['tokens_per_s']:,.0f} tok/s) when its {last} steps ended; whether it settles at the "
                       "goal needs a longer run." if b[last]["tokens_per_s"] > 1.05 * first and last <= LONG_RUN_STEPS
                       else f"; the last windows {_window_effs(a, b, wide.gpus)}."))]
        fsdp = next((x for x in peagle if x.machine == wide.machine and x.gpus == wide.gpus
                     and training_setting(x.record, "parallel_strategy") == "fsdp"), None)
        if fsdp is not None:
            c = {int(h["step"]): h for h in _history(fsdp)}
            lines[-1] += (f" FSDP on the same {wide.gpus} GPUs ran {train_tok_s(_history(fsdp)) / train_tok_s(_history(wide)):.0%} "
                          f"of DDP's tokens/s (a 4-layer head gains nothing from sharding) with the same losses "
                          f"(step {last}: {c[last]['loss']:.3f} against {b[last]['loss']:.3f}).")
        lines += [""]


# A 300-step run on 4 GPUs and the same machine's 1-GPU run, whose record was lost (its device call ended after the
# job SUCCEEDED and before `record`): their console logs, as the device returned them.
PROGRESS_PAIR = ("multi_gpu_train_4_long", "multi_gpu_train_1_long4")
PROGRESS_LINE = re.compile(r"^\[train\] (\d+)/\d+ steps, .* (\d+)m(\d+)s$")
WARM_STEP = 10  # progress lines from this step on: past the first step's compilation


def progress_steps_per_s(log: str) -> float | None:
    """Steps a second from a train stage's console progress lines (``[train] 98/300 steps, ..., 2m00s``): from the
    first line at or past :data:`WARM_STEP` to the last line before the final one (which closes a shorter
    interval); None with fewer than two such lines."""
    points = [(int(m[1]), 60 * int(m[2]) + int(m[3])) for m in map(PROGRESS_LINE.match, log.splitlines()) if m]
    points = [pt for pt in points[:-1] if pt[0] >= WARM_STEP]
    if len(points) < 2 or points[-1][1] == points[0][1]:
        return None
    return (points[-1][0] - points[0][0]) / (points[-1][1] - points[0][1])


def progress_reading(lines: list[str], runs: list[StageRun]) -> None:
    """The :data:`PROGRESS_PAIR`'s scaling from their console logs: steps/s x tokens a step, per GPU."""
    wide = next((x for x in runs if x.name == PROGRESS_PAIR[0]), None)
    logs = [RESULTS / f"{name}.log" for name in PROGRESS_PAIR]
    if wide is None or not all(p.exists() for p in logs):
        return
    rates = [progress_steps_per_s(p.read_text()) for p in logs]
    if None in rates:
        return
    workers, per = _batch(wide)
    tok = [rate * (workers or wide.gpus) * per for rate in rates]  # both at the same global batch
    eff = tok[0] / wide.gpus / tok[1]
    warm = [h["tokens_per_s"] for h in _history(wide)[1:]]
    lines += [(f"Reading ({wide.machine}, P-EAGLE, DDP, 300 steps on {wide.gpus} GPUs against 1 at equal global batch, "
               f"from the console's progress lines: `{PROGRESS_PAIR[0]}.log`, `{PROGRESS_PAIR[1]}.log`; the 1-GPU "
               "run's record was lost, its device call having ended after the job SUCCEEDED and before `record`): "
               f"{wide.gpus} workers ran {rates[0]:.2f} steps/s ({tok[0]:,.0f} tok/s), one worker {rates[1]:.2f} "
               f"({tok[1]:,.0f} tok/s): per GPU {eff:.0%} (goal {SCALE_GOAL:.0%}: "
               f"{'met' if eff >= SCALE_GOAL else 'not met'}). The {wide.gpus}-GPU run's logged windows after the first ran "
               f"{min(warm):,.0f}-{max(warm):,.0f} tok/s up to step {int(_history(wide)[-1]['step'])}: it was not "
               "still warming up."), ""]
