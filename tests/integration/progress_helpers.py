"""Helpers of the progress checks folded into the stage tests (test_regenerate, test_capture): a stand-in for the
progress bar that records every reading with its time, and the check that a count moved while the work ran
(``make demo`` once printed ``[regenerate] 0/304 conversations`` for 12 minutes, then 304/304)."""

from __future__ import annotations

import itertools
import time
from contextlib import contextmanager

MAX_GAP_S = 20.0  # progress moves at least this often once the work has started (the heartbeat prints every 30 s)


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


def assert_moved_while_running(readings: list[tuple[float, int]], final: int, max_gap_s: float = MAX_GAP_S) -> None:
    """``readings`` (time, count) held counts strictly between 0 and ``final``, moving at most ``max_gap_s``
    apart from the first to the last move; the count ended at ``final``."""
    moves = [(t, v) for (t, v), (_, before) in zip(readings, [(0.0, 0)] + readings) if v != before]
    assert moves, f"the count never moved from 0 (final {final})"
    assert moves[-1][1] == final, moves
    between = sorted({v for _, v in moves if 0 < v < final})
    assert len(between) >= 2, f"the count went from 0 to {final} with nothing in between: {moves}"
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(moves)]
    assert max(gaps) < max_gap_s, f"progress stood still for {max(gaps):.0f} s (limit {max_gap_s:.0f} s): {moves}"


def record_bars(monkeypatch) -> list[Recorder]:
    """Every progress bar a stage opens (``pipelines.console.progress``) replaced by a :class:`Recorder`, appended to
    the returned list."""
    from pipelines import console

    bars: list[Recorder] = []

    @contextmanager
    def recording(description, total, unit, **work):
        bars.append(Recorder(total, unit, **work))
        yield bars[-1]

    monkeypatch.setattr(console, "progress", recording)
    return bars
