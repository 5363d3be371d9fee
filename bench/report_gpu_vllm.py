"""The GPU vLLM sections of ``docs/benchmarks.md`` (issue 25), computed from the result rows only:
vLLM on the lent GPU, the serving table of SmolLM2 with trained heads, the synthetic-acceptance mechanics at
real model sizes, regeneration and capture with vLLM. Called by :func:`bench.report.main`.
"""

from __future__ import annotations

from collections import defaultdict

# the seeds' anchor (B200, GPT-OSS-20B, vLLM blog 2026-03-13; shared/REFERENCES.md): P-EAGLE / EAGLE-3 tok/s
ANCHOR_RATIO = {1: (1.55, 1.69), 64: (1.05, 1.25)}
GOAL_REGEN_TOK_S = 50_000
GOAL_CAPTURE_RATIO = 2.0


def _f(x, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _env(r: dict) -> str:
    e = r["environment"]
    return f"{e['device']}, torch {e['torch']}, CUDA {e.get('cuda')}, {e['date'][:10]}"


def in_flight(row: dict) -> int:
    """Requests decoding together in a sweep row: its concurrency, or all its prompts when there are fewer."""
    return min(row["concurrency"], row["num_prompts"])


def step_ms(row: dict) -> float:
    """Wall milliseconds per engine step of a sweep row: :func:`in_flight` requests each emit AL tokens a step."""
    return 1000.0 * in_flight(row) * row["acceptance_length"] / row["tokens_per_s"]


def break_even_al(row: dict, none_row: dict) -> float:
    """The AL at which ``row``'s speculative step would match no speculation's tokens/s at the same
    concurrency: its step time over the target-only step time."""
    return step_ms(row) / step_ms(none_row)


def _split(row: dict) -> str:
    s = row.get("step_costs") or {}
    if not s or "unavailable" in s:
        return "-"
    return " / ".join(_f(s.get(k), 1) for k in ("target_forward_ms", "draft_ms", "sample_ms", "other_ms"))


def serving(lines: list[str], data: dict | None) -> None:
    lines += ["## GPU vLLM: SmolLM2 with trained heads (issue 25 item 5a)", ""]
    if data is None:
        lines += ["not run", ""]
        return
    rows = [r for r in data["rows"] if r.get("engine") == "gpu"]
    lines += [(f"{_env(data)}; vLLM {data.get('vllm', '0.26.0')}; `bash bench/device/run_gpu_serving.sh SETS K_SWEEP "
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
        none = {r["concurrency"]: r for r in rs if r["head"] == "none"}
        table = []
        for r in sorted(rs, key=lambda r: (r["head"] != "none", r["head"], r["K"], r["concurrency"])):
            base = none.get(r["concurrency"])
            be = break_even_al(r, base) if base and r["head"] != "none" else None
            table.append([r["head"], r["K"], r["concurrency"], _f(r["acceptance_length"]),
                          " / ".join(_f(a) for a in r["al_per_pos"][:3]) or "-", f"{r['tokens_per_s']:.0f}",
                          _f(r.get("speedup")), _f(r.get("tpot_ms")), _f(step_ms(r)), _f(be),
                          r.get("model_runner", "-"), _split(r)])
        lines += [f"**{set_name}**", ""]
        lines += _table(["head", "K", "c", "AL", "accept pos 1/2/3", "tok/s", "vs none", "TPOT ms", "step ms",
                         "break-even AL", "runner", "split ms"], table) + [""]
        spec = [r for r in rs if r["head"] != "none" and r.get("speedup")]
        if spec:
            best = max(spec, key=lambda r: r["speedup"])
            verdict = ("pays" if best["speedup"] > 1 else "does not pay at any measured (K, c)")
            lines += [(f"Speculation {verdict} on {set_name}: best {best['head']} K={best['K']} c={best['concurrency']} "
                      f"at {best['speedup']:.2f}x no speculation (AL {best['acceptance_length']:.2f} against a "
                      f"break-even AL of {break_even_al(best, none[best['concurrency']]):.2f})."), ""]
    runners = {r["head"]: r.get("model_runner") for r in rows}
    if len(set(runners.values())) > 1:
        lines += ["Runners differ: " + ", ".join(f"{h} on {v}" for h, v in runners.items()) + " (vLLM 0.26 serves a "
                  "dense target without speculation on Model Runner V2 and falls back to V1 for parallel drafting).",
                  ""]


def synthetic(lines: list[str], data: dict | None) -> None:
    lines += ["## GPU vLLM: parallel drafting's mechanics at real sizes, synthetic acceptance (issue 25 item 5b)", ""]
    if data is None:
        lines += ["not run", ""]
        return
    lines += [(f"{_env(data)}; `{data.get('command', 'python -m bench.synthetic_serving')}`. Random-weight targets "
              "(`load_format=dummy`), heads of matching shape (EAGLE-3 1 layer, P-EAGLE 4 layers), "
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
                          f"{lo:.2f}-{hi:.2f}x on a B200 ({'within' if gap <= 0.15 else 'outside'} 15%: "
                          f"{100 * gap:.0f}% from the range)."), ""]


def regeneration(lines: list[str], vllm: dict | None, static: dict | None) -> None:
    lines += ["## GPU vLLM: regeneration (issue 25 item 4)", ""]
    if vllm is None:
        lines += ["not run", ""]
        return
    v = vllm["vllm"]
    ref = (static or {}).get("static_warm") or vllm.get("static_warm")
    ratio = f", {v['tokens_per_s'] / ref['tokens_per_s']:.2f}x the transformers static-cache engine's " \
            f"{ref['tokens_per_s']:.0f} tok/s" if ref else ""
    lines += [(f"{_env(vllm)}; `bash bench/device/run_regen_throughput.sh vllm regen_throughput_vllm "
              f"{vllm['prompts']}` (`pipelines.engines.VLLMEngine`, the regenerate stage's engine): {vllm['prompts']} "
              f"ShareGPT first turns, <= {vllm['max_new_tokens']} new tokens, greedy: {v['generated_tokens']} tokens "
              f"in {v['wall_s']:.1f} s = **{v['tokens_per_s']:.0f} tok/s**{ratio}; engine start "
              f"{v['engine_start_s']:.0f} s (not counted); vLLM max_num_seqs {v.get('scheduler_max_num_seqs', '-')}. "
              f"Goal {GOAL_REGEN_TOK_S} tok/s: {'met' if v['tokens_per_s'] >= GOAL_REGEN_TOK_S else 'not met'}."), ""]


def main_sections(lines: list[str], load) -> None:
    """Every GPU vLLM section, ``load(name)`` giving ``bench/results/<name>.json`` or None."""
    serving(lines, load("gpu_vllm_serving"))
    synthetic(lines, load("gpu_synthetic_serving"))
    regeneration(lines, load("regen_throughput_vllm"), load("regen_throughput"))
