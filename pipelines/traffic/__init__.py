"""The traffic log: served chat completions as Parquet shards, written off the request path (docs/traffic.md;
personal data included); read back as a prompt source by :mod:`pipelines.data.traffic_source`.

Modules:

* :mod:`pipelines.traffic.shards`: the row schema, shard names, where a log lives (local path or
  ``pyarrow.fs`` URI), listing and reading shards back;
* :mod:`pipelines.traffic.writer`: :class:`Exchange` (one request/response pair parsed into a row) and
  :class:`TrafficLogWriter` (the background thread that writes shards, the size cap and rotation), fed
  by the Serve middleware :class:`pipelines.serve.traffic.TrafficLog`;

The public names of both are re-exported here. Configs:
:mod:`pipelines.recipe.traffic`.
"""

from pipelines.traffic.shards import (
    SHARD_PREFIX,
    SHARD_SUFFIX,
    list_shards,
    open_log_dir,
    read_log,
    resolve_log_uri,
    schema,
)
from pipelines.traffic.writer import STREAM_DONE, Exchange, TrafficLogWriter

__all__ = ["SHARD_PREFIX", "SHARD_SUFFIX", "STREAM_DONE", "Exchange", "TrafficLogWriter", "list_shards", "open_log_dir",
           "read_log", "resolve_log_uri", "schema"]
