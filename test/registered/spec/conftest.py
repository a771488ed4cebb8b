"""Synthetic model pairs for GPU tests, generated once per session (on the GPU, no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _pair(tmp_path_factory, preset: str, agreement: float) -> tuple[Path, Path]:
    from specpatch import synth

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
