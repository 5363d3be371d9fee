"""The evaluation table: :class:`EvalReport`, best K per method, speedups over no speculation,
markdown and PNG plots, built (and written) by :func:`build_report`.

Rows are those of :func:`pipelines.evaluate.measure.evaluate` (one per method x K x concurrency; the columns
are listed in its module doc).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle_core.atomic import atomic_write_text


@dataclass
class EvalReport:
    """Result of :func:`pipelines.evaluate.measure.evaluate`: ``rows`` (the table), ``best_K`` per method per concurrency
    (by tokens/s), ``offline`` rows of the reference decoder, ``plots`` (PNG paths), ``markdown``."""

    eval_set: str
    rows: list[dict[str, Any]]
    best_K: dict[str, dict[int, int]]
    offline: list[dict[str, Any]] = field(default_factory=list)
    plots: dict[str, Path] = field(default_factory=dict)
    markdown: str = ""

    def al_by_K(self, method: str = "peagle", concurrency: int | None = None) -> dict[int, float]:
        """``{K: AL}`` of a method (at the lowest measured concurrency unless given)."""
        rows = [r for r in self.rows if r["method"] == method]
        if not rows:
            return {}
        c = concurrency if concurrency is not None else min(r["concurrency"] for r in rows)
        return {r["K"]: r["acceptance_length"] for r in rows if r["concurrency"] == c}


def best_K(rows: Sequence[dict[str, Any]]) -> dict[str, dict[int, int]]:
    """``{method: {concurrency: K with the highest tokens/s}}`` over the speculative rows."""
    out: dict[str, dict[int, int]] = {}
    for r in rows:
        if r["method"] == "none":
            continue
        cur = out.setdefault(r["method"], {})
        c = r["concurrency"]
        best = next((x for x in rows if x["method"] == r["method"] and x["concurrency"] == c and
                     x["K"] == cur.get(c)), None)
        if best is None or r["tokens_per_s"] > best["tokens_per_s"]:
            cur[c] = r["K"]
    return out


def add_speedup(rows: list[dict[str, Any]]) -> None:
    """``speedup`` = tokens/s over the ``none`` row at the same concurrency (None without a baseline)."""
    base = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["method"] == "none"}
    for r in rows:
        b = base.get(r["concurrency"])
        r["speedup"] = r["tokens_per_s"] / b if b else None


TABLE_COLUMNS = ("method", "K", "concurrency", "acceptance_length", "draft_acceptance_rate", "tokens_per_s",
                 "speedup", "latency_mean_s", "tpot_ms", "num_output_tokens")


def table_markdown(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Markdown table of eval rows (default columns: :data:`TABLE_COLUMNS` present in the rows, else all)."""
    if columns is None:
        present = {k for r in rows for k in r}
        columns = [c for c in TABLE_COLUMNS if c in present]
        if not columns:
            columns = []
            for r in rows:
                columns += [k for k in r if k not in columns]

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict[str, Any]], out_dir: str | os.PathLike, *, title: str = "") -> dict[str, Path]:
    """PNG plots: ``al_per_position.png`` (acceptance rate per draft position, one line per method x K
    at the lowest concurrency) and ``tokens_per_s_vs_K.png`` (one line per method x concurrency;
    no speculation as dashed horizontal lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec_rows = [r for r in rows if r["method"] != "none"]
    paths: dict[str, Path] = {}
    fig, ax = plt.subplots(figsize=(6, 4))
    if spec_rows:
        c0 = min(r["concurrency"] for r in spec_rows)
        for r in spec_rows:
            if r["concurrency"] == c0 and r.get("al_per_pos"):
                ax.plot(range(1, len(r["al_per_pos"]) + 1), r["al_per_pos"], marker="o",
                        label=f"{r['method']} K={r['K']} (AL {r['acceptance_length']:.2f})")
        ax.legend(fontsize=7)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"acceptance per position {title}".strip())
    paths["al_per_position"] = out / "al_per_position.png"
    fig.tight_layout()
    fig.savefig(paths["al_per_position"], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in sorted({r["method"] for r in spec_rows}):
        for c in sorted({r["concurrency"] for r in spec_rows}):
            pts = sorted((r["K"], r["tokens_per_s"]) for r in spec_rows if r["method"] == method and r["concurrency"] == c)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"{method} c={c}")
    for r in rows:
        if r["method"] == "none":
            ax.axhline(r["tokens_per_s"], linestyle="--", linewidth=1, color="gray",
                       label=f"none c={r['concurrency']}")
    ax.set_xlabel("K (num_speculative_tokens)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"throughput vs K {title}".strip())
    ax.legend(fontsize=7)
    paths["tokens_per_s_vs_K"] = out / "tokens_per_s_vs_K.png"
    fig.tight_layout()
    fig.savefig(paths["tokens_per_s_vs_K"], dpi=120)
    plt.close(fig)
    return paths


@dataclass
class SetsTable:
    """Every eval set's report as one table (:func:`write_sets_table`): ``rows`` (tagged ``eval_set``, the gate
    set's first), ``markdown`` (a section per set), the trained method's K ``schedule`` on the gate set
    (``[[batch_min, batch_max, K], ...]``, None when it has none) and ``plots`` (``{"<eval_set>/<plot>": path}``)."""

    rows: list[dict[str, Any]]
    markdown: str
    schedule: list[list[int]] | None
    plots: dict[str, str]


def write_sets_table(reports: dict[str, EvalReport], *, gate: str, method: str, champion: dict[str, Any] | None,
                     out_dir: str | os.PathLike) -> SetsTable:
    """The reports of every eval set (``reports``, gate set first) as one table: ``table.json`` (rows, best K per
    set, the gate set's K schedule of ``method``, the champion measured) and ``table.md`` under ``out_dir``."""
    from pipelines.evaluate.k_schedule import schedule_or_none

    out = Path(out_dir)
    found = schedule_or_none(reports[gate].rows, method)
    schedule = [list(e) for e in found] if found is not None else None
    rows = [row for rep in reports.values() for row in rep.rows]
    markdown = "".join(f"## {name}{' (gate)' if name == gate else ''}\n\n{rep.markdown}\n"
                       for name, rep in reports.items())
    table = {"gate_eval_set": gate, "eval_sets": list(reports), "rows": rows,
             "best_K": {name: rep.best_K for name, rep in reports.items()},
             "k_schedule": {"eval_set": gate, "method": method, "schedule": schedule}, "champion": champion}
    atomic_write_text(out / "table.json", json.dumps(table, indent=2, default=str))
    atomic_write_text(out / "table.md", markdown)
    plots = {f"{name}/{k}": str(v) for name, rep in reports.items() for k, v in rep.plots.items()}
    return SetsTable(rows=rows, markdown=markdown, schedule=schedule, plots=plots)


def build_report(rows: list[dict[str, Any]], eval_set: str, *, offline: Sequence[dict[str, Any]] = (),
                 out_dir: str | os.PathLike | None = None) -> EvalReport:
    """The :class:`EvalReport` of measured ``rows`` (tagged ``eval_set`` and given ``speedup`` in place)
    and the reference decoder's ``offline`` rows; with ``out_dir``, also ``table.json``, ``table.md``
    and the plots there."""
    offline = list(offline)
    for r in rows:
        r["eval_set"] = eval_set
    add_speedup(rows)
    report = EvalReport(eval_set=eval_set, rows=rows, best_K=best_K(rows), offline=offline)
    report.markdown = table_markdown(rows)
    if offline:
        report.markdown += "\nOffline reference decoder (peagle_core.decoder):\n\n" + table_markdown(
            offline, ["method", "K", "acceptance_length", "num_drafts", "wall_s"])
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "table.json", json.dumps({"eval_set": eval_set, "rows": rows, "best_K": report.best_K,
                                                          "offline": offline}, indent=2))
        atomic_write_text(out / "table.md", report.markdown)
        report.plots = plot(rows, out, title=f"({eval_set})")
    return report


def headline(rows: Sequence[dict[str, Any]], method: str, c: int) -> dict[str, Any]:
    """AL per K of ``method`` (the trained head) and its tokens/s against no speculation at concurrency ``c``
    (``rows`` of one eval set): the pipeline summary's eval section."""
    base = next((x for x in rows if x["method"] == "none" and int(x.get("concurrency", 1)) == c), None)
    per_K = {}
    for x in rows:
        if x["method"] == method and int(x.get("concurrency", 1)) == c:
            speedup = (x["tokens_per_s"] / base["tokens_per_s"]
                       if base and base.get("tokens_per_s") and x.get("tokens_per_s") else None)
            per_K[int(x["K"])] = {"acceptance_length": x.get("acceptance_length"),
                                  "tokens_per_s": x.get("tokens_per_s"), "speedup": speedup}
    return {"method": method, "concurrency": c,
            "none_tokens_per_s": base.get("tokens_per_s") if base else None, "per_K": per_K}
