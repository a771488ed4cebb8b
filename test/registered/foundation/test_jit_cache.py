"""specpatch.gpu_host.jit_cache: sglang's tvm-ffi modules carried between device calls.

The end-to-end test builds a real module through tvm-ffi (a C++ one: this machine has no
CUDA) and checks that after the trip ninja finds it up to date; the others lay out module
folders as tvm-ffi leaves them.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from specpatch.gpu_host import jit_cache

BUILT = {
    "build.ninja": "ninja_required_version = 1.3\n",
    "main.cpp": "int add_one(int x) { return x + 1; }\n",
    "cpp_0.o": b"\x7fELF object",
    ".ninja_log": "# ninja log v6\n",
    ".ninja_deps": b"# ninjadeps\n",
    "lock": "",
}


@pytest.fixture(autouse=True)
def header_trees(tmp_path, monkeypatch) -> list[Path]:
    """The header trees the modules were built against (sglang's jit_kernel, tvm-ffi's
    include): the host's own installs must not have their times pinned by a test."""
    roots = [tmp_path / "site" / "sglang" / "jit_kernel", tmp_path / "site" / "include"]
    for root in roots:
        (root / "sub").mkdir(parents=True)
        (root / "sub" / "kernel.cuh").write_text(f"// {root.name}\n")
    monkeypatch.setattr(jit_cache, "include_roots", lambda: roots)
    return roots


def build_into(cache: Path, folder: str, files=BUILT) -> Path:
    """What tvm-ffi leaves for one module: `<module>_<hash>/` with `<module>.so` once built."""
    module = cache / folder
    module.mkdir(parents=True)
    for name, data in files.items():
        path = module / name
        path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
    return module


def built(cache: Path, folder: str) -> Path:
    module = build_into(cache, folder)
    (module / f"{jit_cache.module_name(module)}.so").write_bytes(b"\x7fELF module")
    return module


def test_module_name_is_the_folder_without_its_hash():
    folder = Path("sgl_kernel_jit_kvcache_256_0c1d2e3f4a5b6c7d")
    assert jit_cache.module_name(folder) == "sgl_kernel_jit_kvcache_256"


def test_built_modules_travel_with_their_times_and_without_the_lock(tmp_path):
    module = built(tmp_path / "host-a", "sgl_kernel_jit_act_1a2b")
    built_at = 1_795_959_223_953_638_706  # to the nanosecond: tar alone rounds it
    os.utime(module / "cpp_0.o", ns=(built_at, built_at))
    archive = tmp_path / "out" / jit_cache.ARCHIVE

    packed = jit_cache.pack(tmp_path / "host-a", archive)
    assert (packed.entries, packed.files) == (1, 6)  # every file but the lock
    assert packed.archive_bytes == archive.stat().st_size
    shutil.rmtree(tmp_path / "host-a")

    assert jit_cache.install(archive, tmp_path / "host-b") == 1
    carried = tmp_path / "host-b" / "sgl_kernel_jit_act_1a2b"
    assert sorted(p.name for p in carried.iterdir()) == sorted(
        [n for n in BUILT if n != "lock"] + ["sgl_kernel_jit_act.so"]
    )
    # ninja builds an object again when its time moved past the one its dependency log
    # recorded, or when it is older than its sources
    assert (carried / "cpp_0.o").stat().st_mtime_ns == built_at
    assert [p.name for p in (tmp_path / "host-b").iterdir()] == [carried.name]


def test_install_pins_the_header_trees_older_than_every_module(tmp_path, header_trees):
    """The bundle installs the headers afresh at every call, newer than a carried object:
    ninja would rebuild it."""
    built(tmp_path / "host-a", "sgl_kernel_jit_act_1a2b")
    archive = tmp_path / jit_cache.ARCHIVE
    jit_cache.pack(tmp_path / "host-a", archive)
    header = header_trees[0] / "sub" / "kernel.cuh"
    header.write_text(header.read_text())  # installed again: the time of the install

    assert jit_cache.install(archive, tmp_path / "host-b") == 1
    carried = tmp_path / "host-b" / "sgl_kernel_jit_act_1a2b"
    assert header.stat().st_mtime_ns == jit_cache.PINNED_NS
    assert min(p.stat().st_mtime_ns for p in carried.iterdir()) > jit_cache.PINNED_NS
    assert not (carried / jit_cache.INPUTS).exists()


def test_a_module_built_against_other_headers_stays_out(tmp_path, header_trees):
    """Pinned times no longer tell ninja that a header changed: such a module builds anew."""
    built(tmp_path / "host-a", "sgl_kernel_jit_act_1a2b")
    archive = tmp_path / jit_cache.ARCHIVE
    jit_cache.pack(tmp_path / "host-a", archive)
    (header_trees[1] / "sub" / "kernel.cuh").write_text("// another version\n")

    assert jit_cache.install(archive, tmp_path / "host-b") == 0
    assert list((tmp_path / "host-b").iterdir()) == []


def test_the_digest_covers_each_files_tree_path_and_bytes(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        root.mkdir()
    (a / "x.h").write_text("1")
    digest = jit_cache.inputs_digest([a, b])
    (a / "x.h").rename(b / "x.h")  # same path and bytes, the other tree
    assert jit_cache.inputs_digest([a, b]) != digest
    (b / "x.h").rename(b / "y.h")
    moved = jit_cache.inputs_digest([a, b])
    assert moved != digest
    (b / "__pycache__").mkdir()
    (b / "__pycache__" / "x.pyc").write_bytes(
        b"\0"
    )  # written by an import, not a header
    assert jit_cache.inputs_digest([a, b]) == moved


def test_a_module_not_built_stays_home(tmp_path):
    cache = tmp_path / "cache"
    built(cache, "sgl_kernel_jit_done_1a")
    build_into(
        cache, "sgl_kernel_jit_failed_2b"
    )  # nvcc failed, or still running: no .so
    no_record = built(cache, "sgl_kernel_jit_odd_3c")
    (no_record / "build.ninja").unlink()
    (cache / "libtorch_c_dlpack_addon_torch211-cuda.so").write_bytes(b"\x7fELF")

    archive = tmp_path / jit_cache.ARCHIVE
    assert jit_cache.pack(cache, archive).entries == 1
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert {name.split("/")[0] for name in names} == {"sgl_kernel_jit_done_1a"}


def test_an_archive_over_the_limit_is_refused_and_not_written(tmp_path, monkeypatch):
    module = built(tmp_path / "cache", "sgl_kernel_jit_big_1a")
    (module / "sgl_kernel_jit_big.so").write_bytes(os.urandom(1 << 16))
    archive = tmp_path / "out" / jit_cache.ARCHIVE
    with pytest.raises(ValueError, match="over the 0.0 MiB limit"):
        jit_cache.pack(tmp_path / "cache", archive, max_bytes=1000)
    assert not archive.exists()
    monkeypatch.setenv("TVM_FFI_CACHE_DIR", str(tmp_path / "cache"))
    assert jit_cache.main(["collect", str(tmp_path / "out"), "--max-mib", "0"]) == 1
    assert not archive.exists()


def test_an_empty_or_missing_cache_packs_to_nothing(tmp_path):
    packed = jit_cache.pack(tmp_path / "never-made", tmp_path / "a.tar.xz")
    assert (packed.entries, packed.files) == (0, 0)
    assert jit_cache.install(tmp_path / "a.tar.xz", tmp_path / "cache") == 0


def test_an_archive_member_outside_the_cache_is_refused(tmp_path):
    archive = tmp_path / jit_cache.ARCHIVE
    with tarfile.open(archive, mode="w:xz") as tar:
        member = tarfile.TarInfo("../escaped/x.so")
        member.size = 4
        tar.addfile(member, io.BytesIO(b"\x7fELF"))
    with pytest.raises(tarfile.OutsideDestinationError):
        jit_cache.install(archive, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # nothing escaped, nothing left


def test_a_damaged_archive_leaves_the_cache_as_it_was(tmp_path, monkeypatch):
    for folder in ("sgl_kernel_jit_a_1", "sgl_kernel_jit_b_2", "sgl_kernel_jit_c_3"):
        module = built(tmp_path / "host-a", folder)
        (module / "cpp_0.o").write_bytes(os.urandom(1 << 14))
    archive = tmp_path / jit_cache.ARCHIVE
    jit_cache.pack(tmp_path / "host-a", archive)
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])  # cut short on its way back
    with pytest.raises((tarfile.TarError, EOFError, OSError)):
        jit_cache.install(archive, tmp_path / "host-b")
    assert list((tmp_path / "host-b").iterdir()) == []
    monkeypatch.setenv("TVM_FFI_CACHE_DIR", str(tmp_path / "host-b"))
    assert jit_cache.main(["install", str(archive)]) == 1  # a line, not a traceback


def test_a_module_the_host_built_keeps_its_own_folder(tmp_path):
    built(tmp_path / "host-a", "sgl_kernel_jit_act_1a")
    archive = tmp_path / jit_cache.ARCHIVE
    jit_cache.pack(tmp_path / "host-a", archive)
    own = built(tmp_path / "host-b", "sgl_kernel_jit_act_1a")
    (own / "sgl_kernel_jit_act.so").write_bytes(b"\x7fELF this host's")

    assert jit_cache.install(archive, tmp_path / "host-b") == 0
    assert (own / "sgl_kernel_jit_act.so").read_bytes() == b"\x7fELF this host's"
    assert (own / "lock").exists()  # its own folder, untouched


def test_collect_and_install_through_the_command_line(tmp_path, monkeypatch, capsys):
    built(tmp_path / "host-a", "sgl_kernel_jit_act_1a")
    monkeypatch.setenv("TVM_FFI_CACHE_DIR", str(tmp_path / "host-a"))
    assert jit_cache.main(["collect", str(tmp_path / "out")]) == 0
    assert "1 tvm-ffi modules from" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "host-a")

    monkeypatch.setenv("TVM_FFI_CACHE_DIR", str(tmp_path / "host-b"))
    # the carried folder, as tools/gpu-env.sh passes it
    assert jit_cache.main(["install", str(tmp_path / "out")]) == 0
    assert "1 tvm-ffi modules added" in capsys.readouterr().out
    assert (
        tmp_path / "host-b" / "sgl_kernel_jit_act_1a" / "sgl_kernel_jit_act.so"
    ).is_file()


def test_the_cache_is_tvm_ffis_default_without_the_variable():
    assert jit_cache.cache_dir({"HOME": "/h"}) == Path("/h/.cache/tvm-ffi")
    assert jit_cache.cache_dir({"TVM_FFI_CACHE_DIR": "/c", "HOME": "/h"}) == Path("/c")


# A module built the way sglang.jit_kernel builds its own (tvm_ffi.cpp.load_inline), in a
# process of its own: prints the module's answer.
LOAD = textwrap.dedent(
    """
    from tvm_ffi.cpp import load_inline
    module = load_inline(
        "specpatch_add_one",
        cpp_sources="int add_one(int x) { return x + 1; }",
        functions=["add_one"],
    )
    print(module.add_one(41))
    """
)


@pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None,
    reason="tvm-ffi builds with a C++ compiler and ninja, and this host lacks one",
)
def test_a_module_tvm_ffi_built_loads_without_a_build_after_the_trip(tmp_path):
    """End to end through tvm-ffi: a module built on one host, carried to the next, whose
    tvm-ffi is installed afresh (its headers newer than the module), loads there with ninja
    doing nothing: its build log gains no line and the module keeps its time."""
    import tvm_ffi

    installed = Path(tvm_ffi.__file__).parent
    site = tmp_path / "site"

    def install_site() -> list[Path]:
        """tvm-ffi as the bundle installs it: every file with the time of the install."""
        shutil.rmtree(site, ignore_errors=True)
        shutil.copytree(installed, site / "tvm_ffi", copy_function=shutil.copyfile)
        return [site / "tvm_ffi" / "include"]

    cache = tmp_path / "tvm-ffi-cache"
    env = dict(os.environ, TVM_FFI_CACHE_DIR=str(cache), PYTHONPATH=str(site))

    def load() -> str:
        done = subprocess.run(
            [sys.executable, "-c", LOAD], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    roots = install_site()
    assert load() == "42"
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    assert f"-I{roots[0]}" in (folder / "build.ninja").read_text()
    module = folder / "specpatch_add_one.so"
    built_at = module.stat().st_mtime_ns
    build_log = (folder / ".ninja_log").read_text()
    archive = tmp_path / "out" / jit_cache.ARCHIVE
    assert jit_cache.pack(cache, archive, roots=roots).entries == 1
    shutil.rmtree(cache)  # the next call's host is another machine

    roots = install_site()
    assert min(p.stat().st_mtime_ns for p in roots[0].rglob("*.h")) > built_at
    assert jit_cache.install(archive, cache, roots=roots) == 1
    assert load() == "42"
    assert module.stat().st_mtime_ns == built_at
    assert (folder / ".ninja_log").read_text() == build_log


def test_collect_without_the_bundles_trees_is_refused(tmp_path, monkeypatch, capsys):
    """Run without the bundle's PYTHONPATH, collect would record another digest than the
    host's, and every module would stay out at the next install."""
    built(tmp_path / "host-a", "sgl_kernel_jit_act_1a")
    monkeypatch.setattr(jit_cache, "include_roots", lambda: [])
    monkeypatch.setenv("TVM_FFI_CACHE_DIR", str(tmp_path / "host-a"))
    assert jit_cache.main(["collect", str(tmp_path / "out")]) == 1
    assert "not importable here" in capsys.readouterr().err
    assert not (tmp_path / "out" / jit_cache.ARCHIVE).exists()
