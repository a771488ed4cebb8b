"""One forward call site's canary: static plan buffers, its violation sink, and its three steps.

    stage   outside any graph: write this forward's plan (live rows, prefix lengths, sampling
            switch) into static buffers and empty the sink, in one kernel; note new row
            owners at admitting extends
    run     maybe inside a graph: verify the prefix each row reads, then fingerprint the writes
    drain   outside any graph, after the forward: copy the sink to the host (waiting for the
            copy at once, or leaving a PendingDrain to be read later)

A captured graph bakes in the addresses of one SingleForwardCanary's buffers, so each forward
that shares a graph with others needs its own: EAGLE's draft graph runs all inner draft steps,
and step i uses single forward i. The target has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from sglang.srt.kv_canary import batch_view
from sglang.srt.kv_canary.contract import (
    RECORD_WIDTH,
    FingerprintCheck,
    FingerprintWrite,
    ForwardPlan,
    PlanBuffers,
    ViolationSink,
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
    records: torch.Tensor = field(default_factory=lambda: torch.empty(0, RECORD_WIDTH, dtype=torch.int64))


@dataclass
class PendingDrain:
    """A drained forward's sink on its way to the host."""

    staged: StagedForward
    # [1 + capacity, RECORD_WIDTH] int64 on the host, a copy of the sink's storage (row 0:
    # violations seen, positions checked); None when the forward was not checked
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

    def result(self) -> DrainedForward:
        if self.host is None:
            return DrainedForward(self.staged)
        if not self.landed and self.copied is not None:
            self.copied.synchronize()
        count, checks = self.host[0, :2].tolist()
        records = self.host[1 : 1 + min(count, self.host.shape[0] - 1)].clone() if count else None
        if self.release is not None:
            self.release(self)
        if records is None:
            return DrainedForward(self.staged, 0, checks)
        return DrainedForward(self.staged, count, checks, records)


class _PinnedCopies:
    """Pinned host copies of one sink with their events, reused once read: a pinned
    allocation per forward costs more host time than the copy itself."""

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


class SingleForwardCanary:
    def __init__(self, index: int, max_rows: int, capacity: int, device: torch.device):
        self.index = index
        self.plan = PlanBuffers.allocate(max_rows, device)
        self.sink = ViolationSink.allocate(capacity, device)
        self.staged: Optional[StagedForward] = None
        self._pinned = _PinnedCopies(self.sink.storage) if self.sink.storage.is_cuda else None

    @property
    def is_staged(self) -> bool:
        return self.staged is not None

    def stage(self, impl, record: RequestRecord, owner: FingerprintGroup, forward_batch, verify: bool) -> None:
        view = batch_view.view_of(forward_batch)
        if view.skipped:
            # Zero live rows: the kernel reads no position, so any tensor stands in for them.
            nothing = ForwardPlan(self.plan.live_rows, None, 1, 0, 0, verify=False)
            impl.stage_plan(nothing, self.plan, self.sink)
            self.staged = StagedForward(view.mode, 0, verify=False)
            return
        bs = view.batch_size
        if bs > self.plan.verify_lens.numel():
            raise ValueError(f"KV canary: batch of {bs} rows exceeds the {self.plan.verify_lens.numel()} request rows")
        rids = getattr(forward_batch, "rids", None)
        if view.admits_requests:
            prefix_lens = batch_view.read_prefix_lens(forward_batch, view)
            record.adopt_owners(forward_batch.req_pool_indices[:bs], rids, prefix_lens)
        impl.stage_plan(batch_view.forward_plan(forward_batch, view, owner.speculative_tail, verify), self.plan, self.sink)
        self.staged = StagedForward(view.mode, bs, verify, list(rids) if rids is not None else None)

    def run(self, impl, record: RequestRecord, storage: FingerprintGroup, owner: FingerprintGroup, forward_batch) -> None:
        """Verify then write. Shapes come from the batch (static under a graph), values from
        the staged buffers; no host reads."""
        bs = forward_batch.req_pool_indices.numel()
        view = batch_view.view_of(forward_batch, batch_size=bs)
        if view.skipped:
            return
        impl.verify_fingerprints(
            record,
            storage,
            owner,
            FingerprintCheck(
                forward_batch.req_pool_indices, self.plan.verify_lens, self.plan.live_rows, self.plan.verify_on
            ),
            self.sink,
        )
        num_tokens = forward_batch.out_cache_loc.numel()
        positions = forward_batch.positions[:num_tokens]
        # Embedding inputs carry no ids: such slots are fingerprinted by position alone.
        input_ids = forward_batch.input_ids
        input_ids = torch.zeros_like(positions) if input_ids is None else input_ids[:num_tokens]
        rows_of_tokens, tokens_per_row = batch_view.token_batch_rows(forward_batch, view, num_tokens)
        impl.write_fingerprints(
            record,
            storage,
            owner,
            FingerprintWrite(
                out_cache_loc=forward_batch.out_cache_loc,
                positions=positions,
                input_ids=input_ids,
                req_pool_indices=forward_batch.req_pool_indices,
                token_batch_rows=rows_of_tokens,
                tokens_per_row=tokens_per_row,
                live_rows=self.plan.live_rows,
                record_tokens=batch_view.records_tokens(view, owner.is_draft),
            ),
        )

    def drain(self, deferred: bool = False) -> Optional[PendingDrain]:
        """Take this forward's findings off the device (the next stage empties the sink).

        Not deferred (or on a CPU device): one host sync when the forward was checked, and the
        result is ready. Deferred: one copy into pinned memory behind the forward on the
        current stream, read once it has landed.
        """
        staged, self.staged = self.staged, None
        if staged is None:
            return None
        if not staged.verify:
            return PendingDrain(staged)
        if deferred and self._pinned is not None:
            host, copied = self._pinned.take()
            host.copy_(self.sink.storage, non_blocking=True)
            copied.record()
            return PendingDrain(staged, host, copied, release=self._pinned.give_back)
        return PendingDrain(staged, self.sink.storage.cpu())  # the one sync

    def discard(self) -> None:
        """Forget the staged forward without reading the device (the forward raised)."""
        self.staged = None
        self.sink.reset()
