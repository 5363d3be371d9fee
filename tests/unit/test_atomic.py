"""Crash-safe writes (issue 15 item 7): real SIGKILLs, no hooks in production code.

A child process runs the real writer with a CPython audit hook (``sys.addaudithook``, test code
only) that SIGKILLs the child itself at the k-th file-system event it makes (``open``,
``os.rename``, ``shutil.rmtree``, ...). The kill is a real ``SIGKILL``: no ``finally``/``except``
runs, exactly as a crash. Trying every k visits every point of the write, the window between the
two renames of :func:`peagle_core.atomic.replace_dir` included.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from peagle_core.atomic import (
    atomic_write_bytes,
    atomic_write_text,
    atomic_write_via,
    recover_dir,
    recover_dirs_in,
    replace_dir,
    temp_dir_for,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

# kills the child at the KILL_AT-th audit event in WATCH (after the hook is installed)
KILLER = """
import os, signal, sys
WATCH = {{{watch}}}
_seen = [0]
def _hook(event, args):
    if event in WATCH:
        _seen[0] += 1
        if _seen[0] == {kill_at}:
            os.kill(os.getpid(), signal.SIGKILL)
"""
FS_EVENTS = ('"open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.link", "shutil.rmtree", '
             '"os.scandir"')
OLD = {"a.txt": b"old a", "sub/b.bin": b"\x00old b" * 1000, "gone.txt": b"only in old"}
NEW = {"a.txt": b"new a", "sub/b.bin": b"\x01new b" * 2000, "c.txt": b"only in new"}


def run_child(body: str, *args: str, kill_at: int, watch: str = FS_EVENTS, umask: int | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``body`` in a fresh interpreter; it is SIGKILLed at its ``kill_at``-th watched event
    (0: never). ``body`` calls ``sys.addaudithook(_hook)`` where the kills should start."""
    code = KILLER.format(watch=watch, kill_at=kill_at) + textwrap.dedent(body)
    if umask is not None:
        code = f"import os\nos.umask({umask})\n" + code
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-c", code, *args], check=False, env=env, capture_output=True,
                          text=True, timeout=timeout)


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def snapshot(root: Path) -> dict[str, bytes] | None:
    if not root.is_dir():
        return None
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def others(final: Path) -> list[str]:
    """Entries of ``final``'s parent other than ``final`` (siblings a writer left)."""
    return sorted(p.name for p in final.parent.iterdir() if p.name != final.name)


REPLACE_CHILD = """
from pathlib import Path
from peagle_core.atomic import replace_dir, temp_dir_for
final = Path(sys.argv[1])
files = {"a.txt": b"new a", "sub/b.bin": b"\\x01new b" * 2000, "c.txt": b"only in new"}
sys.addaudithook(_hook)
tmp = temp_dir_for(final)
for name, data in files.items():
    (tmp / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp / name).write_bytes(data)
replace_dir(tmp, final)
print("events", _seen[0])
"""


def test_replace_dir_killed_at_every_step_leaves_old_or_new(tmp_path):
    """SIGKILL at each of the writer's file-system events (writing the temp tree, fsyncing it, the
    renames, deleting the old tree): after the next reader's ``recover_dir``, ``final`` is exactly
    the old tree or exactly the new one, and no sibling is left."""
    outcomes, between_renames, k = [], 0, 0
    while True:
        k += 1
        assert k < 500, "the writer never finished: the kill loop does not end"
        case = tmp_path / f"k{k}"
        final = case / "final"
        write_tree(final, OLD)
        r = run_child(REPLACE_CHILD, str(final), kill_at=k)
        if r.returncode == 0:
            assert snapshot(final) == NEW and others(final) == []
            break
        assert r.returncode == -signal.SIGKILL, r.stderr
        left = others(final)
        if not final.exists():
            # killed between the two renames: the old tree waits in .final.old-<pid>
            assert any(n.startswith(".final.old-") for n in left), left
            between_renames += 1
        recover_dir(final)
        got = snapshot(final)
        assert got in (OLD, NEW), f"kill at event {k}: final holds {sorted(got or {})}"
        assert others(final) == [], f"kill at event {k}: siblings left after recovery: {others(final)}"
        outcomes.append("new" if got == NEW else "old")
    print(f"RESULT replace_dir: {len(outcomes)} kill points, old kept {outcomes.count('old')}, new in place "
          f"{outcomes.count('new')}, killed between the renames {between_renames}")
    assert between_renames >= 1, "no kill landed between the two renames"
    assert "old" in outcomes and "new" in outcomes, outcomes
    assert len(outcomes) >= 10, outcomes  # mkdir, writes, fsyncs, renames, rmtree: many kill points


def test_leftover_old_is_restored_by_the_next_replace(tmp_path):
    """The state of a kill between the renames, then the next writer: the newest tree wins and the
    moved-aside copy is gone."""
    final = tmp_path / "final"
    write_tree(final, OLD)
    r = run_child(REPLACE_CHILD, str(final), kill_at=2, watch='"os.rename"')
    assert r.returncode == -signal.SIGKILL and not final.exists()
    assert [n for n in others(final) if n.startswith(".final.old-")]
    tmp = temp_dir_for(final)
    write_tree(tmp, {"z.txt": b"newest"})
    replace_dir(tmp, final)
    assert snapshot(final) == {"z.txt": b"newest"} and others(final) == []


def test_sibling_of_a_live_writer_is_left_alone(tmp_path):
    """``.old-<pid>`` of a process that still runs may be mid-replace: readers do not touch it; once
    that process is gone it is restored."""
    final = tmp_path / "final"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        old = tmp_path / f".final.old-{sleeper.pid}"
        write_tree(old, OLD)
        assert recover_dir(final) is False and not final.exists() and old.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert recover_dir(final) is True and snapshot(final) == OLD and others(final) == []


def test_recover_dirs_in_a_checkpoint_root(tmp_path):
    """A checkpoint root after a kill: each moved-aside checkpoint is back, dead temp dirs are gone."""
    root = tmp_path / "ckpts"
    write_tree(root / "checkpoint_000010", {"state.json": b"10"})
    final = root / "checkpoint_000020"
    write_tree(final, OLD)
    r = run_child(REPLACE_CHILD, str(final), kill_at=2, watch='"os.rename"')
    assert r.returncode == -signal.SIGKILL and not final.exists()
    assert recover_dirs_in(root) == [final]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_000010", "checkpoint_000020"]
    assert snapshot(final) == OLD


EXPORT_CHILD = """
from pathlib import Path
from peagle_core.contract import export_head
from tests.unit.conftest import make_drafter
d = make_drafter()
sys.addaudithook(_hook)
export_head(d, Path(sys.argv[1]), dtype="bfloat16", overwrite=True)
"""


def test_export_head_killed_between_renames_keeps_the_old_head(tmp_path):
    """``export_head`` over an existing head, SIGKILLed between its two renames: the head is
    missing under its name, and the next reader (``load_head``) restores the complete old one."""
    from peagle_core.contract import export_head, load_head, validate_head

    from .conftest import make_drafter

    final = export_head(make_drafter(), tmp_path / "head", dtype="float32")
    before = snapshot(final)
    r = run_child(EXPORT_CHILD, str(final), kill_at=2, watch='"os.rename"')
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert not final.exists()  # the kill landed between the two renames
    assert sorted(n.split("-")[0] for n in others(final)) == [".head.old", ".head.tmp"]
    assert load_head(final).fc.weight.dtype.is_floating_point  # the reader restores it
    assert snapshot(final) == before and others(final) == []
    assert json.loads((final / "config.json").read_text())["torch_dtype"] == "float32"
    validate_head(final)


def test_failed_write_leaves_the_old_head_and_no_temp(tmp_path):
    """An error while the new head is written (an extra file in a missing subdirectory): the old
    head is untouched and no temporary sibling is left."""
    from peagle_core.contract import export_head

    from .conftest import make_drafter

    final = export_head(make_drafter(), tmp_path / "head", dtype="float32")
    before = snapshot(final)
    with pytest.raises(FileNotFoundError):
        export_head(make_drafter(), final, dtype="bfloat16", overwrite=True,
                    extra_files={"no/such/dir.txt": "x"})
    assert snapshot(final) == before and others(final) == []


def test_failed_file_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "f.json"
    atomic_write_text(path, "old")
    with pytest.raises(TypeError):
        atomic_write_bytes(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_text() == "old" and others(path) == []
    atomic_write_text(path, "new")
    assert path.read_text() == "new" and others(path) == []


def test_a_writer_that_fails_halfway_leaves_the_old_file_and_no_temp(tmp_path):
    """``atomic_write_via`` (shards: safetensors writes the file itself): a writer that dies after writing part of
    the temp file leaves the old file and nothing else; one that finishes replaces it."""
    path = tmp_path / "shard-00000.safetensors"
    atomic_write_text(path, "old")

    def half(tmp: Path) -> None:
        tmp.write_bytes(b"partial shard")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_via(path, half)
    assert path.read_text() == "old" and others(path) == []
    atomic_write_via(path, lambda tmp: tmp.write_text("new"))
    assert path.read_text() == "new" and others(path) == []


def test_fsync_tree_skips_fifos_and_symlinks(tmp_path):
    """fsync_tree does not open a FIFO (that would block forever) or follow a symlink; run in a
    child with a timeout so that a regression fails instead of hanging."""
    tmp = tmp_path / "t"
    write_tree(tmp, {"a": b"1"})
    os.mkfifo(tmp / "pipe")
    (tmp_path / "outside.txt").write_bytes(b"x")
    (tmp / "link").symlink_to(tmp_path / "outside.txt")
    code = f"from peagle_core.atomic import fsync_tree\nprint(fsync_tree({str(tmp)!r}))"
    r = run_child(code, kill_at=0, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["2"], r.stderr  # the file "a" and the directory


# ---------------------------------------------------------------------------------------- secrets

# the child stats every entry of the token's directory at each of its own audit events: a file
# that exists with another mode, for however short a time, is recorded
MODE_WATCH_CHILD = """
import json
from pathlib import Path
d = Path(sys.argv[1])
modes, _busy = [], [False]
def _watch(event, args):
    if _busy[0] or not event.startswith(("open", "os.")):
        return
    _busy[0] = True  # listing the directory raises audit events of its own
    try:
        for name in os.listdir(d):
            try:
                modes.append(oct(os.lstat(d / name).st_mode & 0o777))
            except FileNotFoundError:
                pass
    finally:
        _busy[0] = False
{create}
sys.addaudithook(_watch)
create(d / "auth_token")
sys.audit("os.done")
print(json.dumps(modes))
"""
CREATE_WITH_LOCAL_RAY = """
from pipelines.local_ray import ensure_token as create
"""
CREATE_THE_OLD_WAY = """
def create(path):  # what pipelines/local_ray.py did before: write, then chmod
    path.write_text("secret")
    path.chmod(0o600)
"""


def observed_modes(tmp_path: Path, create: str, umask: int) -> tuple[list[str], Path]:
    d = tmp_path / f"ray-{umask:o}"
    d.mkdir()
    r = run_child(MODE_WATCH_CHILD.replace("{create}", create), str(d), kill_at=0, umask=umask)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), d / "auth_token"


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_ray_token_is_0600_from_its_creation(tmp_path, umask):
    modes, token = observed_modes(tmp_path, CREATE_WITH_LOCAL_RAY, umask)
    print(f"RESULT token umask {umask:o}: {len(modes)} observations, modes {sorted(set(modes))}")
    assert len(modes) >= 3, modes  # the token (or its temp sibling) was seen while being written
    assert set(modes) == {"0o600"}, modes
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64
    first = token.read_text()
    from pipelines.local_ray import ensure_token

    ensure_token(token)  # an existing token is kept
    assert token.read_text() == first and others(token) == []


def test_mode_watch_sees_the_old_write_then_chmod_window(tmp_path):
    """The check above can fail: the old write-then-chmod shows a world-readable token."""
    modes, _ = observed_modes(tmp_path, CREATE_THE_OLD_WAY, 0o022)
    assert "0o644" in modes, modes


def test_killed_token_write_leaves_no_token(tmp_path):
    """SIGKILL at each step of creating the token: afterwards there is no token or the whole one
    (64 hex characters, mode 0600); the next start creates or keeps it."""
    from pipelines.local_ray import ensure_token

    body = """
from pathlib import Path
from pipelines.local_ray import ensure_token
sys.addaudithook(_hook)
ensure_token(Path(sys.argv[1]))
"""
    for k in range(1, 50):
        token = tmp_path / f"k{k}" / "auth_token"
        token.parent.mkdir()
        r = run_child(body, str(token), kill_at=k,
                      watch='"open", "os.chmod", "os.link", "os.remove", "os.rename"')
        if token.exists():
            assert len(token.read_text()) == 64 and stat.S_IMODE(token.stat().st_mode) == 0o600
        ensure_token(token)
        assert len(token.read_text()) == 64
        if r.returncode == 0:
            break
        assert r.returncode == -signal.SIGKILL, r.stderr
    else:
        pytest.fail("ensure_token never finished")
    print(f"RESULT token: {k - 1} kill points, each left no token or the whole 0600 one")
    assert k >= 3, k
