"""The traffic log on storage: the row schema, the shard names, where a log lives, reading shards back.

A log is a directory of Parquet shards ``traffic-<UTC time>-<host>-<pid>-<seq>.parquet``, each written
whole by :class:`pipelines.traffic.writer.TrafficLogWriter` (a hidden temporary file renamed: readers
never see half a shard), every row in :func:`schema`. :func:`read_log` reads every shard under a
directory (recursively) into one table; shards of an older schema get null columns.

Paths: a local directory or any ``pyarrow.fs`` URI (``s3://``, ``gs://``, ``file://``); the default
directory is ``pipelines.settings.traffic_dir``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

SHARD_PREFIX, SHARD_SUFFIX = "traffic-", ".parquet"


def schema() -> pa.Schema:
    import pyarrow as pa

    return pa.schema([
        ("time", pa.timestamp("us", tz="UTC")),  # when the response completed
        ("request_id", pa.string()),  # the response's id (chatcmpl-...)
        ("model", pa.string()),  # served model id
        ("head", pa.string()),  # draft head served: models:/NAME/VERSION (pinned) or a directory; null = none
        ("num_speculative_tokens", pa.int32()),  # K served; null without a head
        ("k_schedule", pa.string()),  # JSON [[batch_min, batch_max, K], ...] when served with a K schedule, else null
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("completion", pa.string()),  # the served answer (choice 0)
        ("finish_reason", pa.string()),
        ("stream", pa.bool_()),
        ("temperature", pa.float64()),  # as sent; null = not sent (the engine's default applied)
        ("top_p", pa.float64()),
        ("max_tokens", pa.int64()),
        ("seed", pa.int64()),
        ("prompt_tokens", pa.int64()),  # usage, when reported
        ("completion_tokens", pa.int64()),
        ("acceptance_length", pa.float64()),  # vLLM's per-request mean AL (bonus token included); null = not reported
        ("num_draft_tokens", pa.int64()),
        ("num_accepted_tokens", pa.int64()),
        ("latency_s", pa.float64()),  # request start to last byte, seen by the ingress
    ])


def open_log_dir(uri: str | os.PathLike):
    """``(pyarrow FileSystem, path)`` of a log directory: a pyarrow.fs URI, or a local path (~ and
    $VARS expanded, made absolute).

    Raises:
        pyarrow.ArrowInvalid / OSError: an unknown scheme or an unreachable store.
    """
    import pyarrow.fs as pafs

    uri = str(uri)
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), str(Path(os.path.expandvars(uri)).expanduser().resolve())


def resolve_log_uri(uri: str | None, model_id: str) -> str:
    """Where a Serve app logs: ``uri`` (a local path expanded and made absolute here, on the driver,
    so replicas on other nodes need no ``$PEAGLE_HOME``), else ``settings.traffic_dir(model_id)``."""
    from pipelines import settings

    if uri is None:
        return str(settings.traffic_dir(model_id).resolve())
    return uri if "://" in uri else str(Path(os.path.expandvars(uri)).expanduser().resolve())


def list_shards(fs, root: str) -> list:
    """``FileInfo`` of the log's shards directly under ``root``, oldest first (by name); [] when
    ``root`` does not exist."""
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    shards = [i for i in infos if i.type == pafs.FileType.File and i.base_name.startswith(SHARD_PREFIX)
              and i.base_name.endswith(SHARD_SUFFIX)]
    return sorted(shards, key=lambda i: i.base_name)


def read_log(uri: str | os.PathLike) -> pa.Table:
    """Every row of the shards under ``uri`` (recursively; hidden temporaries skipped), in :func:`schema`.

    Raises:
        ValueError: no shard there (names the directory and how to fill it).
    """
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs, root = open_log_dir(uri)
    files = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
                   if i.type == pafs.FileType.File and i.base_name.startswith(SHARD_PREFIX)
                   and i.base_name.endswith(SHARD_SUFFIX))
    if not files:
        raise ValueError(f"no traffic log shards under {uri}: serve with serving.traffic_log set (and send "
                         "requests), or point the traffic source's path at the log directory")
    want = schema()

    def conform(t: pa.Table) -> pa.Table:  # shards of an older schema: missing columns are null
        cols = [t.column(f.name).cast(f.type) if f.name in t.column_names else pa.nulls(t.num_rows, f.type)
                for f in want]
        return pa.Table.from_arrays(cols, schema=want)

    return pa.concat_tables([conform(pq.read_table(f, filesystem=fs)) for f in files])


__all__ = ["SHARD_PREFIX", "SHARD_SUFFIX", "list_shards", "open_log_dir", "read_log", "resolve_log_uri", "schema"]
