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
loads before considering a JIT build, so a carried module is never rebuilt. Where the modules
cover the run, the headers may stay home (carry `.flashinfer/manifest.json` and
`.flashinfer/flashinfer-aot.tar.gz` only): 3.4 MiB less, room for FA3's slim pack beside the
bundle in one call; a module that was not carried then cannot compile there.

`prebuild` compiles those modules here instead, with this machine's nvcc (the GPU host's
version) for sm_90a, so that no device call spends its minutes compiling:

    python -m specpatch.gpu_host.flashinfer_stage prebuild .flashinfer --head-dims 64,128

With `--head-dims ""` it builds only the modules that do not depend on the attention backend:
sglang's RMSNorm calls FlashInfer's, so even a triton engine builds FlashInfer's norm module on
a host's first start (about a minute of nvcc, inside its first CUDA-graph capture).

The CUDA toolkit here is nvcc and the runtime only: the cuBLAS and cuRAND headers that
FlashInfer's sources include come from their PyPI wheels (headers only are unpacked), and the
link gets a stub libcuda.so.1 (a module needs the driver only once loaded, on the GPU host).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from specpatch.gpu_host import MAX_RETURNED_BYTES

HEADER_DIRS = ("cccl", "cutlass", "spdlog")
HEADERS = "jit-headers.tar.xz"
MODULES = "flashinfer-aot.tar.gz"
MANIFEST = "manifest.json"


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
    A store without the headers must carry modules: they are then all this host can run.
    """
    manifest = json.loads((store / MANIFEST).read_text())
    if version != manifest["flashinfer_version"]:
        raise SystemExit(
            f"flashinfer_stage: headers are for flashinfer {manifest['flashinfer_version']}, "
            f"this host imports {version}"
        )
    if (store / HEADERS).is_file():
        if _sha256(store / HEADERS) != manifest["headers_sha256"]:
            raise SystemExit(
                f"flashinfer_stage: {store / HEADERS} does not match its manifest"
            )
        with tarfile.open(store / HEADERS) as tar:
            tar.extractall(package / "data", filter="data")
    elif not (store / MODULES).is_file():
        raise SystemExit(
            f"flashinfer_stage: {store} has neither {HEADERS} nor {MODULES}: "
            "FlashInfer could neither compile nor load a kernel"
        )
    installed = []
    if (store / MODULES).is_file():
        with tarfile.open(store / MODULES) as tar:
            installed = sorted({Path(n).parts[0] for n in tar.getnames()})
        _install_modules(store / MODULES, package / "data" / "aot")
    return installed


def _install_modules(archive: Path, aot: Path) -> None:
    """Put the archive's modules into FlashInfer's AOT folder, once per archive: every script
    of a call sources gpu-env.sh, and engines started by an earlier one have these libraries
    loaded. Extracting over a loaded library rewrites the file it mapped (the engine then
    dies with SIGSEGV); each module lands under a temporary name and is renamed over the old
    one, so a process that has it open keeps the file it opened."""
    digest = _sha256(archive)
    marker = aot / (MODULES + ".installed")
    if marker.is_file() and marker.read_text() == digest:
        return
    aot.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=aot))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        for module in sorted(p for p in staging.rglob("*") if p.is_file()):
            target = aot / module.relative_to(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(module, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    marker.write_text(digest)


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


# The GPU host's architecture (H100 / H200).
PREBUILD_ARCH = "9.0a"
# PyPI wheels whose headers FlashInfer's sources include and a bare nvcc install lacks.
HEADER_WHEELS = ("nvidia-cublas>=13,<14", "nvidia-curand>=10.4,<11")


def module_specs(head_dims: list[int]) -> list:
    """FlashInfer JitSpecs of the modules sglang's flashinfer backend loads for a bf16 MHA
    model of these head dims: per head_dim the decode and the FA2 and FA3 (Hopper) prefill
    (verify, draft extend, prefill), by FlashInfer's generator arguments (dtype_q, dtype_kv,
    dtype_o, dtype_idx, head_dim_qk, head_dim_vo, pos_encoding_mode, use_sliding_window,
    use_logits_soft_cap[, use_fp16_qk_reduction]); once, its RMSNorm, the packbits of the
    tree mask, and what `launch_server` loads besides: cascade (merge_state) and sampling.
    """
    import torch
    from flashinfer.jit.attention import (
        gen_batch_decode_module,
        gen_batch_prefill_module,
    )
    from flashinfer.jit.cascade import gen_cascade_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.quantization import gen_quantization_module
    from flashinfer.jit.sampling import gen_sampling_module

    bf16, i32 = torch.bfloat16, torch.int32
    specs = [
        gen_norm_module(),
        gen_quantization_module(),
        gen_cascade_module(),
        gen_sampling_module(),
    ]
    for d in head_dims:
        common = (bf16, bf16, bf16, i32, d, d, 0, False, False)
        specs.append(gen_batch_decode_module(*common))
        for backend in ("fa2", "fa3"):
            specs.append(gen_batch_prefill_module(backend, *common, False))
    return specs


def header_dir(cache: Path) -> Path:
    """A folder with the cuBLAS and cuRAND headers (HEADER_WHEELS), unpacked once into
    `cache`."""
    include = cache / "include"
    if include.is_dir():
        return include
    wheels = cache / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        + ["--only-binary=:all:", "--dest", str(wheels), *HEADER_WHEELS],
        check=True,
    )
    staging = cache / "include.tmp"
    staging.mkdir(parents=True, exist_ok=True)
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                parts = Path(info.filename).parts
                if len(parts) > 3 and parts[2] == "include" and not info.is_dir():
                    target = staging.joinpath(*parts[3:])
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(zf.read(info))
    staging.rename(include)
    return include


def _cudart() -> Path:
    """The CUDA runtime library to link against: the toolkit's, else the one torch's
    nvidia-cuda-runtime wheel installed."""
    roots = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    for root in filter(None, roots):
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
            found = sorted(Path(root, sub).glob("libcudart.so*"))
            if found:
                return found[0]
    try:
        import nvidia
    except ImportError:
        raise SystemExit("flashinfer_stage: prebuild found no libcudart.so") from None
    for package in nvidia.__path__:
        found = sorted(Path(package).glob("*/lib/libcudart.so*"))
        if found:
            return found[0]
    raise SystemExit("flashinfer_stage: prebuild found no libcudart.so")


def prebuild(out_dir: Path, head_dims: list[int], cache: Path, jobs: int) -> list[str]:
    """Compile module_specs(head_dims) here for sm_90a and pack them into
    out_dir/flashinfer-aot.tar.gz (the layout `collect` writes); return their names."""
    if shutil.which("nvcc") is None:
        raise SystemExit("flashinfer_stage: prebuild needs nvcc on PATH")
    work = Path(tempfile.mkdtemp(prefix="flashinfer-prebuild-"))
    try:
        return _prebuild_in(work, out_dir, head_dims, cache, jobs)
    finally:
        shutil.rmtree(work)


def _prebuild_in(
    work: Path, out_dir: Path, head_dims: list[int], cache: Path, jobs: int
) -> list[str]:
    libs = work / "lib"
    libs.mkdir()
    # The link names -lcudart -lcuda: the runtime links for real (its soname, libcudart.so.13,
    # is what the GPU host loads), the driver as a stub that names libcuda.so.1.
    (libs / "libcudart.so").symlink_to(_cudart())
    subprocess.run(
        ["gcc", "-shared", "-x", "c", "-", "-Wl,-soname,libcuda.so.1"]
        + ["-o", str(libs / "libcuda.so")],
        input=b"",
        check=True,
    )
    env = {
        "FLASHINFER_CUDA_ARCH_LIST": PREBUILD_ARCH,
        "FLASHINFER_WORKSPACE_BASE": str(work),
        "MAX_JOBS": str(jobs),
        "CPATH": os.pathsep.join(
            filter(None, [str(header_dir(cache)), os.environ.get("CPATH")])
        ),
        "LIBRARY_PATH": str(libs),
    }
    code = (
        "import sys\n"
        "from specpatch.gpu_host.flashinfer_stage import module_specs\n"
        "for spec in module_specs([int(d) for d in sys.argv[1:]]):\n"
        "    spec.build(verbose=False)\n"
        "    print('built', spec.name, flush=True)\n"
    )
    # A child process: FlashInfer reads its environment when its modules are first imported.
    subprocess.run(
        [sys.executable, "-c", code, *map(str, head_dims)],
        env={**os.environ, **env, "PYTHONPATH": _tools_path()},
        check=True,
    )
    return collect(out_dir, sorted(work.glob(".cache/flashinfer/*/*/cached_ops")))


def _tools_path() -> str:
    tools = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join(filter(None, [tools, os.environ.get("PYTHONPATH")]))


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
    b = sub.add_parser(
        "prebuild",
        help="here, with nvcc: the modules, compiled for sm_90a, into OUT/" + MODULES,
    )
    b.add_argument("out_dir", type=Path)
    b.add_argument(
        "--head-dims",
        default="64,128",
        help='"" for the modules every engine loads whatever its attention backend '
        "(sglang's RMSNorm is FlashInfer's): what a triton run needs",
    )
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)

    if args.cmd == "pack":
        wheel = args.wheel or fetch_wheel(Path.home() / ".cache" / "flashinfer-stage")
        print(json.dumps(pack(wheel, args.out_dir)))
    elif args.cmd == "install":
        headers = (
            "headers installed" if (args.store / HEADERS).is_file() else "no headers"
        )
        print(
            f"flashinfer_stage: {headers}; modules:",
            install(args.store, *_flashinfer_package()) or "none",
        )
    elif args.cmd == "prebuild":
        head_dims = [int(d) for d in args.head_dims.split(",") if d.strip()]
        cache = Path.home() / ".cache" / "flashinfer-stage"
        names = prebuild(args.out_dir, head_dims, cache, args.jobs)
        print("flashinfer_stage: prebuilt", names)
    else:
        from flashinfer.jit import env as jit_env

        roots = [jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_AOT_DIR]
        print("flashinfer_stage: collected", collect(args.out_dir, roots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
