"""Sections of ``docs/benchmarks.md`` on one several-GPU node run as a Ray cluster of two "nodes"
(``bench/device/run_multi_gpu.sh``, ``bench/multi_gpu.py``): the main job's stages, where each ran and what it did
(``multi_gpu_pipeline.json``); the autoscaled GPU Serve replicas under a load ramp (``serve_autoscale.json``);
training at 1, 2 and 4 GPUs (``multi_gpu_train_<N>.json``, where run)."""

from __future__ import annotations

import statistics
from typing import Any

from bench.report_fmt import f, load, section, stage_table, table

PIPELINE_HEADING = "### The main job on one 4-GPU node: every stage through Ray, a real MLflow server"
SERVING_HEADING = "### Autoscaled GPU vLLM replicas under a load ramp"
TRAIN_HEADING = "### Training on 1, 2 and 4 GPUs through the train stage"
REGEN_HEADING = "### Regeneration on 1, 2 and 4 GPUs through the regenerate stage (one vLLM engine per GPU)"
CAPTURE_HEADING = "### Capture on 1, 2 and 4 GPUs through the capture stage (one actor per GPU)"
SCALE_GOAL = 0.90  # issue goal: tokens/s scaling efficiency at 4 GPUs
REGEN_GOAL_TOK_S = 45_000  # output tokens/s per H100 for SmolLM2 (datatrove's tuned public figure)


def _where(st: dict) -> str:
    from pipelines.placement import Placement

    return Placement.describe(st.get("placement"))


def _train_tok_s(history: list[dict]) -> float | None:
    """Median tokens/s of the logged training windows after the first (compilation and warm-up)."""
    vals = [h["tokens_per_s"] for h in history[1:] if h.get("tokens_per_s")]
    return statistics.median(vals) if vals else None


def _what(n_gpus: dict[str, int]) -> dict:
    def per_gpu(total: float | None, stage: str) -> str:
        n = n_gpus.get(stage) or 0
        return f", {total / n:,.0f} per GPU" if total and n > 1 else ""

    return {
        "regenerate": lambda o: (f"{o['num_conversations']:,} conversations, {o.get('num_generated_tokens') or 0:,} "
                                 f"tokens; {o.get('tokens_per_s') or 0:,.0f} tok/s per engine inside its generate "
                                 f"calls, {o.get('wall_tokens_per_s') or 0:,.0f} tok/s over the stage (all engines, "
                                 "their start included)"),
        "capture": lambda o: (f"{o.get('num_samples', 0):,} samples, {o.get('num_tokens', 0):,} tokens, "
                              f"{(o.get('bytes_on_disk') or 0) / 2**30:.1f} GiB, {o.get('tokens_per_s') or 0:,.0f} "
                              f"tok/s over the stage{per_gpu(o.get('tokens_per_s'), 'capture')}"),
        "train": lambda o: (f"{o['step']} steps, {_train_tok_s(o.get('history') or []) or 0:,.0f} training tok/s "
                            "(median logged window after the first, all workers)"),
        "evaluate": lambda o: "; ".join(f"{x['method']} K={x['K']} c={x['concurrency']}: AL "
                                        f"{x['acceptance_length']:.2f}, {x['tokens_per_s']:,.0f} tok/s"
                                        for x in o.get("rows", [])),
        "register": lambda o: f"{o.get('model_name')} v{o.get('version')} ({'champion' if o.get('promoted') else 'challenger'})",
        "serve": lambda o: f"{o.get('url')} serving {o.get('head')}",
    }


def pipeline(lines: list[str]) -> None:
    r = section(lines, "multi_gpu_pipeline", PIPELINE_HEADING)
    if r is None:
        return
    e, c, job = r["environment"], r["cluster"], r["job"]
    gpus = r.get("gpus") or []
    lines += [(f"{f'{len(gpus)} x {gpus[0]}' if gpus else e['device']}, {e['date'][:10]}; one host as {c['nodes']} Ray nodes "
               f"of {c['gpus_per_node']} GPUs (`python -m pipelines.local_ray start` + `join`, each with its own "
               "`CUDA_VISIBLE_DEVICES`), an MLflow tracking server (`peagle registry server start`, SQLite store, "
               f"served artifacts) for register and serve; the job: `ray job submit -- {' '.join(job['entrypoint'])}` "
               "(`bench/device/run_multi_gpu.sh`)."), ""]
    n_gpus = {k: (v.get("placement") or {}).get("num_gpus", 0) for k, v in r["summary"]["stages"].items()}
    rows = stage_table(r, _what(n_gpus))
    where = {k: _where(v) for k, v in r["summary"]["stages"].items()}
    head, sep, *body = rows
    lines += [head.replace("| seconds |", "| seconds | where |"), sep + "---|"]
    for row, name in zip(body, r["summary"]["stages"], strict=True):
        cells = row.split(" | ")
        lines.append(" | ".join(cells[:3] + [where[name]] + cells[3:]))
    regen = (r["stage_records"].get("regenerate") or {}).get("outputs") or {}
    if regen.get("tokens_per_s"):
        per = regen["tokens_per_s"]  # RegenerateResult.tokens_per_s: tokens / engine seconds summed = per engine
        lines += ["", (f"Regeneration per GPU (one engine each): {per:,.0f} tok/s in the engine against "
                       f"{REGEN_GOAL_TOK_S:,} ({'met' if per >= REGEN_GOAL_TOK_S else 'not met'}).")]
    if r.get("note"):
        lines += ["", r["note"]]
    lines += [""]


RAMP_RUNS = ("serve_autoscale", "serve_autoscale_kill", "serve_autoscale_run3",
             "serve_autoscale_run4")  # the load ramps in the order run


def serving(lines: list[str]) -> None:
    runs = [section(lines, RAMP_RUNS[0], SERVING_HEADING), *(load(name) for name in RAMP_RUNS[1:])]
    for r in runs:
        if r is not None:
            ramp_run(lines, r)
    replicas_started(lines)
    rollout(lines)


LATENCY_COLUMNS = ("TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms")


def _latency_cells(x: dict) -> list[str]:
    """The :data:`LATENCY_COLUMNS` cells of a ``bench.serve_autoscale`` row (``serve_autoscale.latencies``)."""
    return [f(x["ttft_ms_p50"], 0), f(x["ttft_ms_p99"], 0), f(x["tpot_ms_p50"], 1), f(x["tpot_ms_p99"], 1)]


def ramp_run(lines: list[str], r: dict) -> None:
    """One run of ``bench.serve_autoscale``: its levels, the scale-up and -down, kills, per replica count."""
    e = r["environment"]
    lines += [(f"{e['device']}, {e['date'][:10]}; `{r['command']}` against the serve stage's endpoint: closed-loop "
               f"streaming clients, {_prompts(r)}, {r['output_len']} output tokens each; the "
               "LLMServer replicas Serve ran meanwhile read from `serve.status()` every second."), ""]
    rows = [[x["concurrency"], x["seconds"], f"{x['replicas_min']}-{x['replicas_max']} ({x['replicas_end']})",
             x["completed"], x["failed"], f(x["requests_per_s"]), f(x["output_tokens_per_s"], 0), *_latency_cells(x)]
            for x in r["levels"]]
    lines += table(["concurrency", "seconds", "replicas min-max (end)", "completed", "failed", "requests/s",
                    "output tok/s", *LATENCY_COLUMNS], rows)
    start, top = r["replicas_at_start"], r["replicas_max_seen"]
    if top is not None and start is not None and top > start:
        reach, down = r["scale_up_to_max_s"], r["scale_down_s"]
        up = (f"{top} were running {f(reach, 0)} s after the first level above concurrency 1 began" if reach is not None
              else f"{top} at most, fewer than the ramp's --max-replicas")
        back = _scaled_down(r) or (f"back to {start} {f(down, 0)} s after the load ended" if down is not None
                                   else f"not back to {start} within the idle watch")
        scaled = f"Replicas {start} -> {top}: {up}; {back}."
    else:
        scaled = f"No scale-up: {start} replica(s) throughout."
    kills = ", ".join(f"pid {k['pid']} at {k['t_s']} s" + (
        f" ({k['replicas_running']} running)" if k.get("replicas_running") is not None else "")
        for k in r.get("kills") or []) or "none"
    lines += ["", f"{scaled} Replica SIGKILLs: {kills}; failed requests over the ramp: {r['failed_total']}."]
    if r.get("note"):
        lines += ["", r["note"]]
    lines += [""]
    if r.get("by_replicas"):
        lines += ["Per replica count (requests grouped by the replicas running when each started):", ""]
        lines += table(["concurrency", "replicas", "seconds", "completed", "failed", "requests/s", *LATENCY_COLUMNS],
                       [[x["concurrency"], x["replicas"], x["seconds"], x["completed"], x["failed"],
                         f(x["requests_per_s"]), *_latency_cells(x)] for x in r["by_replicas"]]) + [""]


def _scaled_down(r: dict) -> str | None:
    """When the replicas were back at the start count after the peak, counted from the first lower level after it
    (a ramp that ends on a lower level scales down under load); None when that happened only after the load."""
    timeline, start = r.get("timeline") or [], r["replicas_at_start"]
    peak = next((t for t, n, *_ in timeline if n == r["replicas_max_seen"]), None)
    if peak is None:
        return None
    at_peak = [x for x in r["levels"] if x["t_start_s"] <= peak][-1]
    lower = next((x for x in r["levels"] if x["t_start_s"] > peak and x["concurrency"] < at_peak["concurrency"]), None)
    back = next((t for t, n, *_ in timeline if t > peak and n <= start), None)
    if lower is None or back is None or back > lower["t_start_s"] + lower["seconds"]:
        return None
    return (f"back to {start} at {f(back, 0)} s, {f(back - lower['t_start_s'], 0)} s after the load fell to "
            f"concurrency {lower['concurrency']}")


def _prompts(r: dict) -> str:
    """The ramp's prompts: token ids (runs before 2026-11-27's fourth session, no ``prompts`` key) or text."""
    if r.get("prompts", "token ids") == "token ids":
        return f"{r['input_len']}-token prompts of token ids"
    return f"{r['input_len']}-word text prompts"


def replicas_started(lines: list[str]) -> None:
    started = load("serve_replicas")
    if started is not None:
        e = started["environment"]
        outcome = (f"all ran {f(started['seconds'], 0)} s after the roll began" if started["ok"]
                   else f"failed after {f(started['seconds'], 0)} s: {started['error'][-300:]}")
        lines += [(f"Replicas starting together (`python -m bench.serve_replicas --replicas {started['replicas']}`, "
                   f"{len(started['gpus'])}x {e['device']}, {e['date'][:10]}; the serve stage's deployment, target "
                   f"alone, replica environment {started['replica_env']}): {outcome}."), ""]
        if started.get("note"):
            lines += [started["note"], ""]


def rollout(lines: list[str]) -> None:
    """The blue/green rolls to a new champion under load: ``serve_rollout.json`` (``run_multi_gpu.sh roll``) and
    the ramps of :data:`RAMP_RUNS` that rolled (``run_multi_gpu.sh load`` with ``ROLL_AT``)."""
    runs = [r for r in (load(name) for name in ("serve_rollout", *RAMP_RUNS)) if r is not None and r.get("rolls")]
    if not runs:
        lines += ["Blue/green roll to a new champion under load on GPUs (`bench/device/run_multi_gpu.sh roll`): not run.",
                  ""]
    for r in runs:
        _rolls(lines, r)


def _rolls(lines: list[str], r: dict) -> None:
    e = r["environment"]
    for roll in r["rolls"]:
        level = [x for x in r["levels"] if x["t_start_s"] <= roll["t_start_s"]][-1]
        served = ", ".join(f"{head}: {n}" for head, n in sorted((level.get("served") or {}).items())) or "not recorded"
        lines += [(f"Blue/green roll to a new champion under load ({e['device']}, {e['date'][:10]}; "
                   f"`bench/device/run_multi_gpu.sh roll`, or `load` with `ROLL_AT`: {level['concurrency']} closed-loop clients for "
                   f"{level['seconds']} s while the champion's files were registered as a new champion and the serve "
                   f"stage was submitted alone): the roll ran from {roll['t_start_s']} s to {roll['t_end_s']} s "
                   f"(exit status {roll['returncode']}); {level['completed']} requests completed, "
                   f"{level['failed']} failed; answered by {served}."), ""]
    if r.get("note") and r.get("benchmark") != "serve_autoscale":  # a ramp's note is under its own table
        lines += [r["note"], ""]


SCALE_GPUS = (1, 2, 4)


def _stage_run(stage: str, n: int) -> tuple[dict, str] | None:
    """``(outputs, source)`` of ``stage`` run on ``n`` GPUs through ``bench/device/run_multi_gpu.sh``: the stage
    alone (``stage STAGE multi_gpu_<stage>_<n>``), or at 4 GPUs the main job's own stage; None where not run."""
    r, src = load(f"multi_gpu_{stage}_{n}"), f"`multi_gpu_{stage}_{n}.json`"
    if r is None and n == 4:
        r, src = load("multi_gpu_pipeline"), "the main job"
    rec = (r or {}).get("stage_records", {}).get(stage)
    if not rec or rec.get("status") != "ran":
        return None
    return rec.get("outputs") or {}, f"{src}, {(r.get('environment') or {}).get('date', '')[:10]}"


def _per_gpus(lines: list[str], stage: str, heading: str, metrics: list[tuple[str, Any]], scaled: str) -> None:
    """One stage at 1, 2 and 4 GPUs: ``metrics`` (column, fn(outputs, n) -> tok/s), the efficiency of the column
    ``scaled`` against ``n`` times its 1-GPU value (the issue's goal: >= 0.9, i.e. 3.6x at 4 GPUs)."""
    lines += [heading, ""]
    runs = {n: _stage_run(stage, n) for n in SCALE_GPUS}
    if not any(runs.values()):
        lines += ["not run", ""]
        return
    col = dict(metrics)[scaled]
    base = runs[1] and col(runs[1][0], 1)
    rows = []
    for n, run in runs.items():
        if run is None:
            rows.append([n, "not run"] + ["-"] * (len(metrics) + 1))
            continue
        out, src = run
        eff = f(col(out, n) / (n * base), 2) if base and col(out, n) else "-"
        rows.append([n, src, *[f"{v:,.0f}" if (v := fn(out, n)) else "-" for _, fn in metrics], eff])
    lines += table(["GPUs", "run", *[c for c, _ in metrics], f"efficiency vs 1 GPU (goal >= {SCALE_GOAL})"], rows)
    lines += [""]


def _profile(o: dict, key: str) -> float | None:
    return (o.get("profile") or {}).get(key)


def _steady(o: dict) -> float | None:
    """The capture pool's tokens/s once its actors started (``pipelines.capture.materialize.steady_tokens_per_s``,
    recomputed from the record's profile: records before 2026-11-28 stored another definition)."""
    from pipelines.capture.materialize import steady_tokens_per_s

    return steady_tokens_per_s(o["profile"], o.get("num_tokens", 0)) if o.get("profile") else None


def _forward_tok_s(o: dict, n: int) -> float | None:
    """The capture actors' model step alone (forward and copy to host): tokens / (forward seconds / actors)."""
    fwd, actors = _profile(o, "forward_s"), _profile(o, "num_actors")
    return o.get("num_tokens", 0) / (fwd / actors) if fwd and actors else None


def data_path(lines: list[str]) -> None:
    """Regeneration and capture at 1, 2 and 4 GPUs, the engine's scheduler sweep, where capture time goes."""
    _per_gpus(lines, "regenerate", REGEN_HEADING, [
        # RegenerateResult.tokens_per_s is per engine (tokens / engine seconds summed): n engines decode n times it
        ("tok/s in the engines (all)", lambda o, n: (o.get("tokens_per_s") or 0) * n),
        ("tok/s per engine", lambda o, n: o.get("tokens_per_s")),
        ("tok/s over the stage", lambda o, n: o.get("wall_tokens_per_s"))], "tok/s in the engines (all)")
    regen_sweep(lines)
    regen_reading(lines)
    _per_gpus(lines, "capture", CAPTURE_HEADING, [
        ("tok/s over the stage", lambda o, n: o.get("tokens_per_s")),
        ("tok/s once started", lambda o, n: _steady(o)),
        ("tok/s of the model step alone", _forward_tok_s)], "tok/s over the stage")
    capture_profile(lines)


def regen_sweep(lines: list[str]) -> None:
    """vLLM's own ``LLM.generate`` on the same prompts, one engine per GPU at once (``bench.regen_throughput
    --per-gpu``): the ceiling the regenerate stage's engines can reach, by scheduler setting."""
    r = load("multi_gpu_regen_sweep")
    if r is None:
        return
    lines += [(f"vLLM alone ({r.get('prompts')} ShareGPT first turns in one `generate` call, at most "
               f"{r.get('max_new_tokens')} new tokens, {(r.get('environment') or {}).get('device', '')}, vLLM "
               f"{(r.get('vllm') or {}).get('vllm', '')}; `multi_gpu_regen_sweep.json`):"), ""]
    rows = [[x.get("scheduler_max_num_seqs", "-"), x.get("scheduler_max_num_batched_tokens", "-"),
             "vLLM's default" if not x.get("max_num_seqs") else "set", x.get("engines_at_once", 1),
             f"{x['tokens_per_s']:,.0f}" if x.get("tokens_per_s") else x.get("error", "-"),
             f(x.get("engine_start_s"), 0)] for x in r.get("vllm_sweep", [])]
    lines += table(["max_num_seqs", "max_num_batched_tokens", "", "engines at once", "tok/s per engine",
                    "engine start s"], rows) + [""]


def regen_reading(lines: list[str]) -> None:
    """What the regenerate rows say, from the 1- and 2-GPU stage runs and vLLM's own sweep."""
    one, two, sweep = _stage_run("regenerate", 1), _stage_run("regenerate", 2), load("multi_gpu_regen_sweep")
    if not (one and two and sweep):
        return
    best = max(x["tokens_per_s"] for x in sweep["vllm_sweep"] if x.get("tokens_per_s"))
    lines += [(f"Reading: each engine of the stage decodes {one[0]['tokens_per_s']:,.0f}-{two[0]['tokens_per_s']:,.0f} "
               f"tok/s, as fast as vLLM alone on these prompts ({best:,.0f} at best; the public tuned setting, 512 "
               "sequences and 32,768 batched tokens, is no faster here): the stage is not what stands between "
               f"SmolLM2 and the goal of {REGEN_GOAL_TOK_S:,} per GPU, vLLM 0.26's step is (a 135M target is "
               "host-bound). The engines scale with the GPUs; the stage's wall time does less "
               f"({two[0]['wall_tokens_per_s'] / one[0]['wall_tokens_per_s']:.2f}x from 1 to 2 GPUs) because each "
               "engine's start (~100 s, compilation and CUDA graphs) is paid once per GPU whatever the data size. "
               "The 4-GPU row is the main job of 2026-11-27 (4,000 conversations, turns fed one batch per turn): "
               "its stage time is mostly engine start. Each conversation's next turn is now queued as soon as its "
               "answer ends, so progress moves conversation by conversation; no same-machine A/B against the "
               "batch-per-turn runner was measured."), ""]


def capture_profile(lines: list[str]) -> None:
    """Where the capture stage's time went at each GPU count that has a profile (``capture_meta`` ``profile``)."""
    rows = []
    for n in SCALE_GPUS:
        run = _stage_run("capture", n)
        prof = (run or ({}, ""))[0].get("profile")
        if not prof:
            continue
        o = run[0]
        rows.append([n, f"{o.get('num_tokens', 0):,}", f"{o.get('bytes_per_token', 0):,.0f}",
                     *[f(prof.get(k), 1) for k in ("actor_start_s", "wait_s", "forward_s", "write_s", "run_s")]])
    if not rows:
        return
    lines += [("Where the capture time went (seconds summed over the actors; `run s` is the actor pool's wall "
               "time):"), ""]
    lines += table(["GPUs", "tokens", "bytes/token on disk", "actor start s", "waiting for input s",
                    "forward + copy to host s", "shard writes s", "run s"], rows) + [""]
    n, o = next((n, run[0]) for n in SCALE_GPUS if (run := _stage_run("capture", n)) and run[0].get("profile"))
    prof, fwd = o["profile"], _forward_tok_s(o, n)
    busy = prof["forward_s"] + prof["write_s"]
    steady = _steady(o) / n
    reading = (f"Reading ({n} GPUs): the shard writes took {prof['write_s'] / busy:.0%} of the actors' forward and "
              f"write time ({o.get('bytes_per_token', 0):,.0f} bytes per token: three aux hidden states and the final "
              f"one, {o.get('bytes_on_disk', 0) / prof['write_s'] / 2**20:,.0f} MiB/s per actor), each write after its "
              f"forward. Once started, an actor captured {steady:,.0f} tok/s (the pool's wall time less the mean "
              f"actor start), {steady / (fwd / n):.0%} of its model step alone ({fwd / n:,.0f} tok/s; goal >= 50%): "
              f"capture was bound by the disk, not by the GPU. Start-up ({prof['actor_start_s'] / n:.0f} s per "
              "actor) and waiting for tokenized input are small. Since 2026-11-28 a GPU actor writes a shard while it "
              "captures the next (two calls in flight per actor, one forward at a time; "
              "`CaptureShardActor.SHARDS_IN_FLIGHT`), not yet run on a GPU; streaming capture into training "
              "(`capture.streaming`) writes no shards at all." + _shard_write_note())
    lines += [reading, ""]


def _shard_write_note() -> str:
    """The shard writer's A/B on the CPU box (``bench.shard_write``), where run."""
    r = load("shard_write")
    if r is None:
        return ""
    rate = {x["path"]: x["mib_per_s"] for x in r["rows"]}
    return (f" Since this run the writer hands safetensors the file instead of building each shard in memory first: "
            f"{rate['writer']:,.0f} against {rate['bytes_first']:,.0f} MiB/s for a {r['mib']:,.0f} MiB shard on the "
            "CPU box (`shard_write.json`, fsync included); not yet measured on a GPU machine's disk.")


def _batch(r: dict) -> tuple[int | None, int | None]:
    """(workers, tokens per worker per step) of a train run from its recipe overrides (None: the recipe's)."""
    sets = dict(s.split("=", 1) for s in (r.get("job") or {}).get("sets", []) if "=" in s)
    workers, per = sets.get("training.num_workers"), sets.get("training.batch_tokens")
    return (int(workers) if workers else None), (int(per) if per else None)


def training(lines: list[str]) -> None:
    _per_gpus(lines, "train", TRAIN_HEADING, [
        ("training tok/s", lambda o, n: _train_tok_s(o.get("history") or []))], "training tok/s")
    loss_curves(lines)
    one, two = load("multi_gpu_train_1"), load("multi_gpu_train_2")
    if one and two:
        losses = [{int(h["step"]): h["loss"] for h in r["stage_records"]["train"]["outputs"]["history"]}
                  for r in (one, two)]
        gap = max(abs(losses[1][k] / losses[0][k] - 1) for k in losses[0].keys() & losses[1].keys())
        lines += [("Reading: P-EAGLE (4 layers, K=5, DDP) at 1 GPU trains 32,768 tokens per step and at 2 GPUs "
                   "16,384 per worker, so the two runs share the global batch: their losses agree within "
                   f"{gap:.1%} at every logged window. Per GPU, 2 workers keep "
                   f"{_train_tok_s(two['stage_records']['train']['outputs']['history']) / 2 / _train_tok_s(one['stage_records']['train']['outputs']['history']):.0%}"
                   " of one GPU's tokens/s (the 1-GPU run at twice the tokens per step, which favours it). The 4-GPU "
                   "row is the main job of 2026-11-27 (150 steps, other data), not a run of this series. Not run "
                   "yet: 4 GPUs in this series, FSDP, EAGLE-3."), ""]


def loss_curves(lines: list[str]) -> None:
    """The loss of each logged window at 1, 2 and 4 GPUs, with each run's global batch (the issue: at equal global
    batch the curve matches one GPU's)."""
    runs = {n: load(f"multi_gpu_train_{n}") for n in SCALE_GPUS}
    runs = {n: r for n, r in runs.items() if r and (r.get("stage_records", {}).get("train") or {}).get("outputs")}
    if len(runs) < 2:
        return
    hist = {n: {int(h["step"]): h for h in r["stage_records"]["train"]["outputs"].get("history") or []}
            for n, r in runs.items()}
    header = ["step"]
    for n, r in runs.items():
        workers, per = _batch(r)
        header.append(f"loss, {n} GPU{'s' if n > 1 else ''} ({(workers or n)} x {per or 16384:,} tokens)")
    steps = sorted(set().union(*[h.keys() for h in hist.values()]))
    rows = [[s, *[f(hist[n].get(s, {}).get("loss"), 3) for n in runs]] for s in steps]
    lines += ["Loss per logged window (training stage records; the first and last three windows are kept):", ""]
    lines += table(header, rows) + [""]


NODE_FAULT_HEADING = "### A Ray node lost in the middle of training (its raylet SIGKILLed, then joined again)"
NODE_FAULT_RUNS = ("node_fault_train_cpu", "multi_gpu_node_fault")


def node_fault(lines: list[str]) -> None:
    """``bench.node_fault`` runs (``run_multi_gpu.sh nodekill``): the train stage alone on two Ray nodes of one host,
    node b's raylet SIGKILLed once the progress reaches a step, joined again after ``down_s``."""
    runs = [(name, r) for name in NODE_FAULT_RUNS if (r := load(name)) is not None]
    if not runs:
        return
    lines += [NODE_FAULT_HEADING, ""]
    rows = []
    for name, r in runs:
        job, kill, out = r.get("job") or {}, r.get("kill") or {}, ((r.get("stage_record") or {}).get("outputs") or {})
        env = r.get("environment") or {}
        sets = dict(x.split("=", 1) for x in job.get("sets", []) if "=" in x)
        rows.append([f"`{name}.json`", f"{env.get('device', '')}, {env.get('date', '')[:10]}",
                     sets.get("training.num_workers", "-"), sets.get("training.max_steps", "-"),
                     f"step {kill.get('progress', '-')} at {f(kill.get('t_s'), 0)} s", f(r.get("rejoined_s"), 0),
                     out.get("resumed_from_step") or "-", f"{job.get('status', '-')} after {f(job.get('seconds'), 0)} s",
                     r.get("last_progress", "-")])
    lines += table(["run", "where", "workers", "steps", "SIGKILL", "joined again s", "resumed from step",
                    "job", "last step on the bar"], rows) + [""]
    lines += [("Reading: on the CPU rehearsal Ray Train restarted the workers once the node was back and resumed "
               "from the step-10 checkpoint. On the GPU run (2 H200s, one Ray node each) the bar froze at step 49: "
               "the train stage's progress queue was a Ray actor placed on node b and died with it, so the driver "
               "saw no step after the kill, and the job was still running when the call's 200 s ran out; whether "
               "the training itself resumed there is not known. The driver's progress actors now live on the "
               "driver's node (`pipelines.tally.on_driver_node`), and a lost queue stops the bar, not the stage "
               "(tests/integration/test_progress_faults.py). The GPU run is to be repeated."), ""]
