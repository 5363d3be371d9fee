"""Where a stage ran (pipelines.placement): GPUs and actors per node from Ray state-API rows."""

from types import SimpleNamespace as NS

import pytest

from pipelines.placement import Placement, placement_of

pytestmark = pytest.mark.unit

NAMES = {"n-a": "a", "n-b": "b"}


def actor(node, gpus=0, pg=None, state="DEAD"):
    return NS(actor_id=f"{node}-{gpus}-{pg}", node_id=node, placement_group_id=pg, state=state,
              required_resources={"CPU": 1} | ({"GPU": gpus} if gpus else {}))


def task(node, gpus, start, end, actor_id=None, pg=None):
    return NS(node_id=node, actor_id=actor_id, placement_group_id=pg, start_time_ms=start, end_time_ms=end,
              required_resources={"CPU": 1, "GPU": gpus})


def pg(pid, *bundles):
    return NS(placement_group_id=pid, bundles=[{"node_id": n, "unit_resources": r} for n, r in bundles])


def test_actor_pool_one_gpu_each_on_two_nodes():
    p = placement_of([actor("n-a", 1), actor("n-a", 1), actor("n-b", 1), actor("n-b", 1)], [], [], NAMES)
    assert p.gpus_by_node == {"a": 2, "b": 2} and p.num_gpus == 4 and p.nodes == ["a", "b"]
    assert Placement.describe(p.to_json()) == "4 GPUs: a 2, b 2"


def test_engines_sharing_a_gpu_count_it_once():
    """regenerate.engines_per_gpu: 2 on two nodes of one GPU: four actors of 0.5 GPU hold 2 GPUs (the 2x H200 run
    of 2026-11-28 reported 0 while fractions were rounded one by one)."""
    p = placement_of([actor("n-a", 0.5), actor("n-a", 0.5), actor("n-b", 0.5), actor("n-b", 0.5)], [], [], NAMES)
    assert p.gpus_by_node == {"a": 1, "b": 1} and p.num_gpus == 2
    assert placement_of([actor("n-a", 1 / 3)] * 3, [], [], NAMES).gpus_by_node == {"a": 1}


def test_train_workers_in_a_group_count_once():
    """Ray Train: a placement group of 2 GPU bundles whose 2 worker actors hold the GPUs, plus a CPU controller."""
    group = pg("g1", ("n-a", {"GPU": 1, "CPU": 1}), ("n-b", {"GPU": 1, "CPU": 1}))
    actors = [actor("n-a", 1, pg="g1"), actor("n-b", 1, pg="g1"), actor("n-a", 0)]
    p = placement_of(actors, [], [group], NAMES)
    assert p.gpus_by_node == {"a": 1, "b": 1}
    assert p.actors_by_node == {"a": 2, "b": 1}


def test_group_whose_gpus_no_actor_holds_counts_its_bundles():
    """A Serve LLM replica: a CPU actor in a group that reserves the GPU its engine uses in-process."""
    group = pg("g2", ("n-b", {"CPU": 1}), ("n-b", {"GPU": 1}))
    p = placement_of([actor("n-b", 0, pg="g2")], [], [group], NAMES)
    assert p.gpus_by_node == {"b": 1}


def test_tasks_count_the_most_gpus_held_at_once():
    """Three one-GPU tasks on node a, two side by side then one after them; an actor task is not counted."""
    tasks = [task("n-a", 1, 0, 10), task("n-a", 1, 5, 10), task("n-a", 1, 10, 20), task("n-b", 1, 0, 5, actor_id="x")]
    p = placement_of([], tasks, [], NAMES)
    assert p.gpus_by_node == {"a": 2}


def test_train_restarted_after_a_node_loss_holds_its_gpus_once():
    """The 4-GPU node kill of 2026-11-29: Ray Train's workers on a and b (a 2+2 split, one GPU each here), node b's
    raylet SIGKILLed at 70 s (its worker's last task never ended), then a new worker group on a and on b joined again
    under a new node id. The summary said "8 GPUs: 192.0.2.2/b2e83e0f 2, a 4, b 2" before workers' lifetimes counted
    and the lost node kept its name."""
    names = NAMES | {"n-b2": "b"}  # the lost node n-b: named at the probe's start, before it died
    first = [actor("n-a", 1, pg="g1"), actor("n-b", 1, pg="g1")]
    second = [actor("n-a", 1, pg="g2", state="ALIVE"), actor("n-b2", 1, pg="g2", state="ALIVE")]
    tasks = [task("n-a", 0, 0, 70, actor_id=first[0].actor_id), task("n-b", 0, 0, None, actor_id=first[1].actor_id),
             task("n-a", 0, 115, 230, actor_id=second[0].actor_id), task("n-b2", 0, 116, None, actor_id=second[1].actor_id)]
    p = placement_of(first + second, tasks, [pg("g1"), pg("g2")], names)
    assert Placement.describe(p.to_json()) == "2 GPUs: a 1, b 1"
    assert p.actors_by_node == {"a": 2, "b": 2}
    overlapping = [task(t.node_id, 0, 0, 300, actor_id=t.actor_id) for t in tasks]  # both groups at once: twice
    assert placement_of(first + second, overlapping, [], names).gpus_by_node == {"a": 2, "b": 2}


def test_cpu_only_and_unknown():
    p = placement_of([actor("n-a"), actor("n-zzzzzzzz9")], [], [], NAMES)
    assert p.num_gpus == 0
    assert Placement.describe(p.to_json()) == "CPU: a (1 actor), n-zzzzzz (1 actor)"
    assert Placement.describe(None) == "-" and Placement.describe(Placement().to_json()) == "-"


def test_node_resources_name_rule():
    from pipelines import settings
    from pipelines.local_ray import node_resources

    assert node_resources("b") == {settings.NODE_RESOURCE_PREFIX + "b": 1.0}
    assert node_resources(None) == {}
    with pytest.raises(ValueError, match="node name"):
        node_resources("a b")


def test_gpu_actors_missing_from_the_capped_task_listing_get_their_tasks_by_actor(monkeypatch):
    """The one-GPU worker kill of 2026-12-02 read "2 GPUs: a 2": the cluster-wide task listing (capped at
    LIST_LIMIT over every job) may not hold the killed worker's tasks, and an actor without listed tasks spans
    everything, so it overlapped its replacement. The probe now lists such actors' tasks by actor id."""
    from pipelines.placement import PlacementProbe

    killed, replacement = actor("n-a", 1, pg="g1"), actor("n-a", 1, pg="g2", state="ALIVE")
    by_actor = {killed.actor_id: [task("n-a", 0, 0, None, actor_id=killed.actor_id)]}  # SIGKILLed at 127 s
    listed = {"actors": [killed, replacement], "pgs": [pg("g1"), pg("g2")],
              "tasks": [task("n-a", 0, 200, 310, actor_id=replacement.actor_id)]}  # the killed one's: capped out
    probe = PlacementProbe()
    probe._before = {"actors": set(), "tasks": set(), "pgs": set()}
    monkeypatch.setattr(PlacementProbe, "_list", staticmethod(lambda: listed))
    monkeypatch.setattr(PlacementProbe, "_node_names", staticmethod(lambda: NAMES))
    asked = []
    monkeypatch.setattr(PlacementProbe, "_actor_tasks",
                        staticmethod(lambda ids: asked.extend(ids) or [t for i in ids for t in by_actor.get(i, [])]))
    for t in listed["tasks"] + by_actor[killed.actor_id]:
        t.task_id = f"{t.actor_id}-{t.start_time_ms}"
    assert Placement.describe(probe.finish().to_json()) == "1 GPU: a 1" and asked == [killed.actor_id]
    assert placement_of(listed["actors"], listed["tasks"], listed["pgs"], NAMES).gpus_by_node == {"a": 2}  # before
