"""bench.report_long_context: a head trained on from another head is read against its parent at the lengths both
were measured at; a head from scratch, or one whose parent has no rows, adds nothing."""

from bench import report_long_context as rl
from bench import report_scale as rs

TRAIN = [{"tag": "parent", "run": 1, "train_s_goal": 1800, "overrides": [], "recipe": {}},
         {"tag": "child", "run": 1, "train_s_goal": 330, "recipe": {"data.max_length_tokens": 8192},
          "overrides": ["training.init_from=/root/keep/head-parent"]}]
SETS = {f"he-{n}": {"context_tokens": n} for n in (0, 1024, 7168)}


def _row(head, n, al, pos2):
    return {"head": head, "run": 1, "eval_set": f"he-{n}", "acceptance_length": al, "al_per_pos": [0.8, pos2]}


def test_a_continued_head_is_read_against_its_parent(monkeypatch):
    monkeypatch.setattr(rs, "train_rows", lambda: TRAIN)
    rows = [_row("child", 0, 2.85, 0.51), _row("child", 1024, 2.79, 0.51), _row("child", 7168, 1.73, 0.07),
            _row("parent", 0, 2.92, 0.50), _row("parent", 1024, 1.84, 0.04)]  # the parent lacks L = 7,168
    runs = [("child", 1), ("parent", 1)]
    text = rl._continued(rows, SETS, runs)
    assert "child (its parent parent trained on for 330 GPU-s with conversations cut at 8,192 tokens)" in text
    assert "at L = 0, 1,024: 2.85 vs 2.92, 2.79 vs 1.84; acceptance at position 2: 0.51 vs 0.50, 0.51 vs 0.04." in text
    assert rl._continued([r for r in rows if r["head"] == "child"], SETS, runs[:1]) == ""  # parent not measured
