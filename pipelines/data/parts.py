"""Regeneration in parts: each engine batch the regenerate stage finishes is kept as one part file, and a later run
with the same settings takes the conversations the parts hold instead of regenerating them
(``pipelines.data.regenerate``, module doc). A part is ``part-<sha256 of its sorted ids>.json``: the batch's input
ids (dropped conversations too), its output rows and its own counts, written atomically (``peagle_core.atomic``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from peagle_core.atomic import atomic_write_text

log = logging.getLogger(__name__)
PART_GLOB = "part-*.json"


def write_part(parts_dir: str | Path, ids: Sequence[str], rows: list[dict[str, Any]], stats: Mapping[str, Any],
               ) -> Path:
    """Keep one finished batch (input ``ids``, output ``rows``, its ``stats``) in ``parts_dir``; returns the file."""
    name = "part-" + hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()[:16] + ".json"
    Path(parts_dir).mkdir(parents=True, exist_ok=True)
    return atomic_write_text(Path(parts_dir) / name, json.dumps({"ids": list(ids), "rows": rows, "stats": dict(stats)}))


def read_parts(parts_dir: str | Path, ids: Iterable[str]) -> tuple[set[str], list[dict[str, Any]], Counter]:
    """What earlier runs wrote to ``parts_dir`` (:func:`write_part`) for conversations ``ids``: the ids done
    (regenerated or dropped), their rows and the parts' summed counts. A part naming ids outside ``ids`` is not
    used; a part that does not parse (cut short: it is written atomically, so only by hand) is skipped."""
    wanted, done, rows, stats = set(ids), set(), [], Counter()
    for path in sorted(Path(parts_dir).glob(PART_GLOB)):
        try:
            part = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log.warning("regenerate: part %s unreadable (%s); its conversations run again", path.name, e)
            continue
        if not set(part["ids"]) <= wanted or done & set(part["ids"]):
            continue
        done |= set(part["ids"])
        rows += part["rows"]
        stats.update({k: v for k, v in part["stats"].items() if isinstance(v, (int, float))})
    return done, rows, stats


__all__ = ["PART_GLOB", "read_parts", "write_part"]
