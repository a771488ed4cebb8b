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

A carried module is loaded without a build where ninja finds it up to date: ninja's logs keep
the commands and header dependencies it compares, and `install` gives every file back its
modification time to the nanosecond (each folder travels with a list of them, MTIMES: tar's
own times are rounded, and ninja rebuilds an object whose time moved past the one its
dependency log recorded). The headers a module compiles against are sglang's `jit_kernel`
tree and tvm-ffi's `include`, which the bundle installs afresh at every call (pip gives them
the time of the install), newer than every carried object: ninja rebuilt each module anyway,
about ten seconds of nvcc apiece inside the first engine's first graph capture. So `install`
runs once the bundle is installed, and sets those trees' files to one old time (PINNED_NS);
each folder also travels with a digest of the trees' contents (INPUTS), and a module whose
digest is not the host's stays out and builds as before, since pinned times no longer tell
ninja that a header changed. The folder's hash covers the sources' absolute paths and the GPU
architecture's flag, so a host that unpacks the bundle elsewhere, or another architecture,
only misses and builds as before.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from specpatch.gpu_host import MAX_RETURNED_BYTES, cache_archive
from specpatch.gpu_host.cache_archive import Packed

ARCHIVE = "tvm-ffi-cache.tar.xz"
# tvm-ffi's build lock: recreated by the next build, meaningless on another host.
LOCK = "lock"
# Travels in each module folder: every file's modification time in nanoseconds, by name.
MTIMES = "specpatch-mtimes.json"
# Travels in each module folder: the digest of the header trees it was built against.
INPUTS = "specpatch-inputs.txt"
# The time `install` gives the header trees' files (1980-01-01, the zip epoch): older than
# any module built since.
PINNED_NS = 315_532_800 * 10**9


def include_roots() -> list[Path]:
    """The header trees sglang's JIT modules compile against, in the site this process
    imports from: sglang's `jit_kernel` (its csrc and include) and tvm-ffi's `include`.
    Found without importing either (importing sglang takes seconds)."""
    roots = []
    for package, sub in (("sglang", "jit_kernel"), ("tvm_ffi", "include")):
        spec = importlib.util.find_spec(package)
        for location in (spec and spec.submodule_search_locations) or []:
            if (Path(location) / sub).is_dir():
                roots.append(Path(location) / sub)
                break
    return roots


def _tree_files(roots: Sequence[Path]) -> list[tuple[int, Path]]:
    return [
        (i, path)
        for i, root in enumerate(roots)
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    ]


def inputs_digest(roots: Sequence[Path]) -> str:
    """sha256 over every file of the trees: its tree's place, its path there, its bytes."""
    digest = hashlib.sha256()
    for i, path in _tree_files(roots):
        name = f"{i}/{path.relative_to(roots[i]).as_posix()}".encode()
        data = path.read_bytes()
        digest.update(b"%d:%s%d:" % (len(name), name, len(data)))
        digest.update(data)
    return digest.hexdigest()


def pin_mtimes(roots: Sequence[Path]) -> int:
    """Give every file of the trees PINNED_NS; returns how many."""
    files = _tree_files(roots)
    for _, path in files:
        os.utime(path, ns=(PINNED_NS, PINNED_NS))
    return len(files)


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


def pack(
    cache: Path,
    archive: Path,
    max_bytes: int = MAX_RETURNED_BYTES,
    roots: Optional[Sequence[Path]] = None,
) -> Packed:
    """Write the cache's built modules, each with its MTIMES and INPUTS (the digest of
    `roots`, by default include_roots()), to `archive` (tar.xz). Raises ValueError, writing
    nothing, when the archive would exceed max_bytes."""
    modules = _built_modules(cache) if cache.is_dir() else []
    if roots is None:
        roots = include_roots()
        if modules and len(roots) < 2:
            # Packed with another digest than the host's, every module would stay out.
            raise ValueError(
                "sglang's jit_kernel and tvm-ffi's include are not importable here "
                "(collect with the bundle's PYTHONPATH): not written"
            )
    digest = inputs_digest(roots).encode()
    members = []
    for folder, files in modules:
        members += [(f"{folder.name}/{f.name}", f) for f in files]
        mtimes = {f.name: f.stat().st_mtime_ns for f in files}
        members.append((f"{folder.name}/{MTIMES}", json.dumps(mtimes).encode()))
        members.append((f"{folder.name}/{INPUTS}", digest))
    size = cache_archive.write_archive(
        archive, members, max_bytes, f"{len(modules)} tvm-ffi modules"
    )
    return Packed(len(modules), sum(len(files) for _, files in modules), size)


def _restore_mtimes(folder: Path) -> bool:
    """Give the unpacked module's files their times back from its MTIMES (which goes)."""
    listing = folder / MTIMES
    if not listing.is_file():
        return False
    for name, ns in json.loads(listing.read_text()).items():
        if (folder / name).is_file():
            os.utime(folder / name, ns=(ns, ns))
    listing.unlink()
    return True


def install(archive: Path, cache: Path, roots: Optional[Sequence[Path]] = None) -> int:
    """Add a collected archive's modules built against these header trees (`roots`, by
    default include_roots()) to `cache`, then pin the trees' times; returns how many modules
    were added.

    The archive is unpacked beside the cache first and each module folder then moved in
    whole, so a damaged archive leaves the cache as it was (install raises) and a module this
    host already built keeps its own folder."""
    roots = include_roots() if roots is None else roots
    digest = inputs_digest(roots)

    def prepare(folder: Path, final: Path) -> bool:
        inputs = folder / INPUTS
        if not inputs.is_file() or inputs.read_text() != digest:
            return False
        inputs.unlink()
        return _restore_mtimes(folder)

    added = cache_archive.install_folders(archive, cache, prepare)
    pin_mtimes(roots)
    return added


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
