"""One forward call site's canary: its violation sink and the forward's own step.

    run     maybe inside a graph: verify the prefix each row reads, then fingerprint the writes,
            from the plan its bracket staged (staging.py)

A captured graph bakes in the addresses of one SingleForwardCanary's sink, so each forward
that shares a graph with others needs its own: EAGLE's draft graph runs all inner draft steps,
and step i uses single forward i. The target has one. The plan buffers are the manager's,
shared: every forward of one bracket reads the same plan.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.kv_canary import batch_view
from sglang.srt.kv_canary.contract import (
    FingerprintCheck,
    FingerprintWrite,
    PlanBuffers,
    ViolationSink,
)
from sglang.srt.kv_canary.staging import StagedForward
from sglang.srt.kv_canary.tables import FingerprintGroup, RequestRecord


class SingleForwardCanary:
    def __init__(self, index: int, plan: PlanBuffers, sink: ViolationSink):
        self.index = index
        self.plan = plan
        self.sink = sink
        # What the enclosing bracket staged; None outside brackets.
        self.staged: Optional[StagedForward] = None

    @property
    def is_staged(self) -> bool:
        return self.staged is not None

    def run(
        self,
        impl,
        record: RequestRecord,
        storage: FingerprintGroup,
        owner: FingerprintGroup,
        forward_batch,
    ) -> None:
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
                forward_batch.req_pool_indices,
                self.plan.verify_lens,
                self.plan.live_rows,
                self.plan.verify_on,
            ),
            self.sink,
        )
        num_tokens = forward_batch.out_cache_loc.numel()
        positions = forward_batch.positions[:num_tokens]
        # Embedding inputs carry no ids: such slots are fingerprinted by position alone.
        input_ids = forward_batch.input_ids
        input_ids = (
            torch.zeros_like(positions) if input_ids is None else input_ids[:num_tokens]
        )
        rows_of_tokens, tokens_per_row = batch_view.token_batch_rows(
            forward_batch, view, num_tokens
        )
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
