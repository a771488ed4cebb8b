"""Reporting: violation lines, capped logging, JSON stats, Prometheus counters."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from canary_sim import SimEngine

from sglang.srt.kv_canary.config import CanaryMode
from sglang.srt.kv_canary.report import (
    METRIC_CHECKS,
    METRIC_VIOLATIONS,
    Violation,
    kv_canary_stats,
)


def _violation(**over):
    base = dict(
        rid="r1",
        group="draft step 1",
        forward_mode="DECODE",
        req_row=3,
        position=7,
        slot=42,
        borrowed=False,
        expected_fp=0x1235,
        expected_token=9,
        found_fp=0x99,
        found_writer_row=5,
        found_writer_pos=2,
    )
    return Violation(**{**base, **over})


def test_violation_line_names_everything_needed():
    line = _violation().describe()
    for part in (
        "rid=r1",
        "group=draft step 1",
        "pos=7",
        "slot=42",
        "token 9",
        "0x0000000000001235",
        "written for row 5 pos 2",
    ):
        assert part in line
    assert (
        "found never written"
        in _violation(found_fp=0, found_writer_row=None).describe()
    )
    assert "found freed" in _violation(found_fp=2, found_writer_row=None).describe()
    assert (
        "borrowed prefix"
        in _violation(borrowed=True, expected_fp=0, expected_token=None).describe()
    )
    assert "0xffffffffffffffff" in _violation(expected_fp=-1).describe()


def _corrupted_engine(mode=CanaryMode.LOG, n=40):
    engine = SimEngine(seed=2, eagle=False, mode=mode)
    engine.target.reporter.max_log_lines = 5
    req = engine.admit(n)
    engine.target.group.slot_fp[engine.r2t[req.row, :n].to(torch.int64)] = 3
    return engine, req


def test_log_lines_are_capped(caplog):
    engine, req = _corrupted_engine()
    with caplog.at_level(logging.ERROR, logger="sglang.srt.kv_canary"):
        engine.decode([req])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 6 and all("KV canary violation" in line for line in lines[:5])
    assert "35 more violation(s) in group target (DECODE)" in lines[5]


def test_stats_are_json_and_count_dropped_records():
    engine, req = _corrupted_engine(
        n=80
    )  # more violations than the 64 records a forward keeps
    engine.decode([req])
    stats = json.loads(json.dumps(kv_canary_stats()))
    assert stats["violations_total"] == 80 and stats["violations_by_group"] == {
        "target": 80
    }
    assert stats["checks_total"] == 80 and stats["records_dropped"] == 16
    assert (
        stats["forwards_checked"] == 2
    )  # the extend (nothing to check yet) and the decode


def test_prometheus_counters():
    prometheus_client = pytest.importorskip("prometheus_client")
    engine, req = _corrupted_engine()
    engine.decode([req])
    registry = prometheus_client.REGISTRY
    violations = registry.get_sample_value(METRIC_VIOLATIONS, {"group": "target"})
    checks = registry.get_sample_value(METRIC_CHECKS, {"group": "target"})
    assert violations is not None and violations >= 40 and checks >= 40


def test_clean_forwards_count_their_checks_in_prometheus():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.REGISTRY

    def sample(metric):
        return registry.get_sample_value(metric, {"group": "target"}) or 0.0

    engine = SimEngine(seed=5, eagle=False)
    req = engine.admit(30)
    checks, violations = sample(METRIC_CHECKS), sample(METRIC_VIOLATIONS)
    engine.decode([req])
    engine.decode([req])
    assert (
        sample(METRIC_CHECKS) - checks == 30 + 31
        and sample(METRIC_VIOLATIONS) == violations
    )
