"""Self-instruct prompts on a real Ray actor pool (``ray.init(address="local")``) of fake engines (no model: the
completions depend on the request seeds only, as vLLM's do): one engine actor, three, and one engine in-process
keep the same prompts and write the same parts; a pool resumed from its parts starts engines only for the ranges
left; a pool the cluster cannot hold is refused before any engine starts. The regenerate stage's pool
(:func:`pipelines.data.engine_pool.pool_strategy`) hands a batch to an engine ready late while batches are left."""

import os
import time
from functools import partial

import pytest

from pipelines.data import parts
from pipelines.data.selfinstruct import SelfInstructWriter
from pipelines.recipe import DataConfig, RegenerateConfig, SelfInstructConfig, SourceConfig, TargetConfig
from tests.unit.test_selfinstruct import FakeEngine

pytestmark = pytest.mark.integration
SOURCE = SourceConfig(kind="self_instruct", self_instruct=SelfInstructConfig(num_prompts=40, seed=3, min_chars=10))
BATCH = 8  # five ranges of requests


def fake_engine(backend, model_path, **kwargs):
    """The engine factory of the actors: a FakeEngine (its tokenizer is not used: the driver's is)."""
    return FakeEngine(None)


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def write(tmp_path, name: str, num_workers: int, use_ray: bool = True) -> tuple[list[dict], SelfInstructWriter]:
    regen = RegenerateConfig(backend="vllm", vllm_runner="actor", batch_size=BATCH, num_workers=num_workers)
    with SelfInstructWriter(TargetConfig(), regen, DataConfig(max_length_tokens=512), use_ray=use_ray,
                            num_cpus_per_worker=1, make=fake_engine, parts_dir=lambda cfg: tmp_path / name) as writer:
        return writer(SOURCE), writer


def test_one_engine_or_three_keep_the_same_prompts_and_resume_from_their_parts(ray_local, tmp_path):
    local, _ = write(tmp_path, "local", 1, use_ray=False)
    one, w1 = write(tmp_path, "one", 1)
    three, w3 = write(tmp_path, "three", 3)
    assert one == three == local and 3 <= len(one) < 40
    assert (w1.stats[0]["num_engines"], w3.stats[0]["num_engines"]) == (1, 3)
    assert parts.read_range_parts(tmp_path / "one", 40) == parts.read_range_parts(tmp_path / "three", 40)
    assert len(list((tmp_path / "three").glob(parts.PART_GLOB))) == 5
    for name in ("part-0000000008-0000000016.json", "part-0000000032-0000000040.json"):
        (tmp_path / "three" / name).unlink()
    again, w = write(tmp_path, "three", 3)
    assert again == one and w.stats[0]["num_engines"] == 2 and w.stats[0]["resumed_prompts"] == 24


def counted_engine(started: str, backend, model_path, **kwargs):
    """:func:`fake_engine` that first appends its process id to the file ``started``."""
    with open(started, "a") as f:
        f.write(f"{os.getpid()}\n")
    return FakeEngine(None)


def test_every_source_runs_on_the_same_engines_until_the_writer_closes(ray_local, tmp_path):
    """Engines start once for a recipe's self_instruct sources (each start is ~1.5 min of a GPU with vLLM), a later
    source that needs more adds only those, and closing the writer ends them all."""
    started = tmp_path / "started"
    regen = RegenerateConfig(backend="vllm", vllm_runner="actor", batch_size=BATCH, num_workers=3)
    small = SourceConfig(kind="self_instruct", self_instruct=SelfInstructConfig(num_prompts=16, seed=4, min_chars=10))
    with SelfInstructWriter(TargetConfig(), regen, DataConfig(max_length_tokens=512), num_cpus_per_worker=1,
                            make=partial(counted_engine, str(started)),
                            parts_dir=lambda cfg: tmp_path / f"p{cfg.seed}") as writer:
        other = SOURCE.self_instruct.model_copy(update={"seed": 5})
        rows = [writer(small), writer(SOURCE), writer(SOURCE.model_copy(update={"self_instruct": other}))]
        pids = [int(p) for p in started.read_text().split()]
    assert [(s["num_engines"], s["engines_started"]) for s in writer.stats] == [(2, 2), (3, 1), (3, 0)]
    assert len(pids) == len(set(pids)) == 3 and all(rows) and rows[1] == write(tmp_path, "one", 1)[0]
    assert writer._actors == [] and wait_gone(pids)


def wait_gone(pids: list[int], timeout_s: float = 20.0) -> bool:
    """Whether every process of ``pids`` has ended within ``timeout_s``."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(psutil.pid_exists(p) for p in pids)


def test_a_pool_the_cluster_cannot_hold_is_refused_before_an_engine_starts(ray_local, tmp_path):
    with pytest.raises(ValueError, match="5 engine actors need 5 CPUs \\(1 each\\); the Ray cluster has 4"):
        write(tmp_path, "big", 8)
    assert not list((tmp_path / "big").glob(parts.PART_GLOB))


class LateEngine:
    """A Ray Data engine actor whose start takes 0 s for the first actor to claim ``flag`` and ``LATE_S`` for the
    others; a batch takes ``BATCH_S``. Returns the pid of the actor that answered each row."""

    LATE_S, BATCH_S = 3.0, 6.0

    def __init__(self, flag: str):
        try:
            os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            time.sleep(self.LATE_S)

    def __call__(self, batch: dict) -> dict:
        time.sleep(self.BATCH_S)
        return {"pid": [os.getpid()] * len(batch["id"])}


def test_an_engine_ready_late_gets_a_batch_while_batches_are_left(ray_local, tmp_path):
    """Two engines, two batches, one engine ready 3 s after the other: each answers one batch (Ray Data's default,
    two batches in flight an actor, gave both to the first: on 4 GPUs 4 of 8 engines answered)."""
    import ray

    from pipelines.data.engine_pool import pool_strategy

    ds = ray.data.from_items([{"id": i} for i in range(4)]).map_batches(
        LateEngine, fn_constructor_args=(str(tmp_path / "first"),), compute=pool_strategy(2), batch_size=2,
        num_cpus=1)
    assert len({r["pid"] for r in ds.iter_rows()}) == 2
