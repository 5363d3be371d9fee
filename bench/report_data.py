"""The GPU data path and whole-job sections of ``docs/benchmarks.md`` (issue 14) and the shifted-traffic refresh
(issue 16): training warm-up, regeneration throughput, online vs offline steps, the main job through Ray, and the
multi-turn regeneration's engine batches (``bench.regen_batch_replay``)."""

from __future__ import annotations

from bench.common import ROOT
from bench.report_fmt import env, f, load, met, section, stage_table, table
from bench.report_scale import regen_tokens_per_s
from pipelines.recipe import load_recipe

STEADY_FACTOR = 2.0  # a step is steady once it takes < this x the median of the last five (the table's definition)
GOAL_REGEN_TOK_S = 30_000  # transformers regeneration, tokens/s (issue 14 item 3)
GOAL_ONLINE_RATIO = 1.15  # online / offline training step (issue 14 item 4)


def warmup(lines: list[str]) -> None:
    """Issue 14 item 7: compile warm-up of a training run (``bench.warmup_compile``), per method."""
    r = section(lines, "warmup_compile", "### Training warm-up: compilation per method")
    if r is None:
        return
    lines += [(f"`python -m bench.warmup_compile --methods eagle3 peagle --steps {len(r['rows'][0]['steps'])}` — "
               f"{env(r)}; random weights and states at SmolLM2's sizes, packed batches of {r['tokens'][0]}-"
               f"{r['tokens'][1]} tokens drawn per step, the methods run one after the other in one process (the second "
               "reuses kernels the first compiled). Steps to steady = steps until one takes < "
               f"{STEADY_FACTOR:g}x the median of the last five."), ""]
    rows = []
    for m in r["rows"]:
        s_ = [x["s"] for x in m["steps"]]
        steady = next((i for i, x in enumerate(s_) if x < STEADY_FACTOR * m["median_last5_s"]), len(s_))
        rows.append([m["method"], " / ".join(f(x, 1) for x in s_[:3]), steady, f(sum(s_[:steady]), 0),
                     m["graphs"], f(m["median_last5_s"], 3)])
    lines += table(["method", "first steps s", "steps to steady", "warm-up s", "graphs", "steady s/step"], rows)
    probe = r.get("probe")
    if probe:
        lines += ["", ("EAGLE-3's TTT builds its step masks by slicing one block mask over all steps "
                       "(`ttt_flex_step_masks`, since `46304e8`); with " + probe["what"] + ", the first of those "
                       f"masks had not been built after {probe['first_mask_not_built_after_s']} s on the same "
                       f"{r['device'].removeprefix('NVIDIA ').split()[0]} ({probe['date']})."), ""]
    else:
        lines += [""]


def regen_throughput(lines: list[str]) -> None:
    """Issue 14 item 3: regeneration throughput (transformers backend)."""
    r = section(lines, "regen_throughput", "### Regeneration throughput: the transformers engine on a GPU")
    if r is None:
        return
    lines += [(f"`python -m bench.regen_throughput` — {env(r)}; SmolLM2-135M {r['dtype']}, {r['prompts']} "
               f"ShareGPT first turns, greedy, <= {r['max_new_tokens']} new tokens, batches of <= {r['batch_size']} "
               f"prompts and {r['max_batch_tokens']} tokens, sorted by length. Same prompts, one run: plain "
               "`generate` (dynamic cache) vs `regenerate.static_cache` (StaticCache per shape, compiled "
               "decoding step); cold = first pass incl. compilations, warm = second pass. Goal >= "
               f"{GOAL_REGEN_TOK_S // 1000}k tok/s."), ""]
    lines += table(["variant", "generated tokens", "wall s", "tokens/s"],
                   [[k, r[k]["generated_tokens"], f(r[k]["wall_s"], 1), f"{r[k]['tokens_per_s']:.0f}"]
                    for k in ("plain", "static_cold", "static_warm")])
    best = max(r[k]["tokens_per_s"] for k in ("plain", "static_cold", "static_warm"))
    n = r.get("notes") or {}
    probe = n.get("fixed_shape_probe")
    why = "" if not probe else (
        f": a fixed-shape probe ({probe['prompts']} prompts of {probe['new_tokens']} tokens, every sequence decoding "
        f"all {probe['new_tokens']} tokens) ran {probe['tokens_per_s'] // 1000}k tok/s, but real batches lose "
        f"~{100 * n['slots_lost_to_stopped_sequences']:.0f}% of their slots to sequences that stopped early (no "
        f"continuous batching in `generate`) and each new shape costs a ~{n['compile_s_per_shape']} s compilation")
    lines += ["", (f"Warm speed-up {r['speedup_warm']:.2f}x; texts identical to plain for {r['agreement']:.0%} of "
                   "the prompts (bf16: more left padding changes rounding, and a greedy run diverges after the "
                   f"first different token). The goal is {met(best >= GOAL_REGEN_TOK_S)}{why}."), ""]


def online_step(lines: list[str]) -> None:
    """Issue 14 item 4: the online (capture in the step) vs offline training step."""
    r = section(lines, "online_step", "### Capturing online vs reading captured states: the training step")
    if r is None:
        return
    ratio = r["online_over_offline"]
    lines += [(f"`python -m bench.online_step` — {env(r)}; P-EAGLE, {r['layers']} layers, K={r['K']}, packed "
               f"batches of <= {r['num_tokens']} real ShareGPT tokens, median step. Offline = captured samples "
               "in host memory (as read from shards) -> pack -> GPU -> step; online = `capture_batch` "
               "(tokenization, target forward, hidden states to host) for the batch's conversations, then the "
               f"same step. Goal: online <= {GOAL_ONLINE_RATIO}x offline."), ""]
    lines += table(["offline step ms", "online step ms", "capture alone ms", "online / offline"],
                   [[f(r["offline_ms"], 1), f(r["online_ms"], 1), f(r["capture_only_ms"], 1), f(ratio)]])
    lines += ["", (f"{met(ratio <= GOAL_ONLINE_RATIO).capitalize()} ({ratio:.2f}x): the capture here runs in series "
                   "with the step and includes the chat-template tokenization on the CPU and a device -> host -> "
                   "device round trip. The pipeline's streaming mode (`capture.streaming: true`) runs the capture as "
                   "a Ray Data stage (a GPU actor) ahead of the trainer; its cost on one shared GPU was not measured."),
              ""]


def pipeline_device(lines: list[str]) -> None:
    """Issue 14 item 5: the main job (``python -m ray_jobs.pipeline``) on the lent GPU through Ray."""
    r = section(lines, "pipeline_device", "### The main job through Ray on one GPU: transformers engines")
    if r is None:
        return
    s, recs = r["summary"], r["stage_records"]
    lines += [(f"`{r['command']} {r['num_samples']}` — {env(r)}; Ray {r['versions']['ray']} (carried), `python -m "
               f"ray_jobs.pipeline --config configs/{s['recipe']}.yaml` with the script's overrides "
               + ", ".join(f"`--set {o}`" for o in r["overrides"]) + ". Regenerate and capture run as Ray Data actors "
               "holding the GPU, train as a Ray Train worker; the stages that need vLLM or MLflow are reported before "
               "any compute and recorded as not run."), ""]
    what = {"regenerate": lambda o: (f"{o['num_conversations']} conversations, {o['num_turns']} turns, "
                                     f"{o['num_generated_tokens']:,} tokens, {o['tokens_per_s']:.0f} tok/s"),
            "capture": lambda o: (f"{o['num_samples']} samples, {o['num_tokens']:,} tokens, "
                                  f"{o['bytes_on_disk'] / 2**30:.1f} GiB, {o['tokens_per_s']:.0f} tok/s"),
            "train": lambda o: f"{o['step']} steps, head exported, MLflow run {o['mlflow_run_id'] or 'none'}"}
    lines += stage_table(r, what)
    reg = recs["regenerate"]["outputs"]["tokens_per_s"]
    scale = load("scale_regenerate")
    size = scale["calls"][0]["size"] if scale else None
    lines += ["", (f"The whole job took {s['total_seconds']:.0f} s. Regeneration through the Ray Data actor ran at "
                   f"{reg:.0f} tok/s, against {f(regen_tokens_per_s(), 0)} tok/s for the same engine driven directly "
                   f"(`{scale['command'] if scale else '-'}`: the whole set sorted by length, batches of up to "
                   f"{scale['calls'][0]['batch_size'] if scale else '-'} prompts). Not profiled; what differs: the actor "
                   f"gets batches of `regenerate.batch_size` ({r['regenerate_batch_size']}) conversations in input "
                   "order, so each batch mixes lengths and meets new static-cache shapes, each compiled once, on "
                   f"{r['num_samples']} conversations instead of {size}."), ""]


def shifted_traffic_table(data: dict) -> list[str]:
    """Markdown rows of ``bench/results/shifted_traffic.json``: per recorded refresh run and eval set, champion
    vs challenger AL (same evaluate run), the challenger's tokens/s over no speculation, and the gate."""
    rows = []
    for name, run in data.get("runs", {}).items():
        by: dict[tuple, dict[str, dict]] = {}
        for r in run["rows"]:
            by.setdefault((r["eval_set"], r["K"] if r["method"] != "none" else None), {})[r["method"]] = r
        gate = run["gate"]
        verdict = gate.get("reason") or ("promoted" if gate.get("promoted") else "kept the champion")
        for (eval_set, k), m in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
            if k is None:
                continue
            none = by.get((eval_set, None), {}).get("none", {}).get("tokens_per_s")
            champ, chal = (m.get(x, {}).get("acceptance_length") for x in ("champion", "peagle"))
            speedup = m.get("peagle", {}).get("speedup")
            rows.append([name, eval_set, k, f(none, 1), f(champ, 3), f(chal, 3),
                         f(chal / champ, 3) if champ and chal else "-",
                         "not measured" if speedup is None else f(speedup), verdict])
    return table(["run", "eval set", "K", "tok/s, no speculation", "champion AL", "challenger AL",
                  "challenger / champion", "challenger tok/s / none", "gate"], rows)


def shifted_traffic(lines: list[str]) -> None:
    r = section(lines, "shifted_traffic", "### Refreshing the demo head from a shifted workload")
    if r is None:
        return
    s = r.get("send", {})
    lines += [
        (f"`python -m bench.shifted_traffic` ({r['environment']['device']}, {r['environment']['date'][:10]}): the "
         "`make demo` head (trained on code conversations) served with the traffic log on receives "
         f"{s.get('num_requests')} greedy chat requests (ShareGPT first turns the demo's filter does not select, "
         f"{s.get('concurrency')} at a time, {s.get('max_tokens')} tokens max; {s.get('num_failed')} failed, "
         f"{s.get('output_tokens_per_s')} output tokens/s). Each refresh run "
         "(`configs/smollm2-135m-cpu-refresh.yaml`) trains a challenger on the log and measures it beside the "
         "champion in the same evaluate run (vLLM, same prompts and K) on the held-out newest slice of the traffic "
         "and on HumanEval; the gate compares the traffic slice."),
        "",
        *shifted_traffic_table(r),
        "",
    ]


def regen_batches(lines: list[str]) -> None:
    """``bench.regen_batch_replay``: the 300k recipe's multi-turn batches as they ran, and replayed in the batches
    the stage cuts now."""
    r = load("regen_batch_replay")
    if r is None:
        return
    lines += ["### Multi-turn regeneration: how many sequences an engine batch keeps running", "",
              (f"`python -m bench.regen_batch_replay` over the {r['conversations']:,} conversations "
               f"({r['tokens'] / 1e6:.1f}M tokens) of `{r['parts']}`, generated on {r['measured_on']} with "
               f"`{r['config']}` (max_num_seqs {r['max_num_seqs']}). Each batch replayed as continuous batching "
               "of its chains of turns; a step's time fitted on the measured batches as "
               f"{r['step_ms']['a']:.1f} ms + {r['step_ms']['b_per_sequence']:.3f} ms a sequence running."), ""]
    run = r["as_run"]
    rows = [["as run: input order, batches of " + " / ".join(map(str, r["batch_sizes_as_run"])), f"{run['steps']:,}",
             f(run["running"], 0), f"{run['measured_tokens_per_s']:,.0f} (measured)"]]
    for key, what in (("whole_batches", "input order, whole batches"),
                      ("longest_chains_first", "longest chains first, whole batches (the stage now)")):
        x = r[key]
        rows.append([f"{what} of {r['batch_size']}", f"{x['steps']:,}", f(x["running"], 0),
                     f"{x['predicted_tokens_per_s']:,.0f} (predicted)"])
    lines += table(["engine batches", "decode steps", "sequences running (mean)", "tok/s per engine"], rows) + [""]
    cfg = load_recipe(ROOT / r["config"]).regenerate
    short = load("multi_gpu_regenerate_4x2c")["stage_records"]["regenerate"]["outputs"]
    lines += [(f"Reading: a batch lasts as long as its longest chain of turns, up to {cfg.max_turns} answers of up to "
               f"{cfg.max_tokens_per_turn} tokens, and every batch in input order held one, so its engine ran "
               f"{run['running']:.0f} sequences at a time of the {r['max_num_seqs']} it may run. "
               "Ray Data also cut every default block of rows into one full batch and one of ~half size. The "
               "stage now sorts conversations by turns (`pipelines.data.regenerate.longest_chains_first`) and "
               f"hands each engine whole blocks: {r['longest_chains_first']['running'] / run['running']:.1f}x the "
               "sequences at once, but each step costs more with each "
               f"sequence, so the model gives {r['longest_chains_first']['predicted_tokens_per_s'] / run['measured_tokens_per_s']:.2f}x "
               "the tokens/s: long multi-turn histories, not the batching, bound these engines "
               f"({short['tokens_per_s']:,.0f} tok/s an engine on the {short['num_conversations']:,} shorter "
               "conversations of `multi_gpu_regenerate_4x2c.json` above). A prediction until a lease "
               "measures it."), ""]
