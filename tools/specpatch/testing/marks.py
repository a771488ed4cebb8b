"""pytest marks the GPU tier shares: a backend the host cannot run, a test that needs two GPUs,
and the attention backends spec v2 trees run on."""

from __future__ import annotations

import pytest

from specpatch.testing import engine as eng


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


FLASHINFER_SKIP = pytest.mark.skipif(
    eng.flashinfer_unavailable() is not None, reason=str(eng.flashinfer_unavailable())
)
FA3_SKIP = pytest.mark.skipif(
    eng.fa3_unavailable() is not None, reason=str(eng.fa3_unavailable())
)
TWO_GPUS = pytest.mark.skipif(
    gpu_count() < 2, reason="needs two GPUs (the nvidia-h100-x2 or nvidia-h200-x2 kind)"
)

# Trees run spec v2 on all three; flashinfer is sglang's default backend for topk > 1, fa3
# Hopper's for topk 1 and the one users pick there.
TREE_BACKENDS = [
    "triton",
    pytest.param("flashinfer", marks=FLASHINFER_SKIP),
    pytest.param("fa3", marks=FA3_SKIP),
]
