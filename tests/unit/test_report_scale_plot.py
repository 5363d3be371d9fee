"""bench.report_scale.plot_al_vs_gpu_s: budget-only recipes as lines per (method, set size, eval set); a recipe with
overrides is plotted only on the largest set, as marks of its own; a warm-started run counts its parent's GPU-seconds."""

import pytest

from bench import report_scale as rs

pytest.importorskip("matplotlib")

RUNS = {
    "peagle-29k": {"method": "peagle", "size": 29905, "variant": "", "overrides": [], "train_s_goal": 150,
                   "horizon": 100, "steps": 100},
    "peagle-29k-600s": {"method": "peagle", "size": 29905, "variant": "600s", "overrides": [], "train_s_goal": 600,
                        "horizon": 400, "steps": 400},
    "peagle-29k-cod003-180s": {"method": "peagle", "size": 29905, "variant": "cod003-180s",
                               "overrides": ["training.cod_ratio=0.03"], "train_s_goal": 180, "horizon": 9,
                               "steps": 9},
    "peagle-99k-cod003-1800s": {"method": "peagle", "size": 99000, "variant": "cod003-1800s",
                                "overrides": ["training.cod_ratio=0.03"], "train_s_goal": 1800, "horizon": 90,
                                "steps": 90},
}


def row(head, al, k=5):
    return {"head": head, "run": 1, "K": k, "concurrency": 1, "eval_set": "humaneval", "acceptance_length": al}


def test_override_recipes_are_marks_on_the_largest_set_only(monkeypatch):
    monkeypatch.setattr(rs, "head_run", lambda label, run=1: (RUNS[label], RUNS[label]["steps"]))
    drawn = {}

    def save(plt, fig, name):
        for line in fig.axes[0].get_lines():
            drawn[line.get_label()] = (list(line.get_xdata()), list(line.get_ydata()), line.get_marker())
        plt.close(fig)
        return name

    monkeypatch.setattr(rs, "_save", save)
    rows = [row("peagle-29k", 1.3), row("peagle-29k-600s", 1.6), row("peagle-29k-cod003-180s", 1.8),
            row("peagle-99k-cod003-1800s", 2.9), row("peagle-99k-cod003-1800s", 2.6, k=3), row("none", 1.0)]
    assert rs.plot_al_vs_gpu_s(rows) == "scale_al_vs_gpu_s.png"
    assert drawn == {"peagle, 29,905 conv., humaneval": ([150.0, 600.0], [1.3, 1.6], "o"),
                     "peagle cod003-1800s, 99,000 conv., humaneval": ([1800.0], [2.9], "x")}


def test_a_warm_started_run_counts_its_parents_gpu_seconds(monkeypatch):
    """``training.init_from=.../head-<tag>`` adds that run's GPU-seconds (and its own parent's); a head dir that is
    no recorded run adds nothing."""
    rows = [{"tag": "peagle-99k-cod003-1800s", "run": 1, "train_s_goal": 1800, "overrides": []},
            {"tag": "peagle-99k-long8k-330s", "run": 1, "train_s_goal": 330,
             "overrides": ["training.lr=3e-4", "training.init_from=/root/keep/head-peagle-99k-cod003-1800s"]},
            {"tag": "peagle-99k-more-100s", "run": 1, "train_s_goal": 100,
             "overrides": ["training.init_from=/root/keep/head-peagle-99k-long8k-330s"]}]
    monkeypatch.setattr(rs, "train_rows", lambda: rows)
    assert [rs.warm_start_s(r) for r in rows] == [0.0, 1800.0, 2130.0]
    assert rs.warm_start_s({"train_s_goal": 5, "overrides": ["training.init_from=models:/peagle@champion"]}) == 0.0
