"""What a user sees while peagle runs: quiet by default, one progress bar per long stage.

Quiet (the default of ``peagle run`` and ``python -m ray_jobs.*``):

- peagle's own lines: ``[stage] ...`` messages, a progress bar per long stage, the summary; peagle's
  loggers at WARNING (``--verbose``: INFO);
- Ray and vLLM internals at WARNING: ``ray.init(logging_level=WARNING)``, ``VLLM_LOGGING_LEVEL``,
  Ray Data's progress bars off (``DataContext.enable_progress_bars``) and its console at WARNING, the
  ``datasets``/``huggingface_hub`` progress bars off;
- worker output (vLLM engine start-up in Ray Data actors and Serve replicas, Ray Train's controller,
  the ``resource_tracker`` tracebacks of Python's multiprocessing when Ray ends an actor whose vLLM
  engine shared memory with it, Ray Data's per-actor progress bars) is not streamed to the driver
  (``ray.init(log_to_driver=False)``): it stays in the Ray session's log files (``<temp dir>/session_latest/logs``);
  a failing task still raises in the driver with its traceback;
- joining an existing cluster (``RAY_ADDRESS`` set, as inside ``ray job submit``): the driver's C++
  core-worker log at FATAL (``RAY_BACKEND_LOG_LEVEL``), which hides the ``E core_worker.cc``
  line Ray Data's actor pools trigger on every run (ray-project/ray#57733: constructor arguments in
  the object store with ``max_restarts > 0``; nothing fails).

``--verbose`` keeps every default of Ray, vLLM and Hugging Face and streams worker output.
Variables already set in the environment are never overridden.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console

# stdout: stage lines, progress bars, the summary. Off a terminal rich assumes 80 columns and wraps tables
# (``peagle registry list | less``): wide enough for any table unless $COLUMNS says otherwise.
PIPED_WIDTH = 200
console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else PIPED_WIDTH)
err_console = Console(stderr=True)  # one-line errors

QUIET_ENV = {
    "RAY_LOGGER_LEVEL": "warning",  # the default of every ray.init, also the ones inside ray.data.llm and vLLM
    "VLLM_LOGGING_LEVEL": "WARNING",
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "warning",
    "MLFLOW_LOGGING_LEVEL": "WARNING",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}
# peagle's own packages too: a library may reset the root logger to INFO (Ray Serve LLM does)
QUIET_LOGGERS = ("pipelines", "peagle_core", "ray", "ray.llm", "ray.serve", "vllm", "mlflow", "alembic", "httpx",
                 "datasets", "transformers")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


_quiet = False  # set by configure(): quiet_loggers() applies only then


def configure(verbose: bool = False) -> None:
    """Log format and levels for a peagle command; call before Ray, vLLM or transformers is imported
    (they read their variables at import)."""
    global _quiet
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format=LOG_FORMAT)
    _quiet = not verbose
    if verbose:
        return
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    llm = logging.getLogger("ray.llm")  # else each ray.llm module adds its own stdout handler at INFO
    if not llm.handlers:
        llm.addHandler(logging.StreamHandler())
        llm.propagate = False
    quiet_loggers()


def quiet_loggers() -> None:
    """:data:`QUIET_LOGGERS` at WARNING when quiet; call again after importing a library that sets its
    own level on import (``ray.serve``)."""
    if _quiet:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


def init_ray(verbose: bool = False) -> None:
    """Connect to ``$RAY_ADDRESS`` (inside ``ray job submit``) or start a private local Ray.

    Never a bare ``ray.init()``: it would join whatever a stale ``ray_current_cluster`` file names.
    The local one gets 2 logical CPUs per core so a stage's actors, Ray Data tasks and the Train
    controller never wait on each other on a laptop.
    """
    address = os.environ.get("RAY_ADDRESS", "local")
    if not verbose and address != "local":
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")  # the driver's own core worker only
    import ray

    from pipelines.settings import local_num_cpus

    kwargs = {"num_cpus": local_num_cpus()} if address == "local" else {}
    ray.init(address=address, logging_level=logging.INFO if verbose else logging.WARNING,
             log_to_driver=verbose, **kwargs)
    if not verbose:
        _quiet_ray_data()


def _quiet_ray_data() -> None:
    """No Ray Data progress bars; its console at WARNING (its ``ray-data.log`` file keeps everything)
    without the notice that the bars are off."""
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setLevel(logging.WARNING)
            handler.addFilter(lambda record: not record.name.startswith("ray.data._internal.progress"))


@contextmanager
def tqdm_only_on_a_terminal() -> Iterator[None]:
    """tqdm bars of transformers and gguf (de-quantizing, loading, writing shards) only when stderr is a
    terminal: in a log file each bar is a line per update (14-18 of them for one conversion).

    ``TQDM_DISABLE`` alone does not do it: tqdm reads it when it is imported, and inside a job something (Ray,
    datasets) has imported it before the conversion (the 2026-11-25 demo log still had the bars). Within the
    block every new bar is built with ``disable=True``; the variable covers processes started inside it.
    """
    if sys.stderr.isatty() or "TQDM_DISABLE" in os.environ:
        yield
        return
    import tqdm.std

    built = tqdm.std.tqdm.__init__

    def disabled(self, *args, **kwargs):
        built(self, *args, **(kwargs | {"disable": True}))

    os.environ["TQDM_DISABLE"] = "1"
    tqdm.std.tqdm.__init__ = disabled
    try:
        yield
    finally:
        tqdm.std.tqdm.__init__ = built
        os.environ.pop("TQDM_DISABLE", None)


def format_duration(seconds: float) -> str:
    """``"4m05s"`` (minutes grow past 59: ``"75m03s"``)."""
    s = max(0, round(seconds))
    return f"{s // 60}m{s % 60:02d}s"


def format_rate(per_s: float | None) -> str:
    """``"1,234"``, ``"12.3"``, ``"1.35"``, ``"0.042"`` (units/s; ``"-"`` for None)."""
    if per_s is None:
        return "-"
    if per_s >= 100:
        return f"{per_s:,.0f}"
    return f"{per_s:.1f}" if per_s >= 10 else f"{per_s:.2f}" if per_s >= 1 else f"{per_s:.2g}"


class Meter:
    """What one progress line shows, and its rate and ETA.

    ``done`` of ``total`` ``unit`` (conversations, steps) is the headline. Where that count moves in jumps
    (regenerate: a vLLM engine decodes all its requests together, so they finish together at the end), the
    work is also counted in a finer ``work_unit`` (tokens): ``work`` of ``work_total``, an upper bound
    when ``work_bound`` (``"of at most"``: a response may end before its ``max_tokens``). The rate and the
    ETA come from the work when there is a work unit, else from ``done``/``total``. The rate (units/s) is
    measured from the first time the work moved (:meth:`rate`), so an engine's start-up does not dilute it.
    Thread-safe: workers' counts arrive on a polling thread while the heartbeat thread reads. Calling the
    meter, ``meter(n)``, advances ``done`` by ``n``.
    """

    def __init__(self, total: int | None, unit: str, *, work_unit: str | None = None, work_total: int | None = None,
                 work_bound: bool = False, clock: Callable[[], float] | None = None):
        import threading
        import time

        self.total, self.unit, self.done = total, unit, 0
        self.work_unit, self.work_total, self.work_bound, self.work = work_unit, work_total, work_bound, 0
        self._clock = clock or time.monotonic
        self.start = self._clock()
        self._first: tuple[float, float] | None = None  # (time, work) when work first moved
        self._lock = threading.Lock()
        self.listeners: list[Callable[[Meter], None]] = []  # called after each change (the rich bar)

    def __call__(self, n: int = 1) -> None:
        self.update(advance=n)

    def update(self, *, advance: int = 0, done: int | None = None, work: int | None = None,
               work_total: int | None = None) -> None:
        """Set the counts given (absolute values; a work unit's ``work`` is kept within ``work_total``), then
        advance ``done`` by ``advance``."""
        with self._lock:
            if done is not None:
                self.done = done
            self.done += advance
            if work_total is not None:
                self.work_total = work_total
            if work is not None:
                self.work = work if self.work_total is None else min(work, self.work_total)
            if self._first is None and self._work_done() > 0:
                self._first = (self._clock(), self._work_done())
        for listener in self.listeners:
            listener(self)

    def _work_done(self) -> float:
        return self.work if self.work_unit else self.done

    def fraction(self) -> tuple[float, float | None]:
        """(work done, work total or None) in the unit of the rate."""
        return (self.work, self.work_total) if self.work_unit else (self.done, self.total)

    def rate(self) -> float | None:
        """Units of work per second since the work first moved (that first move itself not counted: it may
        be work kept from an earlier run, or all that one report held); None until the work moved again."""
        with self._lock:
            if self._first is None or self._work_done() <= self._first[1]:
                return None
            t, w = self._first
            return (self._work_done() - w) / max(self._clock() - t, 1e-9)

    def eta_s(self) -> float | None:
        """Seconds left at :meth:`rate` (None without a rate or a total)."""
        rate, (done, total) = self.rate(), self.fraction()
        if not rate or total is None:
            return None
        return max(0.0, total - done) / rate

    def text(self) -> str:
        """``"40/304 conversations, 5,623 of at most 6,720 tokens, 210 tokens/s, ETA 0m05s at most, 2m27s"``: the
        counts, the rate (``-`` before the work moves), the ETA, the time since the meter started."""
        of = f"/{self.total:,}" if self.total is not None else ""
        parts = [f"{self.done:,}{of} {self.unit}"]
        if self.work_unit:
            bound = "" if self.work_total is None else f" of {'at most ' if self.work_bound else ''}{self.work_total:,}"
            parts.append(f"{self.work:,}{bound} {self.work_unit}")
        rate, eta = self.rate(), self.eta_s()
        parts.append(f"{format_rate(rate)} {self.work_unit or self.unit}/s")
        if eta is not None:
            parts.append(f"ETA {format_duration(eta)}{' at most' if self.work_unit and self.work_bound else ''}")
        parts.append(format_duration(self._clock() - self.start))
        return ", ".join(parts)


@contextmanager
def progress(description: str, total: int | None, unit: str, **work: Any) -> Iterator[Meter]:
    """One progress bar (rich) for a long step; yields its :class:`Meter` (``meter(n)`` advances it by ``n``;
    ``work``: the meter's ``work_unit``, ``work_total``, ``work_bound``).

    On a terminal it updates live. Off a terminal (a log file, ``ray job submit``) a bar cannot redraw, so
    a line ``[description] <Meter.text()>`` is printed when the step starts, every
    :func:`pipelines.settings.progress_every_s` seconds while it runs (30 s unless ``$PEAGLE_PROGRESS_EVERY_S``
    says otherwise), and when it ends.
    """
    meter = Meter(total, unit, **work)
    if not console.is_terminal:
        with _heartbeat(description, meter):
            yield meter
        return
    from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
    from rich.text import Text

    class MeterColumn(ProgressColumn):
        def render(self, task) -> Text:
            return Text(meter.text())

    with Progress(TextColumn("{task.description}"), BarColumn(), MeterColumn(), console=console,
                  transient=False) as bar:
        task = bar.add_task(description, total=meter.fraction()[1])

        def redraw(m: Meter) -> None:
            done, total = m.fraction()
            bar.update(task, completed=done, total=total)

        meter.listeners.append(redraw)
        yield meter


@contextmanager
def every(period_s: float, fn: Callable[[], None], *, name: str) -> Iterator[None]:
    """Call ``fn`` every ``period_s`` seconds from a daemon thread named ``name`` while the body runs, and once
    more when it ends (the one home of the progress loops: heartbeat lines, token counts, tallies)."""
    import threading

    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(period_s):
            fn()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        fn()


@contextmanager
def _heartbeat(description: str, meter: Meter, period_s: float | None = None) -> Iterator[None]:
    """Plain progress lines from a daemon thread (see :func:`progress`)."""

    def line() -> None:
        console.print(f"[{description}] {meter.text()}", highlight=False, markup=False)

    line()
    from pipelines.settings import progress_every_s

    with every(progress_every_s() if period_s is None else period_s, line, name=f"peagle-progress-{description}"):
        yield
