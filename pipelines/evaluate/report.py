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
