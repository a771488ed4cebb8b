"""Ship sgl_kernel's FlashAttention-3 library to the GPU host, in parts.

The GPU bundle (../shared/gpu/stage.sh) leaves FA3 out: `sgl_kernel/flash_ops.abi3.so` is about
1 GiB and one device call carries at most 64 MiB. The host is an H100 or H200, so only the
library's sm90 cubins are ever loaded there. `pack` zeroes the payloads of the other
architectures in place, keeping every header and size so that no offset in the ELF moves,
xz-compresses the result (the zeroed ranges compress to almost nothing) and splits it into parts
that each fit one call alone (README.md, FA3 staging, says how many there are today):

    python -m specpatch.gpu_host.fa3_stage pack .fa3   # here: .fa3/part00 ... + manifest.json
    # one device call per part, carrying [".fa3/manifest.json", ".fa3/partNN"]:
    PYTHONPATH=tools python3 -m specpatch.gpu_host.fa3_stage receive .fa3 /tmp/fa3
    # then, after `source .gpu-bundle/env.sh` (which recreates /tmp/gpu-site) in every call:
    PYTHONPATH=tools python3 -m specpatch.gpu_host.fa3_stage install /tmp/fa3

`install` checks the assembled archive against the manifest's sha256 before unpacking, so a
missing or repeated part is an error, not a corrupt library.

`pack --kernels bf16:64,128` also zeroes the sm90 cubins whose FA3 forward kernels are all for
other head dims or element types (cubin_is_kept): what the synthetic pairs run is about an
eighth of the library, and the archive then fits one call beside the GPU bundle. A launch of a
zeroed kernel fails (an invalid kernel image), so such a library serves only those models.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

LIBRARY = "flash_ops.abi3.so"
ARCHIVE = LIBRARY + ".xz"
FATBIN_SECTION = ".nv_fatbin"
FATBIN_MAGIC = 0xBA55ED50
# The GPU hosts are H100 / H200.
HOST_ARCH = 90
# One call carries 64 MiB with the working tree (a few MiB) and the manifest.
PART_BYTES = 56 << 20

# xz, not gzip: a cubin repeats instruction sequences much farther apart than gzip's 32 KiB
# window. Presets above 6 add much time for little (README.md, FA3 staging).
XZ_PRESET = 6
COMPRESSION = f"xz -{XZ_PRESET}"

_CHUNK = 64 << 20


@dataclass(frozen=True)
class FatbinEntry:
    """One cubin or PTX image inside a CUDA fat binary."""

    # byte offset of the image's payload in the file (after its entry header)
    payload_offset: int
    payload_size: int
    kind: int  # 1: PTX, 2: cubin (ELF)
    arch: int  # e.g. 90 for sm_90


def elf_sections(data: bytes) -> list[tuple[bytes, int, int]]:
    """(name, file offset, size) of every section of an ELF64 little-endian image, read from
    the section headers. `data` may be an mmap: only the headers and names are touched.
    """
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(index: int) -> tuple[int, int, int]:
        base = shoff + index * shentsize
        (name_offset,) = struct.unpack_from("<I", data, base)
        offset, size = struct.unpack_from("<QQ", data, base + 0x18)
        return name_offset, offset, size

    _, strtab_offset, _ = header(shstrndx)
    sections = []
    for index in range(shnum):
        name_offset, offset, size = header(index)
        start = strtab_offset + name_offset
        sections.append((bytes(data[start : data.find(b"\0", start)]), offset, size))
    return sections


def elf_section(data: bytes, name: str) -> tuple[int, int]:
    """(file offset, size) of the ELF section `name`."""
    for section, offset, size in elf_sections(data):
        if section == name.encode():
            return offset, size
    raise ValueError(f"no {name} section")


def fatbin_entries(
    data: bytes, section_offset: int, section_size: int
) -> list[FatbinEntry]:
    """Every image of the fat binaries packed one after another in a section.

    Layout: a fat binary is a 16-byte header (magic u32, version u16, header size u16, body
    size u64) followed by entries, each an entry header (kind u16, version u16, header size
    u32, payload size u32 (low half of a u64), ..., arch u32 at +28) and its payload. Fat
    binaries are 8-byte aligned within the section.
    """
    entries = []
    pos, end = section_offset, section_offset + section_size
    while pos + 16 <= end:
        magic, _, header_size, body_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8
            continue
        entry, body_end = pos + header_size, pos + header_size + body_size
        while entry < body_end:
            kind, _, entry_header_size, payload_size = struct.unpack_from(
                "<HHII", data, entry
            )
            (arch,) = struct.unpack_from("<I", data, entry + 28)
            entries.append(
                FatbinEntry(entry + entry_header_size, payload_size, kind, arch)
            )
            entry += entry_header_size + payload_size
        pos = body_end
    return entries


def zero_other_archs(library: bytes, keep_arch: int) -> tuple[bytearray, int]:
    """A copy of the library whose images for any arch but `keep_arch` are zeroed; and how many
    bytes were zeroed. Refuses a library that has no image for `keep_arch`."""
    entries = fatbin_entries(library, *elf_section(library, FATBIN_SECTION))
    if not any(e.arch == keep_arch for e in entries):
        raise ValueError(
            f"no sm_{keep_arch} image in the library: nothing would run on the host"
        )
    out = bytearray(library)
    zeroed = 0
    for e in entries:
        if e.arch != keep_arch:
            out[e.payload_offset : e.payload_offset + e.payload_size] = bytes(
                e.payload_size
            )
            zeroed += e.payload_size
    return out, zeroed


# cutlass element types by the short names `--kernels` takes.
ELEMENT_TYPES = {
    "bf16": "cutlass::bfloat16_t",
    "fp16": "cutlass::half_t",
    "e4m3": "cutlass::float_e4m3_t",
}


@dataclass(frozen=True)
class KernelSelection:
    """The FA3 forward kernels a slim library keeps: q/k and v head dims, one element type."""

    head_dims: tuple[int, ...]
    element: str  # a cutlass element type, e.g. "cutlass::bfloat16_t"

    @classmethod
    def parse(cls, text: str) -> "KernelSelection":
        """`bf16:64,128` (an ELEMENT_TYPES key, then head dims)."""
        name, _, dims = text.partition(":")
        if name not in ELEMENT_TYPES or not dims:
            raise ValueError(
                f"--kernels {text!r}: expected TYPE:DIM[,DIM...] with TYPE in "
                f"{sorted(ELEMENT_TYPES)}, e.g. bf16:64,128"
            )
        return cls(tuple(int(d) for d in dims.split(",")), ELEMENT_TYPES[name])


# An FA3 forward kernel, demangled: cutlass::device_kernel<flash::...FlashAttnFwdSm90<
# flash::CollectiveMainloopFwdSm90<stages, ClusterShape, TileShape_MNK, kHeadDimV, Element, ...
# TileShape_MNK's K is the q/k head dim.
_SHAPE3 = r"cute::tuple<cute::C<(\d+)>, cute::C<(\d+)>, cute::C<(\d+)> >"
FA3_FORWARD = re.compile(
    r"flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90<\d+, "
    + _SHAPE3
    + ", "
    + _SHAPE3
    + r", (\d+), ([\w:]+),"
)


def forward_kernel_shape(demangled: str) -> Optional[tuple[int, int, str]]:
    """(q/k head dim, v head dim, element type) of an FA3 forward kernel; None for any other."""
    m = FA3_FORWARD.search(demangled)
    return None if m is None else (int(m.group(6)), int(m.group(7)), m.group(8))


def cubin_kernel_names(cubin: bytes) -> list[str]:
    """The mangled names of a cubin's kernels: its `.text.<name>` sections."""
    return [
        name[len(b".text.") :].decode()
        for name, _, _ in elf_sections(cubin)
        if name.startswith(b".text.")
    ]


def cubin_is_kept(demangled_names: list[str], selection: KernelSelection) -> bool:
    """A cubin stays unless it has FA3 forward kernels and none of them is selected: cubins of
    other kernels (the split-KV combine, the varlen scheduler's, sm80 fallbacks) stay whole.
    """
    shapes = [forward_kernel_shape(name) for name in demangled_names]
    forward = [shape for shape in shapes if shape is not None]
    return not forward or any(
        qk in selection.head_dims
        and v in selection.head_dims
        and element == selection.element
        for qk, v, element in forward
    )


def demangle_with_cxxfilt(names: list[str]) -> list[str]:
    """binutils' c++filt, one name a line."""
    out = subprocess.run(
        ["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True
    ).stdout.split("\n")
    return out[: len(names)]


def zero_unselected_cubins(
    trimmed: bytearray,
    keep_arch: int,
    selection: KernelSelection,
    demangle: Callable[[list[str]], list[str]] = demangle_with_cxxfilt,
) -> int:
    """Zero, in place, the `keep_arch` cubins cubin_is_kept drops; return the bytes zeroed.
    An image that is not a plain ELF (PTX, compressed) stays."""
    entries = fatbin_entries(trimmed, *elf_section(trimmed, FATBIN_SECTION))
    zeroed = 0
    for e in entries:
        end = e.payload_offset + e.payload_size
        if (
            e.arch != keep_arch
            or e.kind != 2
            or trimmed[e.payload_offset : e.payload_offset + 4] != b"\x7fELF"
        ):
            continue
        names = cubin_kernel_names(bytes(trimmed[e.payload_offset : end]))
        if not cubin_is_kept(demangle(names) if names else [], selection):
            trimmed[e.payload_offset : end] = bytes(e.payload_size)
            zeroed += e.payload_size
    return zeroed


def xz_compress(data: bytes | bytearray) -> bytes:
    """One xz stream, fed in chunks so that no second copy of the library is made."""
    import lzma

    compressor = lzma.LZMACompressor(format=lzma.FORMAT_XZ, preset=XZ_PRESET)
    view = memoryview(data)
    pieces = [
        compressor.compress(view[start : start + _CHUNK])
        for start in range(0, len(view), _CHUNK)
    ]
    return b"".join(pieces) + compressor.flush()


def pack(
    library: Path,
    out_dir: Path,
    keep_arch: int = HOST_ARCH,
    part_bytes: int = PART_BYTES,
    selection: Optional[KernelSelection] = None,
    demangle: Callable[[list[str]], list[str]] = demangle_with_cxxfilt,
) -> dict:
    """Write out_dir/partNN and out_dir/manifest.json; return the manifest. With `selection`,
    only those FA3 forward kernels' cubins stay (zero_unselected_cubins)."""
    trimmed, zeroed = zero_other_archs(library.read_bytes(), keep_arch)
    if selection is not None:
        zeroed += zero_unselected_cubins(trimmed, keep_arch, selection, demangle)
    archive = xz_compress(trimmed)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    parts = []
    for index, start in enumerate(range(0, len(archive), part_bytes)):
        name = f"part{index:02d}"
        (out_dir / name).write_bytes(archive[start : start + part_bytes])
        parts.append(name)
    manifest = {
        "library": LIBRARY,
        "source": str(library),
        "keep_arch": keep_arch,
        "library_bytes": len(trimmed),
        "zeroed_bytes": zeroed,
        "kernels": (
            None
            if selection is None
            else {"head_dims": list(selection.head_dims), "element": selection.element}
        ),
        "compression": COMPRESSION,
        "archive_bytes": len(archive),
        "archive_sha256": hashlib.sha256(archive).hexdigest(),
        "parts": parts,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def receive(parts_dir: Path, store: Path) -> list[str]:
    """Copy the parts present in parts_dir into the store (one device call brings one or more);
    return the parts the store still lacks."""
    manifest = json.loads((parts_dir / "manifest.json").read_text())
    store.mkdir(parents=True, exist_ok=True)
    stored = store / "manifest.json"
    if stored.is_file() and json.loads(stored.read_text()) != manifest:
        shutil.rmtree(store)  # another pack's parts: start over
        store.mkdir(parents=True)
    for name in [*manifest["parts"], "manifest.json"]:
        source, kept = parts_dir / name, store / name
        if source.is_file() and not (
            kept.is_file() and kept.stat().st_size == source.stat().st_size
        ):
            shutil.copy(source, kept)
    return [name for name in manifest["parts"] if not (store / name).is_file()]


def assemble(store: Path) -> Path:
    """Unpack the received parts into store/LIBRARY (once), after checking the archive's hash."""
    manifest = json.loads((store / "manifest.json").read_text())
    if not manifest.get("compression", "gzip").startswith("xz"):
        raise SystemExit(
            "fa3_stage: these parts were packed by an older fa3_stage (gzip); pack them again"
        )
    library = store / manifest["library"]
    if library.is_file() and library.stat().st_size == manifest["library_bytes"]:
        return library
    missing = [name for name in manifest["parts"] if not (store / name).is_file()]
    if missing:
        raise SystemExit(f"fa3_stage: parts not received yet: {', '.join(missing)}")
    digest = hashlib.sha256()
    archive = store / ARCHIVE
    with archive.open("wb") as out:
        for name in manifest["parts"]:
            chunk = (store / name).read_bytes()
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != manifest["archive_sha256"]:
        raise SystemExit(
            "fa3_stage: the received parts do not hash to the packed archive"
        )
    xz_decompress(archive, library)
    return library


def xz_decompress(archive: Path, out: Path) -> None:
    """Python's lzma, or the xz program where the interpreter was built without it (the GPU
    host has xz: gpu-env.sh unpacks the bundle with tar -J)."""
    try:
        import lzma
    except ImportError:
        with out.open("wb") as dst:
            subprocess.run(["xz", "-dc", str(archive)], stdout=dst, check=True)
        return
    with lzma.open(archive, "rb") as src, out.open("wb") as dst:
        shutil.copyfileobj(src, dst, _CHUNK)


def install(store: Path, sgl_kernel_dir: Path) -> Path:
    """Put the assembled library into an installed sgl_kernel package, once per archive: every
    script of a call sources gpu-env.sh, and benchmarks may already have imported sgl_kernel
    when a later one does. A copy lands under a temporary name and is renamed over the library,
    so a process that has it open keeps the file it opened."""
    library = assemble(store)
    target = sgl_kernel_dir / LIBRARY
    archive_sha256 = json.loads((store / "manifest.json").read_text())["archive_sha256"]
    marker = sgl_kernel_dir / (LIBRARY + ".fa3_stage")
    if target.is_file() and marker.is_file() and marker.read_text() == archive_sha256:
        return target
    partial = target.with_name(f"{LIBRARY}.{os.getpid()}.partial")
    shutil.copy(library, partial)
    os.replace(partial, target)
    marker.write_text(archive_sha256)
    return target


def _sgl_kernel_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "fa3_stage: sgl_kernel is not importable here (source .gpu-bundle/env.sh first)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specpatch.gpu_host.fa3_stage",
        description=__doc__.split("\n")[0],
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="zero the other archs, compress, split into parts")
    p.add_argument("out_dir", type=Path)
    p.add_argument(
        "--library",
        type=Path,
        help="default: the flash_ops of the sgl_kernel importable here",
    )
    p.add_argument("--part-mib", type=int, default=PART_BYTES >> 20)
    p.add_argument(
        "--kernels",
        type=KernelSelection.parse,
        help="keep only these FA3 forward kernels, e.g. bf16:64,128 (the synthetic pairs')",
    )
    r = sub.add_parser("receive", help="on the GPU host: keep this call's parts")
    r.add_argument("parts_dir", type=Path)
    r.add_argument("store", type=Path)
    i = sub.add_parser(
        "install", help="on the GPU host: unpack once, copy into sgl_kernel"
    )
    i.add_argument("store", type=Path)
    args = parser.parse_args(argv)

    if args.cmd == "pack":
        library = args.library or _sgl_kernel_dir() / LIBRARY
        manifest = pack(
            library,
            args.out_dir,
            part_bytes=args.part_mib << 20,
            selection=args.kernels,
        )
        print(json.dumps({k: v for k, v in manifest.items() if k != "archive_sha256"}))
    elif args.cmd == "receive":
        missing = receive(args.parts_dir, args.store)
        print(
            "fa3_stage: all parts received"
            if not missing
            else f"fa3_stage: still missing {missing}"
        )
    else:
        print(install(args.store, _sgl_kernel_dir()))
        kernels = json.loads((args.store / "manifest.json").read_text()).get("kernels")
        if kernels:
            print(
                f"fa3_stage: this FA3 keeps only its {kernels['element']} forward kernels "
                f"for head dims {kernels['head_dims']}; launching another fails"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
