"""CanaryManager: one per ModelRunner (its KV pool is one fingerprint group), owning one
SingleForwardCanary per forward that can share a CUDA graph, and the brackets around them.

    with m.with_ops_outside_graph(indices, forward_batch):   # host side: stage, then drain
        ...
        with m.with_active_single_forward_manager(i):        # which single forward runs next
            m.pre_ops_maybe_inside_graph(forward_batch)      # verify + write; may be captured

A pre-op must find its single forward staged by an enclosing with_ops_outside_graph, or run
under `capturing()` (CUDA-graph capture and its warm-up runs, where nothing is staged and the
kernels only need to be recorded). Anything else is a wiring bug and raises.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from typing import Iterable, Iterator, Optional

import torch

from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode, VerifySampler
from sglang.srt.kv_canary.contract import PlanBuffers, ViolationSinks
from sglang.srt.kv_canary.report import (
    CanaryReporter,
    KVCanaryViolationError,
    Violation,
)
from sglang.srt.kv_canary.single_forward import SingleForwardCanary
from sglang.srt.kv_canary.staging import PendingDrain, SinkDrainer, stage_forward
from sglang.srt.kv_canary.tables import (
    FingerprintGroup,
    RequestRecord,
    move_fingerprints,
)

# Deferred drains waiting for their copies; past this many the oldest are waited for.
MAX_PENDING_DRAINS = 16


# Every live manager, so that the scheduler can report deferred findings when it goes idle.
_live_managers: "weakref.WeakSet[CanaryManager]" = weakref.WeakSet()


def flush_deferred_findings() -> None:
    """Report every manager's deferred findings now (raising in raise mode). The scheduler
    calls this when idle: without it the last forwards' findings would wait for the next
    request. Nothing to do (one empty loop) when the canary is off."""
    for manager in list(_live_managers):
        manager.flush()


class CanaryBracketError(RuntimeError):
    """A canary bracket was nested, missing, or named a single forward that does not exist."""


class CanaryManager:
    def __init__(
        self,
        *,
        config: CanaryConfig,
        record: RequestRecord,
        group: FingerprintGroup,
        num_single_forwards: int,
        impl,
        fault_injector=None,
    ):
        if num_single_forwards < 1:
            raise ValueError("a canary manager needs at least one single forward")
        self.config = config
        self.record = record
        self.group = group
        self.impl = impl  # reference or kernels: stage_plan / write_fingerprints / verify_fingerprints
        self.fault_injector = fault_injector
        # One plan and one sink tensor for all single forwards: a bracket stages and drains
        # them together.
        self.plan = PlanBuffers.allocate(record.req_to_token.shape[0], record.device)
        self.sinks = ViolationSinks.allocate(
            num_single_forwards, config.violation_capacity, record.device
        )
        self.single_forwards = [
            SingleForwardCanary(i, self.plan, self.sinks.sink(i))
            for i in range(num_single_forwards)
        ]
        self._drainer = SinkDrainer(self.sinks)
        self.sampler = VerifySampler(config)
        self.reporter = CanaryReporter(config.max_log_lines)
        self._active: Optional[int] = None
        self._outside: Optional[list[int]] = None
        self._capturing = 0
        # one drain per bracket, in bracket order
        self._pending: deque[PendingDrain] = deque()
        _live_managers.add(self)

    @property
    def is_draft(self) -> bool:
        return self.group.is_draft

    def label(self, index: int) -> str:
        """Report name of single forward `index`: "target", or "draft step i"."""
        return f"{self.group.name} step {index}" if self.is_draft else self.group.name

    # ---------------------------------------------------------------- brackets

    @property
    def in_bracket(self) -> bool:
        """Whether a bracket is open: a forward inside it is already covered."""
        return self._outside is not None or self._active is not None

    @contextlib.contextmanager
    def with_active_single_forward_manager(
        self, index: int
    ) -> Iterator[SingleForwardCanary]:
        """Route pre-ops to single forward `index` (EAGLE inner draft step `index`)."""
        self._check_index(index)
        if self._active is not None:
            raise CanaryBracketError(
                f"nested with_active_single_forward_manager({index}) inside ({self._active})"
            )
        self._active = index
        try:
            yield self.single_forwards[index]
        finally:
            self._active = None

    @contextlib.contextmanager
    def with_ops_outside_graph(
        self, single_forward_indices: Iterable[int], maybe_inaccurate_forward_batch
    ) -> Iterator[None]:
        """Host-side ops around one forward (or one graph replay covering several).

        On entry: report deferred findings that have landed, poison slots freed since the last
        bracket, inject a configured fault, decide sampling, stage the batch once for every
        listed single forward (the batch as it is before replay: only batch size, rows,
        positions and rids are read). On exit: drain and report, raising KVCanaryViolationError
        in raise mode (with deferred drains, at the bracket that reads the findings back).
        """
        indices = list(single_forward_indices)
        for index in indices:
            self._check_index(index)
        if self._outside is not None:
            raise CanaryBracketError(
                f"nested with_ops_outside_graph({indices}) inside ({self._outside})"
            )

        self._report(block=False)
        self.record.apply_pending_frees()
        if self.fault_injector is not None:
            self.fault_injector.maybe_inject(self, maybe_inaccurate_forward_batch)
        verify = self.sampler.tick()
        staged = stage_forward(
            self.impl,
            self.record,
            self.group,
            maybe_inaccurate_forward_batch,
            verify,
            self.plan,
            self.sinks,
        )
        for index in indices:
            self.single_forwards[index].staged = staged
        self._outside = indices
        try:
            yield
        finally:
            # On an exception the findings are dropped unread: the next stage empties the sinks.
            self._outside = None
            for index in indices:
                self.single_forwards[index].staged = None

        self._pending.append(
            self._drainer.drain(staged, indices, self.config.deferred_drain)
        )
        self._report(
            block=not self.config.deferred_drain
            or len(self._pending) > MAX_PENDING_DRAINS
        )

    def flush(self) -> None:
        """Wait for every deferred drain and report it (raising in raise mode)."""
        self._report(block=True)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Around CUDA-graph capture (warm-up runs included): pre-ops are recorded, not staged.

        The live-row count reads 0 meanwhile, so the warm-up runs touch nothing; the count
        staged by an enclosing bracket (a recapture from inside a forward) is put back
        afterwards, in stream order.
        """
        saved = self.plan.live_rows.clone()
        self.plan.live_rows.zero_()
        self._capturing += 1
        try:
            yield
        finally:
            self._capturing -= 1
            self.plan.live_rows.copy_(saved)

    # ---------------------------------------------------------------- the forward itself

    def pre_ops_maybe_inside_graph(self, forward_batch) -> None:
        """Verify what this forward reads, then fingerprint what it writes. Sync-free."""
        index = self._dispatch_index()
        single = self.single_forwards[index]
        if not single.is_staged and not self._capturing:
            raise CanaryBracketError(
                f"KV canary pre-op for {self.label(index)} outside with_ops_outside_graph "
                f"(staged: {self._outside})"
            )
        storage = self.record.group_of_pool(forward_batch.token_to_kv_pool)
        if storage is None:
            raise CanaryBracketError(
                f"KV canary: the batch's KV pool has no fingerprint group ({self.label(index)})"
            )
        single.run(self.impl, self.record, storage, self.group, forward_batch)

    # ---------------------------------------------------------------- KV bookkeeping

    def move_fingerprints(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Call next to this pool's move_kv_cache(tgt_loc, src_loc)."""
        move_fingerprints(self.group, tgt_loc, src_loc)

    def note_freed(self, slots: torch.Tensor) -> None:
        """Call where the allocator takes slots back (they are poisoned at the next bracket)."""
        self.record.note_freed(slots)

    # ---------------------------------------------------------------- internals

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self.single_forwards):
            raise CanaryBracketError(
                f"single forward {index} out of range: {self.group.name} has {len(self.single_forwards)}"
            )

    def _dispatch_index(self) -> int:
        if self._active is not None:
            return self._active
        if len(self.single_forwards) == 1:
            return 0
        raise CanaryBracketError(
            f"KV canary pre-op for {self.group.name} ({len(self.single_forwards)} single forwards) "
            "needs with_active_single_forward_manager(i)"
        )

    def _report(self, block: bool) -> None:
        """Report drains in bracket order: all of them when blocking, else those landed."""
        violations: list[Violation] = []
        while self._pending and (block or self._pending[0].ready()):
            for index, drained in self._pending.popleft().result():
                violations += self.reporter.report(drained, self.label(index))
        if violations and self.config.mode is CanaryMode.RAISE:
            raise KVCanaryViolationError(violations)
