"""Load the CUDA driver stub before any test module here imports torch, sgl_kernel or sglang.

Interim home: this belongs in test/registered/conftest.py (which already does the same); the
duplicate is harmless because cudastub.preload() is idempotent.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

try:
    from specpatch import cudastub  # installed editable by tools/setup.sh
except ImportError:  # bare checkout (GPU host): the package lives in <repo>/tools
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
    from specpatch import cudastub

# Module level, not a fixture: collection imports test modules, and sgl_kernel's extensions
# need libcuda.so.1 resolvable at their first import.
CUDA_STUB = cudastub.preload()  # "driver" on a host with a real NVIDIA driver, else the stub path


@pytest.fixture(scope="session")
def cuda_stub() -> str:
    return CUDA_STUB
