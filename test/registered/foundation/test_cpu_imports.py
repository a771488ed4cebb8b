"""The patched stack imports on a CPU machine (with the driver stub) and reports no GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
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


def import_in_fresh_interpreter(module: str) -> subprocess.CompletedProcess:
    # A fresh process per module: an import that only works because another module was
    # imported first (or a circular import) must fail here.
    code = (
        "from specpatch import cudastub; cudastub.preload()\n"
        f"import importlib, torch; importlib.import_module({module!r})\n"
        "print('cuda', torch.cuda.is_available())\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO / "tools"), "PATH": "/usr/bin:/bin"}, timeout=300)


def test_imports_in_one_interpreter():
    import torch

    import importlib

    for module in MODULES:
        importlib.import_module(module)
    assert not torch.cuda.is_available()


@pytest.mark.parametrize("module", ["sglang.srt.speculative.eagle_utils", "sglang.srt.speculative.eagle_worker_v2",
                                    "sglang.srt.server_args"])
def test_import_alone(module):
    result = import_in_fresh_interpreter(module)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("cuda False")


def test_patched_build_is_installed():
    from specpatch.cli import installed_stamp

    stamp = installed_stamp()
    assert stamp is not None, "sglang in this environment is not a specpatch build (run tools/setup.sh)"
    assert stamp["upstream"] == "sglang==0.5.12.post1"


def test_stub_preload_is_idempotent():
    from specpatch import cudastub

    first = cudastub.preload()
    assert cudastub.preload() == first
    assert first == "driver" or first.endswith("libcuda.so.1")
