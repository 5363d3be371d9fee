"""A finished (materialized) capture read back as a Ray Dataset (:func:`captured_dataset`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from peagle_core import shards
from pipelines.capture.rows import samples_to_columns

if TYPE_CHECKING:
    import ray.data


def _read_shard_rows(batch, capture_dir: str, verify: bool) -> dict[str, Any]:
    """Ray Data ``map_batches`` function: the ``shard`` names of ``batch`` -> their samples as columns."""
    samples = []
    for name in list(batch["shard"]):
        samples.extend(shards.read_shard(Path(capture_dir) / str(name), verify=verify).samples())
    return samples_to_columns(samples)


def captured_dataset(capture_dir: str | Path, *, verify: bool = True) -> ray.data.Dataset:
    """A materialized capture as a Ray Dataset of sample rows (same schema as
    :func:`~pipelines.capture.stream.capture_stream`), one shard per read task, checksums verified on read.

    Raises:
        ShardError: no manifest (unfinished capture: re-run it). Corrupt shards raise on read, naming the file.
    """
    import ray

    capture_dir = Path(capture_dir)
    names = list(dict.fromkeys(shards.load_manifest(capture_dir).column("shard").to_pylist()))
    ds = ray.data.from_items([{"shard": n} for n in names], override_num_blocks=max(1, len(names)))
    return ds.map_batches(_read_shard_rows, batch_size=1, fn_kwargs={"capture_dir": str(capture_dir), "verify": verify})
