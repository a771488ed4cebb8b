"""A compiler's cache carried from one device call to the next (triton_cache, jit_cache).

Both caches keep one folder per compiled thing. `write_archive` packs the files that travel
into one tar.xz under $OUT, refused over what a call brings back; `install_folders` unpacks a
carried archive beside the cache and moves each folder in whole, so a damaged archive leaves
the cache as it was and a folder this host already made keeps its own; `main` is the command
line both modules expose (`collect OUT_DIR`, `install ARCHIVE`).
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, Union

from specpatch.gpu_host import MAX_RETURNED_BYTES


@dataclass(frozen=True)
class Packed:
    # cache folders packed: what a later call need not compile
    entries: int
    files: int
    archive_bytes: int


# An archive member: its name, and the file it copies or its contents.
Member = tuple[str, Union[Path, bytes]]


def write_archive(
    archive: Path, members: Sequence[Member], max_bytes: int, what: str
) -> int:
    """Write `members` to `archive` (tar.xz); returns its size. Raises ValueError, writing
    nothing, when the archive would exceed max_bytes (`what` names the contents)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
        for name, source in members:
            if isinstance(source, bytes):
                info = tarfile.TarInfo(name)
                info.size = len(source)
                tar.addfile(info, io.BytesIO(source))
            else:
                tar.add(source, arcname=name, recursive=False)
    size = buffer.tell()
    if size > max_bytes:
        raise ValueError(
            f"{what} pack to {size / 2**20:.1f} MiB, over the "
            f"{max_bytes / 2**20:.1f} MiB limit: not written"
        )
    archive.parent.mkdir(parents=True, exist_ok=True)
    archive.write_bytes(buffer.getvalue())
    return size


def install_folders(
    archive: Path, cache: Path, prepare: Callable[[Path, Path], bool]
) -> int:
    """Move each folder of a collected archive into `cache` where the cache lacks it; returns
    how many were added. prepare(unpacked folder, its final path) readies a folder for its
    place and says whether it is whole; one that is not stays out."""
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".install-", dir=cache))
    try:
        with tarfile.open(archive, mode="r:xz") as tar:
            # "data": no member may leave the folder or be a link, device or set-uid file.
            tar.extractall(staging, filter="data")
        added = 0
        for folder in sorted(p for p in staging.iterdir() if p.is_dir()):
            final = cache / folder.name
            if final.exists() or not prepare(folder, final):
                continue
            folder.rename(final)
            added += 1
        return added
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(
    argv: list[str] | None,
    *,
    prog: str,
    doc: str,
    archive_name: str,
    variable: str,
    noun: str,
    cache_dir: Callable[[], Path],
    pack: Callable[[Path, Path, int], Packed],
    install: Callable[[Path, Path], int],
) -> int:
    """The command line of a carried cache: `collect OUT_DIR` packs the cache into
    OUT_DIR/archive_name, `install ARCHIVE` (or a folder holding it) unpacks one into it. A
    failure is a line on stderr and status 1: the call goes on, compiling what the archive
    would have brought."""
    parser = argparse.ArgumentParser(
        prog=f"python -m specpatch.gpu_host.{prog}", description=doc.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help=f"pack {variable} into OUT_DIR/{archive_name}")
    c.add_argument("out_dir", type=Path)
    c.add_argument("--max-mib", type=float, default=MAX_RETURNED_BYTES / 2**20)
    i = sub.add_parser("install", help=f"unpack a collected archive into {variable}")
    i.add_argument(
        "archive", type=Path, help=f"the archive, or a folder holding {archive_name}"
    )
    args = parser.parse_args(argv)

    cache = cache_dir()
    if args.command == "collect":
        target = args.out_dir / archive_name
        try:
            packed = pack(cache, target, int(args.max_mib * 2**20))
        except ValueError as e:
            print(f"{prog}: {e}", file=sys.stderr)
            return 1
        print(
            f"{prog}: {packed.entries} {noun} from {cache}, "
            f"{packed.archive_bytes / 2**20:.1f} MiB in {target}"
        )
        return 0
    archive = args.archive / archive_name if args.archive.is_dir() else args.archive
    try:
        added = install(archive, cache)
    except (tarfile.TarError, EOFError, OSError) as e:
        print(f"{prog}: nothing added, {e!r}", file=sys.stderr)
        return 1
    print(f"{prog}: {added} {noun} added to {cache}")
    return 0
