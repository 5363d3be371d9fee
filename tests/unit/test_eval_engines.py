"""Evaluation engines on a GPU cluster: one Ray task per engine holding one GPU, side by side
(pipelines.evaluate.measure.run_engines); on CPU one after another in this process's children."""

import sys

import pytest

from pipelines.evaluate import measure
from pipelines.recipe.stages import GPU_WARMUP_WAVES

pytestmark = pytest.mark.unit


def _fake_engine(spec, timeout_s, report):
    """Stands in for a vLLM engine process: what GPU Ray gave it and when it ran; it reports 2 finished requests
    while it runs (a report sent as the task returns may reach the counter after its last read: pipelines.tally)."""
    import os
    import time

    t0 = time.time()
    report(requests=2)
    time.sleep(1.5)
    return [{"K": spec.K, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "t0": t0, "t1": time.time()}], 1.5


def test_gpu_engines_run_side_by_side_one_gpu_each(monkeypatch):
    import ray

    monkeypatch.setattr(measure, "_timed_engine", _fake_engine)
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False)
    try:
        specs = [measure.EngineSpec(target="t", method="peagle", K=k) for k in (3, 5, 7)]
        done = []
        out = measure.run_engines(specs, on_gpus=True, on_requests=done.append)
    finally:
        ray.shutdown()
    rows = [r[0][0] for r in out]
    assert [r["K"] for r in rows] == [3, 5, 7]  # in the specs' order
    assert sum(done) == 6  # the requests the tasks reported reached the driver (through the counter actor)
    assert {r["gpu"] for r in rows} == {"0", "1"}  # one GPU each, never both
    overlapping = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1:] if a["t0"] < b["t1"] and b["t0"] < a["t1"]]
    assert overlapping and all(a["gpu"] != b["gpu"] for a, b in overlapping)  # side by side, each on its own GPU
    last = max(rows, key=lambda r: r["t0"])  # the third engine waited for a GPU to free: two waves, no third GPU
    assert last["t0"] >= min(r["t1"] for r in rows if r is not last)  # (timestamps: a loaded box starts it later)


def test_cpu_engines_run_one_after_another(monkeypatch):
    """...without Ray: bench/device's GPU evaluations run where Ray is not installed (an import of it failed them)."""
    monkeypatch.setattr(measure, "_timed_engine", _fake_engine)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    done = []
    out = measure.run_engines([measure.EngineSpec(target="t", K=k) for k in (3, 5)], on_gpus=False,
                              on_requests=done.append)
    (a,), (b,) = (r[0] for r in out)
    assert a["t1"] <= b["t0"] and done == [2, 2]


@pytest.mark.parametrize(("on_gpus", "warmup_waves", "expected"), [(True, None, GPU_WARMUP_WAVES), (False, None, 0), (True, 0, 0),
                                                                   (False, 2, 2)])
def test_engines_warm_up_each_concurrency_on_gpus(monkeypatch, on_gpus, warmup_waves, expected):
    """GPU engines run GPU_WARMUP_WAVES untimed waves per concurrency before timing it (first waves compile kernels
    for new batch shapes); CPU engines none, unless the recipe says otherwise."""
    from pipelines.recipe.stages import EvalConfig

    seen = []
    monkeypatch.setattr(measure, "run_engines", lambda specs, **kw: seen.extend(specs) or [([], 0.0) for _ in specs])
    monkeypatch.setattr(measure, "build_report", lambda rows, eval_set, **kw: rows)
    cfg = EvalConfig(methods=["none"], concurrency_sweep=[1, 16], include_offline_decoder=False,
                     warmup_waves=warmup_waves)
    measure.evaluate(target="t", prompts=[[1, 2, 3]], heads={}, cfg=cfg, eval_set="humaneval", on_gpus=on_gpus)
    assert [s.warmup_waves for s in seen] == [expected]
