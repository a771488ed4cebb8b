"""Run FlashInfer on the offline GPU host: its JIT headers there, its compiled modules back.

The GPU bundle (../shared/gpu/stage.sh) ships flashinfer-python without the CUDA headers its
kernels compile against (`flashinfer/data/{cccl,cutlass,spdlog}`, about 60 MiB), so FlashInfer
cannot JIT-compile there. The host has nvcc and ninja; it lacks only those headers. `pack`
puts them into one xz archive of about 4 MiB; `install` unpacks them into the host's
flashinfer, and with them any modules compiled by an earlier call:

    python -m specpatch.gpu_host.flashinfer_stage pack .flashinfer  # here, once per version
    # every device call, carrying ".flashinfer" (after `source .gpu-bundle/env.sh`):
    PYTHONPATH=tools python3 -m specpatch.gpu_host.flashinfer_stage install .flashinfer
    ... run sglang with --attention-backend flashinfer (first use compiles, minutes) ...
    PYTHONPATH=tools python3 -m specpatch.gpu_host.flashinfer_stage collect "$OUT"
    # here: copy $OUT's flashinfer-aot.tar.gz into .flashinfer/ for the next calls

Compiled modules travel as FlashInfer's own AOT layout (`data/aot/<name>/<name>.so`), which it
loads before considering a JIT build, so a carried module is never rebuilt.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

HEADER_DIRS = ("cccl", "cutlass", "spdlog")
HEADERS = "jit-headers.tar.xz"
MODULES = "flashinfer-aot.tar.gz"
MANIFEST = "manifest.json"
# One file that comes back from a device call is at most 16 MiB.
MAX_RETURNED_BYTES = 16 << 20


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _wheel_version(wheel: Path) -> str:
    # flashinfer_python-0.6.11.post1-py3-none-any.whl
    return wheel.name.split("-")[1]


def pack(wheel: Path, out_dir: Path) -> dict:
    """Write out_dir/jit-headers.tar.xz (the header trees the bundle drops) and the manifest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    archive = out_dir / HEADERS
    prefixes = tuple(f"flashinfer/data/{d}/" for d in HEADER_DIRS)
    with zipfile.ZipFile(wheel) as zf, tarfile.open(archive, "w:xz", preset=9) as tar:
        for info in sorted(zf.infolist(), key=lambda i: i.filename):
            if info.is_dir() or not info.filename.startswith(prefixes):
                continue
            member = tarfile.TarInfo(info.filename[len("flashinfer/data/") :])
            member.size = info.file_size
            member.mtime = 0
            member.mode = 0o644
            tar.addfile(member, io.BytesIO(zf.read(info)))
    manifest = {
        "flashinfer_version": _wheel_version(wheel),
        "headers": HEADERS,
        "headers_sha256": _sha256(archive),
        "headers_bytes": archive.stat().st_size,
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _flashinfer_package() -> tuple[Path, str]:
    import flashinfer

    return Path(flashinfer.__file__).parent, flashinfer.__version__


def install(store: Path, package: Path, version: str) -> list[str]:
    """Unpack the headers (checked against the manifest) and any carried modules into the
    flashinfer package at `package` (of `version`); return the names of the modules installed.
    """
    manifest = json.loads((store / MANIFEST).read_text())
    if version != manifest["flashinfer_version"]:
        raise SystemExit(
            f"flashinfer_stage: headers are for flashinfer {manifest['flashinfer_version']}, "
            f"this host imports {version}"
        )
    if _sha256(store / HEADERS) != manifest["headers_sha256"]:
        raise SystemExit(
            f"flashinfer_stage: {store / HEADERS} does not match its manifest"
        )
    with tarfile.open(store / HEADERS) as tar:
        tar.extractall(package / "data", filter="data")
    installed = []
    if (store / MODULES).is_file():
        with tarfile.open(store / MODULES) as tar:
            installed = sorted({Path(n).parts[0] for n in tar.getnames()})
            tar.extractall(package / "data" / "aot", filter="data")
    return installed


def collect(out_dir: Path, module_roots: list[Path]) -> list[str]:
    """Pack every module under module_roots (FlashInfer's JIT cache, then its AOT folder: what
    this host compiled and what was carried in), laid out `<name>/<name>.so`, as AOT modules
    into out_dir/flashinfer-aot.tar.gz; return their names."""
    modules = {}
    for root in module_roots:
        for so in sorted(Path(root).glob("*/*.so")):
            if so.stem == so.parent.name:
                modules.setdefault(so.stem, so)
    out_dir.mkdir(parents=True, exist_ok=True)
    archive = out_dir / MODULES
    with tarfile.open(archive, "w:gz", compresslevel=9) as tar:
        for name, so in sorted(modules.items()):
            tar.add(so, arcname=f"{name}/{name}.so")
    if archive.stat().st_size > MAX_RETURNED_BYTES:
        raise SystemExit(
            f"flashinfer_stage: {archive} is {archive.stat().st_size >> 20} MiB, "
            "more than one device call returns"
        )
    return sorted(modules)


def fetch_wheel(cache: Path) -> Path:
    """The flashinfer-python wheel of the version installed here (the bundle ships the same
    version: constraints.txt and stage.sh pin it), downloaded once into `cache`."""
    from importlib.metadata import version

    pinned = version("flashinfer-python")
    found = sorted(cache.glob(f"flashinfer_python-{pinned}-*.whl"))
    if not found:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--dest",
                str(cache),
                f"flashinfer-python=={pinned}",
            ],
            check=True,
        )
        found = sorted(cache.glob(f"flashinfer_python-{pinned}-*.whl"))
    if not found:
        raise SystemExit(
            f"flashinfer_stage: no flashinfer_python {pinned} wheel in {cache}"
        )
    return found[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specpatch.gpu_host.flashinfer_stage",
        description=__doc__.split("\n")[0],
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser(
        "pack", help="here: the JIT headers the bundle drops, as one archive"
    )
    p.add_argument("out_dir", type=Path)
    p.add_argument(
        "--wheel",
        type=Path,
        help="an untrimmed flashinfer-python wheel "
        "(default: download the version installed here)",
    )
    i = sub.add_parser(
        "install", help="on the GPU host: headers and carried modules into flashinfer"
    )
    i.add_argument("store", type=Path)
    c = sub.add_parser(
        "collect", help="on the GPU host: compiled modules into OUT/" + MODULES
    )
    c.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)

    if args.cmd == "pack":
        wheel = args.wheel or fetch_wheel(Path.home() / ".cache" / "flashinfer-stage")
        print(json.dumps(pack(wheel, args.out_dir)))
    elif args.cmd == "install":
        print(
            "flashinfer_stage: headers installed; modules:",
            install(args.store, *_flashinfer_package()) or "none",
        )
    else:
        from flashinfer.jit import env as jit_env

        roots = [jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_AOT_DIR]
        print("flashinfer_stage: collected", collect(args.out_dir, roots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
