"""Shared test setup: make `specpatch` importable, load the CUDA driver stub on CPU machines,
skip `gpu` tests without CUDA, and record metrics that `--junitxml` reports (the GPU tier's
summary, tools/gpu-tests.sh).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

try:
    import specpatch  # noqa: F401  (installed editable by tools/setup.sh)
except ImportError:  # the GPU host runs from a bare checkout
    sys.path.insert(0, str(REPO / "tools"))

from specpatch.testing import cudastub  # noqa: E402

# Must run before anything imports sgl_kernel: it links libcuda.so.1, absent without a driver.
CUDA_STUB = cudastub.preload()  # "driver" on a GPU host


@pytest.fixture(scope="session")
def cuda_stub() -> str:
    return CUDA_STUB


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU (run the GPU tier on the GPU host: tools/gpu-tests.sh)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _report_cuda_stub(record_testsuite_property):
    """--junitxml names the libcuda the run loaded: "driver" on a GPU host."""
    record_testsuite_property("cuda_stub", CUDA_STUB)


@pytest.fixture
def record_metric(request):
    """Record a number for the run's report, e.g. record_metric("tok_per_s", 1834.2): --junitxml
    writes it as a <property> of the test's <testcase>. pytest's record_property does the same
    but warns under the default junit family (xunit2)."""

    def record(name: str, value) -> None:
        request.node.user_properties.append((name, value))

    return record


# Synthetic model pairs for GPU tests, generated once per session (on the GPU, no downloads).
def _pair(tmp_path_factory, preset: str, agreement: float) -> tuple[Path, Path]:
    from specpatch.testing import synth

    cache = os.environ.get("SPECPATCH_MODEL_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("models")
    out = root / f"{preset}-a{agreement}"
    target, draft = out / "target", out / "draft"
    if not (draft / synth.META).exists():
        synth.make_pair(out, preset, agreement, device="cuda")
    return target, draft


@pytest.fixture(scope="session")
def toy_pair(tmp_path_factory):
    """1-layer toy target + EAGLE draft agreeing on ~70% of tokens."""
    return _pair(tmp_path_factory, "toy", 0.7)


@pytest.fixture(scope="session")
def small_pair(tmp_path_factory):
    """4-layer target with 8 query heads + EAGLE draft (~70 %): enough heads that a verify at
    bs 48 launches the (request, head) pairs triton's short extend tile needs."""
    return _pair(tmp_path_factory, "small", 0.7)


@pytest.fixture(scope="session")
def standalone_pair(tmp_path_factory):
    """The toy Llama target + a STANDALONE draft, an ordinary Llama LM agreeing with it on ~70%
    of tokens (specpatch.testing.synth_standalone)."""
    from specpatch.testing import synth, synth_standalone

    cache = os.environ.get("SPECPATCH_MODEL_CACHE")
    out = (
        Path(cache) if cache else tmp_path_factory.mktemp("models")
    ) / "standalone-toy-a0.7"
    if not (out / "draft" / synth.META).exists():
        synth_standalone.make_standalone_pair(out, "toy", 0.7, device="cuda")
    return out / "target", out / "draft"


@pytest.fixture(scope="session")
def qwen3_eagle3_pair(tmp_path_factory):
    """Dense Qwen3 target + EAGLE3 draft whose first step agrees on ~70% of tokens: the pair
    DP attention can run (specpatch.testing.synth_eagle3)."""
    from specpatch.testing import synth, synth_eagle3

    cache = os.environ.get("SPECPATCH_MODEL_CACHE")
    name = f"qwen3-eagle3-aux{len(synth_eagle3.AUX_LAYER_IDS)}-a0.7"
    out = (Path(cache) if cache else tmp_path_factory.mktemp("models")) / name
    if not (out / "draft" / synth.META).exists():
        synth_eagle3.make_eagle3_pair(out, "toy", 0.7, device="cuda")
    return out / "target", out / "draft"


@pytest.fixture(scope="session")
def step3p5_mtp_model(tmp_path_factory):
    """A Step-3.5-shaped checkpoint: the bigram target and three MTP layers that agree with it
    on ~90%, ~70% and ~50% of tokens, the draft of sglang's multi-layer EAGLE
    (specpatch.testing.synth_mtp)."""
    from specpatch.testing import synth, synth_mtp

    cache = os.environ.get("SPECPATCH_MODEL_CACHE")
    agreements = "-".join(str(a) for a in synth_mtp.MTP_AGREEMENTS)
    out = (
        Path(cache) if cache else tmp_path_factory.mktemp("models")
    ) / f"step3p5-mtp-toy-a{agreements}"
    if not (out / synth.META).exists():
        synth_mtp.make_mtp_model(out, "toy", device="cuda")
    return out
