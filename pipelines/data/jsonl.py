"""JSON and JSON Lines files of prompt sources: a JSON array becomes JSON Lines once, cached under
``$PEAGLE_HOME/data`` (keyed on the file's path, size and mtime), so ``datasets`` reads every source
as raw lines and every malformed row can be reported with its index (:mod:`pipelines.data.prompts`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path

from peagle_core.atomic import atomic_write_text, replace_file
from pipelines import settings

log = logging.getLogger(__name__)

_WS_COMMA = re.compile(r"[\s,]*")


def json_array_to_jsonl(src: Path, dst: Path) -> dict[str, int]:
    """Rewrite a JSON array file as JSONL (one element per line), keeping complete elements only.

    A file cut off mid-element (as the packaged ShareGPT is) keeps the complete prefix and is
    reported as truncated. Returns ``{"num_rows", "truncated_at_char"}`` (-1 if complete).

    Raises:
        ValueError: the file is not a JSON array.
    """
    text = src.read_text(encoding="utf-8")
    start = _WS_COMMA.match(text, 0).end()
    if start >= len(text) or text[start] != "[":
        raise ValueError(f"{src} is not a JSON array; use a JSONL file with one object per line")
    decoder = json.JSONDecoder()
    i, n, count, truncated = start + 1, len(text), 0, -1
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            while True:
                i = _WS_COMMA.match(text, i).end()
                if i >= n:
                    truncated = i
                    break
                if text[i] == "]":
                    break
                try:
                    obj, i = decoder.raw_decode(text, i)
                except json.JSONDecodeError:
                    truncated = i
                    break
                out.write(json.dumps(obj, ensure_ascii=False) + "\n")
                count += 1
        replace_file(tmp, dst)  # fsync, rename, fsync the directory
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return {"num_rows": count, "truncated_at_char": truncated}


def as_jsonl(path: Path, home: Path | None, *, known_truncated: bool = False) -> Path:
    """``path`` itself if it is JSONL (or .jsonl.gz), else a cached JSONL rewrite of the JSON array.

    A cut-off file is said once, when it is first rewritten: a warning, or an information line when
    ``known_truncated`` (the packaged ShareGPT file, cut off upstream: expected, nothing to fix).
    """
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
        return path
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        return path  # JSON Lines with another extension
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    dst = settings.data_dir(home) / f"{path.stem}-{key}.jsonl"
    meta = dst.with_suffix(".meta.json")
    if dst.is_file() and meta.is_file():
        return dst
    info = json_array_to_jsonl(path, dst)
    atomic_write_text(meta, json.dumps(info))  # the cache's commit marker: whole or absent
    if info["truncated_at_char"] >= 0:
        log.log(logging.INFO if known_truncated else logging.WARNING,
                "%s is cut off at character %d (an incomplete last element); using its %d complete rows",
                path, info["truncated_at_char"], info["num_rows"])
    return dst
