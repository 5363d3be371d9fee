"""Two processes that ask for the same embedded target at once convert it once (``pipelines.assets.ensure_target``
takes a file lock per target): the second waits for the first's directory instead of converting again and swapping
it under a reader (the integration tests' two workers on a fresh machine; two replicas of one node)."""

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

CONVERT_S = 1.0  # the fake conversion's length: the second process asks while the first converts


def ask_for_target(home: str, log: str, barrier, results) -> None:
    """Child process: ``ensure_target`` with a fake conversion that records its process id."""
    from pipelines import assets

    def fake_convert(spec, dtype, out: Path, home_) -> dict:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(CONVERT_S)
        (out / "config.json").write_text("{}")
        return {"source": "fake"}

    assets._convert = fake_convert
    barrier.wait()
    asset = assets.ensure_target("smollm2-135m-instruct", "float32", home=Path(home))
    results.put((str(asset.path), asset.sha256))


def test_two_processes_convert_a_target_once(tmp_path):
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    log = tmp_path / "conversions.log"
    procs = [ctx.Process(target=ask_for_target, args=(str(tmp_path / "home"), str(log), barrier, results))
             for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    got = [results.get(timeout=5) for _ in procs]
    assert len(log.read_text().splitlines()) == 1, "both processes converted the target"
    assert got[0] == got[1]  # the same directory and checksum for both
    final = Path(got[0][0])
    assert (final / "config.json").is_file() and not list(final.parent.glob(".*old-*"))
