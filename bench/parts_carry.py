"""Regeneration parts from one lent GPU machine to the next.

A lent machine keeps nothing once it goes back, and each call carries at most 64 MiB in and returns at most 8 files
of at most 16 MiB. The regenerate stage keeps every finished engine batch as a part file in a parts directory
under its ``regenerate/`` directory (:mod:`pipelines.data.parts`, which names both kinds): the regenerated
conversations in ``parts-<key>/part-*.json`` and each self_instruct source's raw completions in
``self_instruct-parts-<key>/part-*.json``; a run of the same recipe resumes from them. So a regeneration larger than
one lease (issue 42: 780k self-instruct prompts, then 300k conversations) goes on across leases:

* ``pack``, on the machine: bundle the parts no earlier bundle holds (``--sent`` lists those as
  ``<parts dir>/<part>``, in ``~/keep``) of the parts directories given, or of every one under ``--regenerate-dir``,
  into at most ``--max-files`` tar bundles of at most ``--max-bytes`` each, every part xz-compressed on its own,
  under its parts directory's name;
* the call returns the bundles; they wait on this machine (e.g. ``.carry/regen/``, not in git);
* ``unpack``, on the next machine: write each bundle's parts back under ``--regenerate-dir`` (the run's
  ``regenerate/``; each member names its parts directory), atomically, keeping parts already there. The
  regenerate stage then generates only what no part holds.

    python -m bench.parts_carry pack --regenerate-dir ~/keep/peagle/runs/RUN/regenerate $OUT/parts --sent ~/keep/sent.txt
    python -m bench.parts_carry unpack .carry/regen/*.tar --regenerate-dir ~/keep/peagle/runs/RUN/regenerate --sent ~/keep/sent.txt

A part too large for one bundle is an error (lower ``regenerate.batch_size``).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import lzma
import tarfile
from collections.abc import Sequence
from pathlib import Path

from peagle_core.atomic import atomic_write_bytes
from pipelines.data.parts import PART_GLOB, is_parts_dir, parts_dirs

MIB = 2**20
TAR_MEMBER_OVERHEAD = 1024  # a member's header block plus the padding of its data to 512 bytes, at most
TAR_END = 1024  # the two zero blocks that end an archive


def _tar_bytes(content: int) -> int:
    """A tar's size on disk for ``content`` bytes of members and end blocks: tarfile pads it to 20 blocks."""
    return -(-content // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


def _read_sent(sent: str | Path | None) -> set[str]:
    """The ``<parts dir>/<part>`` names the ``sent`` list holds (none without the file)."""
    return set(Path(sent).read_text().split()) if sent and Path(sent).is_file() else set()


def _add_sent(sent: str | Path | None, names: list[str]) -> None:
    """Append ``names`` to the ``sent`` list (nothing without ``sent``)."""
    if sent and names:
        with open(sent, "a") as f:
            f.write("".join(n + "\n" for n in names))


def pack(parts_dir: str | Path | Sequence[str | Path], out_dir: str | Path, *, sent: str | Path | None = None,
         max_bytes: int = 16 * MIB, max_files: int = 8) -> tuple[list[Path], int]:
    """Bundle the parts of ``parts_dir`` (one parts directory or several) that ``sent`` does not list into
    ``out_dir``; ``(bundles written, parts left for another call)``. The bundled parts are appended to ``sent``.

    Raises:
        ValueError: a directory not named as a parts directory (:func:`pipelines.data.parts.is_parts_dir`: unpack
            would refuse it); one compressed part larger than ``max_bytes``.
    """
    dirs = [Path(parts_dir)] if isinstance(parts_dir, (str, Path)) else [Path(d) for d in parts_dir]
    for d in dirs:
        if not is_parts_dir(d.name):
            raise ValueError(f"{d}: not a parts directory (parts-<key> or self_instruct-parts-<key>)")
    out_dir = Path(out_dir)
    done = _read_sent(sent)
    todo = [(f"{d.name}/{p.name}", p) for d in dirs for p in sorted(d.glob(PART_GLOB))
            if f"{d.name}/{p.name}" not in done]
    bundles: list[list[tuple[str, bytes]]] = [[]]
    size = TAR_END
    left = 0
    for i, (name, p) in enumerate(todo):
        blob = lzma.compress(p.read_bytes(), preset=6)
        if _tar_bytes(TAR_END + len(blob) + TAR_MEMBER_OVERHEAD) > max_bytes:
            raise ValueError(f"{name}: {len(blob) / MIB:.1f} MiB compressed, more than a bundle's "
                             f"{max_bytes / MIB:.1f} MiB; lower regenerate.batch_size")
        if _tar_bytes(size + len(blob) + TAR_MEMBER_OVERHEAD) > max_bytes:
            if len(bundles) == max_files:
                left = len(todo) - i
                break
            bundles.append([])
            size = TAR_END
        bundles[-1].append((name, blob))
        size += len(blob) + TAR_MEMBER_OVERHEAD
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for members in (b for b in bundles if b):
        names = [n for n, _ in members]
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name, blob in members:
                info = tarfile.TarInfo(f"{name}.xz")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
        digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:12]
        written.append(atomic_write_bytes(out_dir / f"parts-bundle-{digest}.tar", buf.getvalue()))
        _add_sent(sent, names)
    return written, left


def unpack(bundles: list[str | Path], regenerate_dir: str | Path, *, sent: str | Path | None = None) -> int:
    """Write the parts of ``bundles`` under ``regenerate_dir`` (each in the parts directory its member names);
    parts already there are kept. Every part of the bundles is appended to ``sent`` (the list :func:`pack` skips)
    unless it lists it already: a machine does not send back what it was given. Returns the number of parts
    written.

    Raises:
        ValueError: a member that is not ``<parts dir>/part-*.json.xz``, its directory named as a parts directory
            (:func:`pipelines.data.parts.is_parts_dir`).
    """
    written = 0
    done = _read_sent(sent)
    given: list[str] = []
    for bundle in bundles:
        with tarfile.open(bundle) as tar:
            for info in tar.getmembers():
                directory, _, name = info.name.partition("/")
                if not (is_parts_dir(directory) and name.startswith("part-") and name.endswith(".json.xz")
                        and "/" not in name):
                    raise ValueError(f"{bundle}: member {info.name!r} is not <parts dir>/part-*.json.xz (parts dir: "
                                     "parts-<key> or self_instruct-parts-<key>)")
                target = Path(regenerate_dir) / directory / name.removesuffix(".xz")
                if (part := f"{directory}/{target.name}") not in done:
                    given.append(part)
                    done.add(part)
                if target.exists():
                    continue
                atomic_write_bytes(target, lzma.decompress(tar.extractfile(info).read()))
                written += 1
    _add_sent(sent, given)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("parts_dirs", nargs="*", help="parts directories (or --regenerate-dir)")
    p.add_argument("out_dir")
    p.add_argument("--regenerate-dir", default=None, help="the run's regenerate/ directory: every parts directory in it")
    p.add_argument("--sent", default=None, help="file listing the parts earlier bundles hold (appended to)")
    p.add_argument("--max-bytes", type=int, default=16 * MIB)
    p.add_argument("--max-files", type=int, default=8)
    p = sub.add_parser("unpack")
    p.add_argument("bundles", nargs="+")
    p.add_argument("--regenerate-dir", required=True, help="the run's regenerate/ directory")
    p.add_argument("--sent", default=None, help="file listing the parts pack skips: the bundles' parts are appended")
    args = ap.parse_args()
    if args.cmd == "pack":
        dirs = args.parts_dirs + (parts_dirs(args.regenerate_dir) if args.regenerate_dir else [])
        if not dirs:
            ap.error("pack: give parts directories or a --regenerate-dir that holds some")
        written, left = pack(dirs, args.out_dir, sent=args.sent, max_bytes=args.max_bytes, max_files=args.max_files)
        print(f"{len(written)} bundles, {sum(p.stat().st_size for p in written) / MIB:.1f} MiB; {left} parts left "
              "for another call")
    else:
        print(f"{unpack(args.bundles, args.regenerate_dir, sent=args.sent)} parts written under {args.regenerate_dir}")


if __name__ == "__main__":
    main()
