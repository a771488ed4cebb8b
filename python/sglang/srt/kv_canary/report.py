"""Turning drained violation records into log lines, counters and JSON.

One process-wide CanaryStats collects every manager's numbers (the target's and the draft's),
so `kv_canary_stats()` answers for the whole process; Prometheus counters are created on first
use when prometheus_client is importable.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass
from typing import Optional

from sglang.srt.kv_canary import contract as rec
from sglang.srt.kv_canary.fingerprint import FREED, NEVER_WRITTEN, unpack_writer
from sglang.srt.kv_canary.staging import DrainedForward

logger = logging.getLogger("sglang.srt.kv_canary")

METRIC_CHECKS = "sglang:kv_canary_checks_total"
METRIC_VIOLATIONS = "sglang:kv_canary_violations_total"


class KVCanaryViolationError(RuntimeError):
    def __init__(self, violations: list["Violation"]):
        self.violations = violations
        head = violations[0].describe() if violations else "(no records)"
        super().__init__(f"KV canary: {len(violations)} violation(s); first: {head}")


@dataclass(frozen=True)
class Violation:
    rid: Optional[str]
    group: str  # "target", "draft step 1", ...
    forward_mode: str
    req_row: int
    position: int
    slot: int
    borrowed: bool  # position came from the prefix cache: checked for liveness and position only
    expected_fp: int
    expected_token: Optional[int]
    found_fp: int
    found_writer_row: Optional[int]
    found_writer_pos: Optional[int]

    def describe(self) -> str:
        if self.borrowed:
            expected = "a live slot written for this position (borrowed prefix)"
        else:
            expected = f"fp=0x{self.expected_fp & (2**64 - 1):016x} (token {self.expected_token})"
        if self.found_fp == NEVER_WRITTEN:
            found = "never written"
        elif self.found_fp == FREED:
            found = "freed"
            if self.found_writer_row is not None:
                found += f" (last written for row {self.found_writer_row} pos {self.found_writer_pos})"
        else:
            found = (
                f"fp=0x{self.found_fp & (2**64 - 1):016x} written for row {self.found_writer_row} "
                f"pos {self.found_writer_pos}"
            )
        return (
            f"KV canary violation: rid={self.rid} group={self.group} mode={self.forward_mode} "
            f"row={self.req_row} pos={self.position} slot={self.slot}: expected {expected}, found {found}"
        )


def decode_records(drained: DrainedForward, group: str) -> list[Violation]:
    rids = drained.staged.rids
    out = []
    for values in drained.records.tolist():
        batch_row = values[rec.REC_BATCH_ROW]
        writer = values[rec.REC_FOUND_WRITER]
        borrowed = (
            values[rec.REC_EXPECTED_TOKEN] == -1 and values[rec.REC_EXPECTED_FP] == 0
        )
        writer_row, writer_pos = unpack_writer(writer) if writer >= 0 else (None, None)
        out.append(
            Violation(
                rid=(
                    rids[batch_row]
                    if rids is not None and 0 <= batch_row < len(rids)
                    else None
                ),
                group=group,
                forward_mode=drained.staged.mode,
                req_row=values[rec.REC_REQ_ROW],
                position=values[rec.REC_POSITION],
                slot=values[rec.REC_SLOT],
                borrowed=borrowed,
                expected_fp=values[rec.REC_EXPECTED_FP],
                expected_token=None if borrowed else values[rec.REC_EXPECTED_TOKEN],
                found_fp=values[rec.REC_FOUND_FP],
                found_writer_row=writer_row,
                found_writer_pos=writer_pos,
            )
        )
    return out


class CanaryStats:
    """Counters since process start; thread-safe (the scheduler and HTTP threads read them)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._zero()

    def _zero(self) -> None:
        self.forwards_checked = 0
        self.checks_total = 0
        self.violations_total = 0
        self.records_dropped = 0  # violations past a forward's record capacity
        self.checks_by_group: dict[str, int] = {}
        self.violations_by_group: dict[str, int] = {}

    def add(self, group: str, checks: int, violations: int, dropped: int) -> None:
        with self._lock:
            self.forwards_checked += 1
            self.checks_total += checks
            self.violations_total += violations
            self.records_dropped += dropped
            self.checks_by_group[group] = self.checks_by_group.get(group, 0) + checks
            self.violations_by_group[group] = (
                self.violations_by_group.get(group, 0) + violations
            )
        _prometheus_add(group, checks, violations)

    def as_dict(self) -> dict:
        with self._lock:
            return {
                "forwards_checked": self.forwards_checked,
                "checks_total": self.checks_total,
                "violations_total": self.violations_total,
                "records_dropped": self.records_dropped,
                "checks_by_group": dict(self.checks_by_group),
                "violations_by_group": dict(self.violations_by_group),
            }

    def reset(self) -> None:
        with self._lock:
            self._zero()


STATS = CanaryStats()


class CanaryReporter:
    """Logs and counts what one manager drains."""

    def __init__(self, max_log_lines: int, stats: CanaryStats = STATS):
        self.max_log_lines = max_log_lines
        self.stats = stats
        self.last_violations: list[Violation] = []

    def report(self, drained: DrainedForward, group: str) -> list[Violation]:
        if not drained.staged.verify:
            return []
        if (
            drained.violation_count == 0
        ):  # the common case: count the checks, nothing to log
            self.stats.add(group, drained.checks, 0, 0)
            return []
        violations = decode_records(drained, group)
        dropped = drained.violation_count - len(violations)
        self.stats.add(group, drained.checks, drained.violation_count, dropped)
        for violation in violations[: self.max_log_lines]:
            logger.error(violation.describe())
        hidden = drained.violation_count - min(len(violations), self.max_log_lines)
        if hidden > 0:
            logger.error(
                f"KV canary: {hidden} more violation(s) in group {group} ({drained.staged.mode}) not shown"
            )
        self.last_violations = violations
        return violations


def kv_canary_stats() -> dict:
    """JSON-able counters for an HTTP endpoint."""
    return STATS.as_dict()


def violation_as_dict(violation: Violation) -> dict:
    return asdict(violation)


# ---------------------------------------------------------------------------- prometheus

_prometheus_lock = threading.Lock()
_prometheus_counters: Optional[tuple] = None
_prometheus_unavailable = False
# group -> (checks child, violations child)
_prometheus_children: dict[str, tuple] = {}


def _prometheus_add(group: str, checks: int, violations: int) -> None:
    counters = _prometheus_children.get(group)
    if counters is None:
        parents = _prometheus()
        if parents is None:
            return
        # labels() takes a lock and a dict lookup per call: resolve each group's children once.
        counters = _prometheus_children.setdefault(
            group, tuple(c.labels(group=group) for c in parents)
        )
    checks_counter, violations_counter = counters
    checks_counter.inc(checks)
    if violations:
        violations_counter.inc(violations)


def _prometheus():
    global _prometheus_counters, _prometheus_unavailable
    if _prometheus_counters is not None or _prometheus_unavailable:
        return _prometheus_counters
    with _prometheus_lock:
        if _prometheus_counters is None and not _prometheus_unavailable:
            try:
                from prometheus_client import Counter
            except ImportError:
                _prometheus_unavailable = True
                return None
            _prometheus_counters = (
                Counter(
                    METRIC_CHECKS,
                    "KV slots whose fingerprint the canary checked",
                    ["group"],
                ),
                Counter(
                    METRIC_VIOLATIONS,
                    "KV slots that did not carry the expected fingerprint",
                    ["group"],
                ),
            )
    return _prometheus_counters
