"""Counts of work done inside workers (``pipelines.tally``): handed on as they are reported, in-process or
through a counter the driver polls, and vLLM's token counter read from Ray's metrics text."""

import threading
import time

import pytest

from pipelines import tally

pytestmark = pytest.mark.unit


def test_in_process_reports_are_handed_on_at_once():
    got = []
    with tally.tally(got.append, use_ray=False) as t:
        t.add(conversations=8, tokens=0)
        assert got == [{"conversations": 8}]  # zero counts dropped, nothing waits for a poll
        t.add()
    assert got == [{"conversations": 8}]
    assert not [x for x in threading.enumerate() if x.name == "peagle-tally"]


class FakeGauge:
    def __init__(self) -> None:
        self.totals: dict[str, int] = {}

    def read(self) -> dict[str, int]:
        return dict(self.totals)


def wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "the polling thread never handed the counts on"
        time.sleep(0.01)


def test_gauges_are_polled_and_handed_on_as_deltas_with_a_last_read_at_the_end():
    got, gauge = [], FakeGauge()
    with tally.tally(got.append, use_ray=False, gauges=[gauge], period_s=0.02) as t:
        gauge.totals = {"live_tokens": 100}
        wait_for(lambda: got)  # read while the body runs
        time.sleep(0.1)
        assert got == [{"live_tokens": 100}]  # once: it did not move since
        t.add(tokens=7)
        gauge.totals = {"live_tokens": 250}
        wait_for(lambda: len(got) == 3)
        gauge.totals = {"live_tokens": 300}  # moved just before the end: the last read gets it
    assert got == [{"live_tokens": 100}, {"tokens": 7}, {"live_tokens": 150}, {"live_tokens": 50}]


def test_a_report_that_fails_is_dropped_not_raised():
    class Broken:
        class add:  # the shape of a Ray actor method
            @staticmethod
            def remote(counts):
                raise ConnectionError("counter actor gone")

    tally.Tally(actor=Broken()).add(conversations=1)  # no exception: progress never fails the work


def _metrics_text(value: float, *, model: str = "/t/smollm2", replica: str = "", worker: str = "w1") -> str:
    labels = f'Component="core_worker",ReplicaId="{replica}",WorkerId="{worker}",engine="0",model_name="{model}"'
    return (f"# HELP ray_vllm_generation_tokens_total Number of generation tokens processed.\n"
            f"# TYPE ray_vllm_generation_tokens_total counter\n"
            f"ray_vllm_generation_tokens_total{{{labels}}} {value}\n"
            f"ray_vllm_prompt_tokens_total{{{labels}}} 99999.0\n")


def test_vllm_token_gauge_counts_this_models_engines_since_it_was_made():
    texts = [[_metrics_text(500.0)]]  # an engine of an earlier pass: its 500 tokens are not ours
    gauge = tally.VLLMTokenGauge("/t/smollm2", key="live_tokens", min_interval_s=0, fetch=lambda: texts[-1])
    assert gauge.read() == {"live_tokens": 0}
    texts.append([_metrics_text(500.0) + _metrics_text(1606.0, worker="w2"),
                  _metrics_text(40.0, model="/other") + _metrics_text(70.0, replica="serve-1")])
    assert gauge.read() == {"live_tokens": 1606}  # another model and a Serve replica do not count
    texts.append([_metrics_text(900.0)])  # w2's engine ended, its series gone: its count stays
    assert gauge.read() == {"live_tokens": 1606 + 400}


def test_vllm_token_gauge_without_a_metrics_endpoint_reads_nothing():
    gauge = tally.VLLMTokenGauge("/t/smollm2", min_interval_s=0, fetch=list)
    assert gauge.read() == {}
