"""Counts of work finished inside Ray workers, read by the driver while the work runs (the stages' progress).

A stage's heavy work runs in large batches inside Ray Data actors (a vLLM engine, the capture target): the
driver sees a batch's rows only once all of them are done, minutes apart on a CPU. So the workers report
what they finish as they finish it, ``tally.add(conversations=8)``, into a :class:`Tally`, and a driver
thread reads the totals every :data:`POLL_S` seconds and hands on what changed. Under Ray the counts go to
one small counter actor (no CPU; a report is one fire-and-forget actor call, tens of microseconds, that no
work waits on); in-process (no Ray, or work that runs in the driver) the Tally hands them on directly.

Counts the workers' own code cannot report come from gauges read on the same thread:
:class:`VLLMTokenGauge` reads vLLM's ``vllm:generation_tokens`` counter of the ``ray.data.llm`` engines from
Ray's metrics endpoints.

Counts are for progress only: a task that Ray retries reports again, and a report sent just before the
work ends may arrive after the last read. The stages' results never come from here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol

from pipelines.console import every

log = logging.getLogger(__name__)

POLL_S = 1.0  # the driver reads the counts this often
METRICS_EVERY_S = 5.0  # and Ray's metrics endpoints at most this often (Ray exports every 10 s by default)
Counts = dict[str, int]


class Tally:
    """Where workers report counts: ``add(**counts)``; picklable when it holds a Ray actor (pass it to Ray Data
    actors and Ray Train workers). Made by :func:`tally`."""

    def __init__(self, actor: Any = None, local: Callable[[Counts], None] | None = None):
        self._actor, self._local = actor, local

    def add(self, **counts: int) -> None:
        """Add ``counts`` (e.g. ``conversations=8, tokens=1200``); zero counts are dropped. Never raises for a
        lost report: progress must not fail the work."""
        counts = {k: int(v) for k, v in counts.items() if v}
        if not counts:
            return
        try:
            if self._actor is not None:
                self._actor.add.remote(counts)
            elif self._local is not None:
                self._local(counts)
        except Exception as e:  # noqa: BLE001 - a lost progress report must not stop the work
            log.debug("progress report %s lost: %s", counts, e)


def on_driver_node() -> dict[str, Any]:
    """Ray actor options of the driver's own helpers (progress counters, queues): no CPU, and a hard affinity to
    the node this process runs on. Placed anywhere, such an actor can land on a worker node and die with it: on
    a 2-node GPU cluster the train stage's progress queue sat on the node whose raylet was killed, and the bar
    stopped while training went on (bench/results/multi_gpu_node_fault.json)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)}


class _Counts:
    """The counter actor of a Ray :class:`Tally`: totals by name."""

    def __init__(self) -> None:
        self.totals: Counts = {}

    def add(self, counts: Counts) -> None:
        for k, v in counts.items():
            self.totals[k] = self.totals.get(k, 0) + v

    def read(self) -> Counts:
        return dict(self.totals)


class Gauge(Protocol):
    """Counts read rather than reported: ``read()`` returns totals since the gauge was made."""

    def read(self) -> Counts: ...


@contextmanager
def tally(on_delta: Callable[[Counts], None], *, use_ray: bool, gauges: Sequence[Gauge] = (),
          period_s: float | None = None) -> Iterator[Tally]:
    """A :class:`Tally` for the body's workers; ``on_delta(counts)`` receives what was added since its last
    call (and what the ``gauges`` moved).

    ``use_ray``: the counts go to a counter actor on the driver's node (:func:`on_driver_node`), read by a driver thread every ``period_s``
    seconds (default :data:`POLL_S`), once more when the body ends, then the actor is ended; else ``add`` calls ``on_delta`` in the
    caller's thread. Gauges are read on that thread too (one is started for them without Ray). Calls of
    ``on_delta`` never overlap.
    """
    lock = threading.Lock()

    def deliver(counts: Counts) -> None:
        with lock:
            on_delta(counts)

    actor = None
    if use_ray:
        import ray

        actor = ray.remote(_Counts).options(**on_driver_node()).remote()
    sources: list[tuple[Callable[[], Counts], Counts]] = [(g.read, {}) for g in gauges]
    if actor is not None:
        import ray

        sources.append((lambda: ray.get(actor.read.remote(), timeout=30), {}))

    def poll() -> None:
        for read, last in sources:
            try:
                totals = read()
            except Exception as e:  # noqa: BLE001 - an unreadable count leaves the bar where it is
                log.debug("progress counts unreadable: %s", e)
                continue
            delta = {k: v - last.get(k, 0) for k, v in totals.items() if v != last.get(k, 0)}
            last.update(totals)
            if delta:
                deliver(delta)

    polling = every(POLL_S if period_s is None else period_s, poll, name="peagle-tally") if sources else nullcontext()
    try:
        with polling:
            yield Tally(actor=actor, local=None if use_ray else deliver)
    finally:
        if actor is not None:
            import ray

            ray.kill(actor)


class VLLMTokenGauge:
    """Tokens generated since this gauge was made by the vLLM engines of ``model_name`` that run in Ray but
    not in Ray Serve: vLLM's ``vllm:generation_tokens`` counter, which the engines of ``ray.data.llm`` export
    to Ray's metrics (its ``log_engine_metrics``, on by default), read from every node's metrics endpoint
    (``ray.nodes()``' ``MetricsExportPort``). ``{key: tokens}``, or ``{}`` where no endpoint answers (a Ray
    without its metrics agent). A series that disappears (its engine ended) keeps its last count.

    Read at most every ``min_interval_s`` seconds (default :data:`METRICS_EVERY_S`; an endpoint's text is a
    few hundred kB). The count lags the engines by up to Ray's export interval (``metrics_report_interval_ms``,
    10 s by default) plus that.
    """

    METRIC = "ray_vllm_generation_tokens_total"

    def __init__(self, model_name: str, key: str = "tokens", *, min_interval_s: float | None = None,
                 fetch: Callable[[], list[str]] | None = None):
        self.model_name, self.key = model_name, key
        self.min_interval_s = METRICS_EVERY_S if min_interval_s is None else min_interval_s
        self._fetch = fetch or _metrics_texts
        self._baseline = self._series()
        self._peak: dict[tuple, float] = {}
        self._last_read = float("-inf")
        self._last: Counts = {}

    def read(self) -> Counts:
        if time.monotonic() - self._last_read < self.min_interval_s:
            return self._last
        self._last_read = time.monotonic()
        for series, value in self._series().items():
            self._peak[series] = max(self._peak.get(series, 0.0), value - self._baseline.get(series, 0.0))
        self._last = {self.key: int(sum(self._peak.values()))} if self._peak else {}
        return self._last

    def _series(self) -> dict[tuple, float]:
        """``{labels: value}`` of the counter's series for ``model_name`` outside Serve, over all endpoints."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[tuple, float] = {}
        for text in self._fetch():
            lines = "\n".join(x for x in text.splitlines() if x.startswith(self.METRIC + "{"))
            for family in text_string_to_metric_families(lines):
                for s in family.samples:
                    if s.labels.get("model_name") == self.model_name and not s.labels.get("ReplicaId"):
                        out[tuple(sorted(s.labels.items()))] = float(s.value)
        return out


def _metrics_texts(timeout_s: float = 3.0) -> list[str]:
    """The Prometheus text of every alive Ray node's metrics endpoint that answers."""
    import urllib.request

    import ray

    texts = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        try:
            with urllib.request.urlopen(f"http://{node['NodeManagerAddress']}:{port}/metrics",
                                        timeout=timeout_s) as r:
                texts.append(r.read().decode())
        except OSError as e:
            log.debug("metrics of node %s unreadable: %s", node.get("NodeManagerAddress"), e)
    return texts
