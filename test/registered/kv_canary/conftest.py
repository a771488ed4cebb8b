"""Shared setup for the KV canary tests: the helper modules next to them (canary_sim,
kernel_cases) on sys.path, and process-wide canary counters reset around every test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


@pytest.fixture(autouse=True)
def _fresh_canary_stats():
    from sglang.srt.kv_canary.report import STATS

    STATS.reset()
    yield
    STATS.reset()
