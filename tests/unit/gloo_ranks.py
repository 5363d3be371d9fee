"""Spawned gloo ranks for the FSDP tests (:func:`spawn_ranks`), and the ranks of its own test, which live here so
that their spawned processes import only this module and torch."""

import faulthandler
import os
import warnings
from pathlib import Path

from pipelines.ports import free_port

WORLD = 2


def _rank(rank: int, fn, *args) -> None:
    faulthandler.enable()  # a native crash prints every thread's Python stack to the test's captured stderr
    fn(rank, *args)


def spawn_ranks(fn, out_dir: Path) -> Path:
    """``fn(rank, port, out)`` on :data:`WORLD` spawned gloo ranks, ``out`` a new directory under ``out_dir``
    (returned); run once more, in another directory, if a rank dies by a signal.

    A rank aborted once in CI (glibc's heap check: ``malloc_consolidate(): invalid chunk size``, SIGABRT,
    2026-11-29; here 0 of 60 runs of the same ranks alone and 0 of 2 unit suites on 2 workers) and once at teardown
    (``terminate called without an active exception``, 2026-11-28): native crashes, which no Python code of these
    ranks can cause. The second run must pass; a rank that raises (a wrong value, an error of ours) is never run
    again."""
    import torch.multiprocessing as mp

    for attempt in (1, 2):
        out = out_dir / f"attempt-{attempt}"
        out.mkdir(parents=True)
        try:
            mp.spawn(_rank, args=(fn, free_port(), str(out)), nprocs=WORLD, join=True)
            return out
        except mp.ProcessExitedException as e:
            if attempt == 2 or e.signal_name is None:
                raise
            warnings.warn(f"gloo rank {e.error_index} died by {e.signal_name}; running the ranks once more",
                          stacklevel=2)


def _abort_in_first_attempt(rank: int, port: int, out_dir: str) -> None:
    if rank == 1 and out_dir.endswith("attempt-1"):
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file where the suite runs
        os.abort()  # a real SIGABRT, as glibc's heap check raises it
    Path(out_dir, f"rank{rank}").touch()


def _raise(rank: int, port: int, out_dir: str) -> None:
    Path(out_dir, f"rank{rank}").touch()
    raise ValueError("a wrong value")
