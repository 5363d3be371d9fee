"""bench.report_scale.plot_al_vs_gpu_s: budget-only recipes as lines per (method, set size, eval set); a recipe with
overrides is plotted only on the largest set, as marks of its own."""

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
                     "peagle cod_ratio=0.03, 99,000 conv., humaneval": ([1800.0], [2.9], "x")}
