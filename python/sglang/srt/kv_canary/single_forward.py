"""One forward call site's canary: static plan buffers, its violation sink, and its three steps.

    stage   outside any graph: write this forward's plan (live rows, prefix lengths, sampling
            switch) into static buffers; note new row owners at admitting extends
    run     maybe inside a graph: verify the prefix each row reads, then fingerprint the writes
    drain   outside any graph, after the forward: copy the sink to the host and reset it
            (waiting for the copy at once, or leaving a PendingDrain to be read later)

A captured graph bakes in the addresses of one SingleForwardCanary's buffers, so each forward
that shares a graph with others needs its own: EAGLE's draft graph runs all inner draft steps,
and step i uses single forward i. The target has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang.srt.kv_canary import batch_view
from sglang.srt.kv_canary.contract import RECORD_WIDTH, FingerprintCheck, FingerprintWrite, ViolationSink
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
    """A drained forward's counters and records on their way to the host."""

    staged: StagedForward
    # [2] int64 on the host: violations seen, positions checked; None when not checked
    counters: Optional[torch.Tensor] = None
    # [n, RECORD_WIDTH] int64 on the host, n >= the records kept
    records: Optional[torch.Tensor] = None
    # Recorded after the device-to-host copies; None when they already completed.
    copied: Optional["torch.cuda.Event"] = None

    def ready(self) -> bool:
        return self.copied is None or self.copied.query()

    def result(self) -> DrainedForward:
        if self.counters is None:
            return DrainedForward(self.staged)
        if self.copied is not None:
            self.copied.synchronize()
        count, checks = self.counters.tolist()
        if count == 0:
            return DrainedForward(self.staged, 0, checks)
        return DrainedForward(self.staged, count, checks, self.records[: min(count, self.records.shape[0])])


class SingleForwardCanary:
    def __init__(self, index: int, max_rows: int, capacity: int, device: torch.device):
        self.index = index
        # [max_rows] int32: positions [0, len) of batch row b are checked
        self.verify_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        # [1] int32: batch rows >= live_rows are CUDA-graph padding
        self.live_rows = torch.zeros(1, dtype=torch.int32, device=device)
        # [1] int32: this forward is sampled for checking
        self.verify_on = torch.zeros(1, dtype=torch.int32, device=device)
        self.sink = ViolationSink.allocate(capacity, device)
        self.staged: Optional[StagedForward] = None

    @property
    def is_staged(self) -> bool:
        return self.staged is not None

    def stage(self, record: RequestRecord, owner: FingerprintGroup, forward_batch, verify: bool) -> None:
        view = batch_view.view_of(forward_batch)
        if view.skipped:
            self.live_rows.zero_()
            self.verify_on.zero_()
            self.staged = StagedForward(view.mode, 0, verify=False)
            return
        bs = view.batch_size
        if bs > self.verify_lens.numel():
            raise ValueError(f"KV canary: batch of {bs} rows exceeds the {self.verify_lens.numel()} request rows")
        prefix_lens = batch_view.read_prefix_lens(forward_batch, view)
        rids = getattr(forward_batch, "rids", None)
        if view.admits_requests:
            record.adopt_owners(forward_batch.req_pool_indices[:bs], rids, prefix_lens)
        checked = (prefix_lens - owner.speculative_tail).clamp_(min=0)
        self.verify_lens[:bs].copy_(checked)
        self.verify_lens[bs:].zero_()
        self.live_rows.fill_(bs)
        self.verify_on.fill_(int(verify))
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
            FingerprintCheck(forward_batch.req_pool_indices, self.verify_lens, self.live_rows, self.verify_on),
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
                live_rows=self.live_rows,
                record_tokens=batch_view.records_tokens(view, owner.is_draft),
            ),
        )

    def drain(self, deferred: bool = False) -> Optional[PendingDrain]:
        """Take this forward's findings off the device and reset the sink for the next one.

        Not deferred (or on a CPU device): one host sync when the forward was checked, and the
        result is ready. Deferred: the copies go into pinned memory behind the forward on the
        current stream, and the result is read once they have landed.
        """
        staged, self.staged = self.staged, None
        if staged is None:
            return None
        if not staged.verify:
            return PendingDrain(staged)
        counters = torch.cat([self.sink.count, self.sink.checks])
        if deferred and counters.is_cuda:
            host_counters = torch.empty(counters.shape, dtype=counters.dtype, pin_memory=True)
            host_records = torch.empty(self.sink.records.shape, dtype=self.sink.records.dtype, pin_memory=True)
            host_counters.copy_(counters, non_blocking=True)
            host_records.copy_(self.sink.records, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            self.sink.reset()  # stream-ordered after the copies
            return PendingDrain(staged, host_counters, host_records, copied)
        host_counters = counters.cpu()  # the one sync
        count = int(host_counters[0])
        host_records = self.sink.records[: min(count, self.sink.capacity)].cpu()
        self.sink.reset()
        return PendingDrain(staged, host_counters, host_records)

    def discard(self) -> None:
        """Forget the staged forward without reading the device (the forward raised)."""
        self.staged = None
        self.sink.reset()
