"""specpatch.gpu_host.fa3_stage: FA3's library shipped to the GPU host in parts, sm90 images only,
as one xz stream."""

from __future__ import annotations

import builtins
import gzip
import json
import lzma
import mmap
import struct
from pathlib import Path

import pytest

from specpatch.gpu_host import fa3_stage

ENTRY_HEADER = 64


def fat_binary(images: list[tuple[int, int, bytes]]) -> bytes:
    """A fat binary of (kind, arch, payload) images."""
    body = b""
    for kind, arch, payload in images:
        header = bytearray(ENTRY_HEADER)
        struct.pack_into("<HHII", header, 0, kind, 0x101, ENTRY_HEADER, len(payload))
        struct.pack_into("<I", header, 28, arch)
        body += bytes(header) + payload
    return struct.pack("<IHHQ", fa3_stage.FATBIN_MAGIC, 1, 16, len(body)) + body


def elf_with_sections(sections: dict[str, bytes]) -> bytes:
    """A minimal little-endian ELF64 image: header, section contents, section header table."""
    names = b"\0" + b"".join(name.encode() + b"\0" for name in [".shstrtab", *sections])
    contents = [(".shstrtab", names), *sections.items()]
    blob, offsets = bytearray(64), []
    for _, content in contents:
        blob += bytes(-len(blob) % 8)
        offsets.append(len(blob))
        blob += content
    blob += bytes(-len(blob) % 8)
    shoff = len(blob)
    blob += bytes(64)  # the null section
    for (name, content), offset in zip(contents, offsets):
        header = bytearray(64)
        struct.pack_into("<II", header, 0, names.index(name.encode() + b"\0"), 1)
        struct.pack_into("<QQ", header, 0x18, offset, len(content))
        blob += header
    blob[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", blob, 0x28, shoff)
    struct.pack_into("<HHH", blob, 0x3A, 64, len(contents) + 1, 1)
    return bytes(blob)


def payload(tag: int, size: int) -> bytes:
    return bytes([tag]) * size


@pytest.fixture
def library(tmp_path: Path) -> Path:
    fatbins = (
        fat_binary(
            [(2, 80, payload(1, 40)), (2, 90, payload(2, 24)), (1, 90, payload(3, 16))]
        )
        + bytes(8)  # alignment padding between fat binaries
        + fat_binary([(2, 86, payload(4, 32)), (2, 90, payload(5, 8))])
    )
    path = tmp_path / fa3_stage.LIBRARY
    path.write_bytes(
        elf_with_sections({".text": payload(9, 20), fa3_stage.FATBIN_SECTION: fatbins})
    )
    return path


def test_every_image_of_every_fat_binary_is_found(library):
    data = library.read_bytes()
    entries = fa3_stage.fatbin_entries(data, *fa3_stage.elf_section(data, ".nv_fatbin"))

    assert [(e.kind, e.arch, e.payload_size) for e in entries] == [
        (2, 80, 40),
        (2, 90, 24),
        (1, 90, 16),
        (2, 86, 32),
        (2, 90, 8),
    ]
    assert [
        data[e.payload_offset : e.payload_offset + e.payload_size] for e in entries
    ] == [payload(1, 40), payload(2, 24), payload(3, 16), payload(4, 32), payload(5, 8)]


def test_only_other_archs_payloads_are_zeroed(library):
    data = library.read_bytes()

    trimmed, zeroed = fa3_stage.zero_other_archs(data, keep_arch=90)

    assert zeroed == 40 + 32 and len(trimmed) == len(data)
    changed = [i for i, (a, b) in enumerate(zip(data, trimmed)) if a != b]
    assert len(changed) == zeroed and all(trimmed[i] == 0 for i in changed)
    assert {data[i] for i in changed} == {
        1,
        4,
    }  # the sm80 and sm86 payloads, nothing else
    assert fa3_stage.fatbin_entries(
        bytes(trimmed), *fa3_stage.elf_section(data, ".nv_fatbin")
    ) == fa3_stage.fatbin_entries(data, *fa3_stage.elf_section(data, ".nv_fatbin"))


def test_a_library_without_the_host_arch_is_refused(library):
    with pytest.raises(ValueError, match="no sm_100 image"):
        fa3_stage.zero_other_archs(library.read_bytes(), keep_arch=100)


def test_parts_received_over_several_calls_install_the_trimmed_library(
    library, tmp_path
):
    packed, store, site = (
        tmp_path / "packed",
        tmp_path / "store",
        tmp_path / "sgl_kernel",
    )
    site.mkdir()
    manifest = fa3_stage.pack(library, packed, part_bytes=48)
    assert len(manifest["parts"]) > 2
    expected, _ = fa3_stage.zero_other_archs(library.read_bytes(), keep_arch=90)

    # Each device call brings one part (plus the manifest); the store keeps what came before.
    for index, name in enumerate(manifest["parts"]):
        call = tmp_path / f"call{index}"
        call.mkdir()
        (call / "manifest.json").write_bytes((packed / "manifest.json").read_bytes())
        (call / name).write_bytes((packed / name).read_bytes())
        missing = fa3_stage.receive(call, store)
        assert missing == manifest["parts"][index + 1 :]

    installed = fa3_stage.install(store, site)

    assert installed == site / fa3_stage.LIBRARY and installed.read_bytes() == bytes(
        expected
    )
    assert fa3_stage.install(store, site).read_bytes() == bytes(
        expected
    )  # again: unpacked once


def test_a_missing_or_damaged_part_is_an_error_not_a_library(library, tmp_path):
    packed, store = tmp_path / "packed", tmp_path / "store"
    manifest = fa3_stage.pack(library, packed, part_bytes=48)
    fa3_stage.receive(packed, store)
    (store / manifest["parts"][1]).unlink()
    with pytest.raises(
        SystemExit, match=f"parts not received yet: {manifest['parts'][1]}"
    ):
        fa3_stage.assemble(store)

    fa3_stage.receive(packed, store)
    damaged = store / manifest["parts"][0]
    damaged.write_bytes(b"\xff" + damaged.read_bytes()[1:])
    with pytest.raises(SystemExit, match="do not hash to the packed archive"):
        fa3_stage.assemble(store)
    assert not (store / fa3_stage.LIBRARY).exists()


def test_the_parts_are_one_xz_stream_of_the_trimmed_library(library, tmp_path):
    manifest = fa3_stage.pack(library, tmp_path / "packed", part_bytes=48)
    archive = b"".join(
        (tmp_path / "packed" / name).read_bytes() for name in manifest["parts"]
    )
    expected, zeroed = fa3_stage.zero_other_archs(library.read_bytes(), keep_arch=90)

    assert archive.startswith(b"\xfd7zXZ\x00") and lzma.decompress(archive) == expected
    assert all(
        (tmp_path / "packed" / name).stat().st_size <= 48 for name in manifest["parts"]
    )
    assert manifest["compression"] == f"xz -{fa3_stage.XZ_PRESET}"
    assert (manifest["archive_bytes"], manifest["zeroed_bytes"]) == (
        len(archive),
        zeroed,
    )
    assert json.loads((tmp_path / "packed" / "manifest.json").read_text()) == manifest


def test_an_archive_that_fits_one_part_arrives_in_one_call(library, tmp_path):
    packed, store, site = tmp_path / "packed", tmp_path / "store", tmp_path / "site"
    site.mkdir()
    manifest = fa3_stage.pack(library, packed)

    assert manifest["parts"] == ["part00"]
    assert fa3_stage.receive(packed, store) == []
    expected, _ = fa3_stage.zero_other_archs(library.read_bytes(), keep_arch=90)
    assert fa3_stage.install(store, site).read_bytes() == bytes(expected)


def test_a_host_python_without_lzma_unpacks_with_the_xz_program(
    library, tmp_path, monkeypatch
):
    packed, store = tmp_path / "packed", tmp_path / "store"
    fa3_stage.pack(library, packed)
    fa3_stage.receive(packed, store)
    real_import = builtins.__import__

    def no_lzma(name, *args, **kwargs):
        if name == "lzma":
            raise ImportError("No module named '_lzma'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_lzma)
    expected, _ = fa3_stage.zero_other_archs(library.read_bytes(), keep_arch=90)
    assert fa3_stage.assemble(store).read_bytes() == bytes(expected)


def test_parts_packed_by_the_gzip_stager_are_refused(library, tmp_path):
    packed, store = tmp_path / "packed", tmp_path / "store"
    fa3_stage.pack(library, packed)
    fa3_stage.receive(packed, store)
    manifest = json.loads((store / "manifest.json").read_text())
    del manifest["compression"]  # what the gzip stager wrote
    (store / "manifest.json").write_text(json.dumps(manifest))

    with pytest.raises(SystemExit, match="older fa3_stage .gzip.; pack them again"):
        fa3_stage.assemble(store)
    assert not (store / fa3_stage.LIBRARY).exists()


def _installed_library() -> Path:
    try:
        location = fa3_stage._sgl_kernel_dir() / fa3_stage.LIBRARY
    except SystemExit:
        pytest.skip("sgl_kernel is not installed in this environment")
    if not location.is_file():
        pytest.skip(f"{location} is absent from this sgl_kernel build")
    return location


def test_xz_keeps_under_half_of_what_gzip_keeps_of_the_real_sm90_cubins():
    """Why the archive is xz: on a sample of the installed library's host images (every 40th,
    about 4 MiB, so that the test stays fast) xz at the packer's preset keeps less than half of
    what gzip -6 keeps."""
    with (
        _installed_library().open("rb") as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data,
    ):
        entries = fa3_stage.fatbin_entries(
            data, *fa3_stage.elf_section(data, fa3_stage.FATBIN_SECTION)
        )
        sample = b""
        for e in [e for e in entries if e.arch == fa3_stage.HOST_ARCH][::40]:
            if len(sample) > 3 << 20:
                break
            sample += data[e.payload_offset : e.payload_offset + e.payload_size]
    assert len(sample) > 3 << 20
    xz = len(fa3_stage.xz_compress(sample))
    assert xz < 0.5 * len(gzip.compress(sample, compresslevel=6))


def test_the_installed_sgl_kernel_library_has_the_layout_the_packer_reads():
    """The fat-binary layout is read from the real FA3 library (headers only, through mmap)."""
    with (
        _installed_library().open("rb") as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data,
    ):
        offset, size = fa3_stage.elf_section(data, fa3_stage.FATBIN_SECTION)
        entries = fa3_stage.fatbin_entries(data, offset, size)
        host = sum(e.payload_size for e in entries if e.arch == fa3_stage.HOST_ARCH)
        assert host > 0 and all(
            offset <= e.payload_offset
            and e.payload_offset + e.payload_size <= offset + size
            for e in entries
        )
        # Most of the section is images: the walk did not lose its place between fat binaries.
        assert sum(e.payload_size for e in entries) > 0.9 * size
