"""The checksums of a head directory (part of :mod:`peagle_core.contract`, which re-exports these names):
``peagle_checksums.json`` lists the sha256 of every other file; its own sha256 is the head's identity in the
registry (``head_sha256``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from peagle_core.mask_token import HeadContractError

CHECKSUMS_FILE = "peagle_checksums.json"


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    """The sha256 hex digest of a file, read ``chunk_bytes`` at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def head_digest(head_dir: str | os.PathLike) -> str:
    """The identity of a head's files: sha256 of its ``peagle_checksums.json`` (which lists the sha256 of
    every other file); the registry tags each model version with it (``head_sha256``).

    Raises:
        HeadContractError: the checksum file is missing.
    """
    f = Path(head_dir) / CHECKSUMS_FILE
    if not f.is_file():
        raise HeadContractError(f"{f} is missing: export the head with peagle_core.contract.export_head")
    return hashlib.sha256(f.read_bytes()).hexdigest()


def write_checksums(head_dir: str | os.PathLike) -> dict[str, str]:
    """Write ``peagle_checksums.json`` (sha256 of every other file) and return it."""
    d = Path(head_dir)
    sums = {p.name: sha256_file(p) for p in sorted(d.iterdir()) if p.is_file() and p.name != CHECKSUMS_FILE}
    (d / CHECKSUMS_FILE).write_text(json.dumps(sums, indent=2, sort_keys=True))
    return sums


def verify_checksums(head_dir: str | os.PathLike) -> dict[str, str]:
    """Re-hash the files listed in ``peagle_checksums.json``.

    Raises:
        HeadContractError: the checksum file is missing, or a file is missing or differs (named).
    """
    d = Path(head_dir)
    f = d / CHECKSUMS_FILE
    if not f.exists():
        raise HeadContractError(f"{f} is missing: export the head with peagle_core.contract.export_head")
    sums = json.loads(f.read_text())
    for name, want in sums.items():
        p = d / name
        if not p.exists():
            raise HeadContractError(f"{p} listed in {CHECKSUMS_FILE} is missing")
        got = sha256_file(p)
        if got != want:
            raise HeadContractError(f"{p}: sha256 {got[:12]}… != recorded {want[:12]}… (corrupted or edited)")
    return sums
