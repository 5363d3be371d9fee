"""Self-instruct prompts on a real Ray actor pool (``ray.init(address="local")``) of fake engines (no model: the
completions depend on the request seeds only, as vLLM's do): one engine actor, three, and one engine in-process
keep the same prompts and write the same parts; a pool resumed from its parts starts engines only for the ranges
left; a pool the cluster cannot hold is refused before any engine starts."""

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
    writer = SelfInstructWriter(TargetConfig(), regen, DataConfig(max_length_tokens=512), use_ray=use_ray,
                                num_cpus_per_worker=1, make=fake_engine, parts_dir=lambda cfg: tmp_path / name)
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


def test_a_pool_the_cluster_cannot_hold_is_refused_before_an_engine_starts(ray_local, tmp_path):
    with pytest.raises(ValueError, match="5 engine actors need 5 CPUs \\(1 each\\); the Ray cluster has 4"):
        write(tmp_path, "big", 8)
    assert not list((tmp_path / "big").glob(parts.PART_GLOB))
