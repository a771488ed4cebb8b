"""specpatch.gpu_host.flashinfer_stage: FlashInfer's JIT headers to the GPU host, compiled modules back."""

from __future__ import annotations

import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from specpatch.gpu_host import flashinfer_stage as stage
from specpatch.testing import engine as eng

WHEEL_FILES = {
    "flashinfer/__init__.py": "",
    "flashinfer/data/csrc/kernel.cu": "// shipped in the bundle already",
    "flashinfer/data/include/flashinfer/attn.cuh": "// shipped in the bundle already",
    "flashinfer/data/cutlass/include/cutlass/cutlass.h": "#define CUTLASS 1",
    "flashinfer/data/cccl/cub/cub.cuh": "#define CUB 1",
    "flashinfer/data/spdlog/include/spdlog/spdlog.h": "#define SPDLOG 1",
}


@pytest.fixture
def store(tmp_path) -> Path:
    wheel = tmp_path / "flashinfer_python-0.6.11.post1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in WHEEL_FILES.items():
            zf.writestr(name, text)
    stage.pack(wheel, tmp_path / "store")
    return tmp_path / "store"


def test_pack_keeps_only_the_header_trees_the_bundle_drops(store):
    with tarfile.open(store / stage.HEADERS) as tar:
        names = sorted(m.name for m in tar.getmembers())
    assert names == [
        "cccl/cub/cub.cuh",
        "cutlass/include/cutlass/cutlass.h",
        "spdlog/include/spdlog/spdlog.h",
    ]
    manifest = json.loads((store / stage.MANIFEST).read_text())
    assert manifest["flashinfer_version"] == "0.6.11.post1"


def test_install_unpacks_headers_into_the_package(store, tmp_path):
    package = tmp_path / "site" / "flashinfer"
    assert stage.install(store, package, "0.6.11.post1") == []
    assert (
        package / "data/cutlass/include/cutlass/cutlass.h"
    ).read_text() == "#define CUTLASS 1"
    assert (package / "data/cccl/cub/cub.cuh").is_file()


def test_install_refuses_another_version_and_a_damaged_archive(store, tmp_path):
    with pytest.raises(
        SystemExit,
        match="headers are for flashinfer 0.6.11.post1, this host imports 0.6.12",
    ):
        stage.install(store, tmp_path / "pkg", "0.6.12")
    with (store / stage.HEADERS).open("ab") as f:
        f.write(b"\0")
    with pytest.raises(SystemExit, match="does not match its manifest"):
        stage.install(store, tmp_path / "pkg", "0.6.11.post1")


def test_collected_modules_come_back_as_aot_modules(store, tmp_path):
    jit, aot = tmp_path / "cached_ops", tmp_path / "aot"
    for root, name in (
        (jit, "batch_prefill_hd128"),
        (jit, "norm"),
        (aot, "batch_decode_hd64"),
        (aot, "norm"),
    ):
        (root / name).mkdir(parents=True)
        (root / name / f"{name}.so").write_bytes(root.name.encode())
    (jit / "norm" / "norm.cuda.o").write_bytes(b"object files stay")
    (jit / "norm" / "helper.so").write_bytes(b"not the module")
    assert stage.collect(store, [jit, aot]) == [
        "batch_decode_hd64",
        "batch_prefill_hd128",
        "norm",
    ]
    package = tmp_path / "host" / "flashinfer"
    assert stage.install(store, package, "0.6.11.post1") == [
        "batch_decode_hd64",
        "batch_prefill_hd128",
        "norm",
    ]
    assert (
        package / "data/aot/norm/norm.so"
    ).read_bytes() == b"cached_ops", "the JIT build wins over a carried one"
    assert sorted(p.name for p in (package / "data/aot/norm").iterdir()) == ["norm.so"]


def test_modules_install_without_the_headers_and_nothing_is_refused(store, tmp_path):
    """Carried modules alone install (the headers stay home to save room); a store with
    neither could run no FlashInfer kernel and is refused."""
    module = tmp_path / "jit" / "norm"
    module.mkdir(parents=True)
    (module / "norm.so").write_bytes(b"compiled")
    stage.collect(store, [tmp_path / "jit"])
    (store / stage.HEADERS).unlink()
    package = tmp_path / "host" / "flashinfer"
    assert "neither JIT headers nor compiled modules" in eng.flashinfer_kernels_missing(
        package
    )
    assert stage.install(store, package, "0.6.11.post1") == ["norm"]
    # The GPU tests run on the modules alone (one they lack fails to compile, not skips).
    assert eng.flashinfer_kernels_missing(package) is None
    assert (package / "data/aot/norm/norm.so").read_bytes() == b"compiled"
    assert not (package / "data/cutlass").exists()
    (store / stage.MODULES).unlink()
    with pytest.raises(SystemExit, match="neither jit-headers.tar.xz nor"):
        stage.install(store, package, "0.6.11.post1")


def test_modules_install_once_and_never_over_a_loaded_library(store, tmp_path):
    """Every script of a device call sources gpu-env.sh, while engines of an earlier one run
    with these libraries loaded: installing the same modules again leaves the files alone, and
    new modules land by rename, so a process holding the old file keeps reading it (writing
    over a loaded library killed three engines of a call with SIGSEGV)."""
    module = tmp_path / "jit" / "norm"
    module.mkdir(parents=True)
    (module / "norm.so").write_bytes(b"first build")
    stage.collect(store, [tmp_path / "jit"])
    package = tmp_path / "host" / "flashinfer"
    so = package / "data/aot/norm/norm.so"

    assert stage.install(store, package, "0.6.11.post1") == ["norm"]
    inode = so.stat().st_ino
    with so.open("rb") as loaded:
        assert stage.install(store, package, "0.6.11.post1") == ["norm"]
        assert so.stat().st_ino == inode, "the same modules were written again"

        (module / "norm.so").write_bytes(b"second build")
        stage.collect(store, [tmp_path / "jit"])
        stage.install(store, package, "0.6.11.post1")
        assert so.read_bytes() == b"second build"
        assert loaded.read() == b"first build", "the loaded file was written over"
    assert sorted(p.name for p in (package / "data/aot").iterdir()) == [
        stage.MODULES + ".installed",
        "norm",
    ]


# What sglang's flashinfer backend loaded on an H100 for the toy pair and the Qwen3 + EAGLE3 pair
# (head_dim 64), with the mission-command server (launch_server) adding cascade and sampling
# (flashinfer_stage collect, 2026-11-25): prebuild must make exactly these.
MODULES_LOADED_FOR_HEAD_DIM_64 = [
    "batch_decode_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_64_head_dim_vo_64_posenc_0_use_swa_False_use_logits_cap_False",
    "batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_64_head_dim_vo_64_posenc_0_use_swa_False_use_logits_cap_False_f16qk_False",
    "batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_64_head_dim_vo_64_posenc_0_use_swa_False_use_logits_cap_False_f16qk_False_sm90",
    "cascade",
    "norm",
    "quantization",
    "sampling",
]


def test_prebuild_makes_the_modules_the_gpu_host_loaded(monkeypatch):
    # FlashInfer reads its target architectures once, at import (from the GPU, or from
    # FLASHINFER_CUDA_ARCH_LIST as prebuild's child process gives it): set them on that object.
    from flashinfer.jit.core import current_compilation_context

    monkeypatch.setattr(current_compilation_context, "TARGET_CUDA_ARCHS", {(9, "0a")})
    names = sorted(spec.name for spec in stage.module_specs([64]))
    assert names == MODULES_LOADED_FOR_HEAD_DIM_64
    with_128 = {spec.name for spec in stage.module_specs([64, 128])}
    assert len(with_128) == 10
    assert {n for n in with_128 if "head_dim_qk_128" in n} == {
        n.replace("_64_", "_128_")
        for n in MODULES_LOADED_FOR_HEAD_DIM_64
        if "head_dim" in n
    }


def test_prebuild_without_head_dims_makes_what_every_engine_loads(
    monkeypatch, tmp_path
):
    """`--head-dims ""`: sglang's RMSNorm is FlashInfer's, so a triton engine builds the norm
    module too; no attention module."""
    from flashinfer.jit.core import current_compilation_context

    monkeypatch.setattr(current_compilation_context, "TARGET_CUDA_ARCHS", {(9, "0a")})
    assert sorted(spec.name for spec in stage.module_specs([])) == [
        "cascade",
        "norm",
        "quantization",
        "sampling",
    ]
    asked = []
    monkeypatch.setattr(
        stage, "prebuild", lambda out, dims, cache, jobs: asked.append(dims) or []
    )
    assert stage.main(["prebuild", str(tmp_path), "--head-dims", ""]) == 0
    assert stage.main(["prebuild", str(tmp_path), "--head-dims", "64,128"]) == 0
    assert asked == [[], [64, 128]]
