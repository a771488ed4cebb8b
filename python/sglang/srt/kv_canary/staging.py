"""The host side of one bracket: stage its forwards before they run, drain their sinks after.

    stage   outside any graph: write the plan (live rows, prefix lengths, sampling switch)
            into the manager's static buffers and empty every sink, in one kernel; note new
            row owners at admitting extends
    drain   outside any graph, after the forwards: copy every sink to the host in one copy
            (waiting for it at once, or leaving a PendingDrain to be read later)

One stage and one drain per bracket, however many single forwards it covers (EAGLE's draft
graph runs all inner draft steps in one replay): the decode loop at batch size 1 is bound by
host launches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from sglang.srt.kv_canary import batch_view
from sglang.srt.kv_canary.contract import (
    RECORD_WIDTH,
    ForwardPlan,
    PlanBuffers,
    ViolationSinks,
)
from sglang.srt.kv_canary.tables import FingerprintGroup, RequestRecord


@dataclass(frozen=True)
class StagedForward:
    """Host-side memory of what `stage` saw, for the report after the forward."""

    mode: str
    batch_size: int
    verify: bool
    rids: Optional[list] = None


@dataclass
class DrainedForward:
    staged: StagedForward
    violation_count: int = 0
    checks: int = 0
    # [min(count, capacity), RECORD_WIDTH] int64 on the host
    records: torch.Tensor = field(
        default_factory=lambda: torch.empty(0, RECORD_WIDTH, dtype=torch.int64)
    )


def stage_forward(
    impl,
    record: RequestRecord,
    owner: FingerprintGroup,
    forward_batch,
    verify: bool,
    plan: PlanBuffers,
    sinks: ViolationSinks,
) -> StagedForward:
    """Stage `forward_batch` for every single forward of `owner`'s manager (they share `plan`)."""
    view = batch_view.view_of(forward_batch)
    if view.skipped:
        # Zero live rows: the kernel reads no position, so any tensor stands in for them.
        impl.stage_plan(
            ForwardPlan(plan.live_rows, None, 1, 0, 0, verify=False), plan, sinks
        )
        return StagedForward(view.mode, 0, verify=False)
    bs = view.batch_size
    if bs > plan.verify_lens.numel():
        raise ValueError(
            f"KV canary: batch of {bs} rows exceeds the {plan.verify_lens.numel()} request rows"
        )
    rids = getattr(forward_batch, "rids", None)
    if view.admits_requests:
        prefix_lens = batch_view.read_prefix_lens(forward_batch, view)
        record.adopt_owners(forward_batch.req_pool_indices[:bs], rids, prefix_lens)
    impl.stage_plan(
        batch_view.forward_plan(forward_batch, view, owner.speculative_tail, verify),
        plan,
        sinks,
    )
    return StagedForward(
        view.mode, bs, verify, list(rids) if rids is not None else None
    )


@dataclass
class PendingDrain:
    """One bracket's sinks on their way to the host."""

    staged: StagedForward
    # single forwards the bracket ran, in order
    indices: Sequence[int]
    # [num_sinks, 1 + capacity, RECORD_WIDTH] int64 on the host, a copy of the sinks (row 0 of
    # each: violations seen, positions checked); None when the forwards were not checked
    host: Optional[torch.Tensor] = None
    # Recorded after the device-to-host copy; None when it already completed.
    copied: Optional["torch.cuda.Event"] = None
    # Hands `host` back for reuse once read.
    release: Optional[Callable[["PendingDrain"], None]] = None

    # Set once the copy is known to have landed, so result() need not wait on it again.
    landed: bool = False

    def ready(self) -> bool:
        self.landed = self.landed or self.copied is None or self.copied.query()
        return self.landed

    def result(self) -> list[tuple[int, DrainedForward]]:
        """(single forward index, what its sink held), in bracket order."""
        if self.host is None:
            return [(index, DrainedForward(self.staged)) for index in self.indices]
        if not self.landed and self.copied is not None:
            self.copied.synchronize()
        counters = self.host[:, 0, :2].tolist()
        capacity = self.host.shape[1] - 1
        drained = []
        for index in self.indices:
            count, checks = counters[index]
            if count:
                records = self.host[index, 1 : 1 + min(count, capacity)].clone()
                drained.append(
                    (index, DrainedForward(self.staged, count, checks, records))
                )
            else:
                drained.append((index, DrainedForward(self.staged, 0, checks)))
        if self.release is not None:
            self.release(self)
        return drained


class SinkDrainer:
    """Takes a manager's sinks off the device after each bracket."""

    def __init__(self, sinks: ViolationSinks):
        self.sinks = sinks
        self._pinned = _PinnedCopies(sinks.storage) if sinks.storage.is_cuda else None

    def drain(
        self, staged: StagedForward, indices: Sequence[int], deferred: bool
    ) -> PendingDrain:
        """Not deferred (or on a CPU device): one host sync when the forwards were checked, and
        the result is ready. Deferred: one copy into pinned memory behind the forwards on the
        current stream, read once it has landed. The next stage empties the sinks."""
        if not staged.verify:
            return PendingDrain(staged, indices)
        if deferred and self._pinned is not None:
            host, copied = self._pinned.take()
            host.copy_(self.sinks.storage, non_blocking=True)
            copied.record()
            return PendingDrain(
                staged, indices, host, copied, release=self._pinned.give_back
            )
        return PendingDrain(staged, indices, self.sinks.storage.cpu())  # the one sync


class _PinnedCopies:
    """Pinned host copies of the sinks with their events, reused once read: a pinned
    allocation per bracket costs more host time than the copy itself."""

    def __init__(self, like: torch.Tensor):
        self._like = like
        self._free: list[tuple[torch.Tensor, "torch.cuda.Event"]] = []

    def take(self) -> tuple[torch.Tensor, "torch.cuda.Event"]:
        if self._free:
            return self._free.pop()
        host = torch.empty(self._like.shape, dtype=self._like.dtype, pin_memory=True)
        return host, torch.cuda.Event()

    def give_back(self, pending: PendingDrain) -> None:
        self._free.append((pending.host, pending.copied))
