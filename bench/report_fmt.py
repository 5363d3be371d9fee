"""Formatting helpers of ``bench.report``'s sections: result files, tables, numbers, the environment line.

Every figure a section prints is computed from a result file through these helpers; a section holds no
measured number of its own (goals and literature anchors are named constants in the section's module).
"""

from __future__ import annotations

import functools
import json
import re
import statistics
from collections.abc import Iterable
from pathlib import Path

from bench.common import RESULTS, ROOT

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def load(name: str) -> dict | None:
    """``bench/results/<name>.json``, or None when it is absent."""
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading (``### Two GPUs: DDP`` -> ``two-gpus-ddp``): lower case,
    punctuation dropped, spaces as hyphens."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def link(text: str, heading: str, doc: str = "") -> str:
    """A Markdown link to ``heading`` of ``doc`` (this document when empty)."""
    return f"[{text}]({doc}#{anchor(heading)})"


def section(lines: list[str], name: str, heading: str) -> dict | None:
    """Append ``heading``; returns ``bench/results/<name>.json`` or, when absent, notes "not run" and
    returns None."""
    lines += [heading, ""]
    r = load(name)
    if r is None:
        lines += ["not run", ""]
    return r


def env(r: dict, *, triton: bool = True) -> str:
    """The environment line of a result file: device, versions, date."""
    e = r["environment"]
    tri = f", triton {e.get('triton', '-')}" if triton else ""
    return f"{e['device']}, torch {e['torch']}, CUDA {e.get('cuda')}{tri}, {e['date'][:10]}"


def table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def f(x, nd: int = 2) -> str:
    """``x`` with ``nd`` decimals, ``-`` for None."""
    return "-" if x is None else f"{x:.{nd}f}"


def rounded(x: float, step: float) -> float:
    """``x`` rounded to a multiple of ``step`` (a reading such as ``~6.5`` ms or ``~1,300`` launches)."""
    return round(round(x / step) * step, 6)


def approx(x: float, step: float) -> str:
    """:func:`rounded` as text, thousands separated, no trailing zeros (``4``, ``6.5``, ``1,300``)."""
    return f"{rounded(x, step):,g}"


def sci(x: float) -> str:
    """``6e-4``, ``1.2e-3``: a learning rate as recipes write it."""
    mant, exp = f"{x:e}".split("e")
    return f"{float(mant):g}e{int(exp)}"


def span(values: Iterable[float], nd: int | None = 2, unit: str = "") -> str:
    """``min-max`` of ``values`` with ``nd`` decimals (None: as :func:`approx` writes them); one number when
    both ends agree."""
    vs = list(values)
    lo, hi = (f"{min(vs):,g}", f"{max(vs):,g}") if nd is None else (f(min(vs), nd), f(max(vs), nd))
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def profile_column(table_text: str, op: str, column: str) -> str | None:
    """One cell of a ``torch.profiler`` key-averages table (as stored in the result files): the row of ``op``,
    the column headed ``column``; None when the table has no such row."""
    lines = table_text.splitlines()
    header = next((ln for ln in lines if ln.strip().startswith("Name")), None)
    if header is None:
        return None
    names = [h.strip() for h in re.split(r"\s{2,}", header.strip())]
    for ln in lines:
        cells = [c.strip() for c in re.split(r"\s{2,}", ln.strip())]
        if cells and cells[0] == op and len(cells) == len(names):
            return cells[names.index(column)]
    return None


def profile_total_ms(table_text: str, what: str = "Self CUDA time total") -> float | None:
    """The footer ``<what>: 308.550ms`` of a profiler table, in milliseconds."""
    m = re.search(rf"{what}: ([0-9.]+)(us|ms|s)\b", table_text)
    return None if m is None else to_ms(m.group(1) + m.group(2))


def to_ms(cell: str) -> float:
    """A profiler time cell (``738.238us``, ``2.707ms``, ``3.657s``) in milliseconds."""
    m = re.fullmatch(r"([0-9.]+)(us|ms|s)", cell)
    if m is None:
        raise ValueError(f"not a profiler time: {cell!r}")
    return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]


def met(ok: bool) -> str:
    return "met" if ok else "not met"


def stage_table(run: dict, what: dict) -> list[str]:
    """Markdown stage table of a device run of the main job (``bench/device/run_pipeline_ray.sh``: ``summary`` and
    ``stage_records``). Status and seconds come from each stage's own record where the run directory holds one (a
    resumed run's summary says "skipped" for a stage an earlier call ran), else from the summary; the last column is
    ``what[stage](outputs)`` or the summary's reason."""
    rows = []
    for name, st in run["summary"]["stages"].items():
        rec = run["stage_records"].get(name) or {}
        out = rec.get("outputs") or {}
        rows.append([name, rec.get("status", st["status"]), f(rec.get("seconds", st["seconds"]), 1),
                     st.get("reason") or (what[name](out) if name in what and out else "-")])
    return table(["stage", "status", "seconds", "outputs / reason"], rows)


def job_sets(r: dict) -> dict[str, str]:
    """The ``--set`` overrides of a recorded job (``job.sets``): field -> value."""
    return dict(s.split("=", 1) for s in (r.get("job") or {}).get("sets", []) if "=" in s)


@functools.cache
def recipe_of(config: str):
    """The committed recipe a recorded job named (``job.config``, relative to the repository)."""
    from pipelines.recipe.load import load_recipe

    return load_recipe(ROOT / config)


def training_setting(record: dict, key: str) -> str:
    """``training.<key>`` of a recorded job (``job.sets``, ``job.config``): its override, else its recipe's."""
    return job_sets(record).get(f"training.{key}") or str(getattr(recipe_of(record["job"]["config"]).training, key))
