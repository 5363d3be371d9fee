"""pipelines.evaluate.step_profile: host phases wrapped on a runner and an engine core of vLLM's shape, the
profiler window summarized per step (device busy time as a union of intervals, launches, waits)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType

from pipelines.evaluate import step_costs, step_profile


class _Runner:
    def execute_model(self, n):
        self._model_forward(n)
        return n

    def sample_tokens(self, n):
        self._sample(n)
        return self.propose_draft_token_ids(n)

    def _model_forward(self, n):
        return torch.ones(n) @ torch.ones(n)

    def _sample(self, n):
        time.sleep(0.002)

    def propose_draft_token_ids(self, n):
        return [n]


class EngineCoreForTest:  # found by class name and attributes, as vLLM's EngineCore in the worker's process
    def __init__(self, runner):
        self.runner = runner
        self.scheduler = SimpleNamespace(schedule=lambda: 8, update_from_output=lambda out: out)
        self.step_fn = self.step

    def step(self):
        n = self.scheduler.schedule()
        self.runner.execute_model(n)
        return self.scheduler.update_from_output(self.runner.sample_tokens(n))


def test_phases_and_steps_are_counted_without_synchronizing():
    runner = _Runner()
    core = EngineCoreForTest(runner)
    worker = SimpleNamespace(model_runner=runner)
    got = step_profile.start(worker)
    assert got["missing"] == [] and set(got["wrapped"]) == set(step_profile.HOST_PHASES)
    for _ in range(5):
        core.step_fn()
    out = step_profile.stop(worker)
    assert out["num_steps"] == 5
    assert set(out["host_ms"]) == set(step_profile.HOST_PHASES)
    assert out["host_ms"]["sample"] >= 2.0  # the 2 ms sleep, per step
    assert out["host_ms"]["engine_step"] >= out["host_ms"]["execute_model"] + out["host_ms"]["sample_tokens"] - 0.5
    assert out["wall_ms"] >= 2.0 and out["device_busy_fraction"] == 0.0  # CPU only: no device events
    # a second window starts from zero, and step_costs (wrapping on top) still finds execute_model by name
    step_profile.start(worker)
    core.step_fn()
    assert step_profile.stop(worker)["num_steps"] == 1
    assert step_costs.install(worker)
    core.step_fn()
    assert step_costs.per_step_ms(step_costs.read(worker))["num_steps"] == 1


def _event(name, start, end, device=DeviceType.CPU):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_summary_unions_device_intervals_and_counts_launches_and_waits():
    events = [
        _event("gemm", 0, 100, DeviceType.CUDA), _event("gemm", 50, 150, DeviceType.CUDA),  # overlap: 150 us busy
        _event("softmax", 300, 350, DeviceType.CUDA),  # +50 us
        _event("cudaGraphLaunch", 0, 5), _event("cudaGraphLaunch", 10, 15), _event("cudaLaunchKernel", 20, 22),
        _event("cudaStreamSynchronize", 200, 600), _event("aten::mm", 0, 10),
    ]
    out = step_profile.summarize(events, wall_s=0.001, steps=[0.0, 0.0005], host={"schedule": [2, 0.0002]})
    assert out["num_steps"] == 2 and out["wall_ms"] == 0.5
    assert out["device_busy_ms"] == 0.1  # 200 us over 2 steps
    assert abs(out["device_busy_fraction"] - 0.2) < 1e-9
    assert out["graph_launches"] == 1.0 and out["kernel_launches"] == 0.5
    assert out["sync_ms"] == 0.2 and out["host_ms"] == {"schedule": 0.1}
    assert [k["name"] for k in out["top_kernels"]] == ["gemm", "softmax"]
    assert out["top_kernels"][0]["calls_per_step"] == 1.0


def test_compile_counts_see_a_new_dynamo_frame_and_a_new_triton_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    worker = SimpleNamespace(model_runner=_Runner())
    before = step_profile.compile_counts(worker)
    assert set(before) == {"dynamo_frames", "dynamo_graphs", "triton_cache_entries"}
    (tmp_path / "kernel-hash").mkdir()  # what Triton adds per compiled kernel specialization

    def f(x):
        return x * 2 + 1

    torch.compile(f, backend="eager")(torch.ones(3))
    after = step_profile.compile_counts(worker)
    assert after["triton_cache_entries"] == before["triton_cache_entries"] + 1
    assert after["dynamo_frames"] > before["dynamo_frames"]
