"""The K schedule (pipelines.evaluate.k_schedule): measured rows -> vLLM's num_speculative_tokens_per_batch_size, the
version tag, and the speculative_config Serve and evaluate build from it. Hand-computed expectations."""

import pytest

from pipelines.evaluate import k_schedule as ks

pytestmark = pytest.mark.unit


def rows(table: dict[int, dict[int, float]], method: str = "eagle3") -> list[dict]:
    """Eval rows from ``{concurrency: {K: tokens/s}}`` (K=0: the ``none`` row)."""
    return [{"method": "none" if K == 0 else method, "K": K, "concurrency": c, "tokens_per_s": v}
            for c, by_K in table.items() for K, v in by_K.items()]


# c=1: K=5 best; c=4: K=3 best; c=16: no speculation best.
SWEEP = {1: {0: 10.0, 3: 15.0, 5: 18.0}, 4: {0: 30.0, 3: 36.0, 5: 33.0}, 16: {0: 80.0, 3: 70.0, 5: 60.0}}


def test_per_concurrency_K_takes_the_best_K_with_geometric_boundaries():
    got = ks.build_k_schedule(rows(SWEEP), "eagle3", zero_ranges=True, one_K=False)
    assert got == [(1, 2, 5), (3, 8, 3), (9, ks.DEFAULT_MAX_BATCH_SIZE, 0)]
    # default: speculation wins somewhere, so no K=0 range (vLLM still runs the drafter there): c=16 takes K=3
    assert ks.build_k_schedule(rows(SWEEP), "eagle3", one_K=False) == [(1, 2, 5), (3, ks.DEFAULT_MAX_BATCH_SIZE, 3)]


def test_default_uses_only_zero_and_the_best_fixed_K_for_either_method():
    # geometric means: K=3 (15*36*70)^(1/3)=34.0 > K=5 (18*33*60)^(1/3)=32.9 -> fixed K=3
    for method in ("peagle", "eagle3"):
        assert ks.best_fixed_K(rows(SWEEP, method), method) == 3
        got = ks.build_k_schedule(rows(SWEEP, method), method, zero_ranges=True)
        assert got == [(1, 8, 3), (9, ks.DEFAULT_MAX_BATCH_SIZE, 0)]  # c=1's K=5 is not allowed: merged with c=4
        assert ks.build_k_schedule(rows(SWEEP, method), method) == [(1, ks.DEFAULT_MAX_BATCH_SIZE, 3)]
        # the schedule is never below the best fixed K at a measured concurrency
        for c, by_K in SWEEP.items():
            K = next(k for lo, hi, k in got if lo <= c <= hi)
            assert by_K[K] >= by_K[3]


def test_zero_everywhere_merges_into_one_range():
    table = {1: {0: 10.0, 5: 9.0}, 4: {0: 30.0, 5: 20.0}}
    assert ks.build_k_schedule(rows(table, "peagle"), "peagle", max_batch_size=64) == [(1, 64, 0)]
    # the measured CPU case (bench/k_schedule.py): K=1 wins only at c=1 -> the best fixed K everywhere
    demo = {1: {0: 12.08, 1: 12.50, 3: 10.88, 5: 10.73}, 4: {0: 39.58, 1: 26.64, 3: 21.83, 5: 17.78},
            16: {0: 65.34, 1: 30.98, 3: 27.03, 5: 21.45}}
    assert ks.build_k_schedule(rows(demo, "peagle"), "peagle") == [(1, ks.DEFAULT_MAX_BATCH_SIZE, 1)]
    assert ks.build_k_schedule(rows(demo, "peagle"), "peagle", zero_ranges=True) == [
        (1, 2, 1), (3, ks.DEFAULT_MAX_BATCH_SIZE, 0)]


def test_one_concurrency_and_same_K_ranges_merge():
    assert ks.build_k_schedule(rows({1: {0: 10.0, 5: 12.0}}), "eagle3") == [(1, ks.DEFAULT_MAX_BATCH_SIZE, 5)]
    table = {1: {3: 10.0, 5: 12.0}, 4: {3: 20.0, 5: 22.0}, 16: {3: 40.0, 5: 30.0}}  # no none rows: no K=0
    assert ks.build_k_schedule(rows(table), "eagle3", max_batch_size=100, one_K=False) == [(1, 8, 5), (9, 100, 3)]


def test_ties_go_to_the_smaller_K():
    assert ks.best_fixed_K(rows({1: {5: 12.0, 3: 12.0}, 4: {5: 30.0, 3: 30.0}}), "eagle3") == 3
    table = {1: {0: 10.0, 3: 12.0, 5: 12.0}, 2: {0: 20.0, 3: 20.0}}
    assert ks.build_k_schedule(rows(table), "eagle3", max_batch_size=8, zero_ranges=True) == [(1, 1, 3), (2, 8, 0)]
    assert ks.build_k_schedule(rows(table), "eagle3", max_batch_size=8) == [(1, 8, 3)]


def test_boundaries_for_other_sweeps():
    # {1, 2, 8}: isqrt(1*2)=1, isqrt(2*8)=4; a smallest concurrency above 1 still starts the first range at 1
    table = {1: {0: 1.0, 2: 2.0}, 2: {0: 2.0, 3: 3.0}, 8: {0: 9.0, 2: 8.0}}
    assert ks.build_k_schedule(rows(table), "eagle3", max_batch_size=32, zero_ranges=True, one_K=False) == [
        (1, 1, 2), (2, 4, 3), (5, 32, 0)]
    assert ks.build_k_schedule(rows(table), "eagle3", max_batch_size=32, one_K=False) == [
        (1, 1, 2), (2, 4, 3), (5, 32, 2)]
    table = {4: {0: 1.0, 2: 2.0}, 16: {0: 9.0, 2: 8.0}}
    assert ks.build_k_schedule(rows(table), "eagle3", max_batch_size=16, zero_ranges=True) == [(1, 8, 2), (9, 16, 0)]


def test_vllm_reads_the_schedule_as_meant():
    """vLLM's own dense lookup (what its scheduler indexes by batch size) of a built schedule."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    schedule = ks.build_k_schedule(rows(SWEEP), "eagle3", zero_ranges=True, one_K=False)
    dense = build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=20,
                                             vllm_num_speculative_tokens=ks.max_K(schedule))
    assert dense[1:] == [5, 5, 3, 3, 3, 3, 3, 3] + [0] * 12


def test_errors():
    with pytest.raises(ValueError, match="no 'peagle' rows"):
        ks.build_k_schedule(rows({1: {0: 10.0}}), "peagle")
    with pytest.raises(ValueError, match="every concurrency"):
        ks.best_fixed_K(rows({1: {3: 1.0}, 4: {5: 1.0}}), "eagle3")
    with pytest.raises(ValueError, match="max_batch_size"):
        ks.build_k_schedule(rows(SWEEP), "eagle3", max_batch_size=0)


BAD = [[], [(2, 4, 3)], [(1, 4, 3), (4, 8, 2)], [(1, 4, -1)], [(1, 0, 3)], [(1, 2)], "1,2,3"]
GOOD = [[(1, 4, 3)], [(5, 9, 0), (1, 4, 3)], [[1, 1, 0], [2, 2, 7], [10, 20, 1]]]


@pytest.mark.parametrize("schedule", BAD)
def test_invalid_schedules_raise_with_vllm_and_without(schedule):
    with pytest.raises(ValueError):
        ks.validate_k_schedule(schedule)
    with pytest.raises(ValueError):
        ks._validate_without_vllm(schedule)


@pytest.mark.parametrize("schedule", GOOD)
def test_valid_schedules_agree_with_vllm(schedule):
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    want = validate_and_normalize_dynamic_sd_schedule(list(schedule))
    assert ks.validate_k_schedule(schedule) == want == ks._validate_without_vllm(list(schedule))


def test_version_tag_round_trip():
    schedule = [(1, 2, 5), (3, 1024, 0)]
    tag = ks.schedule_to_tag(schedule)
    assert tag == "[[1,2,5],[3,1024,0]]"
    assert ks.schedule_from_tags({ks.K_SCHEDULE_TAG: tag, "K": "5"}) == schedule
    assert ks.schedule_from_tags({"K": "5"}) is None and ks.schedule_from_tags(None) is None
    with pytest.raises(ValueError, match="not JSON"):
        ks.schedule_from_tags({ks.K_SCHEDULE_TAG: "[[1,2"})
    with pytest.raises(ValueError):
        ks.schedule_from_tags({ks.K_SCHEDULE_TAG: "[[2,4,3]]"})


# ---------------------------------------------------------------------------------------------- Serve


def test_serve_speculative_config_with_and_without_a_schedule():
    from pipelines.serve import ServeAppArgs, speculative_config

    fixed = speculative_config(ServeAppArgs(num_speculative_tokens=4, k_schedule="off"), "/heads/h")
    assert fixed == {"method": "eagle3", "model": "/heads/h", "num_speculative_tokens": 4, "parallel_drafting": True}
    # 'auto' not resolved against a registry (a local directory): the fixed K
    assert speculative_config(ServeAppArgs(num_speculative_tokens=4), "/heads/h") == fixed
    sched = speculative_config(ServeAppArgs(num_speculative_tokens=4, k_schedule=[[3, 8, 0], [1, 2, 6]]), "m")
    assert sched["num_speculative_tokens_per_batch_size"] == [[1, 2, 6], [3, 8, 0]]
    assert sched["num_speculative_tokens"] == 6 and sched["method"] == "eagle3" and sched["parallel_drafting"]
    # one K everywhere: vLLM's fixed-K path (no per-batch-size field)
    one = speculative_config(ServeAppArgs(num_speculative_tokens=4, k_schedule=[[1, 8, 2], [9, 64, 2]]), "m")
    assert one["num_speculative_tokens"] == 2 and "num_speculative_tokens_per_batch_size" not in one
    # K=0 everywhere: no speculation at all (the measured K=0 rows were plain decoding)
    assert speculative_config(ServeAppArgs(num_speculative_tokens=4, k_schedule=[[1, 64, 0]]), "m") is None
    with pytest.raises(ValueError, match="start at 1"):
        ServeAppArgs(k_schedule=[[2, 8, 3]])
    # parallel drafting with a K between 0 and the largest: allowed when asked for (the engine carries the fix,
    # below), never built from rows (build_k_schedule keeps one K for P-EAGLE)
    mixed = ServeAppArgs(k_schedule=[[1, 1, 2], [2, 8, 3], [9, 16, 0]])
    assert speculative_config(mixed, "m")["num_speculative_tokens"] == 3
    with pytest.raises(ValueError):
        ServeAppArgs(k_schedule="sometimes")


def test_traffic_log_asks_for_per_request_acceptance_only_when_speculating(tmp_path):
    # vLLM refuses per_request_spec_decode_metrics without a speculative_config (replicas die at start)
    from pipelines.serve import ServeAppArgs, build_llm_config

    def engine_kwargs(**kw):
        args = ServeAppArgs(traffic_log={"uri": str(tmp_path)}, num_speculative_tokens=3, **kw)
        return build_llm_config(args, target_path="/t", target_config=None, head="/heads/h").engine_kwargs

    assert engine_kwargs()["per_request_spec_decode_metrics"] == "summary"
    plain = engine_kwargs(k_schedule=[[1, 64, 0]])
    assert "speculative_config" not in plain and "per_request_spec_decode_metrics" not in plain


def test_serve_args_from_recipe_map_the_k_schedule_option():
    from pipelines.recipe import load_recipe
    from pipelines.serve import ServeAppArgs
    from tests.conftest import CONFIGS

    r = load_recipe(CONFIGS / "smollm2-135m-cpu.yaml")
    assert r.serving.k_schedule is None and ServeAppArgs.from_recipe(r).k_schedule == "auto"
    off = load_recipe(CONFIGS / "smollm2-135m-cpu.yaml", ["serving.k_schedule=off"])
    assert ServeAppArgs.from_recipe(off).k_schedule == "off"


def test_resolve_reads_the_version_tag(tmp_path):
    """``auto`` against a real (sqlite) MLflow registry: a tagged version gives its schedule, an untagged
    one and ``off`` give None (fixed K)."""
    from pipelines.registry.refs import HeadRef
    from pipelines.registry.register import get_client
    from pipelines.serve import ServeAppArgs, resolve_k_schedule

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = get_client(uri)
    client.create_registered_model("peagle-x")
    tagged = client.create_model_version("peagle-x", source=str(tmp_path), tags={ks.K_SCHEDULE_TAG: "[[1,2,5],[3,64,0]]"})
    plain = client.create_model_version("peagle-x", source=str(tmp_path))
    args = ServeAppArgs(tracking_uri=uri)
    assert resolve_k_schedule(args, HeadRef("peagle-x", version=tagged.version)) == [(1, 2, 5), (3, 64, 0)]
    assert resolve_k_schedule(args, HeadRef("peagle-x", version=plain.version)) is None
    off = args.model_copy(update={"k_schedule": "off"})
    assert resolve_k_schedule(off, HeadRef("peagle-x", version=tagged.version)) is None
    assert resolve_k_schedule(args, "/a/local/head") is None


def test_evaluate_engine_spec_builds_the_same_config():
    from pipelines.evaluate.k_schedule import vllm_speculative_config

    spec = vllm_speculative_config("h", num_speculative_tokens=5, parallel_drafting=True, k_schedule=[[1, 4, 5], [5, 9, 0]])
    assert spec["num_speculative_tokens"] == 5 and spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 5], [5, 9, 0]]
    with pytest.raises(ValueError):
        vllm_speculative_config("h", num_speculative_tokens=5, parallel_drafting=True, k_schedule=[[1, 4, 5], [3, 9, 0]])
    for parallel in (True, False):
        assert vllm_speculative_config("h", num_speculative_tokens=5, parallel_drafting=parallel,
                                       k_schedule=[[1, 4, 5], [5, 9, 2]])["num_speculative_tokens"] == 5


def test_the_parallel_drafting_fix_goes_on_exactly_the_engines_that_need_it(tmp_path):
    """pipelines.evaluate.dynamic_k: vLLM's worker_extension_cls on a P-EAGLE engine under a schedule with several
    K (evaluate's and Serve's engine kwargs), nowhere else; another extension of the user's is refused."""
    from pipelines.evaluate import dynamic_k
    from pipelines.evaluate.k_schedule import vllm_speculative_config
    from pipelines.serve import ServeAppArgs, build_llm_config

    def spec(parallel, schedule):
        return vllm_speculative_config("h", num_speculative_tokens=5, parallel_drafting=parallel, k_schedule=schedule)

    several = spec(True, [[1, 4, 5], [5, 9, 2]])
    assert dynamic_k.engine_kwargs_for({"dtype": "float32"}, several) == {
        "dtype": "float32", "speculative_config": several, "worker_extension_cls": dynamic_k.EXTENSION}
    for other in (spec(True, None), spec(True, [[1, 9, 5]]), spec(False, [[1, 4, 5], [5, 9, 2]]), None):
        assert "worker_extension_cls" not in dynamic_k.engine_kwargs_for({}, other)
    with pytest.raises(ValueError, match="one extension class"):
        dynamic_k.engine_kwargs_for({"worker_extension_cls": "mine.Ext"}, several)
    assert dynamic_k.engine_kwargs_for({"worker_extension_cls": "mine.Ext"}, spec(True, None))[
        "worker_extension_cls"] == "mine.Ext"
    args = ServeAppArgs(num_speculative_tokens=3, k_schedule=[[1, 1, 3], [2, 64, 2]])
    served = build_llm_config(args, target_path="/t", target_config=None, head="/heads/h").engine_kwargs
    assert served["worker_extension_cls"] == dynamic_k.EXTENSION
    assert served["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 64, 2]]
