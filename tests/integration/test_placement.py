"""Where a stage ran, read from a real Ray cluster's state API (pipelines.placement.PlacementProbe): a GPU actor
SIGKILLed and replaced holds its GPU once, even where the capped task listing has lost both actors' tasks.

The cluster declares one GPU it does not have (Ray only counts it): the actors never touch CUDA."""

import os
import signal
import time

import pytest

from pipelines import placement
from pipelines.placement import Placement, PlacementProbe

pytestmark = pytest.mark.integration


def test_a_killed_gpu_actor_and_its_replacement_hold_one_gpu(monkeypatch):
    """The one-GPU worker kill of 2026-12-02 read "2 GPUs: a 2": the cluster-wide task listing is capped
    (LIST_LIMIT over every job), earlier jobs' tasks filled it, and a GPU actor with no listed task spans
    everything. Here 40 earlier tasks and a cap of 15 leave both workers' tasks out of it; the probe lists them
    by actor id (it read 2 GPUs before)."""
    import ray

    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=True, log_to_driver=False)
    try:
        @ray.remote(num_cpus=0)
        def earlier() -> int:
            return 0

        @ray.remote(num_gpus=1, num_cpus=0)
        class Worker:
            def pid(self) -> int:
                return os.getpid()

            def poll(self) -> int:
                return 1

        ray.get([earlier.remote() for _ in range(40)])  # another job's tasks, listed first
        probe = PlacementProbe()
        probe.start()
        killed = Worker.remote()
        pid = ray.get(killed.pid.remote())
        ray.get([killed.poll.remote() for _ in range(5)])
        os.kill(pid, signal.SIGKILL)  # its GPU is free once Ray sees it dead
        replacement = Worker.remote()
        ray.get([replacement.poll.remote() for _ in range(30)])
        time.sleep(3)  # task events reach the GCS about every second
        monkeypatch.setattr(placement, "LIST_LIMIT", 15)
        found = probe.finish()
        assert found is not None and found.num_gpus == 1 and sum(found.actors_by_node.values()) == 2, found
        assert Placement.describe(found.to_json()).startswith("1 GPU: ")
    finally:
        ray.shutdown()
