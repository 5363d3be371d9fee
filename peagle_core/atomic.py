"""Writes that survive crashes: a file or directory replacing an older one goes through a temporary
sibling that is fsynced, then renamed; secrets are 0600 from their first byte.

Guarantee (a process killed at any instruction; for power loss, as far as the file system honours
``fsync``): the name ``final`` holds the complete old version or the complete new one, or it is
missing and the complete old version lies in a sibling ``.<name>.old-<pid>`` that
:func:`recover_dir` renames back. :func:`replace_dir` calls :func:`recover_dir` itself, and so do
the readers of replaced directories (``peagle_core.contract.validate_head`` / ``load_head``, the
target cache of ``pipelines.assets``, the head cache of ``pipelines.serve.heads``, the checkpoint
root of ``pipelines.train.local`` before a resume). A killed writer also leaves its temporary sibling
``.<name>.tmp-<pid>-*``; :func:`recover_dir` deletes it once that process is gone.

Why two renames for a directory: ``rename(2)`` replaces a file atomically, but a directory only
onto a missing or *empty* one; onto a non-empty directory Linux fails with ``ENOTEMPTY``/``EEXIST``
(``man 2 rename``). So :func:`replace_dir` first moves ``final`` aside, then renames the new tree
into place; the window between the two is what the ``.old-<pid>`` sibling covers. The ``<pid>``
says whose it is: a sibling whose process still runs (on this host) is left to that writer.

Not thread-safe per name: two threads of one process must not replace the same ``final`` at once
(callers that may do so hold a lock, e.g. the Serve head cache's ``flock``).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "atomic_write_bytes", "atomic_write_text", "atomic_write_via", "fsync_dir", "fsync_tree", "recover_dir",
    "recover_dirs_in", "replace_dir", "replace_file", "temp_dir_for", "temp_sibling",
]

_SIBLING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>old|tmp)-(?P<pid>\d+)(?:-.*)?$")


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory ``path`` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)  # Linux flushes the inode's dirty pages whichever fd asks
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> int:
    """fsync every regular file under ``root``, then every directory bottom-up (``root`` last).

    Symlinks, FIFOs and sockets are not opened (opening a FIFO would block).

    Returns:
        The number of files and directories fsynced.
    """
    count = 0
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                _fsync_file(p)
                count += 1
        fsync_dir(dirpath)
        count += 1
    return count


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (this process counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _siblings(final: Path) -> list[tuple[str, int, Path]]:
    """``(kind, pid, path)`` of the ``.old-<pid>`` / ``.tmp-<pid>-*`` siblings of ``final``."""
    out = []
    try:
        entries = list(os.scandir(final.parent))
    except OSError:  # no parent, or not readable: nothing to recover here
        return out
    for e in entries:
        m = _SIBLING.match(e.name)
        if m and m["name"] == final.name:
            out.append((m["kind"], int(m["pid"]), Path(e.path)))
    return out


def temp_dir_for(final: str | os.PathLike) -> Path:
    """A new empty temporary sibling of ``final`` (``.<name>.tmp-<pid>-XXXX``, same file system, so
    :func:`replace_dir` can rename it); the parent is created if needed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))


def recover_dir(final: str | os.PathLike) -> bool:
    """Finish what a killed :func:`replace_dir` left: when ``final`` is missing, rename its
    ``.old-<pid>`` sibling back; then delete the ``.old``/``.tmp`` siblings of dead processes.

    Siblings of processes still running, this one included, are left alone (they may be
    mid-replace; :func:`replace_dir` handles this process's own). Cheap when there
    is nothing to do (one ``scandir`` of the parent).

    Returns:
        True when ``final`` was restored from an ``.old`` sibling.
    """
    final = Path(final)
    dead = [(kind, path) for kind, pid, path in _siblings(final) if not _pid_alive(pid)]
    restored = False
    if not os.path.lexists(final):
        olds = sorted((p for kind, p in dead if kind == "old"), key=lambda p: p.stat().st_mtime_ns)
        if olds:
            try:
                os.rename(olds[-1], final)
            except OSError:
                if not os.path.lexists(final):  # else another reader restored it first
                    raise
            else:
                fsync_dir(final.parent)
                restored = True
    for _kind, path in dead:  # best effort: garbage, a read-only parent keeps it
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
    return restored


def recover_dirs_in(parent: str | os.PathLike) -> list[Path]:
    """:func:`recover_dir` for every name in ``parent`` that has an ``.old``/``.tmp`` sibling (e.g.
    a checkpoint root before picking the latest checkpoint).

    Returns:
        The directories restored from an ``.old`` sibling.
    """
    parent = Path(parent)
    try:
        names = {m["name"] for e in os.scandir(parent) if (m := _SIBLING.match(e.name))}
    except OSError:
        return []
    return [parent / name for name in sorted(names) if recover_dir(parent / name)]


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Move the complete directory ``tmp`` to ``final``, replacing what is there, crash-safely.

    Steps: fsync every file and directory in ``tmp``; :func:`recover_dir` (a leftover of an earlier
    crash); rename an existing ``final`` to ``.<name>.old-<pid>``; rename ``tmp`` to ``final``;
    fsync the parent; delete the old tree. Two renames because Linux cannot rename a directory
    onto a non-empty one (module docstring). ``tmp`` must be on the same file system as ``final``
    (use :func:`temp_dir_for`).

    Returns:
        ``final`` as a Path.

    Raises:
        OSError: a rename failed; ``final`` then holds the old tree again, or, when another process
            put a complete ``final`` in place meanwhile (``ENOTEMPTY``), that one. ``tmp`` is left
            for the caller to delete.
    """
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    recover_dir(final)
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if os.path.lexists(old):  # this process's own leftover (an earlier call that failed half-way)
        if os.path.lexists(final):
            shutil.rmtree(old)
        else:
            os.rename(old, final)
    moved = False
    if os.path.lexists(final):
        os.rename(final, old)
        moved = True
    try:
        os.rename(tmp, final)
    except OSError:
        if moved:
            if os.path.lexists(final):  # another writer won the race: its tree supersedes ours
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(old, final)
        raise
    fsync_dir(final.parent)
    if moved:
        shutil.rmtree(old, ignore_errors=True)
    return final


def replace_file(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """fsync the complete file ``tmp``, rename it over ``final`` (atomic for a file), fsync the parent.

    Returns:
        ``final`` as a Path.
    """
    _fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(Path(final).parent)
    return Path(final)


def temp_sibling(path: Path) -> Path:
    """The temporary sibling a file is written to before it is renamed over ``path``: hidden, unique to this
    process, ending in ``.tmp`` (the capture's cleanup of killed shard writes globs ``.shard-*.tmp``)."""
    return path.parent / f".{path.name}.{os.getpid()}-{os.urandom(8).hex()}.tmp"


def atomic_write_via(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """As :func:`atomic_write_bytes` for a writer that takes a file name (e.g. ``safetensors.torch.save_file``,
    which writes a large file without first building it in memory): ``write(tmp)`` fills the temporary sibling,
    then it is fsynced and renamed over ``path``; on any error no temp file remains.

    Returns:
        ``path`` as a Path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        write(tmp)
        return replace_file(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, mode: int | None = None,
                       exclusive: bool = False) -> Path:
    """Write ``data`` to ``path`` through a temporary sibling: readers see the old file or the whole
    new one, never a part, and on any error the old file is left intact and no temp file remains.

    Args:
        mode: permission bits set with ``fchmod`` before the first byte is written (umask-proof;
            ``0o600`` for secrets). None: ``0o666`` less the umask, as ``open()`` would.
        exclusive: publish with ``link(2)`` instead of ``rename(2)``: an existing ``path`` is never
            replaced (for a secret created once).

    Returns:
        ``path`` as a Path.

    Raises:
        FileExistsError: ``exclusive`` and ``path`` exists.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o666 if mode is None else mode & 0o600)  # never more open than asked, even for a moment
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            os.link(tmp, path)  # fails on an existing path, unlike rename
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str, *, mode: int | None = None,
                      exclusive: bool = False, encoding: str = "utf-8") -> Path:
    """:func:`atomic_write_bytes` of ``text`` encoded with ``encoding``."""
    return atomic_write_bytes(path, text.encode(encoding), mode=mode, exclusive=exclusive)
