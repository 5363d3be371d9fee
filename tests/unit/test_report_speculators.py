"""bench.report_speculators: which peagle run a speculators row is compared with, and peagle's training rate."""

import pytest

from bench import report_speculators as rs


def _run(run: int, *, done=True, method="peagle", tokens=1000, goal=600.0, calls=None) -> dict:
    return {"tag": f"{method}-99k-600s", "run": run, "method": method, "done": done, "tokens_per_epoch": tokens,
            "train_s_goal": goal, "calls": calls or []}


SPEC = {"method": "peagle", "tokens_per_epoch": 1000, "train_s_goal": 600.0}


def test_counterpart_is_the_finished_run_on_the_same_tokens_and_goal(monkeypatch):
    rows = [_run(1, done=False), _run(2), _run(3, tokens=999), _run(4, goal=300.0), _run(5, method="eagle3")]
    monkeypatch.setattr(rs, "train_rows", lambda: rows)
    assert rs.peagle_counterpart(SPEC)["run"] == 2
    monkeypatch.setattr(rs, "train_rows", lambda: rows[:1] + rows[2:])
    assert rs.peagle_counterpart(SPEC) is None


def test_peagle_rate_is_over_the_timed_calls_and_the_last_window():
    final = {"step": 100.0, "tokens_seen": 1_600_000.0, **{f"acc_d{d}": 0.5 - d / 10 for d in range(5)}}
    run = _run(2, calls=[{"timed_s": 30.0, "timed_steps": 60, "peak_mem_gib": 8.0},
                         {"timed_s": 10.0, "timed_steps": 20, "peak_mem_gib": 8.5, "final": final},
                         {"note": "a call that only exported the head"}])
    t = rs.peagle_training(run)
    assert t["s_per_step"] == pytest.approx(0.5)
    assert t["tokens_per_s"] == pytest.approx(16_000 / 0.5)
    assert t["peak_mem_gib"] == 8.5 and t["acc"][0] == 0.5
