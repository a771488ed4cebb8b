"""What the canary reads out of a ForwardBatch, by forward mode.

Duck-typed on purpose (forward_mode.name, tensors by attribute), so this package imports
without the rest of sglang. The fields read:

    forward_mode         ForwardMode (only .name is used)
    batch_size           rows before CUDA-graph padding (staging) / req_pool_indices.numel()
    req_pool_indices     [bs] req_to_token row of each batch row
    positions            [n] KV position of each token
    input_ids            [n] token id of each token
    out_cache_loc        [n] slot each token's K/V is written to
    extend_seq_lens      [bs] tokens per row in extend-like modes (None otherwise)
    rids                 request ids (extend only: new owners of rows)
    token_to_kv_pool     the KV pool the forward really reads and writes
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.kv_canary.contract import ForwardPlan

# Nothing is written or read through req_to_token in these (PREBUILT: KV arrived from a
# prefill server; DLLM_EXTEND: block diffusion, not supported).
_SKIPPED_MODES = frozenset({"IDLE", "PREBUILT", "DLLM_EXTEND"})
# Rows carry different numbers of tokens, given by extend_seq_lens.
_VARIABLE_EXTEND_MODES = frozenset({"EXTEND", "MIXED", "SPLIT_PREFILL", "DRAFT_EXTEND"})
# A request's first forward is one of these: a row may change owner here.
_ADMITTING_MODES = frozenset({"EXTEND", "MIXED", "SPLIT_PREFILL"})
KNOWN_MODES = (
    _SKIPPED_MODES
    | _VARIABLE_EXTEND_MODES
    | {"DECODE", "TARGET_VERIFY", "DRAFT_EXTEND_V2"}
)


@dataclass(frozen=True)
class BatchView:
    mode: str
    batch_size: int
    skipped: bool
    variable_extend: bool
    admits_requests: bool


def view_of(forward_batch, batch_size: Optional[int] = None) -> BatchView:
    mode = forward_batch.forward_mode.name
    if mode not in KNOWN_MODES:
        raise ValueError(f"KV canary: unknown forward mode {mode}")
    bs = int(forward_batch.batch_size if batch_size is None else batch_size)
    variable = (
        mode in _VARIABLE_EXTEND_MODES
        and getattr(forward_batch, "extend_seq_lens", None) is not None
    )
    return BatchView(
        mode=mode,
        batch_size=bs,
        skipped=mode in _SKIPPED_MODES or bs == 0,
        variable_extend=variable,
        admits_requests=mode in _ADMITTING_MODES,
    )


def first_token_index(forward_batch, view: BatchView) -> torch.Tensor:
    """[bs] index of each row's first token in the token arrays."""
    bs = view.batch_size
    device = forward_batch.positions.device
    if view.variable_extend:
        lens = forward_batch.extend_seq_lens[:bs].to(torch.int64)
        return torch.cumsum(lens, 0) - lens
    per_row = forward_batch.positions.numel() // bs
    return torch.arange(bs, device=device, dtype=torch.int64) * per_row


def read_prefix_lens(forward_batch, view: BatchView) -> torch.Tensor:
    """[bs] positions each row already has in KV = the position of its first token now.

    Holds in every mode: extend (prefix), decode (seq_len - 1), target verify and draft
    decode (seq_len: the tree starts there), draft extend (the previous seq_len). Reads on
    the device, no sync.
    """
    return forward_batch.positions.index_select(
        0, first_token_index(forward_batch, view)
    ).to(torch.int64)


def forward_plan(
    forward_batch, view: BatchView, speculative_tail: int, verify: bool
) -> ForwardPlan:
    """The inputs of stage_plan for a batch that is not skipped. Reads no tensor values."""
    bs = view.batch_size
    if view.variable_extend:
        return ForwardPlan(
            forward_batch.positions,
            forward_batch.extend_seq_lens,
            0,
            bs,
            speculative_tail,
            verify,
        )
    per_row = forward_batch.positions.numel() // bs
    return ForwardPlan(
        forward_batch.positions, None, per_row, bs, speculative_tail, verify
    )


def token_batch_rows(
    forward_batch, view: BatchView, num_tokens: int
) -> tuple[Optional[torch.Tensor], int]:
    """(token -> batch row map or None, tokens per row for the uniform layout). Sync-free."""
    bs = forward_batch.req_pool_indices.numel()
    if view.variable_extend:
        rows = torch.arange(
            bs, device=forward_batch.req_pool_indices.device, dtype=torch.int32
        )
        lens = forward_batch.extend_seq_lens[:bs].to(torch.int64)
        return torch.repeat_interleave(rows, lens, output_size=num_tokens), 0
    if num_tokens % bs != 0:
        raise ValueError(
            f"KV canary: {num_tokens} tokens do not split evenly over {bs} rows in {view.mode}"
        )
    return None, num_tokens // bs


def records_tokens(view: BatchView, is_draft: bool) -> bool:
    """Whether this forward's tokens are committed ones, worth recording per position.

    Target verify and draft decode steps write speculative tokens, several per position in a
    tree; the committed ones are recorded by the next draft extend (EAGLE always runs one).
    """
    if view.mode == "TARGET_VERIFY":
        return False
    return not (view.mode == "DECODE" and is_draft)
