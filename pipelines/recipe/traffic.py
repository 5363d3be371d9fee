"""Traffic: the served-request log (``serving.traffic_log``) and reading it back as a prompt source
(``data.sources[].traffic`` / ``evaluation.sources[].traffic``, kind ``traffic``).

The log itself (shards, schema, writer) is :mod:`pipelines.traffic`; the Serve middleware that feeds
it is :mod:`pipelines.serve.traffic`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from pipelines.recipe.base import Section


class TrafficLogConfig(Section):
    """Opt-in log of served chat completions (``pipelines.traffic``): one Parquet row per completed
    ``/v1/chat/completions`` request (the request's messages, the served answer, model version, K,
    vLLM's per-request acceptance), written by a background thread off the request path.

    Personal data: the log holds whatever users send (docs/traffic.md) -- turn it on only where
    storing prompts is allowed, and size ``max_bytes`` / delete shards per your retention rules.
    """

    uri: str | None = Field(
        None, description="Directory of the shards: a local path (~ and $VARS expanded) or a pyarrow.fs URI "
        "(s3://bucket/prefix, gs://..., file:///...); None = $PEAGLE_HOME/traffic/<served model id> "
        "(pipelines.settings.traffic_dir, resolved on the Serve driver).",
    )
    sample_rate: float = Field(
        1.0, ge=0.0, le=1.0, description="Fraction of completed requests logged (decided per request, at random).",
    )
    max_bytes: int = Field(
        1 << 30, ge=1, description="Size cap of the log directory (bytes, all shards of every writer summed).",
    )
    on_full: Literal["rotate", "stop"] = Field(
        "rotate", description="At the cap: rotate = delete the oldest shards until the log fits again; stop = "
        "drop new rows (counted, one warning) until shards are removed.",
    )
    rows_per_shard: int = Field(1000, ge=1, description="A shard is written once this many rows are queued.")
    flush_interval_s: float = Field(
        30.0, gt=0.0, description="...or when the oldest queued row is this old (seconds), whichever comes first.",
    )
    max_queue_rows: int = Field(
        10000, ge=1, description="Bound of the in-memory queue (requests); a full queue drops rows (counted).",
    )
    max_record_bytes: int = Field(
        4 << 20, ge=1024, description="Largest response (bytes of JSON / SSE) copied for the log; a larger one "
        "is not logged (counted). The response to the client is never held back.",
    )


class TrafficSourceConfig(Section):
    """A traffic log read as prompts (source kind ``traffic``, ``pipelines.data.traffic_source.load_traffic``).

    Rows are sorted by completion time; rows after ``until`` are ignored; prompts are deduplicated
    (first, i.e. oldest, occurrence kept: ``pipelines.data.selfinstruct.deduplicate``); the newest
    ``heldout_fraction`` of what is left is the held-out slice. Greedy served answers (the request sent
    ``temperature: 0``) are kept as the assistant turn and skip regeneration; sampled ones are
    regenerated.
    """

    heldout_fraction: float = Field(
        0.1, ge=0.0, lt=1.0, description="Newest fraction of the (deduplicated) log held out as the eval slice "
        "(at least one row when > 0 and there are two or more rows).",
    )
    split: Literal["auto", "train", "heldout", "all"] = Field(
        "auto", description="Which rows this source gives: auto = the older part in data.sources and the "
        "held-out slice in evaluation.sources; train / heldout / all force one.",
    )
    until: datetime | None = Field(
        None, description="Ignore rows completed after this time (ISO 8601; naive = UTC). Pins the split while "
        "the log keeps growing between stages; None = every row.",
    )
    dedup_threshold: float | None = Field(
        0.9, gt=0.0, le=0.98, description="Near-duplicate prompt removal (MinHash Jaccard of word 3-grams >= "
        "this, as self_instruct); None = exact duplicates only.",
    )
    keep_greedy_answers: bool = Field(
        True, description="Greedy rows (temperature 0) keep the served answer and skip regeneration; False = "
        "regenerate every row.",
    )
