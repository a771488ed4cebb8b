"""Carry Triton's compiled kernels from one device call to the next.

Every device call starts on a bare host, so the first sglang engine of a call compiles each
Triton kernel it launches (sglang's attention kernels, ours, the eager index kernels) before
its CUDA graphs are captured, and later engines of the same call, which find them in
Triton's cache, start far sooner (README, "GPU tier").
Triton keeps one folder per kernel key in TRITON_CACHE_DIR: the binary, its metadata, the IR
of each stage, and a group file (`__grp__<name>.json`) naming them. `collect` packs the
binaries, metadata and group files (the IR is only read for debugging) into one archive under
$OUT; `install` unpacks a carried archive into the host's cache before any engine starts, so
a kernel an earlier call compiled is a cache hit:

    # on the GPU host: tools/gpu-env.sh sets TRITON_CACHE_DIR and installs .triton-cache/ if
    # carried; tools/gpu-tests.sh and tools/gpu-lanes.sh collect into their output folder
    PYTHONPATH=tools python3 -m specpatch.gpu_host.triton_cache collect "$OUT"
    # here: copy triton-cache.tar.xz into .triton-cache/ and carry ".triton-cache"

The key covers the kernel's source, its options, the GPU architecture and the compiler's
versions, so an H100's entries serve an H200 (both sm_90) and a host with another toolkit
only misses. Group files name their members by absolute path; `install` rewrites them to
where the members are now, so the archive does not depend on where either cache lived.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specpatch.gpu_host import MAX_RETURNED_BYTES

ARCHIVE = "triton-cache.tar.xz"
GROUP_PREFIX = "__grp__"
# What a cache hit reads: the metadata (.json, group files included) and the binary (.cubin).
KEPT_SUFFIXES = (".json", ".cubin")


def cache_dir(environ=os.environ) -> Path:
    """Where Triton keeps compiled kernels (its own default when TRITON_CACHE_DIR is unset)."""
    if environ.get("TRITON_CACHE_DIR"):
        return Path(environ["TRITON_CACHE_DIR"])
    return Path(environ.get("HOME", "~")).expanduser() / ".triton" / "cache"


@dataclass(frozen=True)
class Packed:
    # cache folders with a group file: kernels a later call need not compile
    kernels: int
    files: int
    archive_bytes: int


def _complete_entries(cache: Path) -> list[tuple[Path, list[Path]]]:
    """Each cache folder that has a group file, with the files worth carrying. A folder
    without one is a compile still in progress (or an autotuner's record) and is skipped, as
    are Triton's temporary files."""
    entries = []
    for folder in sorted(p for p in cache.iterdir() if p.is_dir()):
        files = sorted(
            f
            for f in folder.iterdir()
            if f.is_file() and f.suffix in KEPT_SUFFIXES and ".tmp." not in f.name
        )
        if any(f.name.startswith(GROUP_PREFIX) for f in files):
            entries.append((folder, files))
    return entries


def pack(cache: Path, archive: Path, max_bytes: int = MAX_RETURNED_BYTES) -> Packed:
    """Write the cache's complete entries, without their IR, to `archive` (tar.xz). Raises
    ValueError, writing nothing, when the archive would exceed max_bytes."""
    entries = _complete_entries(cache) if cache.is_dir() else []
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
        for folder, files in entries:
            for f in files:
                tar.add(f, arcname=f"{folder.name}/{f.name}", recursive=False)
    size = buffer.tell()
    if size > max_bytes:
        raise ValueError(
            f"{len(entries)} Triton kernels pack to {size / 2**20:.1f} MiB, over the "
            f"{max_bytes / 2**20:.1f} MiB limit: not written"
        )
    archive.parent.mkdir(parents=True, exist_ok=True)
    archive.write_bytes(buffer.getvalue())
    return Packed(len(entries), sum(len(f) for _, f in entries), size)


def _relinked_group(group: Path, final: Path) -> Optional[dict]:
    """The group file's contents with its members at `final`, keeping those the archive
    brought (the IR stays home), or None where the entry could not load: Triton treats a group
    with its metadata as a hit and then reads the binary, so an entry needs both."""
    members = [
        name
        for name in json.loads(group.read_text()).get("child_paths", {})
        if (group.parent / name).is_file()
    ]
    if not (
        any(n.endswith(".json") for n in members)
        and any(n.endswith(".cubin") for n in members)
    ):
        return None
    return {"child_paths": {name: str(final / name) for name in members}}


def install(archive: Path, cache: Path) -> int:
    """Add a collected archive's kernels to `cache`; returns how many were added.

    The archive is unpacked beside the cache first and each complete entry then moved in
    whole, so a damaged archive leaves the cache as it was (install raises) and a kernel this
    host already compiled keeps its own entry."""
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".install-", dir=cache))
    try:
        with tarfile.open(archive, mode="r:xz") as tar:
            # "data": no member may leave the folder or be a link, device or set-uid file.
            tar.extractall(staging, filter="data")
        added = 0
        for group in sorted(staging.glob(f"*/{GROUP_PREFIX}*")):
            final = cache / group.parent.name
            contents = _relinked_group(group, final)
            if contents is None or final.exists():
                continue
            group.write_text(json.dumps(contents))
            group.parent.rename(final)
            added += 1
        return added
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _archive_in(path: Path) -> Path:
    return path / ARCHIVE if path.is_dir() else path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specpatch.gpu_host.triton_cache",
        description=__doc__.split("\n")[0],
    )
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help=f"pack TRITON_CACHE_DIR into OUT_DIR/{ARCHIVE}")
    c.add_argument("out_dir", type=Path)
    c.add_argument("--max-mib", type=float, default=MAX_RETURNED_BYTES / 2**20)
    i = sub.add_parser(
        "install", help="unpack a collected archive into TRITON_CACHE_DIR"
    )
    i.add_argument(
        "archive", type=Path, help=f"the archive, or a folder holding {ARCHIVE}"
    )
    args = parser.parse_args(argv)

    cache = cache_dir()
    if args.command == "collect":
        try:
            packed = pack(cache, args.out_dir / ARCHIVE, int(args.max_mib * 2**20))
        except ValueError as e:
            print(f"triton_cache: {e}", file=sys.stderr)
            return 1
        print(
            f"triton_cache: {packed.kernels} kernels from {cache}, "
            f"{packed.archive_bytes / 2**20:.1f} MiB in {args.out_dir / ARCHIVE}"
        )
        return 0
    try:
        kernels = install(_archive_in(args.archive), cache)
    except (tarfile.TarError, EOFError, OSError) as e:
        # The call goes on: its engines compile what the archive would have brought.
        print(f"triton_cache: nothing added, {e!r}", file=sys.stderr)
        return 1
    print(f"triton_cache: {kernels} kernels added to {cache}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
