"""Regeneration in parts: each engine batch the regenerate stage finishes is kept as one part file, and a later run
with the same settings takes what the parts hold instead of generating it again. Two kinds, each in its own
directory under the stage's directory, named here (the one source of these names: the stage and
``bench.parts_carry`` import them):

- ``parts-<key>/`` (:data:`REGENERATE_PARTS`, ``pipelines.data.regenerate``, module doc): a part is
  ``part-<sha256 of its sorted ids>.json``, the batch's input ids (dropped conversations too), its output rows
  and its own counts (:func:`write_part`, :func:`read_parts`);
- ``self_instruct-parts-<key>/`` (:data:`SELF_INSTRUCT_PARTS`, ``pipelines.data.selfinstruct``): a part is
  ``part-<start>-<stop>.json``, the raw completions of self-instruct request indices ``[start, stop)``
  (:func:`write_range_part`, :func:`read_range_parts`).

Parts are written atomically (``peagle_core.atomic``): a part is whole or absent.
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
PART_GLOB = "part-*.json"  # the part files of either kind
REGENERATE_PARTS = "parts-"  # + key: the regenerate stage's conversations
SELF_INSTRUCT_PARTS = "self_instruct-parts-"  # + key: one self_instruct source's raw completions
PARTS_DIR_PREFIXES = (REGENERATE_PARTS, SELF_INSTRUCT_PARTS)


def is_parts_dir(name: str) -> bool:
    """Whether ``name`` (one path component) names a parts directory: a prefix of :data:`PARTS_DIR_PREFIXES` and a
    key of letters and digits."""
    return any(name.startswith(p) and name[len(p):].isalnum() for p in PARTS_DIR_PREFIXES)


def parts_dirs(stage_dir: str | Path) -> list[Path]:
    """The parts directories of either kind under ``stage_dir`` (the regenerate stage's directory), sorted."""
    d = Path(stage_dir)
    return sorted(p for p in d.iterdir() if p.is_dir() and is_parts_dir(p.name)) if d.is_dir() else []


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


def write_range_part(parts_dir: str | Path, start: int, items: Sequence[Any]) -> Path:
    """Keep the results ``items`` (JSON values) of request indices ``start .. start + len(items) - 1`` in
    ``parts_dir`` as ``part-<start>-<stop>.json``; returns the file."""
    name = f"part-{start:010d}-{start + len(items):010d}.json"
    Path(parts_dir).mkdir(parents=True, exist_ok=True)
    return atomic_write_text(Path(parts_dir) / name, json.dumps({"start": start, "items": list(items)}))


def read_range_parts(parts_dir: str | Path, stop: int) -> dict[int, Any]:
    """``{request index: item}`` of what earlier runs wrote to ``parts_dir`` (:func:`write_range_part`) for the
    indices below ``stop``; a part that does not parse is skipped (its indices run again)."""
    out: dict[int, Any] = {}
    for path in sorted(Path(parts_dir).glob(PART_GLOB)):
        try:
            part = json.loads(path.read_text())
            start, items = int(part["start"]), part["items"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("self_instruct: part %s unreadable (%s); its requests run again", path.name, e)
            continue
        out.update((i, x) for i, x in enumerate(items[:max(0, stop - start)], start))
    return out


__all__ = ["PARTS_DIR_PREFIXES", "PART_GLOB", "REGENERATE_PARTS", "SELF_INSTRUCT_PARTS", "is_parts_dir", "parts_dirs",
           "read_parts", "read_range_parts", "write_part", "write_range_part"]
