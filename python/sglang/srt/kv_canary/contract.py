"""What the write and verify implementations (reference.py, kernels.py) take and produce.

Both implementations take the same arguments and must leave the same bits behind: the tests
compare them field by field. Every tensor here has a fixed shape for a given CUDA-graph batch
size, and every per-forward value lives on the device, so a captured graph replays correctly
after `stage` rewrote the buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# Columns of a violation record ([capacity, RECORD_WIDTH] int64).
REC_BATCH_ROW = 0  # row in the forward batch (rid lookup)
REC_REQ_ROW = 1  # req_to_token row
REC_POSITION = 2  # KV position read
REC_SLOT = 3  # slot req_to_token[row, position] points at
REC_EXPECTED_FP = (
    4  # 0 for a borrowed position (no expectation beyond "live, this position")
)
REC_FOUND_FP = 5
REC_EXPECTED_TOKEN = 6  # -1 for a borrowed position
REC_FOUND_WRITER = 7  # pack_writer(row, position) of the slot's last write, -1 if freed
RECORD_WIDTH = 8


@dataclass
class FingerprintWrite:
    """The tokens one forward writes into KV."""

    out_cache_loc: torch.Tensor  # [n] slot of each token
    positions: torch.Tensor  # [n] KV position of each token
    input_ids: torch.Tensor  # [n] token id fed at that position
    req_pool_indices: torch.Tensor  # [bs] req_to_token row of each batch row
    # [n] batch row of each token, or None for the uniform layout: token j -> j // tokens_per_row
    token_batch_rows: Optional[torch.Tensor]
    tokens_per_row: int
    live_rows: torch.Tensor  # [1] int32: batch rows >= this are CUDA-graph padding
    # Also record token ids in the request record (False for speculative layouts where
    # several tokens share a position: target verify, draft decode steps).
    record_tokens: bool

    @property
    def num_tokens(self) -> int:
        return self.out_cache_loc.numel()


@dataclass
class FingerprintCheck:
    """The prefix of each request one forward reads."""

    req_pool_indices: torch.Tensor  # [bs] req_to_token row of each batch row
    verify_lens: torch.Tensor  # [>= bs] int32: positions [0, len) are checked
    live_rows: torch.Tensor  # [1] int32
    verify_on: torch.Tensor  # [1] int32: 0 skips the check (sampling)


@dataclass
class ViolationSink:
    """Fixed-capacity violation records and counters on the device, drained outside graphs.

    Counters and records share one tensor so that a drain is a single device-to-host copy.
    """

    # [1 + capacity, RECORD_WIDTH] int64: row 0 holds (violations seen, positions checked, 0...),
    # rows 1.. the records
    storage: torch.Tensor

    @classmethod
    def allocate(cls, capacity: int, device) -> "ViolationSink":
        """A sink of its own (managers allocate theirs together, as ViolationSinks)."""
        return ViolationSinks.allocate(1, capacity, device).sink(0)

    @property
    def count(self) -> torch.Tensor:
        """[1] int64: violations seen (may exceed capacity)."""
        return self.storage[0, 0:1]

    @property
    def checks(self) -> torch.Tensor:
        """[1] int64: positions checked."""
        return self.storage[0, 1:2]

    @property
    def records(self) -> torch.Tensor:
        """[capacity, RECORD_WIDTH] int64."""
        return self.storage[1:]

    @property
    def capacity(self) -> int:
        return self.storage.shape[0] - 1


@dataclass
class ViolationSinks:
    """The sinks of one manager's single forwards in one tensor: a bracket empties them all in
    its stage launch and takes them off the device in one copy, however many forwards it covers.
    """

    # [num_sinks, 1 + capacity, RECORD_WIDTH] int64; storage[i] is single forward i's sink
    storage: torch.Tensor

    @classmethod
    def allocate(cls, num_sinks: int, capacity: int, device) -> "ViolationSinks":
        storage = torch.full(
            (num_sinks, 1 + capacity, RECORD_WIDTH),
            -1,
            dtype=torch.int64,
            device=device,
        )
        storage[:, 0].zero_()
        return cls(storage)

    def sink(self, index: int) -> ViolationSink:
        return ViolationSink(self.storage[index])

    @property
    def num_sinks(self) -> int:
        return self.storage.shape[0]

    def reset(self) -> None:
        self.storage[:, 0].zero_()


@dataclass
class PlanBuffers:
    """A forward's values in static device memory: written by `stage_plan` outside any graph,
    read by the write and verify kernels (maybe in a graph). The single forwards of one manager
    share them: one stage serves every forward of a bracket, and brackets do not overlap.
    """

    # [max_rows] int32: positions [0, len) of batch row b are checked (rows < live_rows only)
    verify_lens: torch.Tensor
    # [1] int32: batch rows >= live_rows are CUDA-graph padding
    live_rows: torch.Tensor
    # [1] int32: this forward is sampled for checking
    verify_on: torch.Tensor

    @classmethod
    def allocate(cls, max_rows: int, device) -> "PlanBuffers":
        return cls(
            verify_lens=torch.zeros(max_rows, dtype=torch.int32, device=device),
            live_rows=torch.zeros(1, dtype=torch.int32, device=device),
            verify_on=torch.zeros(1, dtype=torch.int32, device=device),
        )


@dataclass
class ForwardPlan:
    """What `stage_plan` reads off a batch before its forward. Row b's prefix (positions
    already in KV) is the position of its first token."""

    positions: torch.Tensor  # [n] KV position of each token
    # [>= batch_size] tokens of each row when rows differ in length; None: row b starts at
    # token b * tokens_per_row
    extend_seq_lens: Optional[torch.Tensor]
    tokens_per_row: int
    batch_size: int  # live rows; 0 for a forward that reads and writes no KV
    speculative_tail: int  # trailing prefix positions holding draft tokens: not checked
    verify: bool  # sampled for checking
