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
    with console._heartbeat("train", 10, "steps", period_s=0.05) as advance:
        for _ in range(4):
            advance(2)
            time.sleep(0.06)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert lines[0] == "[train] 0/10 steps, 0m00s"
    assert lines[-1].startswith("[train] 8/10 steps, ")
    assert len(lines) >= 4  # start, at least two beats while it ran, the end
    assert not [t for t in threading.enumerate() if t.name.startswith("peagle-progress-")]


def test_progress_off_a_terminal_goes_through_the_heartbeat(monkeypatch):
    calls = []
    monkeypatch.setattr(console, "_heartbeat", lambda *a, **k: calls.append(a) or _null())
    monkeypatch.setattr(type(console.console), "is_terminal", property(lambda self: False))
    with console.progress("capture", 3, "conversations") as advance:
        advance(3)
    assert calls == [("capture", 3, "conversations")]


def _null():
    from contextlib import nullcontext

    return nullcontext(lambda n=1: None)


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
