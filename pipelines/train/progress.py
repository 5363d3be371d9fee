"""The train stage's progress bar: Ray Train runs in worker processes, so rank 0 sends its step to the
driver through a Ray queue, at most every :data:`REPORT_EVERY_S` seconds and at each checkpoint, and a
driver thread moves the bar.

Imported by :meth:`pipelines.stages.train.TrainStage.run` only (it imports torch via the train loop).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from pipelines.tally import on_driver_node
from pipelines.train.loop import TrainCallback

log = logging.getLogger(__name__)
POLL_S = 0.5
REPORT_EVERY_S = 1.0  # a step is sent at most this often (a queue put: a Ray actor call, ~0.1 ms)


class StepReporter(TrainCallback):
    """Puts rank 0's step on ``queue``: after a step when :data:`REPORT_EVERY_S` seconds have passed since
    the last one sent, and at each checkpoint; never fails the training."""

    def __init__(self, queue) -> None:
        self.queue = queue
        self._sent_at = float("-inf")

    def on_step(self, step: int) -> None:
        if time.monotonic() - self._sent_at >= REPORT_EVERY_S:
            self._send(step)

    def on_checkpoint(self, step: int, metrics: dict[str, float]) -> None:
        self._send(step)

    def _send(self, step: int) -> None:
        import ray.train

        if ray.train.get_context().get_world_rank() != 0:
            return
        self._sent_at = time.monotonic()
        try:
            self.queue.put_nowait(int(step))
        except Exception as e:  # noqa: BLE001 - a lost progress update must not stop training
            log.debug("progress update of step %d lost: %s", step, e)


@contextmanager
def train_progress(total_steps: int) -> Iterator[list[TrainCallback]]:
    """A progress bar over ``total_steps`` while the body runs ``run_train(..., callbacks=<yielded>)``."""
    from ray.util.queue import Empty, Queue

    from pipelines.console import progress

    queue = Queue(actor_options=on_driver_node())
    stop = threading.Event()
    with progress("train", total=total_steps, unit="steps") as meter:

        def pump() -> None:
            done = 0
            while True:
                try:
                    step = queue.get(timeout=POLL_S)
                except Empty:
                    if stop.is_set():
                        return
                    continue
                except Exception as e:  # noqa: BLE001 - the queue's actor is gone: the bar stops, training goes on
                    log.warning("train progress: the step queue is gone (%s); the bar stops at %d", e, done)
                    return
                done = max(done, step)
                meter.update(done=done)

        thread = threading.Thread(target=pump, name="peagle-train-progress", daemon=True)
        thread.start()
        try:
            yield [StepReporter(queue)]
        finally:
            stop.set()
            thread.join()
            try:
                queue.shutdown()
            except Exception as e:  # noqa: BLE001 - its actor died with its node
                log.debug("train progress queue not shut down: %s", e)


def format_metrics(m: dict) -> str:
    """The headline metrics of a history row (loss, accuracy per depth, lr) as ``k=v, ...`` (``-`` when none)."""
    keys = [k for k in m if k in ("loss", "acc_depth0", "acc_depth1", "acc_depth4", "lr") or k.startswith("acc_d")]
    return ", ".join(f"{k}={m[k]:.4g}" for k in keys[:8] if isinstance(m.get(k), (int, float))) or "-"
