"""docs/benchmarks.md, issue 41: speculation under load on GPU vLLM (``bench.synthetic_serving --step-profile`` rows,
``gpu_synthetic_load.json``): cold and warm concurrencies, the step profile, and the goals on the 8B shape."""

from __future__ import annotations

from functools import partial

from bench.report_fmt import env as _env_line
from bench.report_fmt import f as _f
from bench.report_fmt import met, table

_env = partial(_env_line, triton=False)
_table = table


LOAD_HEADING = "Speculation under load: cold and warm concurrencies, and where a step's time goes"
LOAD_GOALS = {1: 1.9, 16: 1.3, 64: 1.0}  # issue 41: P-EAGLE / none on the 8B shape at each concurrency


def _load_settings(row: dict, env: bool = False) -> str:
    """A row's engine settings beyond the defaults (extra engine and speculative kwargs, a K schedule; with ``env``,
    the engine worker's environment too), '-' for none."""
    extra = {**row.get("engine_kwargs", {}), **row.get("spec_kwargs", {}), **(row.get("engine_env", {}) if env else {}),
             **({"k_schedule": row["k_schedule"]} if row.get("k_schedule") else {})}
    return ", ".join(f"{k}={v}" for k, v in extra.items()) or "-"


def changed_settings(row: dict) -> bool:
    """Whether a row ran with settings other than the defaults: engine or speculative kwargs, an engine
    environment (e.g. EAGLE-3 forced onto the V1 runner), or a K schedule."""
    return bool(row.get("engine_kwargs") or row.get("spec_kwargs") or row.get("engine_env") or row.get("k_schedule"))


def under_load(lines: list[str], data: dict | None) -> None:
    """Issue 41: ``bench.synthetic_serving --step-profile`` rows (``gpu_synthetic_load.json``): each cell's tokens/s
    against no speculation at the same warm-up, the later unsynchronized wave's, and that wave's step profile
    (``pipelines.evaluate.step_profile``)."""
    lines += [f"### {LOAD_HEADING}", ""]
    if data is None:
        lines += ["not run", ""]
        return
    rows = data["rows"]
    commands = sorted({r["command"] for r in rows if r.get("command")})
    lines += [(f"{_env(data)}; `NAME=gpu_synthetic_load bash bench/device/run_synthetic_serving.sh FLAGS` (the "
               f"{len(commands)} commands below). *runner*: vLLM's model runner (v1 forced with "
               "`VLLM_USE_V2_MODEL_RUNNER=0` in the rows of up to one warm-up wave; the rows of "
               f"{WARM} or more warm-up waves run each method on its default: no speculation and EAGLE-3 on V2, P-EAGLE on "
               "V1, the only one with parallel drafting), random-weight targets, synthetic acceptance at the profile of the head named in the table (its per-position acceptance in GPU vLLM, "
               f"{rows[-1].get('profile_source', '-')}). *warm-up*: untimed waves of c requests before c is timed "
               "(0: the first waves at a new concurrency, as the rows before this table were measured). *later "
               "wave*: one more wave of c requests after the whole sweep, host timers only "
               "(`pipelines.evaluate.step_profile`); its step is the wall time between two engine steps; *device "
               "busy*, *launches* from the wave after it, under `torch.profiler`. Host ms: time inside the runner's "
               "`propose_draft_token_ids` (draft) and `execute_model` (target forward queued) per step."), "",
              f"<details><summary>The {len(commands)} commands</summary>", "",
              *[f"- `{c}`" for c in commands], "", "</details>", ""]
    none = {(r["target"], r.get("warmup_waves", 0), r["concurrency"]): r for r in rows if r["method"] == "none"
            and not r.get("engine_kwargs")}

    table = []
    for r in rows:
        n = none.get((r["target"], r.get("warmup_waves", 0), r["concurrency"]))
        t, p = _later(r), (r.get("step_profile") or {}).get("profiler") or {}
        nt = _later(n) if n else {}
        host = t.get("host_ms", {})
        table.append([r["target"], r["method"], r["K"] or "-", r.get("model_runner", "-"), _load_settings(r),
                      r.get("warmup_waves", 0),
                      r["concurrency"], _f(r["acceptance_length"]), f"{r['tokens_per_s']:.0f}",
                      _f(r["tokens_per_s"] / n["tokens_per_s"]) if n and r is not n else "-",
                      f"{t['tokens_per_s']:.0f}" if t else "-",
                      _f(t["tokens_per_s"] / nt["tokens_per_s"]) if t and nt and r is not n else "-",
                      _f(t.get("wall_ms"), 1) if t else "-",
                      f"{100 * p['device_busy_fraction']:.0f}%" if p.get("device_busy_fraction") is not None else "-",
                      " / ".join(_f(host.get(k), 1) for k in ("draft", "execute_model")) if host else "-",
                      f"{p['graph_launches']:.0f} / {p['kernel_launches']:.0f}" if p else "-"])
    lines += _table(["target", "method", "K", "runner", "settings", "warm-up", "c", "AL", "tok/s", "x none",
                     "later wave tok/s", "x none", "later step ms", "device busy", "host ms draft / forward", "graphs / kernels"],
                    table) + [""]
    for target in sorted({r["target"] for r in rows}):
        lines += _load_readings(target, rows)
        for waves in warm_groups(rows, target):
            lines += _warm_readings(target, rows, waves)


WARM = 3  # the fewest warm-up waves of the rows taken each method on its default runner (a group per count)


def warm_groups(rows: list[dict], target: str | None = None) -> list[int]:
    """The warm-up counts >= :data:`WARM` of ``rows`` (of ``target`` when given), ascending: one group each."""
    return sorted({r.get("warmup_waves", 0) for r in rows if target in (None, r["target"])} - set(range(WARM)))


def _warm_readings(target: str, rows: list[dict], waves: int) -> list[str]:
    """The sentences on the rows of ``waves`` (>= :data:`WARM`) warm-up waves of one target: each speculative cell
    against no speculation per concurrency, P-EAGLE / EAGLE-3 (at K=5, and each at its best measured K), the goals
    on the 8B shape with the best K per concurrency and with one K, and what the warm-up waves compiled
    (``compiles``, ``pipelines.evaluate.step_profile.compile_counts``)."""
    warm = [r for r in rows if r["target"] == target and r.get("warmup_waves", 0) == waves]
    cell = {(r["method"], r["K"], r["concurrency"]): r for r in warm if not changed_settings(r)}
    cs = sorted(c for m, _, c in cell if m == "none")
    if not cs:
        return []
    x = {k: r["tokens_per_s"] / cell[("none", 0, k[2])]["tokens_per_s"] for k, r in cell.items() if k[0] != "none"}
    spec = sorted({(m, k) for m, k, _ in x})
    parts = [f"{m} K={k} ({cell[(m, k, cs[0])].get('model_runner', '-')}): "
             + ", ".join(f"c={c} {_f(x[(m, k, c)])}x" for c in cs if (m, k, c) in x) for m, k in spec]
    changed: dict[tuple, dict[int, float]] = {}  # (method, K, runner, settings) -> c -> x none, default settings
    for r in warm:
        if changed_settings(r) and ("none", 0, r["concurrency"]) in cell:
            key = (r["method"], r["K"], r.get("model_runner", "-"), _load_settings(r, env=True))
            changed.setdefault(key, {})[r["concurrency"]] = (
                r["tokens_per_s"] / cell[("none", 0, r["concurrency"])]["tokens_per_s"])
    parts += [f"{m} K={k} ({runner}, {settings}): " + ", ".join(f"c={c} {_f(v)}x" for c, v in sorted(by_c.items()))
              for (m, k, runner, settings), by_c in sorted(changed.items())]
    lines = [(f"**{target}**, after {waves} warm-up waves, against no speculation on its default runner: "
              + "; ".join(parts) + ".")]
    vs = [f"c={c} {_f(x[('peagle', 5, c)] / x[('eagle3', 5, c)])}x" for c in cs
          if ('peagle', 5, c) in x and ('eagle3', 5, c) in x]
    if vs:
        lines[-1] += f" P-EAGLE / EAGLE-3 at K=5: {', '.join(vs)}."
    top = {m: {c: max((v, k) for (mm, k, cc), v in x.items() if mm == m and cc == c) for c in cs
               if any(mm == m and cc == c for mm, _, cc in x)} for m in ("peagle", "eagle3")}
    both = [c for c in cs if c in top["peagle"] and c in top["eagle3"]]
    if both:
        lines[-1] += (" P-EAGLE / EAGLE-3, each at its best measured K: " + ", ".join(
            f"c={c} {_f(top['peagle'][c][0] / top['eagle3'][c][0])}x (K={top['peagle'][c][1]} / "
            f"K={top['eagle3'][c][1]})" for c in both) + ".")
    best = top["peagle"]
    if target == "llama-3.1-8b" and best:
        lines[-1] += (" Goals (P-EAGLE at its best measured K / none): " + ", ".join(
            f"c={c} >= {g}x: {_f(best[c][0])}x at K={best[c][1]} {met(best[c][0] >= g)}"
            for c, g in LOAD_GOALS.items() if c in best) + ".")
        one_k = {k: [c for c, g in LOAD_GOALS.items() if ("peagle", k, c) in x and x[("peagle", k, c)] < g]
                 for m, k in spec if m == "peagle" and all(("peagle", k, c) in x for c in LOAD_GOALS)}
        sched = sorted({r.get("warmup_waves", 0) for r in rows if r["target"] == target and r.get("k_schedule")})
        where = f": the k_schedule row of {sched[0]} warm-up waves" if sched else ""
        lines[-1] += (" A P-EAGLE server drafts at one K for every concurrency (a per-batch-size K schedule runs "
                      "with peagle's fix, pipelines.evaluate.dynamic_k, but vLLM's V1 runner then captures the "
                      f"target's CUDA graphs PIECEWISE{where}); "
                      + ("no single K meets all three" if all(one_k.values()) else "per K") + ": "
                      + "; ".join(
                          f"K={k} misses c={', c='.join(map(str, miss))}" if miss else f"K={k} meets them"
                          for k, miss in sorted(one_k.items())) + ".")
    def compiled(phase: str) -> str:
        got = [f"{m} K={k} c={c}: {r['compiles'][phase]['dynamo_graphs']} graphs, "
               f"{r['compiles'][phase]['triton_cache_entries']} kernels" for (m, k, c), r in sorted(cell.items())
               if r.get("compiles") and any(r["compiles"][phase].values())]
        return "; ".join(got) or "nothing"

    notes = sorted({r["note"] for r in cell.values() if r.get("note")})
    lines += ["", ("What the waves compiled after the engine's start (Dynamo graphs, new Triton kernel cache entries), "
                   f"in the warm-up waves: {compiled('warmup')}; in the timed waves after them: {compiled('timed')}."
                   + (" Measured " + "; ".join(notes) + "." if notes else "")), ""]
    return lines


def _later(row: dict) -> dict:
    """The later, unsynchronized wave's timers of a row (``step_profile.timers``; empty without one)."""
    return (row.get("step_profile") or {}).get("timers") or {}


def _load_readings(target: str, rows: list[dict]) -> list[str]:
    """The sentences under the under-load table for one target: break-even AL at c=1, P-EAGLE / none cold and
    warm per concurrency (with the goals on the 8B shape), the c=1 device and host time of a step."""
    lines: list[str] = []
    steps = {}
    for r in rows:
        if r["target"] == target and r["concurrency"] == 1 and not r.get("engine_kwargs") and _later(r) \
                and r["method"] in ("none", "peagle") and r["K"] in (0, 5):
            steps.setdefault(r["method"], _later(r))
    if len(steps) == 2:
        pe, no = steps["peagle"], steps["none"]
        lines += [(f"**{target}**, c=1, the later wave (asynchronous scheduling, nothing synchronized): a P-EAGLE "
                   f"K=5 step takes {_f(pe['wall_ms'], 2)} ms against {_f(no['wall_ms'], 2)} ms without "
                   f"speculation, so a head breaks even at AL {_f(pe['wall_ms'] / no['wall_ms'])}; this wave "
                   f"emitted {_f(pe['tokens_per_step'])} tokens per step and ran {_f(pe['tokens_per_s'] / no['tokens_per_s'])}x "
                   "no speculation."), ""]
    plain = [r for r in rows if r["target"] == target and not r.get("engine_kwargs") and r["K"] in (0, 5)]
    cell = {(r["method"], r.get("warmup_waves", 0), r["concurrency"]): r for r in plain}
    cs = sorted({c for m, w, c in cell if m == "peagle" and w == 1 and ("none", 1, c) in cell
                 and ("peagle", 0, c) in cell and ("none", 0, c) in cell})
    if not cs:
        return lines
    ratio = {(m, w, c, base): cell[(m, w, c)]["tokens_per_s"] / cell[(base, w, c)]["tokens_per_s"]
             for m, w, c in cell for base in ("none", "eagle3") if (base, w, c) in cell}
    later_ratio = {c: _later(cell[("peagle", 1, c)])["tokens_per_s"] / _later(cell[("none", 1, c)])["tokens_per_s"]
                   for c in cs}
    vs_e3 = [f"c={c} {_f(ratio['peagle', 1, c, 'eagle3'])}x" for c in cs if ("eagle3", 1, c) in cell]
    lines += [(f"**{target}**, P-EAGLE K=5 against no speculation, first waves -> after one warm-up wave: "
               + ", ".join(f"c={c} {_f(ratio['peagle', 0, c, 'none'])}x -> {_f(ratio['peagle', 1, c, 'none'])}x" for c in cs)
               + "; in the later wave: " + ", ".join(f"c={c} {_f(later_ratio[c])}x" for c in cs) + ". "
               + (f"P-EAGLE / EAGLE-3 (both on V1, warm): {', '.join(vs_e3)}. " if vs_e3 else "")
               + ("Goals (P-EAGLE / none after the warm-up wave): " + ", ".join(
                   f"c={c} >= {g}x {met(ratio['peagle', 1, c, 'none'] >= g)}" for c, g in LOAD_GOALS.items() if c in cs)
                  + "." if target == "llama-3.1-8b" else "")), ""]
    prof = {m: (cell[(m, 1, 1)].get("step_profile") or {}).get("profiler") for m in ("none", "peagle")
            if (m, 1, 1) in cell}
    if all(prof.get(m) for m in ("none", "peagle")):
        extra = prof["peagle"]["device_busy_ms"] - prof["none"]["device_busy_ms"]
        host = _later(cell[("peagle", 1, 1)]).get("host_ms", {}).get("draft")
        lines += [(f"At c=1, warm: the device is busy {_f(prof['peagle']['device_busy_ms'], 2)} ms per P-EAGLE "
                   f"step against {_f(prof['none']['device_busy_ms'], 2)} ms per target-only step, so drafting "
                   f"and verifying K+1 tokens add {_f(extra, 2)} ms of device time "
                   f"({100 * extra / prof['none']['device_busy_ms']:.0f}% of the target's), while the drafter "
                   f"holds the host {_f(host, 2)} ms per step and the device is busy "
                   f"{100 * prof['peagle']['device_busy_fraction']:.0f}% of the time: the step is host-bound "
                   "(vLLM's V1 drafter: PIECEWISE graphs, eager logits and input preparation)."), ""]
    return lines
