"""Acceptance length by position in the sequence (issue 26 item 4): the rows of ``bench.long_context``
(``bench/results/long_context.json``), the heads' training cut as that file recorded it, and the reading.
"""

from __future__ import annotations

from bench.report_fmt import env, f, link, section, table
from bench.report_gpu_vllm import SERVING_HEADING
from bench.report_scale import HEADS_HEADING, label, override, train_row, train_rows, warm_start
from peagle_core.masks import FLEX_BLOCK

RESULT = "long_context"  # bench.long_context --name
MASK_RESULT = "mask_compile"  # bench.mask_compile
BY_POSITION_HEADING = "Acceptance length after long chat histories"
# Literature anchor (issue 26 item 4): short-trained EAGLE-3 heads in a speculators study, AL by context length.
ANCHOR_AL = {2048: 2.30, 20480: 1.08}


def _cut_text(heads: list[dict]) -> str:
    """The heads' training cut (``train_max_length_tokens`` of the result file's ``heads``): one number when they
    agree, else per head."""
    cuts = {h["head"]: h.get("train_max_length_tokens") for h in heads}
    known = {c for c in cuts.values() if c is not None}
    if not known:
        return "The heads' training cut was not recorded (no recipe.yaml beside them)."
    if len(known) == 1 and None not in cuts.values():
        return (f"Every head here was trained on conversations cut at {known.pop():,} tokens (`data.max_length_tokens` "
                "of its recipe), so longer histories put the question at positions it never trained on.")
    return "Training cut (`data.max_length_tokens` of each head's recipe): " + ", ".join(
        f"{h} {c:,}" if c is not None else f"{h} not recorded" for h, c in cuts.items()) + "."


def acceptance_by_position(lines: list[str]) -> None:
    """The section: the command and engine, how the prompts were built, the table per (head, L), the reading;
    "not run" without the result file."""
    r = section(lines, RESULT, "### " + BY_POSITION_HEADING)
    if r is None:
        return
    sets, e, ho = r["sets"], r["engine"], r["held_out"]
    rows = sorted(r["rows"], key=lambda x: (x["head"] != "none", x["head"], x["run"] or 0,
                                            sets[x["eval_set"]]["context_tokens"]))
    runs = [(x["head"], x["run"]) for x in rows if x["head"] != "none"]
    lines += [" ".join(f"`{c}`" for c in r["commands"]) + f" ({env(r, triton=False)}).", ""]
    lines += [(f"{e['vllm']}, {e['dtype']}, {e['num_cpus']} CPUs, max_model_len "
               f"{r['engine_kwargs']['max_model_len']:,}, greedy, c=1, K={r['K']}, {r['max_tokens']} new tokens. "
               f"Each prompt is one of the first {r['prompts']} {r['questions']} questions (seed 0, the prompts "
               "evaluation asks) after a chat history that adds >= L tokens to it: whole conversations (user turns "
               f"and the target's own answers) of data build {ho['build']}'s held-out tail (its "
               f"{ho['conversations']:,} conversations from index {ho['first']:,}, after every training run's prefix), "
               "each question its own, the nearest conversation the same at every L; conversations that alone add "
               f"more than {ho['max_conversation_tokens']:,} tokens are skipped. L = 0 is the bare question. AL = 1 + "
               "accepted / drafts from vLLM's counters, one fresh engine per head and L; tokens/s = output tokens / "
               "wall time of the requests, each request's prefill included, on CPU cores shared with other work, so "
               "speed-ups across L are rough (AL does not depend on the machine's speed). "
               + _cut_text(r["heads"])), ""]
    out = []
    for x in rows:
        s = sets[x["eval_set"]]
        name = "none" if x["head"] == "none" else label(x["head"], x["run"], runs)
        out.append([name, x["K"], f"{s['context_tokens']:,}", f"{s['history_tokens_mean']:,.0f}",
                    f"{s['prompt_tokens_mean']:,.0f}", x["num_drafts"] if x["K"] else "-", f(x["acceptance_length"]),
                    " / ".join(f(p) for p in x["al_per_pos"]) or "-", f(x["tokens_per_s"], 1), f(x.get("speedup"))])
    lines += table(["head", "K", "L (history >=)", "history tokens (mean)", "prompt tokens (mean)", "drafts", "AL",
                    "acceptance per position", "tokens/s", "speed-up"], out)
    lines += ["", _reading(rows, sets, runs), ""]
    other = [f"{label(h['head'], h['run'], runs)} (data build {b})" for h in r["heads"]
             if (b := train_row(h["head"], h["run"]).get("data_build")) not in (None, ho["build"])]
    if other:
        lines += [(f"Trained on another data build than the histories': {', '.join(other)}; that build is another "
                   "regenerated set (its own self-instruct prompts, the target's answers), so the histories are new "
                   "to these heads too."), ""]


def _continued(rows: list[dict], sets: dict, runs: list[tuple[str, int]]) -> str:
    """Per head trained on from another head here (``training.init_from``, :func:`bench.report_scale.warm_start`):
    its AL and position-2 acceptance against its parent's at each L both were measured at."""
    out = []
    for head in dict.fromkeys(runs):
        run = train_row(*head)
        parent = warm_start(run)
        if not parent:
            continue
        pair = [{sets[x["eval_set"]]["context_tokens"]: x for x in rows if (x["head"], x["run"]) == h}
                for h in (head, (parent["tag"], parent["run"]))]
        common = sorted(set(pair[0]) & set(pair[1]))
        if not common:
            continue
        cut = run["recipe"].get("data.max_length_tokens")
        out.append(f" {label(*head, runs)} (its parent {label(parent['tag'], parent['run'], runs)} trained on for "
                   f"{run['train_s_goal']:.0f} GPU-s with conversations cut at {cut:,} tokens), AL "
                   "against the parent's at L = " + ", ".join(f"{n:,}" for n in common) + ": "
                   + ", ".join(f"{pair[0][n]['acceptance_length']:.2f} vs {pair[1][n]['acceptance_length']:.2f}"
                               for n in common) + "; acceptance at position 2: "
                   + ", ".join(f"{pair[0][n]['al_per_pos'][1]:.2f} vs {pair[1][n]['al_per_pos'][1]:.2f}"
                               for n in common) + ".")
    return "".join(out)


def _reading(rows: list[dict], sets: dict, runs: list[tuple[str, int]]) -> str:
    """Per head: AL at its shortest and longest history, and the anchor."""
    parts = []
    for head in dict.fromkeys(runs):
        mine = [x for x in rows if (x["head"], x["run"]) == head]
        lo, hi = mine[0], mine[-1]  # rows are sorted by L
        if lo is hi:
            continue
        slo, shi = sets[lo["eval_set"]], sets[hi["eval_set"]]
        parts.append(f"{label(*head, runs)} AL {lo['acceptance_length']:.2f} at L = {slo['context_tokens']:,} "
                     f"({slo['prompt_tokens_mean']:,.0f} prompt tokens) and {hi['acceptance_length']:.2f} at L = "
                     f"{shi['context_tokens']:,} ({shi['prompt_tokens_mean']:,.0f}), "
                     f"{hi['acceptance_length'] / lo['acceptance_length'] - 1:+.0%}")
    (l2, a2), (l20, a20) = ANCHOR_AL.items()
    return ("Reading: " + "; ".join(parts) + "." + _continued(rows, sets, runs) + " For scale, short-trained "
            f"EAGLE-3 heads in a speculators study fall from AL {a2:.2f} at {l2 // 1024}k to {a20:.2f} at "
            f"{l20 // 1024}k tokens; here the longest history is bounded by the target's context "
            "(max_model_len above).")


def long_training(lines: list[str]) -> None:
    """The section on training with sequences up to the target's context (item 4's training): the runs with
    sequence partitions (their ``scale_train`` rows), what stopped the first attempt, and ``bench.mask_compile``'s
    seconds to the first block mask by document length, partitions and how the mask is built."""
    r = section(lines, MASK_RESULT, "### Training on long sequences with partitions")
    if r is None:
        return
    for run in (t for t in train_rows() if int(override(t, "training.num_partitions") or 1) > 1):
        call = run["calls"][-1]
        lines += [(f"`{run['tag']}` ({run['device']}, {run['date']}): `" + " ".join(
                   ["--set " + o for o in run["overrides"]]) + f"`; {run['steps']:,} steps in "
                   f"{call['timed_s']:.0f} timed s ({run['calib_s_per_step']:.3f} s/step, {run['epochs']:.2f} of an "
                   f"epoch), first step {call['to_first_step_s']:.1f} s after warm-up, peak "
                   f"{call['peak_mem_gib']:.1f} GiB. Its notes and accuracies are in {link('the training table', HEADS_HEADING)}; "
                   f"its AL by position in the sequence in {link('the long-history section', BY_POSITION_HEADING)}, its "
                   f"GPU vLLM rows in {link('the serving table', SERVING_HEADING)}."), ""]
    t = r["trigger"]
    lines += [(f"The first attempt: `{t['command']}` (the compiled block mask, then the default). {t['observed']}"), ""]
    lines += [(f"`python -m bench.mask_compile`: one packed batch of N tokens in documents of L tokens, P-EAGLE "
               f"elements (K {r['k']}, COD {r['cod'][0]} / {r['cod'][1]}), the train path's partition, forward order "
               "and padding, then its block mask (compiled: `create_block_mask` compiled on CUDA; blockwise: "
               f"`peagle_core.masks.blockwise_block_tables`), {r['batches']} batches in one fresh process per case "
               "with its own inductor cache. Rows without their own run: "
               f"`{r['command']}` ({env(r)})" + (f", recorded from {r['recorded_from']}" if r.get("recorded_from")
                                                  else "") + "."), ""]
    out = []
    for x in r["rows"]:
        first = x["masks"][0] if x["masks"] else None
        later = [m["s"] for m in x["masks"][1:]]
        when = f"{x['run']['device']}, {x['run']['date'][:10]}" if x.get("run") else "as above"
        out.append([f"{x['doc_tokens']:,}", x["partitions"], f"{x['tokens']:,}", x["block_mask"],
                    f"{first['s']:.2f} s ({first['slots']:,} slots)" if first else f"none within {x['limit_s']:.0f} s",
                    f"{max(later):.2f} s" if later else "-", when])
    lines += table(["document tokens L", "partitions", "batch tokens", "block mask", "first mask", "later masks (max)",
                    "run"], out)
    lines += ["", _mask_reading(r["rows"]), ""]


def _mask_reading(rows: list[dict]) -> str:
    """What the mask rows show: the compiled build with one partition, with several, and the blockwise build."""
    one = next(x["masks"][0] for x in rows if x["partitions"] == 1 and x["block_mask"] == "compiled" and x["masks"])
    stalled = sorted({x["doc_tokens"] for x in rows
                      if x["partitions"] > 1 and x["block_mask"] == "compiled" and not x["masks"]})
    bw = [m["s"] for x in rows if x["block_mask"] == "blockwise" for m in x["masks"]]
    text = (f"Reading: the compiled build with one partition costs {one['s']:.0f} s once ({one['slots']:,} slots, "
            f"{one['slots'] // FLEX_BLOCK} key blocks) and then nothing; with two partitions it produced no mask "
            "within the limit, with " + "- or ".join(f"{n:,}" for n in stalled) + "-token documents alike, so "
            "partitions, not long documents, stall it (the first segment has about half the slots, its own shapes "
            "to compile).")
    if bw:
        text += (f" The blockwise build needs no compilation: {len(bw)} masks, at most {max(bw):.2f} s each (the "
                 "first of a process included), with one or two partitions. So `training.block_mask: auto`, the "
                 "default, builds blockwise where P-EAGLE partitions and compiled otherwise; the GPU recipes with "
                 "`training.num_partitions: 2` (`configs/llama-3.1-8b-h100.yaml`, "
                 "`configs/qwen3-coder-30b-a3b-b200.yaml`, `configs/gpt-oss-20b-b200.yaml`) get blockwise.")
    return text
