"""Captured target states on disk: safetensors shards, a parquet manifest, checksums, capture metadata.

No Ray here: the trainer on a bare GPU box reads a capture with :func:`iter_samples` alone. The
samples themselves (keys, dtypes, validation, checksums) are defined in ``peagle_core.samples``;
storage estimates are in ``peagle_core.storage``, token counts in ``peagle_core.vocab``.

A shard ``shard-00000.safetensors`` holds its samples concatenated along tokens::

    input_ids [sum N] int32, loss_mask [sum N] uint8, aux [sum N, 3*Ht], final_hidden [sum N, Ht]
    offsets [S] int64, lengths [S] int64

plus header metadata (JSON strings): ``sample_ids``, ``checksums`` (sha256 per sample over its
bytes), ``format_version`` and the writer's own keys. Files are written to a temporary name,
fsynced and renamed (``peagle_core.atomic.atomic_write_via``), so a shard on disk is either
absent or complete, also after a crash or power loss; bit rot or truncation is caught by
checksums on read (:class:`ShardError`, naming the file).

Shape legend: N tokens of one sample, S samples in a shard, Ht target hidden size.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peagle_core.atomic import atomic_write_bytes, atomic_write_via  # atomic_write_bytes re-exported
from peagle_core.samples import SAMPLE_KEYS, as_tensor, sample_checksum, validate_sample

FORMAT_VERSION = "1"
MANIFEST_COLUMNS = ("sample_id", "shard", "offset", "length", "checksum")
MANIFEST_NAME = "manifest.parquet"
META_NAME = "capture_meta.json"


class ShardError(ValueError):
    """A shard or manifest on disk is missing, truncated, corrupted or inconsistent (message names the file)."""


def shard_name(index: int) -> str:
    """File name of shard ``index``: ``shard-00000.safetensors``."""
    return f"shard-{index:05d}.safetensors"


# ----------------------------------------------------------------------------------------------
# shards


@dataclass
class Shard:
    """One shard read back: concatenated tensors, per-sample offsets/lengths, header metadata."""

    path: Path
    tensors: dict[str, torch.Tensor]
    sample_ids: list[str]
    checksums: list[str]
    metadata: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.sample_ids)

    def sample(self, i: int) -> dict[str, Any]:
        """Sample ``i`` as a dict of views into the shard tensors."""
        off, n = int(self.tensors["offsets"][i]), int(self.tensors["lengths"][i])
        out: dict[str, Any] = {"sample_id": self.sample_ids[i]}
        for key in SAMPLE_KEYS:
            out[key] = self.tensors[key][off:off + n]
        return out

    def samples(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self.sample(i)

    def rows(self) -> list[dict[str, Any]]:
        """Manifest rows (``sample_id, shard, offset, length, checksum``)."""
        offs, lens = self.tensors["offsets"].tolist(), self.tensors["lengths"].tolist()
        return [
            {"sample_id": s, "shard": self.path.name, "offset": o, "length": n, "checksum": c}
            for s, o, n, c in zip(self.sample_ids, offs, lens, self.checksums)
        ]


def write_shard(
    path: str | Path,
    samples: Sequence[Mapping[str, Any]],
    *,
    metadata: Mapping[str, Any] | None = None,
    validate: bool = True,
) -> list[dict[str, Any]]:
    """Write ``samples`` (see module docstring) into one safetensors shard, atomically.

    ``metadata``: extra header keys (values JSON-encoded unless already str). An empty ``samples``
    writes a valid empty shard (all samples of that slot were dropped), so resume sees it as done.

    Returns:
        manifest rows ``[{sample_id, shard, offset, length, checksum}]`` in sample order.

    Raises:
        ValueError: a sample fails :func:`validate_sample`, duplicate sample ids, mixed dtypes or
            widths, or a metadata key clashing with a reserved one.
    """
    from safetensors.torch import save_file

    path = Path(path)
    samples = list(samples)
    if validate:
        for s in samples:
            validate_sample(s)
    ids = [s["sample_id"] for s in samples]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"{path.name}: duplicate sample ids {dup[:5]}")
    if samples:
        aux0, fin0 = as_tensor(samples[0]["aux"]), as_tensor(samples[0]["final_hidden"])
        for s in samples:
            a, f = as_tensor(s["aux"]), as_tensor(s["final_hidden"])
            if a.dtype != aux0.dtype or a.shape[1] != aux0.shape[1] or f.shape[1] != fin0.shape[1]:
                raise ValueError(
                    f"{path.name}: sample {s['sample_id']!r} has aux {a.dtype} {tuple(a.shape)} / final_hidden "
                    f"{tuple(f.shape)} unlike the first sample's {aux0.dtype} {tuple(aux0.shape)}; one shard, one layout"
                )
        tensors = {
            "input_ids": torch.cat([as_tensor(s["input_ids"]).to(torch.int32) for s in samples]),
            "loss_mask": torch.cat([as_tensor(s["loss_mask"]).to(torch.uint8) for s in samples]),
            "aux": torch.cat([as_tensor(s["aux"]) for s in samples]).contiguous(),
            "final_hidden": torch.cat([as_tensor(s["final_hidden"]) for s in samples]).contiguous(),
        }
    else:  # safetensors accepts zero-size tensors
        tensors = {
            "input_ids": torch.zeros(0, dtype=torch.int32),
            "loss_mask": torch.zeros(0, dtype=torch.uint8),
            "aux": torch.zeros(0, 0, dtype=torch.float32),
            "final_hidden": torch.zeros(0, 0, dtype=torch.float32),
        }
    lengths = torch.tensor([as_tensor(s["input_ids"]).numel() for s in samples], dtype=torch.int64)
    offsets = torch.cumsum(lengths, 0) - lengths
    tensors["offsets"], tensors["lengths"] = offsets, lengths
    checksums = [sample_checksum(s) for s in samples]
    header = {k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in (metadata or {}).items()}
    clash = {"format_version", "sample_ids", "checksums"} & set(header)
    if clash:
        raise ValueError(f"{path.name}: metadata keys {sorted(clash)} are reserved by the shard format")
    header.update(format_version=FORMAT_VERSION, sample_ids=json.dumps(ids), checksums=json.dumps(checksums))
    # straight to the file: save() would first build the whole shard (GBs) as one bytes object
    atomic_write_via(path, lambda tmp: save_file(tensors, str(tmp), metadata=header))
    return [
        {"sample_id": s, "shard": path.name, "offset": int(o), "length": int(n), "checksum": c}
        for s, o, n, c in zip(ids, offsets.tolist(), lengths.tolist(), checksums)
    ]


def shard_header(path: str | Path) -> dict[str, str]:
    """Header metadata of a shard without reading its tensors (cheap; for resume decisions).

    Raises:
        ShardError: missing or unparseable file (e.g. truncated header).
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ShardError(f"shard {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as e:  # safetensors raises its own SafetensorError / OSError
        raise ShardError(f"shard {path} is unreadable ({type(e).__name__}: {e}); delete it and re-run capture") from e


def read_shard(path: str | Path, verify: bool = True) -> Shard:
    """Read a shard written by :func:`write_shard`.

    ``verify=True`` recomputes every sample's sha256 and compares it with the header (about
    1 s per GB); ``verify=False`` still checks structure (sizes, offsets).

    Raises:
        ShardError: naming ``path``: missing, truncated or unparseable file; missing tensors;
            offsets/lengths inconsistent with the tensors; a checksum mismatch (names the sample).
    """
    from safetensors.torch import load

    path = Path(path)
    if not path.is_file():
        raise ShardError(f"shard {path} does not exist")
    data = path.read_bytes()
    try:
        tensors = load(data)
        header = shard_header(path)
    except ShardError:
        raise
    except Exception as e:
        raise ShardError(
            f"shard {path} is truncated or corrupt ({type(e).__name__}: {e}); delete it and re-run capture"
        ) from e
    missing = [k for k in (*SAMPLE_KEYS, "offsets", "lengths") if k not in tensors]
    if missing or "sample_ids" not in header or "checksums" not in header:
        raise ShardError(f"shard {path} lacks {missing or ['sample_ids/checksums header']}; not a peagle shard")
    if header.get("format_version") != FORMAT_VERSION:
        raise ShardError(f"shard {path}: format_version {header.get('format_version')!r} != {FORMAT_VERSION}")
    try:
        sample_ids, checksums = json.loads(header["sample_ids"]), json.loads(header["checksums"])
    except ValueError as e:
        raise ShardError(f"shard {path}: header JSON is corrupt ({e})") from e
    offs, lens = tensors["offsets"], tensors["lengths"]
    total = tensors["input_ids"].numel()
    n_s = len(sample_ids)
    consistent = (
        len(checksums) == n_s == offs.numel() == lens.numel()
        and all(tensors[k].shape[0] == total for k in SAMPLE_KEYS)
        and (n_s == 0 or (int(lens.sum()) == total and bool((offs == torch.cumsum(lens, 0) - lens).all())))
    )
    if not consistent:
        raise ShardError(f"shard {path}: offsets/lengths/sample ids do not match its {total} tokens; corrupt shard")
    shard = Shard(path, tensors, sample_ids, checksums, header)
    if verify:
        for i, want in enumerate(checksums):
            got = sample_checksum(shard.sample(i))
            if got != want:
                raise ShardError(
                    f"shard {path}: checksum mismatch for sample {sample_ids[i]!r} (stored {want[:12]}..., "
                    f"computed {got[:12]}...); the file is corrupt, delete it and re-run capture"
                )
    return shard


# ----------------------------------------------------------------------------------------------
# manifest and capture directory


def write_manifest(capture_dir: str | Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write ``manifest.parquet`` (columns ``sample_id, shard, offset, length, checksum``) atomically.

    Raises:
        ValueError: duplicate sample ids.
    """
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = list(rows)
    ids = [r["sample_id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError(f"manifest for {capture_dir}: duplicate sample ids")
    table = pa.table({
        "sample_id": pa.array(ids, pa.string()),
        "shard": pa.array([r["shard"] for r in rows], pa.string()),
        "offset": pa.array([int(r["offset"]) for r in rows], pa.int64()),
        "length": pa.array([int(r["length"]) for r in rows], pa.int64()),
        "checksum": pa.array([r["checksum"] for r in rows], pa.string()),
    })
    buf = io.BytesIO()
    pq.write_table(table, buf)
    path = Path(capture_dir) / MANIFEST_NAME
    atomic_write_bytes(path, buf.getvalue())
    return path


def load_manifest(capture_dir: str | Path):
    """``manifest.parquet`` of a capture as a ``pyarrow.Table`` (``.to_pylist()`` for rows).

    Raises:
        ShardError: no manifest (the capture did not finish: re-run it to resume) or wrong columns.
    """
    import pyarrow.parquet as pq

    path = Path(capture_dir) / MANIFEST_NAME
    if not path.is_file():
        raise ShardError(f"{path} does not exist: the capture did not finish; re-run capture to resume it")
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise ShardError(f"{path} is unreadable ({type(e).__name__}: {e})") from e
    missing = [c for c in MANIFEST_COLUMNS if c not in table.column_names]
    if missing:
        raise ShardError(f"{path} lacks columns {missing}")
    return table


def write_capture_meta(capture_dir: str | Path, meta: Mapping[str, Any]) -> Path:
    """Write ``capture_meta.json`` atomically (target path/sha, aux layer ids, dtype, sizes, counts)."""
    path = Path(capture_dir) / META_NAME
    atomic_write_bytes(path, (json.dumps(dict(meta), indent=2, sort_keys=True, default=str) + "\n").encode())
    return path


def load_capture_meta(capture_dir: str | Path) -> dict[str, Any]:
    """``capture_meta.json`` of a capture.

    Raises:
        ShardError: missing or unparseable.
    """
    path = Path(capture_dir) / META_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ShardError(f"{path} is missing or corrupt ({e})") from e


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
        t = t.to(torch.float32)
    return t.numpy()


def iter_samples(
    capture_dir: str | Path, verify: bool = True, *, as_numpy: bool = False, shards: Sequence[str] | None = None
) -> Iterator[dict[str, Any]]:
    """Samples of a materialized capture in manifest order (torch views, or numpy with ``as_numpy``;
    bf16 becomes float32 in numpy).

    ``verify=True`` checks each sample's sha256 against the shard header; the manifest's
    offset/length/checksum are always checked against the shard. ``shards`` limits to those file names.

    Raises:
        ShardError: missing manifest, a missing/corrupt shard, or a manifest row disagreeing with its shard.
    """
    capture_dir = Path(capture_dir)
    rows = load_manifest(capture_dir).to_pylist()
    by_shard: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_shard.setdefault(r["shard"], []).append(r)
    for name, want in by_shard.items():
        if shards is not None and name not in shards:
            continue
        shard = read_shard(capture_dir / name, verify=verify)
        index = {r["sample_id"]: (i, r) for i, r in enumerate(shard.rows())}
        for r in want:
            hit = index.get(r["sample_id"])
            if hit is None or (hit[1]["offset"], hit[1]["length"], hit[1]["checksum"]) != (
                r["offset"], r["length"], r["checksum"]
            ):
                raise ShardError(
                    f"shard {shard.path}: manifest row for {r['sample_id']!r} does not match the shard "
                    f"(manifest {r['offset']}/{r['length']}/{r['checksum'][:12]}, shard {hit and hit[1]}); "
                    "re-run capture to rebuild"
                )
            s = shard.sample(hit[0])
            yield {k: (_to_numpy(v) if as_numpy and isinstance(v, torch.Tensor) else v) for k, v in s.items()}


__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_COLUMNS",
    "MANIFEST_NAME",
    "META_NAME",
    "Shard",
    "ShardError",
    "atomic_write_bytes",
    "iter_samples",
    "load_capture_meta",
    "load_manifest",
    "read_shard",
    "shard_header",
    "shard_name",
    "write_capture_meta",
    "write_manifest",
    "write_shard",
]
