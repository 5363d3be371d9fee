"""Where a stage ran: the Ray nodes and GPUs its actors, tasks and placement groups held.

:class:`PlacementProbe` snapshots the ids of the cluster's actors, tasks and placement groups before a stage
(:meth:`PlacementProbe.start`) and reads, after it (:meth:`PlacementProbe.finish`), those the stage created,
through Ray's state API (``ray.util.state``; it needs the dashboard's state aggregator, which ``ray start
--head`` and a local ``ray.init`` start). A GPU is counted once per bundle of a placement group the stage
created (Ray Train workers, Serve LLM replicas) and once per GPU actor or task outside those groups (Ray Data
actor pools, evaluation engines); actors and tasks that ran one after another on a node count once there (a Ray
Train run restarted after a node loss holds its GPUs again, not twice). Nodes are named by their
``settings.NODE_RESOURCE_PREFIX`` resource where they have one (``python -m pipelines.local_ray start|join
--node-name``: the two "nodes" of one host in ``bench/device/run_multi_gpu.sh``), else by their IP and the first 8
hex digits of their id; a node lost during the stage keeps the name it had at :meth:`PlacementProbe.start` (Ray
drops a dead node's resources). The cluster-wide task listing is capped (:data:`LIST_LIMIT` over every job); a GPU
actor none of whose tasks it holds gets them listed by its id.

The probe never fails a stage: without the state API (no dashboard, a Ray without ``ray[default]``), or when a
listing fails, :meth:`finish` returns None and the summary shows ``-``.

Shape legend: not applicable (orchestration only).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

LIST_LIMIT = 10_000  # entries per state-API listing (Ray's own default cap)
_ID_FIELD = {"actors": "actor_id", "tasks": "task_id", "pgs": "placement_group_id"}


@dataclass
class Placement:
    """What one stage held: ``gpus_by_node`` ({node name: GPUs}), ``actors_by_node`` ({node name: actors the
    stage started}); ``num_gpus`` and ``num_nodes`` derived."""

    gpus_by_node: dict[str, int] = field(default_factory=dict)
    actors_by_node: dict[str, int] = field(default_factory=dict)

    @property
    def num_gpus(self) -> int:
        return sum(self.gpus_by_node.values())

    @property
    def nodes(self) -> list[str]:
        return sorted(set(self.gpus_by_node) | set(self.actors_by_node))

    def to_json(self) -> dict[str, Any]:
        return {"num_gpus": self.num_gpus, "nodes": self.nodes, "gpus_by_node": dict(sorted(self.gpus_by_node.items())),
                "actors_by_node": dict(sorted(self.actors_by_node.items()))}

    @staticmethod
    def describe(data: dict[str, Any] | None) -> str:
        """One cell of the summary table, e.g. ``4 GPUs: node-a 2, node-b 2`` or ``CPU: node-a (3 actors)``;
        ``-`` when unknown or nothing was placed (the driver did the work)."""
        if not data or not data.get("nodes"):
            return "-"
        gpus = data.get("gpus_by_node") or {}
        if gpus:
            n = sum(gpus.values())
            return f"{n} GPU{'s' if n != 1 else ''}: " + ", ".join(f"{k} {v}" for k, v in gpus.items())
        actors = data.get("actors_by_node") or {}
        return "CPU: " + ", ".join(f"{k} ({v} actor{'s' if v != 1 else ''})" for k, v in actors.items())


def _gpus(resources: dict[str, Any] | None) -> float:
    return float((resources or {}).get("GPU", 0) or 0)


class PlacementProbe:
    """Before/after snapshot of the cluster's actors, tasks and placement groups (see the module doc)."""

    def __init__(self) -> None:
        self._before: dict[str, set[str]] | None = None
        self._names: dict[str, str] = {}

    def start(self) -> None:
        """Record the ids that exist now (nothing raised: a failed listing disables the probe)."""
        try:
            listed = self._list()
            self._names = self._node_names()
        except Exception as e:  # noqa: BLE001 - the probe is advisory
            log.info("placement probe off: %s", e)
            self._before = None
            return
        self._before = {kind: {self._id(kind, x) for x in items} for kind, items in listed.items()}

    def finish(self) -> Placement | None:
        """The placement of what was created since :meth:`start`, or None (probe off or listing failed)."""
        if self._before is None:
            return None
        try:
            listed = self._list()
            names = self._names | self._node_names()  # a node lost since start keeps its name
        except Exception as e:  # noqa: BLE001
            log.info("placement probe: %s", e)
            return None
        new = {kind: [x for x in items if self._id(kind, x) not in self._before[kind]] for kind, items in listed.items()}
        # the cluster-wide task listing is capped (LIST_LIMIT over every job: a regenerate stage's progress reports
        # alone can fill it), and a GPU actor none of whose tasks it holds spans everything (_lifetimes): a killed
        # Ray Train worker and its replacement then read as held at once ("2 GPUs" on one GPU, 2026-12-02)
        listed_actors = {t.actor_id for t in new["tasks"] if t.actor_id}
        missing = [a.actor_id for a in new["actors"] if _gpus(a.required_resources) and a.actor_id not in listed_actors]
        try:
            new["tasks"] += self._actor_tasks(missing) if missing else []
        except Exception as e:  # noqa: BLE001 - advisory: the lifetimes stay open-ended
            log.info("placement probe: tasks by actor: %s", e)
        return placement_of(new["actors"], new["tasks"], new["pgs"], names)

    @staticmethod
    def _id(kind: str, x: Any) -> str:
        return getattr(x, _ID_FIELD[kind])

    @staticmethod
    def _list() -> dict[str, list]:
        from ray.util.state import list_actors, list_placement_groups, list_tasks

        kw = PlacementProbe._state_kw()
        return {"actors": list_actors(**kw), "tasks": list_tasks(**kw), "pgs": list_placement_groups(**kw)}

    @staticmethod
    def _actor_tasks(actor_ids: list[str]) -> list:
        """The tasks of each of ``actor_ids`` (one state-API listing an actor, filtered by its id)."""
        from ray.util.state import list_tasks

        kw = PlacementProbe._state_kw()
        return [t for a in actor_ids for t in list_tasks(filters=[("actor_id", "=", a)], **kw)]

    @staticmethod
    def _state_kw() -> dict[str, Any]:
        """The state-API listings' arguments: this driver's cluster, never an auto-detected one (other clusters may
        run on the machine), at most :data:`LIST_LIMIT` rows (read at call time), every column."""
        import ray

        return {"address": ray.get_runtime_context().gcs_address, "limit": LIST_LIMIT, "detail": True,
                "raise_on_missing_output": False}

    @staticmethod
    def _node_names() -> dict[str, str]:
        import ray

        return {n.get("NodeID", ""): node_name(n) for n in ray.nodes()}


def node_name(node: dict[str, Any]) -> str:
    """A node of ``ray.nodes()`` by its ``settings.NODE_RESOURCE_PREFIX`` resource's name, else ``IP/<node id[:8]>``."""
    from pipelines.settings import NODE_RESOURCE_PREFIX

    named = [r.removeprefix(NODE_RESOURCE_PREFIX) for r in (node.get("Resources") or {})
             if r.startswith(NODE_RESOURCE_PREFIX)]
    return named[0] if named else f"{node.get('NodeManagerAddress', '?')}/{node.get('NodeID', '')[:8]}"


def _lifetimes(actors: list, tasks: list) -> dict[str, tuple[float, float]]:
    """Each actor's span in ms, from its creation task's start to its last task's end (state-API task rows carry
    ``actor_id``); an actor still alive, or with a task that never ended, is open-ended, except that a dead actor's
    unended task (its node lost) ends at its start. Actors none of whose tasks were listed span everything."""
    spans: dict[str, list[float]] = {}
    dead = {a.actor_id for a in actors if a.state == "DEAD"}
    for t in tasks:
        if not t.actor_id:
            continue
        start = t.start_time_ms or 0
        end = t.end_time_ms or (start if t.actor_id in dead else math.inf)
        lo, hi = spans.get(t.actor_id, (math.inf, -math.inf))
        spans[t.actor_id] = [min(lo, start), max(hi, end)]
    return {a: (lo, hi if a in dead else math.inf) for a, (lo, hi) in spans.items()}


def _peak(intervals: list[tuple[float, float, float]]) -> float:
    """The most GPUs held at once by ``(start, end, gpus)`` intervals (an end before a start at the same instant)."""
    held = peak = 0.0
    events = [(start, g) for start, _, g in intervals] + [(end, -g) for _, end, g in intervals]
    for _, g in sorted(events, key=lambda e: (e[0], e[1])):
        held += g
        peak = max(peak, held)
    return peak


def placement_of(actors: list, tasks: list, pgs: list, node_names: dict[str, str]) -> Placement:
    """The :class:`Placement` of a stage's new ``actors``, ``tasks`` (Ray state-API rows, ``detail=True``) and
    placement groups ``pgs``; ``node_names`` maps node ids to names (unknown ids keep their first 8 digits).

    GPUs: each GPU bundle of a new placement group that no GPU actor of its own sits in, plus per node the most GPUs
    held at once by the new GPU actors (over their lifetimes, :func:`_lifetimes`) and the new non-actor GPU tasks
    outside those groups: tasks run one after another on one GPU count once, and so do the workers of a Ray Train
    run restarted after a node loss. Fractions add up per node and round up: two vLLM engines of 0.5 GPU on a node
    (``regenerate.engines_per_gpu: 2``) hold 1 GPU there. Actors: every new actor on its node."""
    def name(node_id: str | None) -> str:
        return node_names.get(node_id or "", (node_id or "?")[:8])

    gpu_actors = [a for a in actors if _gpus(a.required_resources) and a.node_id]
    spans = _lifetimes(gpu_actors, tasks)
    held: dict[str, list[tuple[float, float, float]]] = {}
    for a in gpu_actors:
        start, end = spans.get(a.actor_id, (-math.inf, math.inf))
        held.setdefault(name(a.node_id), []).append((start, end, _gpus(a.required_resources)))
    gpus: Counter = Counter()
    counted_pgs = {a.placement_group_id for a in gpu_actors if a.placement_group_id}
    for p in pgs:  # a group whose GPUs no actor of its own holds (a Serve replica running its engine in-process)
        if p.placement_group_id in counted_pgs:
            continue
        for b in p.bundles or []:
            if _gpus(b.get("unit_resources")) and b.get("node_id"):
                gpus[name(b["node_id"])] += _gpus(b.get("unit_resources"))
    pg_ids = {p.placement_group_id for p in pgs}
    for t in tasks:
        g = _gpus(t.required_resources)
        if t.actor_id or not g or t.placement_group_id in pg_ids or not t.node_id:
            continue
        held.setdefault(name(t.node_id), []).append((t.start_time_ms or 0, t.end_time_ms or math.inf, g))
    for node, intervals in held.items():
        gpus[node] += _peak(intervals)
    actors_by_node = Counter(name(a.node_id) for a in actors if a.node_id)
    whole = {node: math.ceil(g - 1e-6) for node, g in gpus.items()}  # 3 x 0.333 GPU: 1 GPU
    return Placement(gpus_by_node=whole, actors_by_node=dict(actors_by_node))
