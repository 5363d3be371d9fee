"""The order a worker trains a materialized capture in: a pure function of (seed, epoch, rank, world size).

Every epoch the manifest's sample ids are sorted by ``sha256(f"{seed}:{epoch}:{sample_id}")``: a seeded
permutation that depends on nothing else (not on the manifest's row order, Ray scheduling, restarts,
or a library's random stream). Rank ``r`` of ``W`` workers takes positions ``r, r+W, r+2W, ...`` of it,
``n // W`` samples each (the ``n % W`` last ones sit this epoch out; others each epoch). A worker reads
its samples straight from the shards (safetensors slices of one sample, sha256 checked against the
manifest) and resumes an epoch by its position in that list, so a run restarted from a checkpoint
trains exactly the samples an uninterrupted run trains, in the same order.

What was trained is recorded: the :class:`~pipelines.train.loop.Trainer` chains a sha256 over the ids
of the samples each step consumed (:func:`chain_digest`, saved with the data position) and hands an
:class:`EpochRecord` per rank to ``on_epoch_end``; under Ray rank 0 gathers them and writes
``<storage>/<run>/sample_ids/epoch_XXXX.json`` (:func:`epoch_file`).

Shape legend: N tokens of one sample, Ht target hidden.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peagle_core import shards
from peagle_core.samples import INPUT_IDS, SAMPLE_KEYS, sample_checksum

SAMPLE_ID = shards.MANIFEST_COLUMNS[0]  # "sample_id"
SAMPLE_LOG_DIR = "sample_ids"  # under the Ray Train run directory, beside the checkpoints
ORDER_RULE = "sha256(seed:epoch:sample_id), rank r takes positions r, r+W, ... (n // W each)"
_MAX_OPEN_SHARDS = 8

__all__ = [
    "ORDER_RULE", "SAMPLE_LOG_DIR", "CaptureReader", "EpochRecord", "EpochSamples", "OrderedCapture",
    "chain_digest", "epoch_file", "epoch_order", "epoch_orders", "epoch_summary", "write_epoch_summary",
]


def epoch_orders(sample_ids: Iterable[str], *, seed: int, epoch: int, world_size: int = 1) -> list[list[str]]:
    """Every rank's :func:`epoch_order` of ``epoch`` (one sort)."""
    order = sorted(sample_ids, key=lambda s: hashlib.sha256(f"{seed}:{epoch}:{s}".encode()).digest())
    per_rank = len(order) // world_size
    return [order[r: per_rank * world_size: world_size] for r in range(world_size)]


def epoch_order(sample_ids: Iterable[str], *, seed: int, epoch: int, rank: int = 0, world_size: int = 1) -> list[str]:
    """The sample ids rank ``rank`` of ``world_size`` trains in ``epoch`` (see the module docstring): a pure
    function of the id set, ``seed``, ``epoch``, ``rank`` and ``world_size``.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    return epoch_orders(sample_ids, seed=seed, epoch=epoch, world_size=world_size)[rank]


def chain_digest(sample_ids: Iterable[str], start: str = "") -> str:
    """Running sha256 over ids in order: ``d_k = sha256(d_{k-1} + "\\n" + id_k)`` (hex), ``d_0 = start``.
    Resumable (the state is one hex string) and order-sensitive; ``""`` for no ids."""
    d = start
    for s in sample_ids:
        d = hashlib.sha256(f"{d}\n{s}".encode()).hexdigest()
    return d


@dataclass(frozen=True)
class EpochRecord:
    """What one rank trained in one epoch: ``num_samples`` and the :func:`chain_digest` of their ids."""

    epoch: int
    rank: int
    num_samples: int
    sha256: str


class CaptureReader:
    """Random access to the samples of a finished capture: one sample = four safetensors slices of its
    shard (at most ``_MAX_OPEN_SHARDS`` files open), its sha256 checked against the manifest.

    Raises:
        ShardError: no manifest (unfinished capture), a shard of another format, a sample whose
            bytes do not match the manifest's checksum (names the file and the sample).
    """

    def __init__(self, capture_dir: str | Path, *, verify: bool = True) -> None:
        self.capture_dir, self.verify = Path(capture_dir), verify
        table = shards.load_manifest(self.capture_dir)
        self.rows: dict[str, dict[str, Any]] = {r[SAMPLE_ID]: r for r in table.to_pylist()}
        self._open: OrderedDict[str, Any] = OrderedDict()

    @property
    def sample_ids(self) -> list[str]:
        """The manifest's sample ids (manifest order)."""
        return list(self.rows)

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        if name in self._open:
            self._open.move_to_end(name)
            return self._open[name]
        path = self.capture_dir / name
        if not path.is_file():
            raise shards.ShardError(f"shard {path} does not exist; re-run capture")
        f = safe_open(str(path), framework="pt")
        version = (f.metadata() or {}).get("format_version")
        if version != shards.FORMAT_VERSION:
            raise shards.ShardError(f"shard {path}: format_version {version!r} != {shards.FORMAT_VERSION}")
        self._open[name] = f
        if len(self._open) > _MAX_OPEN_SHARDS:
            self._open.popitem(last=False)
        return f

    def read(self, sample_id: str, float_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """Sample ``sample_id``: ``input_ids [N]`` int64, ``loss_mask [N]`` uint8, ``aux [N, 3*Ht]`` and
        ``final_hidden [N, Ht]`` in ``float_dtype``, and ``sample_id``."""
        row = self.rows[sample_id]
        f = self._handle(row["shard"])
        lo, hi = int(row["offset"]), int(row["offset"]) + int(row["length"])
        sample: dict[str, Any] = {SAMPLE_ID: sample_id}
        for key in SAMPLE_KEYS:
            sample[key] = f.get_slice(key)[lo:hi]
        if self.verify and sample_checksum(sample) != row["checksum"]:
            raise shards.ShardError(f"shard {self.capture_dir / row['shard']}: checksum mismatch for sample "
                                    f"{sample_id!r}; the file is corrupt, delete it and re-run capture")
        for key in SAMPLE_KEYS:
            t = sample[key]
            sample[key] = t.long() if key == INPUT_IDS else (t.to(float_dtype) if t.is_floating_point() else t)
        return sample


class EpochSamples(Sequence):
    """One rank's samples of one epoch, read lazily: ``samples[i]`` reads sample ``sample_ids[i]``.
    A sequence, so the trainer resumes at position ``i`` without reading the samples before it."""

    def __init__(self, reader: CaptureReader, sample_ids: list[str]) -> None:
        self.reader, self.sample_ids = reader, sample_ids

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, i):  # an int or a slice, as Sequence
        if isinstance(i, slice):
            return EpochSamples(self.reader, self.sample_ids[i])
        return self.reader.read(self.sample_ids[i])


@dataclass(frozen=True)
class OrderedCapture:
    """A materialized capture trained in :func:`epoch_order` (what ``run_train`` ships to its workers
    instead of a Ray Dataset; ``capture_dir`` must be readable from every worker, like the target).
    The order's seed is ``training.seed``.

    Args:
        capture_dir: a finished capture (``manifest.parquet`` present).
        verify: check each sample's sha256 on read.
    """

    capture_dir: str
    verify: bool = True

    def open(self) -> CaptureReader:
        """Raises:
            ShardError: the capture has no manifest."""
        return CaptureReader(self.capture_dir, verify=self.verify)

    @staticmethod
    def epoch(reader: CaptureReader, *, seed: int, epoch: int, rank: int = 0, world_size: int = 1) -> EpochSamples:
        """The samples of ``rank`` in ``epoch``."""
        return EpochSamples(reader, epoch_order(reader.sample_ids, seed=seed, epoch=epoch, rank=rank,
                                                world_size=world_size))


def epoch_summary(records: Sequence[EpochRecord], *, seed: int,
                  planned: Sequence[Sequence[str]] | None = None) -> dict[str, Any]:
    """The JSON of one epoch from every rank's record (rank order): counts, digests, a global ``sha256``
    over them and, when the order was planned (``planned[r]`` = rank r's :func:`epoch_order`), each rank's
    trained ids (``planned[r][:num_samples]``) with ``matches_digest``: they chain to the digest the
    trainer recorded from the samples it actually consumed."""
    ranks = []
    for rec in records:
        entry: dict[str, Any] = {"rank": rec.rank, "num_samples": rec.num_samples, "sha256": rec.sha256}
        if planned is not None:
            ids = list(planned[rec.rank][:rec.num_samples])
            entry["matches_digest"] = chain_digest(ids) == rec.sha256
            entry["sample_ids"] = ids
        ranks.append(entry)
    overall = hashlib.sha256("\n".join(f"{r.rank}:{r.num_samples}:{r.sha256}" for r in records).encode()).hexdigest()
    return {"epoch": records[0].epoch, "seed": seed, "world_size": len(records),
            "order": ORDER_RULE if planned is not None else "Ray Data stream (not planned)",
            "num_samples": sum(r.num_samples for r in records), "sha256": overall, "ranks": ranks}


def epoch_file(directory: str | Path, epoch: int) -> Path:
    """``<directory>/epoch_XXXX.json``."""
    return Path(directory) / f"epoch_{epoch:04d}.json"


def write_epoch_summary(directory: str | Path, summary: dict[str, Any]) -> Path:
    """Write ``summary`` to :func:`epoch_file` atomically (temp file, fsync, rename; a re-run of the same
    epoch after a restart replaces it with the same content)."""
    path = epoch_file(directory, int(summary["epoch"]))
    shards.atomic_write_bytes(path, (json.dumps(summary, indent=1) + "\n").encode())
    return path
