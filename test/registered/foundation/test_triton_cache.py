"""specpatch.gpu_host.triton_cache: Triton's compiled kernels carried between device calls.

The cache entries are written by Triton's own FileCacheManager, as its compiler writes them
(members first, then the group that names them), and read back through it, as a cache hit is.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest
from triton.runtime.cache import FileCacheManager

from specpatch.gpu_host import triton_cache

KERNEL_STAGES = {
    "_fwd_kernel.json": '{"name": "_fwd_kernel"}',
    "_fwd_kernel.cubin": b"\x7fELF cubin",
    "_fwd_kernel.ptx": "// ptx",
    "_fwd_kernel.ttgir": "#ttgir",
    "_fwd_kernel.source": "def _fwd_kernel(): pass",
}


def compile_into(cache: Path, monkeypatch, key: str, stages=KERNEL_STAGES) -> None:
    """What Triton's compile() leaves in TRITON_CACHE_DIR for one kernel."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    manager = FileCacheManager(key)
    group = {name: manager.put(data, name) for name, data in stages.items()}
    manager.put_group("_fwd_kernel.json", group)


def read_hit(cache: Path, monkeypatch, key: str) -> dict:
    """The members Triton's compile() would load on a cache hit."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    return FileCacheManager(key).get_group("_fwd_kernel.json") or {}


def test_a_packed_kernel_is_a_cache_hit_in_another_cache(tmp_path, monkeypatch):
    compile_into(tmp_path / "host-a", monkeypatch, "k1")
    compile_into(tmp_path / "host-a", monkeypatch, "k2")
    archive = tmp_path / "out" / triton_cache.ARCHIVE

    packed = triton_cache.pack(tmp_path / "host-a", archive)
    assert (packed.entries, packed.files) == (2, 6)  # json, cubin, group; no IR
    assert packed.archive_bytes == archive.stat().st_size
    shutil.rmtree(tmp_path / "host-a")  # the next call's host is another machine

    assert triton_cache.install(archive, tmp_path / "host-b") == 2
    for key in ("k1", "k2"):
        hit = read_hit(tmp_path / "host-b", monkeypatch, key)
        assert sorted(hit) == ["_fwd_kernel.cubin", "_fwd_kernel.json"]
        assert all(Path(p).parent == tmp_path / "host-b" / key for p in hit.values())
        assert Path(hit["_fwd_kernel.cubin"]).read_bytes() == b"\x7fELF cubin"


def test_entries_without_a_group_and_triton_temporaries_stay_home(
    tmp_path, monkeypatch
):
    cache = tmp_path / "cache"
    compile_into(cache, monkeypatch, "done")
    # a compile still running: members written, no group yet
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    FileCacheManager("running").put(b"\x7fELF", "_fwd_kernel.cubin")
    (cache / "done" / "_fwd_kernel.json.tmp.pid_7_x").write_text("{")

    archive = tmp_path / triton_cache.ARCHIVE
    assert triton_cache.pack(cache, archive).entries == 1
    with tarfile.open(archive) as tar:
        names = sorted(tar.getnames())
    assert names == [
        "done/__grp___fwd_kernel.json",
        "done/_fwd_kernel.cubin",
        "done/_fwd_kernel.json",
    ]


def test_an_archive_over_the_limit_is_refused_and_not_written(tmp_path, monkeypatch):
    big = dict(
        KERNEL_STAGES, **{"_fwd_kernel.cubin": os.urandom(1 << 16)}
    )  # incompressible
    compile_into(tmp_path / "cache", monkeypatch, "k", stages=big)
    archive = tmp_path / "out" / triton_cache.ARCHIVE
    with pytest.raises(ValueError, match="over the 0.0 MiB limit"):
        triton_cache.pack(tmp_path / "cache", archive, max_bytes=1000)
    assert not archive.exists()
    assert triton_cache.main(["collect", str(tmp_path / "out"), "--max-mib", "0"]) == 1


def test_an_empty_or_missing_cache_packs_to_nothing(tmp_path):
    packed = triton_cache.pack(tmp_path / "never-made", tmp_path / "a.tar.xz")
    assert (packed.entries, packed.files) == (0, 0)
    assert triton_cache.install(tmp_path / "a.tar.xz", tmp_path / "cache") == 0


def test_an_archive_member_outside_the_cache_is_refused(tmp_path):
    archive = tmp_path / triton_cache.ARCHIVE
    with tarfile.open(archive, mode="w:xz") as tar:
        data = json.dumps({"child_paths": {}}).encode()
        member = tarfile.TarInfo("../escaped/__grp__x.json")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    with pytest.raises(tarfile.OutsideDestinationError):
        triton_cache.install(archive, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # nothing escaped, nothing left


def test_a_damaged_archive_leaves_the_cache_as_it_was(tmp_path, monkeypatch):
    for key in ("k1", "k2", "k3"):
        compile_into(tmp_path / "host-a", monkeypatch, key)
    archive = tmp_path / triton_cache.ARCHIVE
    triton_cache.pack(tmp_path / "host-a", archive)
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])  # cut short on its way back
    with pytest.raises((tarfile.TarError, EOFError, OSError)):
        triton_cache.install(archive, tmp_path / "host-b")
    assert list((tmp_path / "host-b").iterdir()) == []
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "host-b"))
    assert triton_cache.main(["install", str(archive)]) == 1  # a line, not a traceback


def test_an_entry_that_could_not_load_is_left_out(tmp_path, monkeypatch):
    no_binary = {k: v for k, v in KERNEL_STAGES.items() if not k.endswith(".cubin")}
    compile_into(tmp_path / "host-a", monkeypatch, "no-binary", stages=no_binary)
    compile_into(tmp_path / "host-a", monkeypatch, "whole")
    archive = tmp_path / triton_cache.ARCHIVE
    triton_cache.pack(tmp_path / "host-a", archive)
    shutil.rmtree(tmp_path / "host-a")

    assert triton_cache.install(archive, tmp_path / "host-b") == 1
    # Triton would take the metadata for a hit and then fail to read the binary: a miss
    # (compile again) instead
    assert read_hit(tmp_path / "host-b", monkeypatch, "no-binary") == {}
    assert read_hit(tmp_path / "host-b", monkeypatch, "whole")


def test_a_kernel_the_host_compiled_keeps_its_own_entry(tmp_path, monkeypatch):
    compile_into(tmp_path / "host-a", monkeypatch, "k1")
    archive = tmp_path / triton_cache.ARCHIVE
    triton_cache.pack(tmp_path / "host-a", archive)
    own = dict(KERNEL_STAGES, **{"_fwd_kernel.cubin": b"\x7fELF this host's"})
    compile_into(tmp_path / "host-b", monkeypatch, "k1", stages=own)

    assert triton_cache.install(archive, tmp_path / "host-b") == 0
    hit = read_hit(tmp_path / "host-b", monkeypatch, "k1")
    assert Path(hit["_fwd_kernel.cubin"]).read_bytes() == b"\x7fELF this host's"
    assert "_fwd_kernel.ptx" in hit  # its own entry, IR and all


def test_collect_and_install_through_the_command_line(tmp_path, monkeypatch, capsys):
    compile_into(tmp_path / "host-a", monkeypatch, "k1")
    assert triton_cache.main(["collect", str(tmp_path / "out")]) == 0
    assert "1 kernels from" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "host-a")

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "host-b"))
    # the carried folder, as tools/gpu-env.sh passes it
    assert triton_cache.main(["install", str(tmp_path / "out")]) == 0
    assert "1 kernels added" in capsys.readouterr().out
    assert read_hit(tmp_path / "host-b", monkeypatch, "k1")


def test_the_cache_is_tritons_default_without_the_variable():
    assert triton_cache.cache_dir({"HOME": "/h"}) == Path("/h/.triton/cache")
    assert triton_cache.cache_dir({"TRITON_CACHE_DIR": "/c", "HOME": "/h"}) == Path(
        "/c"
    )


def test_a_kernel_triton_compiled_is_a_hit_after_the_trip(tmp_path, monkeypatch):
    """End to end through triton.compile for sm_90 (Triton's own ptxas, no GPU needed): the
    carried entry, without its IR, is what compile returns on the next host."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def add(x, y, out, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        total = tl.load(x + i, mask=inside) + tl.load(y + i, mask=inside)
        tl.store(out + i, total, mask=inside)

    def compile_add():
        signature = {"x": "*fp32", "y": "*fp32", "out": "*fp32", "n": "i32"}
        source = ASTSource(fn=add, signature=signature, constexprs={"BLOCK": 128})
        return triton.compile(source, target=GPUTarget("cuda", 90, 32))

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "host-a"))
    compiled = compile_add()
    assert "ptx" in compiled.asm  # a fresh compile keeps every stage
    archive = tmp_path / triton_cache.ARCHIVE
    assert triton_cache.pack(tmp_path / "host-a", archive).entries == 1
    shutil.rmtree(tmp_path / "host-a")

    assert triton_cache.install(archive, tmp_path / "host-b") == 1
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "host-b"))
    hit = compile_add()
    assert sorted(hit.asm) == ["cubin"]  # the carried binary, not a new compile
    assert hit.asm["cubin"] == compiled.asm["cubin"]
