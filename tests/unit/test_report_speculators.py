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


def test_counterpart_named_by_the_record_wins_over_the_last(monkeypatch):
    """``record --counterpart TAG#RUN``: peagle's best recipe against speculators', not the last run of the goal."""
    rows = [_run(1), _run(2), _run(3, goal=300.0)]
    monkeypatch.setattr(rs, "train_rows", lambda: rows)
    assert rs.peagle_counterpart(SPEC | {"counterpart": {"tag": "peagle-99k-600s", "run": 1}})["run"] == 1
    assert rs.peagle_counterpart(SPEC | {"counterpart": {"tag": "peagle-99k-600s", "run": 3}}) is None  # other goal


def test_peagle_rate_is_over_the_timed_calls_and_the_last_window():
    final = {"step": 100.0, "tokens_seen": 1_600_000.0, **{f"acc_d{d}": 0.5 - d / 10 for d in range(5)}}
    run = _run(2, calls=[{"timed_s": 30.0, "timed_steps": 60, "peak_mem_gib": 8.0},
                         {"timed_s": 10.0, "timed_steps": 20, "peak_mem_gib": 8.5, "final": final},
                         {"note": "a call that only exported the head"}])
    t = rs.peagle_training(run)
    assert t["s_per_step"] == pytest.approx(0.5)
    assert t["tokens_per_s"] == pytest.approx(16_000 / 0.5)
    assert t["peak_mem_gib"] == 8.5 and t["acc"][0] == 0.5


def test_conditional_acceptance_divides_the_chain_and_drops_thin_positions():
    """Position p given 1..p-1 accepted = chain[p] / chain[p-1], only from >= MIN_CONDITIONING_ANCHORS anchors."""
    r = {"chain_acceptance_per_pos": [0.5, 0.2, 0.05, 0.01], "chain_anchors": 100}
    got = rs.conditional_acceptance(r)
    assert [(p, given) for p, _, given in got] == [(2, 50), (3, 20)]  # position 4: 5 anchors had 1..3 right
    assert [c for _, c, _ in got] == pytest.approx([0.4, 0.25])
    assert rs.conditional_acceptance({"chain_acceptance_per_pos": [0.1, 0.0], "chain_anchors": 100}) == []


def test_speculators_accuracy_key_follows_the_method():
    """P-EAGLE logs position_i_acc; EAGLE-3 only the chain full_acc_i (and cond_acc_i)."""
    assert rs.SPEC_ACC["peagle"].format(d=2) == "position_2_acc"
    assert rs.SPEC_ACC["eagle3"].format(d=2) == "full_acc_2"


def test_compare_reads_small_differences_as_equal():
    assert rs._compare(0.30, 0.32) == "about equal"
    assert rs._compare(0.40, 0.30) == "peagle's higher" and rs._compare(0.28, 0.32) == "speculators' higher"


def test_best_rows_read_the_best_arms_differences():
    from bench.report_speculators import recipe_differences

    text = recipe_differences({"method": "peagle"}, "best")
    assert "`--lr 6e-4`, `--no-norm-before-residual`, `--max-anchors 4096`" in text and "RECIPE_BEST" in text
