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

import json
import os
import sys
from pathlib import Path
from typing import Optional

from specpatch.gpu_host import MAX_RETURNED_BYTES, cache_archive
from specpatch.gpu_host.cache_archive import Packed

ARCHIVE = "triton-cache.tar.xz"
GROUP_PREFIX = "__grp__"
# What a cache hit reads: the metadata (.json, group files included) and the binary (.cubin).
KEPT_SUFFIXES = (".json", ".cubin")


def cache_dir(environ=os.environ) -> Path:
    """Where Triton keeps compiled kernels (its own default when TRITON_CACHE_DIR is unset)."""
    if environ.get("TRITON_CACHE_DIR"):
        return Path(environ["TRITON_CACHE_DIR"])
    return Path(environ.get("HOME", "~")).expanduser() / ".triton" / "cache"


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
    members = [
        (f"{folder.name}/{f.name}", f) for folder, files in entries for f in files
    ]
    size = cache_archive.write_archive(
        archive, members, max_bytes, f"{len(entries)} Triton kernels"
    )
    return Packed(len(entries), len(members), size)


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


def _relink(folder: Path, final: Path) -> bool:
    """Point the unpacked entry's group files at `final`; False where one could not load."""
    groups = sorted(folder.glob(f"{GROUP_PREFIX}*"))
    for group in groups:
        contents = _relinked_group(group, final)
        if contents is None:
            return False
        group.write_text(json.dumps(contents))
    return bool(groups)


def install(archive: Path, cache: Path) -> int:
    """Add a collected archive's kernels to `cache`; returns how many were added.

    The archive is unpacked beside the cache first and each complete entry then moved in
    whole, so a damaged archive leaves the cache as it was (install raises) and a kernel this
    host already compiled keeps its own entry."""
    return cache_archive.install_folders(archive, cache, _relink)


def main(argv: list[str] | None = None) -> int:
    return cache_archive.main(
        argv,
        prog="triton_cache",
        doc=__doc__,
        archive_name=ARCHIVE,
        variable="TRITON_CACHE_DIR",
        noun="kernels",
        cache_dir=cache_dir,
        pack=pack,
        install=install,
    )


if __name__ == "__main__":
    sys.exit(main())
