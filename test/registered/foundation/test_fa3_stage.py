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


def test_install_copies_once_per_archive_and_renames_into_place(
    library, slim_library, tmp_path, monkeypatch
):
    """gpu-env.sh runs install in every script of a call: a library already installed from the
    same archive is left alone (a benchmark may have it open), another archive replaces it.
    """
    site = tmp_path / "sgl_kernel"
    site.mkdir()
    copies = []
    real_copy = fa3_stage.shutil.copy

    def copy(src, dst):
        copies.append(Path(dst).name)
        return real_copy(src, dst)

    monkeypatch.setattr(fa3_stage.shutil, "copy", copy)

    def ship(source: Path, name: str, **pack_args) -> Path:
        fa3_stage.pack(source, tmp_path / name, **pack_args)
        fa3_stage.receive(tmp_path / name, tmp_path / "store")
        return fa3_stage.install(tmp_path / "store", site)

    first = ship(library, "full")
    installs = [c for c in copies if c.endswith(".partial")]
    assert len(installs) == 1 and installs[0].startswith(fa3_stage.LIBRARY)
    assert ship(library, "full") == first
    assert len([c for c in copies if c.endswith(".partial")]) == 1  # not again
    slim_path, demangled = slim_library
    ship(
        slim_path,
        "slim",
        selection=SLIM,
        demangle=lambda names: [demangled[n] for n in names],
    )
    assert len([c for c in copies if c.endswith(".partial")]) == 2
    assert not list(site.glob("*.partial"))
    slim_store = fa3_stage.assemble(tmp_path / "store").read_bytes()
    assert first.read_bytes() == slim_store


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


# ----------------------------------------------------------------------------- slim libraries

# A real FA3 forward kernel's name, demangled (sgl_kernel's flash_ops, sm90): head dim 128 for
# q/k (the tile's K) and for v, bf16.
FWD_HDIM128_BF16 = (
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
    "flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, "
    "cute::tuple<cute::C<128>, cute::C<176>, cute::C<128> >, 128, cutlass::bfloat16_t, float, "
    "cutlass::arch::Sm90, false, false, false, false, false, false, false, true, true, true, "
    "false, false, cutlass::bfloat16_t, 1>, flash::CollectiveEpilogueFwd<cute::tuple<"
    "cute::C<128>, cute::C<128>, cute::C<176> >, cute::tuple<cute::C<1>, cute::C<1>, "
    "cute::C<1> >, cutlass::bfloat16_t, cutlass::arch::Sm90, 256, false, true, false, false>, "
    "flash::StaticPersistentTileScheduler<false> > > >(...)"
)
COMBINE = (
    "void cutlass::device_kernel<flash::FlashAttnFwdCombine<cute::tuple<cute::C<8>, "
    "cute::C<128> >, 8, 256, 1, false, false, cutlass::bfloat16_t, float, "
    "cutlass::arch::Sm90> >(...)"
)
SLIM = fa3_stage.KernelSelection((64, 128), "cutlass::bfloat16_t")


def forward_name(qk: int, v: int, element: str) -> str:
    return FWD_HDIM128_BF16.replace(
        "cute::C<128>, cute::C<176>, cute::C<128> >, 128, " "cutlass::bfloat16_t,",
        f"cute::C<128>, cute::C<176>, cute::C<{qk}> >, {v}, {element},",
    )


def test_a_forward_kernels_head_dims_and_element_are_read_from_its_name():
    assert fa3_stage.forward_kernel_shape(FWD_HDIM128_BF16) == (
        128,
        128,
        "cutlass::bfloat16_t",
    )
    assert fa3_stage.forward_kernel_shape(
        forward_name(192, 128, "cutlass::float_e4m3_t")
    ) == (192, 128, "cutlass::float_e4m3_t")
    assert fa3_stage.forward_kernel_shape(COMBINE) is None


@pytest.mark.parametrize(
    "names,kept",
    [
        ([FWD_HDIM128_BF16], True),
        ([forward_name(64, 64, "cutlass::bfloat16_t")], True),
        ([forward_name(256, 256, "cutlass::bfloat16_t")], False),
        ([forward_name(128, 128, "cutlass::half_t")], False),
        ([forward_name(64, 512, "cutlass::bfloat16_t")], False),  # v head dim 512
        ([forward_name(96, 96, "cutlass::bfloat16_t"), FWD_HDIM128_BF16], True),
        ([COMBINE], True),  # no forward kernel: stays
        ([], True),
    ],
    ids=[
        "hdim128",
        "hdim64",
        "hdim256",
        "fp16",
        "v512",
        "one-of-two",
        "combine",
        "none",
    ],
)
def test_a_cubin_stays_unless_all_its_forward_kernels_are_unselected(names, kept):
    assert fa3_stage.cubin_is_kept(names, SLIM) is kept


def test_kernel_selections_parse_and_refuse_with_the_flag_named():
    assert fa3_stage.KernelSelection.parse("bf16:64,128") == SLIM
    for bad in ("bf16", "int8:64", "bf16:"):
        with pytest.raises(ValueError, match="--kernels"):
            fa3_stage.KernelSelection.parse(bad)


def cubin(kernels: list[str], size: int = 64) -> bytes:
    """A cubin-shaped ELF: one `.text.<mangled>` section per kernel."""
    return elf_with_sections(
        {f".text.{name}": payload(7, size) for name in kernels} or {".text": b"x"}
    )


@pytest.fixture
def slim_library(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """Two fat binaries: sm90 cubins of a kept kernel, a dropped one and a combine kernel,
    sm80 images beside them, and a PTX image. Mangled names are stand-ins: the test's
    demangler maps them."""
    demangled = {
        "_Z4keep": FWD_HDIM128_BF16,
        "_Z4drop": forward_name(256, 256, "cutlass::bfloat16_t"),
        "_Z7combine": COMBINE,
    }
    fatbins = (
        fat_binary(
            [
                (2, 80, payload(1, 40)),
                (2, 90, cubin(["_Z4keep"])),
                (1, 90, payload(3, 16)),
            ]
        )
        + bytes(8)
        + fat_binary([(2, 90, cubin(["_Z4drop"])), (2, 90, cubin(["_Z7combine"]))])
    )
    (tmp_path / "slim-source").mkdir()
    path = tmp_path / "slim-source" / fa3_stage.LIBRARY
    path.write_bytes(
        elf_with_sections({".text": payload(9, 20), fa3_stage.FATBIN_SECTION: fatbins})
    )
    return path, demangled


def test_a_slim_pack_zeroes_the_unselected_sm90_cubins_only(slim_library, tmp_path):
    path, demangled = slim_library

    def demangle(names):
        return [demangled[n] for n in names]

    manifest = fa3_stage.pack(
        path, tmp_path / "parts", selection=SLIM, demangle=demangle
    )
    store = tmp_path / "store"
    fa3_stage.receive(tmp_path / "parts", store)
    original, slim = path.read_bytes(), fa3_stage.assemble(store).read_bytes()
    entries = fa3_stage.fatbin_entries(
        original, *fa3_stage.elf_section(original, fa3_stage.FATBIN_SECTION)
    )
    images = {}
    for e in entries:
        span = slice(e.payload_offset, e.payload_offset + e.payload_size)
        names = (
            fa3_stage.cubin_kernel_names(original[span])
            if e.kind == 2 and e.arch == 90
            else []
        )
        images[(e.kind, e.arch, tuple(names))] = (original[span], slim[span])
    zero = lambda image: image == bytes(len(image))  # noqa: E731
    assert zero(images[(2, 80, ())][1])
    assert not zero(images[(2, 90, ("_Z4keep",))][1])
    assert images[(2, 90, ("_Z4keep",))][0] == images[(2, 90, ("_Z4keep",))][1]
    assert zero(images[(2, 90, ("_Z4drop",))][1])
    assert images[(2, 90, ("_Z7combine",))][0] == images[(2, 90, ("_Z7combine",))][1]
    assert images[(1, 90, ())][0] == images[(1, 90, ())][1]  # PTX stays
    assert len(slim) == len(original)
    assert manifest["kernels"] == {
        "head_dims": [64, 128],
        "element": "cutlass::bfloat16_t",
    }
    dropped = len(images[(2, 90, ("_Z4drop",))][0])
    assert manifest["zeroed_bytes"] == 40 + dropped


def test_a_full_pack_records_no_kernel_selection(library, tmp_path):
    assert fa3_stage.pack(library, tmp_path / "parts")["kernels"] is None


def test_the_real_librarys_forward_kernels_all_parse():
    """Every sm90 cubin of the installed FA3 that names FlashAttnFwdSm90 parses, and the
    selection the synthetic pairs need keeps between a twentieth and a quarter of them.
    """
    import shutil

    if shutil.which("c++filt") is None:
        pytest.skip("binutils' c++filt is not installed")
    with (
        _installed_library().open("rb") as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data,
    ):
        entries = [
            e
            for e in fa3_stage.fatbin_entries(
                data, *fa3_stage.elf_section(data, fa3_stage.FATBIN_SECTION)
            )
            if e.arch == fa3_stage.HOST_ARCH and e.kind == 2
        ]
        total = kept = 0
        for e in entries:
            names = fa3_stage.cubin_kernel_names(
                data[e.payload_offset : e.payload_offset + e.payload_size]
            )
            demangled = fa3_stage.demangle_with_cxxfilt(names)
            for name in demangled:
                if "FlashAttnFwdSm90<" in name:
                    assert fa3_stage.forward_kernel_shape(name) is not None, name[:200]
            total += e.payload_size
            kept += e.payload_size * fa3_stage.cubin_is_kept(demangled, SLIM)
    assert total / 20 < kept < total / 4
