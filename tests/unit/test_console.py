"""What the user sees off a terminal (a log file, ``ray job submit``): progress lines while a step runs,
tables as wide as they need."""

import subprocess
import sys
import threading
import time

import pytest

from pipelines import console

pytestmark = pytest.mark.unit


def test_progress_off_a_terminal_prints_heartbeat_lines(capsys):
    meter = console.Meter(10, "steps")
    with console._heartbeat("train", meter, period_s=0.05):
        for _ in range(4):
            meter(2)
            time.sleep(0.06)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert lines[0] == "[train] 0/10 steps, - steps/s, 0m00s"
    assert lines[-1].startswith("[train] 8/10 steps, ") and "ETA 0m0" in lines[-1]
    assert len(lines) >= 4  # start, at least two beats while it ran, the end
    assert not [t for t in threading.enumerate() if t.name.startswith("peagle-progress-")]


def test_the_progress_period_comes_from_the_environment(monkeypatch, capsys):
    """``$PEAGLE_PROGRESS_EVERY_S`` sets the heartbeat (bench.node_fault gives its job 2 s); 30 s without it; a bad
    value is refused with the variable's name."""
    from pipelines import settings

    monkeypatch.delenv(settings.PROGRESS_EVERY_ENV, raising=False)
    assert settings.progress_every_s() == 30.0
    monkeypatch.setenv(settings.PROGRESS_EVERY_ENV, "0.05")
    meter = console.Meter(4, "steps")
    with console._heartbeat("train", meter):
        time.sleep(0.3)
    assert len([x for x in capsys.readouterr().out.splitlines() if x.strip()]) >= 4
    for bad in ("0", "-2", "soon"):
        monkeypatch.setenv(settings.PROGRESS_EVERY_ENV, bad)
        with pytest.raises(ValueError, match="PEAGLE_PROGRESS_EVERY_S"):
            settings.progress_every_s()


def test_progress_off_a_terminal_goes_through_the_heartbeat(monkeypatch):
    calls = []
    monkeypatch.setattr(console, "_heartbeat", lambda *a, **k: calls.append(a) or _null())
    monkeypatch.setattr(type(console.console), "is_terminal", property(lambda self: False))
    with console.progress("capture", 3, "conversations") as meter:
        meter(3)
    assert [(d, m.done, m.total, m.unit) for d, m in calls] == [("capture", 3, 3, "conversations")]


def test_progress_on_a_terminal_draws_the_meter_in_a_rich_bar(monkeypatch):
    from rich.console import Console

    monkeypatch.setattr(console, "console", Console(force_terminal=True, width=160, record=True))
    with console.progress("train", 960, "steps") as meter:
        meter.update(done=640)
    assert "640/960 steps" in console.console.export_text()


def _null():
    from contextlib import nullcontext

    return nullcontext()


class Clock:
    """A settable clock for :class:`console.Meter`."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_meter_rate_and_eta_are_measured_from_the_first_move():
    clock = Clock()
    meter = console.Meter(960, "steps", clock=clock)
    clock.now += 120  # start-up: no work yet, no rate
    assert (meter.rate(), meter.eta_s()) == (None, None)
    meter.update(done=40)  # a resumed run's steps, or start-up work: the first move is not timed
    assert meter.rate() is None
    clock.now += 10
    meter(20)
    assert meter.rate() == pytest.approx(2.0) and meter.eta_s() == pytest.approx(900 / 2.0)
    assert meter.text() == "60/960 steps, 2.00 steps/s, ETA 7m30s, 2m10s"


def test_meter_with_a_work_unit_times_the_work_and_bounds_it():
    clock = Clock()
    meter = console.Meter(304, "conversations", work_unit="tokens", work_total=58_368, work_bound=True, clock=clock)
    assert meter.text() == "0/304 conversations, 0 of at most 58,368 tokens, - tokens/s, 0m00s"
    clock.now += 60
    meter.update(work=1_000)
    clock.now += 10
    meter.update(work=3_100, work_total=50_000)  # answers ended early: less left than the bound said
    assert meter.rate() == pytest.approx(210.0) and meter.eta_s() == pytest.approx((50_000 - 3_100) / 210.0)
    assert meter.text() == ("0/304 conversations, 3,100 of at most 50,000 tokens, 210 tokens/s, ETA 3m43s at most, "
                            "1m10s")
    meter.update(work=60_000)  # a count that overshoots (a retried task reported twice) stays within the total
    assert meter.work == 50_000


@pytest.mark.parametrize(("per_s", "text"), [(None, "-"), (1234.4, "1,234"), (12.34, "12.3"), (1.346, "1.35"),
                                            (0.0421, "0.042")])
def test_format_rate(per_s, text):
    assert console.format_rate(per_s) == text


@pytest.mark.parametrize(("seconds", "text"), [(0, "0m00s"), (59.6, "1m00s"), (4503, "75m03s"), (-3, "0m00s")])
def test_format_duration(seconds, text):
    assert console.format_duration(seconds) == text


def test_piped_output_is_wide():
    code = "from pipelines.console import console; print(console.width)"
    env = {k: v for k, v in __import__("os").environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert int(out) == console.PIPED_WIDTH


def test_tqdm_bars_off_a_terminal_even_when_tqdm_was_imported_first(capsys):
    """The target conversion inside a Ray job: tqdm (and transformers' GGUF loader's ``tqdm.auto``) imported
    long before; stderr a log file. No bar inside the block, bars as before after it."""
    from tqdm.auto import tqdm

    from pipelines.console import tqdm_only_on_a_terminal

    with tqdm_only_on_a_terminal():
        for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
    assert "de-quantizing" not in capsys.readouterr().err
    for _ in tqdm(range(3), desc="after the block"):
        pass
    assert "after the block" in capsys.readouterr().err
