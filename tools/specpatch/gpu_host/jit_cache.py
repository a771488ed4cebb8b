"""Carry sglang's JIT-compiled CUDA modules (tvm-ffi) from one device call to the next.

sglang 0.5.12 builds several of its CUDA kernels with nvcc on first use, through tvm-ffi
(`sglang.jit_kernel`: the MLP's activation, the KV-cache store, the overlap scheduler's
future-token lookup, among others), each into a folder of TVM_FFI_CACHE_DIR named by the
module and a hash of its sources and flags: build.ninja, the generated sources, the object
files, the module (`<name>.so`) and ninja's logs. Every device call starts on a bare host, so
its first engine waits for each of those builds (Triton's kernels are carried by
triton_cache). `collect` packs every folder whose module was built into one archive under
$OUT; `install` unpacks a carried archive into the host's cache before any engine starts:

    # on the GPU host: tools/gpu-env.sh sets TVM_FFI_CACHE_DIR and installs .jit-cache/ if
    # carried; gpu-tests.sh and gpu-lanes.sh collect into their output folder
    PYTHONPATH=tools python3 -m specpatch.gpu_host.jit_cache collect "$OUT"
    # here: copy tvm-ffi-cache.tar.xz into .jit-cache/ and carry ".jit-cache"

A carried module is loaded without a build because ninja finds it up to date: ninja's logs
keep the commands and header dependencies it compares, and `install` gives every file back
its modification time to the nanosecond (each folder travels with a list of them, MTIMES:
tar's own times are rounded, and ninja rebuilds an object whose time moved past the one its
dependency log recorded), so the objects also stay newer than the sources the bundle
unpacks, which keep their wheel's times. The folder's hash covers the sources' absolute
paths and the GPU architecture's flag, so a host that unpacks the bundle elsewhere, or
another architecture, only misses and builds as before.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from specpatch.gpu_host import MAX_RETURNED_BYTES, cache_archive
from specpatch.gpu_host.cache_archive import Packed

ARCHIVE = "tvm-ffi-cache.tar.xz"
# tvm-ffi's build lock: recreated by the next build, meaningless on another host.
LOCK = "lock"
# Travels in each module folder: every file's modification time in nanoseconds, by name.
MTIMES = "specpatch-mtimes.json"


def cache_dir(environ=os.environ) -> Path:
    """Where tvm-ffi keeps built modules (its own default when TVM_FFI_CACHE_DIR is unset)."""
    if environ.get("TVM_FFI_CACHE_DIR"):
        return Path(environ["TVM_FFI_CACHE_DIR"])
    return Path(environ.get("HOME", "~")).expanduser() / ".cache" / "tvm-ffi"


def module_name(folder: Path) -> str:
    """`sgl_kernel_jit_kvcache_256_1a2b...` -> `sgl_kernel_jit_kvcache_256` (tvm-ffi names the
    folder `<module>_<source hash>`)."""
    return folder.name.rpartition("_")[0]


def _built_modules(cache: Path) -> list[tuple[Path, list[Path]]]:
    """Each module folder with a built module and its build record, with its files but the
    lock. A folder without `<module>.so` is a build that failed or is still running."""
    modules = []
    for folder in sorted(p for p in cache.iterdir() if p.is_dir()):
        built = folder / f"{module_name(folder)}.so"
        if not (built.is_file() and (folder / "build.ninja").is_file()):
            continue
        files = sorted(f for f in folder.iterdir() if f.is_file() and f.name != LOCK)
        modules.append((folder, files))
    return modules


def pack(cache: Path, archive: Path, max_bytes: int = MAX_RETURNED_BYTES) -> Packed:
    """Write the cache's built modules, each with its MTIMES, to `archive` (tar.xz). Raises
    ValueError, writing nothing, when the archive would exceed max_bytes."""
    modules = _built_modules(cache) if cache.is_dir() else []
    members = []
    for folder, files in modules:
        members += [(f"{folder.name}/{f.name}", f) for f in files]
        mtimes = {f.name: f.stat().st_mtime_ns for f in files}
        members.append((f"{folder.name}/{MTIMES}", json.dumps(mtimes).encode()))
    size = cache_archive.write_archive(
        archive, members, max_bytes, f"{len(modules)} tvm-ffi modules"
    )
    return Packed(len(modules), sum(len(files) for _, files in modules), size)


def _restore_mtimes(folder: Path, final: Path) -> bool:
    """Give the unpacked module's files their times back from its MTIMES (which goes)."""
    listing = folder / MTIMES
    if not listing.is_file():
        return False
    for name, ns in json.loads(listing.read_text()).items():
        if (folder / name).is_file():
            os.utime(folder / name, ns=(ns, ns))
    listing.unlink()
    return True


def install(archive: Path, cache: Path) -> int:
    """Add a collected archive's modules to `cache`; returns how many were added.

    The archive is unpacked beside the cache first and each module folder then moved in
    whole, so a damaged archive leaves the cache as it was (install raises) and a module this
    host already built keeps its own folder."""
    return cache_archive.install_folders(archive, cache, _restore_mtimes)


def main(argv: list[str] | None = None) -> int:
    return cache_archive.main(
        argv,
        prog="jit_cache",
        doc=__doc__,
        archive_name=ARCHIVE,
        variable="TVM_FFI_CACHE_DIR",
        noun="tvm-ffi modules",
        cache_dir=cache_dir,
        pack=pack,
        install=install,
    )


if __name__ == "__main__":
    sys.exit(main())
