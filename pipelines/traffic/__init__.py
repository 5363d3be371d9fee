"""The traffic log: served chat completions as Parquet shards, written off the request path, read
back as a prompt source (docs/traffic.md; personal data included).

Modules:

* :mod:`pipelines.traffic.shards`: the row schema, shard names, where a log lives (local path or
  ``pyarrow.fs`` URI), listing and reading shards back;
* :mod:`pipelines.traffic.writer`: :class:`Exchange` (one request/response pair parsed into a row) and
  :class:`TrafficLogWriter` (the background thread that writes shards, the size cap and rotation), fed
  by the Serve middleware :class:`pipelines.serve.traffic.TrafficLog`;
* :mod:`pipelines.traffic.source`: the log as a prompt source (``kind: traffic``): time sort, split,
  deduplication, prompt rows (:func:`load_traffic`).

Every public name is re-exported here; import from ``pipelines.traffic``. Configs:
:mod:`pipelines.recipe.traffic`.
"""

from pipelines.traffic.shards import (
    SHARD_PREFIX,
    SHARD_SUFFIX,
    list_shards,
    open_log_dir,
    read_log,
    resolve_log_uri,
)
from pipelines.traffic.shards import _schema as _schema  # the shard schema (tests compare against it)
from pipelines.traffic.source import (
    SOURCE_LABEL,
    is_greedy,
    load_traffic,
    source_uri,
    split_rows,
    traffic_rows,
)
from pipelines.traffic.writer import STREAM_DONE, Exchange, TrafficLogWriter

__all__ = ["SHARD_PREFIX", "SHARD_SUFFIX", "SOURCE_LABEL", "STREAM_DONE", "Exchange", "TrafficLogWriter", "is_greedy",
           "list_shards", "load_traffic", "open_log_dir", "read_log", "resolve_log_uri", "source_uri", "split_rows",
           "traffic_rows"]
