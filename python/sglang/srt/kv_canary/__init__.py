"""KV canary: a KV-cache integrity checker for target and EAGLE draft forwards.

Every KV slot a forward writes gets a fingerprint of what should be there (request identity,
position, token id); before a forward reads a request's KV, every slot its req_to_token row
points to must carry the fingerprint it should. Off by default (SGLANG_KV_CANARY); when off the
factory returns None and nothing is allocated or launched. Design and wiring: docs/kv_canary.md.

Modules, in reading order:
    config        env / explicit settings, verify sampling
    fingerprint   the hash and the sentinels
    tables        request record (per req_to_token pool), fingerprint groups (per KV pool)
    contract      arguments of the write / verify implementations
    reference     plain-torch write / verify (the specification)
    kernels       fused triton write / verify (CUDA-graph safe)
    batch_view    what is read out of a ForwardBatch, per forward mode
    single_forward  static buffers + stage / run / drain of one forward call site
    report        violations, log lines, counters, Prometheus, JSON stats
    manager       CanaryManager and its brackets
    faults        fault injection
    api           install_kv_canary and the None-tolerant call-site helpers
"""

from sglang.srt.kv_canary.api import (
    active_step,
    capturing,
    check_canary_settings,
    draft_extend_bracket,
    draft_extend_brackets,
    in_draft_step,
    install_kv_canary,
    on_free,
    on_kv_move,
    on_row_free,
    outside_graph,
    pre_ops,
    runner_bracket,
)
from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode, parse_canary_config
from sglang.srt.kv_canary.manager import (
    CanaryBracketError,
    CanaryManager,
    flush_deferred_findings,
)
from sglang.srt.kv_canary.report import (
    KVCanaryViolationError,
    Violation,
    kv_canary_stats,
)
from sglang.srt.kv_canary.tables import (
    FingerprintGroup,
    RequestRecord,
    move_fingerprints,
)

__all__ = [
    "CanaryBracketError",
    "CanaryConfig",
    "CanaryManager",
    "CanaryMode",
    "FingerprintGroup",
    "KVCanaryViolationError",
    "RequestRecord",
    "Violation",
    "active_step",
    "capturing",
    "check_canary_settings",
    "draft_extend_bracket",
    "draft_extend_brackets",
    "flush_deferred_findings",
    "in_draft_step",
    "install_kv_canary",
    "kv_canary_stats",
    "move_fingerprints",
    "on_free",
    "on_kv_move",
    "on_row_free",
    "outside_graph",
    "parse_canary_config",
    "pre_ops",
    "runner_bracket",
]
