"""Fixtures shared by the tests of benchmark/spec's scripts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "spec"))


@pytest.fixture
def bench_without_models(monkeypatch):
    """bench_e2e whose main() gets a synthetic pair without making one: paths /t and /d, a
    vocabulary of 100 and no greedy table to check outputs against."""
    import bench_e2e

    monkeypatch.setattr(bench_e2e, "ensure_pair", lambda *a: (Path("/t"), Path("/d")))
    monkeypatch.setattr(
        bench_e2e.synth,
        "load_meta",
        lambda p: {"spec": {"vocab": 100}, "num_params": 1e9, "agreement": 0.7},
    )
    monkeypatch.setattr(bench_e2e, "greedy_table", lambda target: None)
    return bench_e2e
