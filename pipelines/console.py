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


HEARTBEAT_S = 30.0  # off a terminal: one progress line this often while a step runs


@contextmanager
def progress(description: str, total: int | None, unit: str) -> Iterator[Callable[[int], None]]:
    """One progress bar (rich) for a long step; yields ``advance(n)``.

    On a terminal it updates live. Off a terminal (a log file, ``ray job submit``) a bar cannot redraw, so
    a line ``[description] done/total unit, elapsed`` is printed when the step starts, every
    :data:`HEARTBEAT_S` seconds while it runs, and when it ends.
    """
    if not console.is_terminal:
        with _heartbeat(description, total, unit) as advance:
            yield advance
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


@contextmanager
def _heartbeat(description: str, total: int | None, unit: str,
               period_s: float | None = None) -> Iterator[Callable[[int], None]]:
    """Plain progress lines from a daemon thread (see :func:`progress`)."""
    import threading
    import time

    done, start, stop = [0], time.monotonic(), threading.Event()

    def line() -> None:
        elapsed = int(time.monotonic() - start)
        of = f"/{total}" if total is not None else ""
        console.print(f"[{description}] {done[0]}{of} {unit}, {elapsed // 60}m{elapsed % 60:02d}s", highlight=False, markup=False)

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S if period_s is None else period_s):
            line()

    line()
    thread = threading.Thread(target=beat, name=f"peagle-progress-{description}", daemon=True)
    thread.start()
    try:
        yield lambda n=1: done.__setitem__(0, done[0] + n)
    finally:
        stop.set()
        thread.join()
        line()
