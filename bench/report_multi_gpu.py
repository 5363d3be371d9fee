"""Sections of ``docs/benchmarks.md`` on one several-GPU node run as a Ray cluster of two "nodes"
(``bench/device/run_multi_gpu.sh``, ``bench/multi_gpu.py``): the main job's stages, where each ran and what it did
(``multi_gpu_pipeline.json``); the autoscaled GPU Serve replicas under a load ramp (``serve_autoscale.json``); a Ray
node lost in training. The stages alone at 1, 2 and 4 GPUs: :mod:`bench.report_per_gpu`."""

from __future__ import annotations

from bench.report_fmt import f, job_sets, load, section, stage_table, table, training_setting
from bench.report_per_gpu import REGEN_GOAL_TOK_S, train_tok_s

PIPELINE_HEADING = "### The main job on one 4-GPU node: every stage through Ray, a real MLflow server"
SERVING_HEADING = "### Autoscaled GPU vLLM replicas under a load ramp"


def _where(st: dict) -> str:
    from pipelines.placement import Placement

    return Placement.describe(st.get("placement"))


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
        "train": lambda o: (f"{o['step']} steps, {train_tok_s(o.get('history') or []) or 0:,.0f} training tok/s "
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


NODE_FAULT_HEADING = ("### A Ray node or a training worker lost in the middle of training (the node's raylet "
                      "SIGKILLed, then joined again; or one Ray Train worker SIGKILLed)")
NODE_FAULT_RUNS = ("node_fault_train_cpu", "multi_gpu_node_fault_2gpu", "multi_gpu_node_fault",
                   "worker_fault_train_cpu", "multi_gpu_worker_fault")


def _sample_ids_reading(epochs: list[dict]) -> str:
    """``; epoch 0 (3,671 samples) trained the planned sample ids, ...`` from ``bench.node_fault.sample_id_check``'s
    rows; ``""`` where no epoch ended (runs before 2026-12-02 did not read them)."""
    if not epochs:
        return ""
    ok = all(e["ranks_match_digest"] and e["ids_unique"] for e in epochs)
    done = ", ".join(f"{e['epoch']} ({e['num_samples']:,} samples)" for e in epochs)
    what = ("the planned sample ids, each once (every rank's ids chain to the digest its trainer recorded)" if ok
            else "NOT the planned sample ids (a rank's digest or a repeated id: see the result file)")
    return f"; epoch{'s' if len(epochs) > 1 else ''} {done} trained {what}"


def _fault_training(r: dict, key: str) -> str:
    """``training.<key>`` of a ``bench.node_fault`` run: its override, else its recipe's; ``-`` for runs that
    recorded no recipe (before 2026-11-29) and no override."""
    if (r.get("job") or {}).get("config"):
        return training_setting(r, key)
    return job_sets(r).get(f"training.{key}", "-")


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
        rows.append([f"`{name}.json`", f"{env.get('device', '')}, {env.get('date', '')[:10]}",
                     _fault_training(r, "num_workers"), _fault_training(r, "max_steps"),
                     f"{kill.get('what', 'raylet')}, step {kill.get('progress', '-')} at {f(kill.get('t_s'), 0)} s",
                     f(r.get("rejoined_s"), 0),
                     out.get("resumed_from_step") or "-", f"{job.get('status', '-')} after {f(job.get('seconds'), 0)} s",
                     r.get("last_progress", "-")])
    lines += table(["run", "where", "workers", "steps", "SIGKILL", "joined again s", "resumed from step",
                    "job", "last step on the bar"], rows) + [""]
    lines += [("Reading: on the CPU rehearsal Ray Train restarted the workers once the node was back and resumed "
               "from the step-10 checkpoint. On the first GPU run (2 H200s, one Ray node each, "
               "`multi_gpu_node_fault_2gpu.json`) the bar froze at step 49: the train stage's progress queue was a "
               "Ray actor placed on node b and died with it, and the job was still running when the call's 200 s "
               "ran out. The driver's progress actors have lived on the driver's node since "
               "(`pipelines.tally.on_driver_node`; a lost queue stops the bar, not the stage: "
               "tests/integration/test_progress_faults.py).")]
    gpu = dict(runs).get("multi_gpu_node_fault")
    if gpu and (gpu.get("stage_record") or {}).get("outputs", {}).get("resumed_from_step") is not None:
        kill, out = gpu["kill"], gpu["stage_record"]["outputs"]
        lines[-1] += (f" On {gpu['environment']['device']}s as Ray nodes of {gpu['node_args']['num_gpus']} GPUs "
                      f"({gpu['environment']['date'][:10]}), node {gpu['node']}'s raylet was SIGKILLed at step "
                      f"{kill['progress']} ({f(kill['t_s'], 0)} s into the job) and joined again "
                      f"{f(gpu['rejoined_s'] - kill['t_s'], 0)} s later; Ray Train restarted its "
                      f"{_fault_training(gpu, 'num_workers')} workers once the node was back, resumed from the step-{out['resumed_from_step']} checkpoint (steps "
                      f"{out['resumed_from_step'] + 1}-{kill['progress']} ran again) and finished all "
                      f"{out['step']} steps: {gpu['job']['status']} after {f(gpu['job']['seconds'], 0)} s, the bar "
                      f"following throughout.")
    for name, r in runs:
        kill, out = r.get("kill") or {}, ((r.get("stage_record") or {}).get("outputs") or {})
        if kill.get("what") == "worker":
            lines[-1] += (f" One Ray Train worker SIGKILLed ({r['environment']['device']}, "
                          f"{r['environment']['date'][:10]}, `{name}.json`) at step {kill['progress']}: the node "
                          f"stayed, the run resumed from step {out.get('resumed_from_step', '-')} and ended "
                          f"{r['job']['status']} after {f(r['job']['seconds'], 0)} s at step {out.get('step', '-')}"
                          + _sample_ids_reading(r.get("sample_ids") or []) + ".")
    lines += [""]
