"""Test the checkout's sglang.srt.kv_canary, whatever the installed wheel holds.

The overlay normally reaches sglang through the patched wheel (tools/setup.sh), and a wheel
built earlier may hold an older copy of this package, or none. So the package is bound to
python/sglang/srt/kv_canary/ here, before any test imports it; nothing else in sglang is
touched. On a host without sglang at all (the GPU host running only these tests), python/
itself makes sglang a namespace package.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PACKAGE = REPO / "python" / "sglang" / "srt" / "kv_canary"
HERE = Path(__file__).resolve().parent


def _bind_package_to_checkout() -> None:
    if importlib.util.find_spec("sglang") is None:
        sys.path.insert(0, str(REPO / "python"))
    import sglang.srt

    name = "sglang.srt.kv_canary"
    if getattr(sys.modules.get(name), "__file__", None) == str(PACKAGE / "__init__.py"):
        return
    # Modules collected earlier may have imported the wheel's copy: drop it, submodules too,
    # so the two never mix (those modules keep their reference; these tests do not use it).
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[loaded]
    spec = importlib.util.spec_from_file_location(
        name, PACKAGE / "__init__.py", submodule_search_locations=[str(PACKAGE)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sglang.srt.kv_canary = module
    spec.loader.exec_module(module)


_bind_package_to_checkout()
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # the helper modules next to the tests (canary_sim, kernel_cases)


@pytest.fixture(autouse=True)
def _fresh_canary_stats():
    from sglang.srt.kv_canary.report import STATS

    STATS.reset()
    yield
    STATS.reset()

