"""The real sglang stack imports on a machine without an NVIDIA driver, via the libcuda stub.

Each module is imported in its own fresh interpreter, so an import that only works because some
other module happened to be imported first fails here. The interpreters run a few at a time
(started by a session fixture) to keep the file well under three minutes.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from specpatch.testing import cudastub

TOOLS = Path(__file__).resolve().parents[3] / "tools"
MODULES = [
    "sgl_kernel",
    "sglang.srt.speculative.eagle_worker_v2",
    "sglang.srt.speculative.standalone_worker_v2",
    "sglang.srt.speculative.multi_layer_eagle_worker_v2",
    "sglang.srt.speculative.eagle_info_v2",
    "sglang.srt.speculative.spec_utils",
    "sglang.srt.speculative.eagle_utils",
    "sglang.srt.speculative.chain_draft",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.attention.flashattention_backend",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.server_args",
    "sglang.srt.managers.scheduler",
]
# Preload first, exactly as the conftest does, then time the import alone.
PROBE = """
import importlib, json, sys, time
from specpatch.testing import cudastub
libcuda = cudastub.preload()
start = time.perf_counter()
importlib.import_module(sys.argv[1])
seconds = time.perf_counter() - start
import torch
print(json.dumps({"libcuda": libcuda, "seconds": round(seconds, 2), "cuda": torch.cuda.is_available(),
                  "sgl_kernel": "sgl_kernel.load_utils" in sys.modules}))
"""

needs_no_driver = pytest.mark.skipif(
    cudastub.loaded_libcuda() == "driver",
    reason="a real NVIDIA driver is present; these check the stub",
)


def _import_fresh(module: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(TOOLS), os.environ.get("PYTHONPATH")])
        ),
    )
    return subprocess.run(
        [sys.executable, "-c", PROBE, module],
        capture_output=True,
        text=True,
        env=env,
        timeout=170,
    )


@pytest.fixture(scope="session")
def fresh_imports():
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 1))) as pool:
        yield {module: pool.submit(_import_fresh, module) for module in MODULES}


@needs_no_driver
def test_preload_uses_the_stub(cuda_stub: str):
    assert cuda_stub.endswith("/libcuda.so.1") and Path(cuda_stub).is_file()
    assert cudastub.loaded_libcuda() == "stub"


@needs_no_driver
def test_torch_sees_no_gpu_after_preload():
    import torch

    assert not torch.cuda.is_available()
    assert torch.cuda.device_count() == 0
    # A CUDA op must fail with a Python error, not crash on the stub.
    with pytest.raises(RuntimeError):
        torch.zeros(1, device="cuda")


def test_preload_is_idempotent(cuda_stub: str):
    assert cudastub.preload() == cuda_stub
    assert cudastub.preload() == cuda_stub
    # A fresh copy of the module has no memory of the first call; it must recognise the stub
    # already in the process by its marker rather than mistake it for a real driver.
    fresh = importlib.reload(cudastub)
    assert fresh.preload() == cuda_stub


@pytest.mark.parametrize("module", MODULES)
def test_imports_in_fresh_interpreter(
    module: str,
    fresh_imports: dict[str, Future],
    cuda_stub: str,
    request: pytest.FixtureRequest,
):
    result = fresh_imports[module].result()
    assert result.returncode == 0, f"import {module} failed:\n{result.stderr[-3000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # Into the run summary (user_properties; record_property would warn under junit xunit2).
    request.node.user_properties += [
        ("import_seconds", report["seconds"]),
        ("sgl_kernel_loaded", report["sgl_kernel"]),
    ]
    assert report["libcuda"] == cuda_stub
    if cuda_stub != "driver":
        assert report["cuda"] is False


def test_installed_sglang_is_the_patched_build():
    from specpatch.cli import installed_stamp

    stamp = installed_stamp()
    assert (
        stamp is not None
    ), "sglang here is not a specpatch build (run tools/setup.sh)"
    assert stamp["upstream"] == "sglang==0.5.12.post1"
    assert [p["name"] for p in stamp["patches"]] == [
        line.split()[0]
        for line in (TOOLS.parent / "patches" / "series").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
