"""The driver's progress helpers under a real fault (real Ray): the train stage's step queue killed mid-run stops the
bar without an exception in its thread, and the helpers' actors are pinned to the driver's node
(``pipelines.tally.on_driver_node``: on a GPU cluster the queue sat on the node whose raylet was killed)."""

import threading
import time

import pytest

from pipelines import tally
from pipelines.train import progress
from tests.integration.progress_helpers import record_bars

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_killed_step_queue_stops_the_bar_not_the_stage(ray_local, monkeypatch):
    import ray

    bars, errors = record_bars(monkeypatch), []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    with progress.train_progress(10) as callbacks:
        queue = callbacks[0].queue
        opts = tally.on_driver_node()
        assert opts["scheduling_strategy"].node_id == ray.get_runtime_context().get_node_id()
        queue.put(3)
        deadline = time.monotonic() + 20
        while bars[0].done != 3:
            assert time.monotonic() < deadline, "the step never reached the bar"
            time.sleep(0.05)
        ray.kill(queue.actor)  # the queue's actor dies, as with the node it ran on
        time.sleep(2 * progress.POLL_S + 1)
    assert bars[0].done == 3 and errors == []
