"""The traffic log as a prompt source (``kind: traffic``): log rows to prompt rows.

:func:`load_traffic` reads a source's log (:func:`pipelines.traffic.shards.read_log`), sorts it by
completion time, drops malformed rows, deduplicates prompts, splits by time (the newest rows held out)
and keeps the served answer of greedy requests (``keep_answers``: regenerate skips them); see
:class:`pipelines.recipe.traffic.TrafficSourceConfig` for the split, the deduplication and which answers
skip regeneration.
"""

from __future__ import annotations

import logging
from collections import Counter
from datetime import UTC
from typing import TYPE_CHECKING, Any

from pipelines.traffic.shards import read_log

if TYPE_CHECKING:
    import datasets

    from pipelines.recipe import SourceConfig

log = logging.getLogger(__name__)

SOURCE_LABEL = "traffic"


def source_uri(src: SourceConfig) -> str:
    """The log directory a ``traffic`` source reads: its ``path`` (URI kept, local path expanded),
    else ``settings.traffic_dir()`` (every served model's log)."""
    from pipelines import settings

    if src.path:
        return src.path if "://" in src.path else str(src.resolved_path())
    return str(settings.traffic_dir())


def is_greedy(row: dict[str, Any]) -> bool:
    """The request asked for greedy decoding (``temperature: 0`` sent explicitly)."""
    t = row.get("temperature")
    return t is not None and float(t) == 0.0


def split_rows(rows: list[dict[str, Any]], heldout_fraction: float) -> tuple[list[dict], list[dict]]:
    """``(older, newest)`` of time-sorted ``rows``: the newest ``round(heldout_fraction * n)`` rows held
    out (at least one when the fraction is > 0 and n >= 2; never all)."""
    n = len(rows)
    num = round(heldout_fraction * n)
    if heldout_fraction > 0 and n >= 2:
        num = min(max(num, 1), n - 1)
    return rows[: n - num], rows[n - num:]


def traffic_rows(table_rows: list[dict[str, Any]], src: SourceConfig, *, heldout: bool = False,
                 stats: Counter | None = None) -> list[dict[str, Any]]:
    """Log rows -> prompt rows ``{id, messages, source, keep_answers}`` of the source's split.

    Sorted by completion time, rows after ``until`` dropped, malformed ones skipped (``bad_rows``),
    prompts deduplicated (oldest kept), split by time (``heldout`` picks the newest slice when
    ``split`` is auto). Greedy rows with ``keep_greedy_answers`` carry the served answer as their last
    assistant turn and ``keep_answers=True`` (regenerate keeps them); the others end on the prompt.
    """
    from pipelines.data.rows import KEEP_ANSWERS, BadRow, normalize_row
    from pipelines.data.selfinstruct import deduplicate

    cfg = src.traffic
    stats = stats if stats is not None else Counter()
    rows = [r for r in table_rows if r.get("time") is not None]
    if cfg.until is not None:
        until = cfg.until if cfg.until.tzinfo else cfg.until.replace(tzinfo=UTC)
        rows = [r for r in rows if r["time"] <= until]
    rows.sort(key=lambda r: (r["time"], r.get("request_id") or ""))
    usable = []
    for i, r in enumerate(rows):
        try:
            norm = normalize_row({"messages": r.get("messages"), "id": r.get("request_id") or f"traffic-{i}"}, i,
                                 f"openai_jsonl:{SOURCE_LABEL}")
        except BadRow as e:
            stats["bad_rows"] += 1
            log.debug("traffic: %s", e)
            continue
        usable.append((r, norm))
    texts = ["\n".join(f"{m['role']}: {m['content']}" for m in norm["messages"]) for _, norm in usable]
    kept = [usable[k] for k in deduplicate(texts, cfg.dedup_threshold, stats)]
    older, newest = split_rows(kept, cfg.heldout_fraction)
    which = cfg.split if cfg.split != "auto" else ("heldout" if heldout else "train")
    chosen = {"train": older, "heldout": newest, "all": kept}[which]
    out = []
    for r, norm in chosen:
        msgs = list(norm["messages"])
        keep = bool(cfg.keep_greedy_answers and is_greedy(r) and (r.get("completion") or "").strip()
                    and msgs[-1]["role"] == "user")
        if keep:
            msgs.append({"role": "assistant", "content": r["completion"]})
        stats["greedy_kept" if keep else "to_regenerate"] += 1
        out.append({"id": norm["id"], "messages": msgs, "source": SOURCE_LABEL, KEEP_ANSWERS: keep})
    log.info("traffic: %d rows, %d malformed, %d exact + %d near duplicates, %d older / %d held out; %s split: %d "
             "rows (%d greedy answers kept)", len(rows), stats["bad_rows"], stats["exact_duplicates"],
             stats["near_duplicates"], len(older), len(newest), which, len(out), stats["greedy_kept"])
    return out


def load_traffic(src: SourceConfig, *, heldout: bool = False) -> datasets.Dataset:
    """A ``traffic`` source as a normalized ``datasets.Dataset`` (columns id, messages, source,
    keep_answers): :func:`read_log` then :func:`traffic_rows`.

    Raises:
        ValueError: no shards at the source's path, or no row in the chosen split.
    """
    import datasets

    from pipelines.data.rows import KEEP_ANSWERS

    uri = source_uri(src)
    rows = traffic_rows(read_log(uri).to_pylist(), src, heldout=heldout)
    if not rows:
        raise ValueError(f"traffic log {uri}: no usable row in the {src.traffic.split!r} split "
                         f"(heldout_fraction={src.traffic.heldout_fraction}, until={src.traffic.until}); "
                         "send more requests or change the split")
    return datasets.Dataset.from_dict({
        "id": [r["id"] for r in rows], "messages": [r["messages"] for r in rows],
        "source": [r["source"] for r in rows], KEEP_ANSWERS: [r[KEEP_ANSWERS] for r in rows],
    })


__all__ = ["SOURCE_LABEL", "is_greedy", "load_traffic", "source_uri", "split_rows", "traffic_rows"]
