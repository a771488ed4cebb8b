"""The two accept counters as the draft-extend CUDA-graph buffers hold them.

    num_correct_drafts: [bs] accepted draft tokens per request (no bonus token)
    num_accept_tokens:  [bs] tokens committed per request = num_correct_drafts + 1

A captured graph reads whichever it needs, so both buffers must always hold their own meaning:
padded rows (batches rounded up to a captured size) look like a request that accepted a full
chain, and replay stages each field the batch carries on its own.
"""

from __future__ import annotations

import torch


def pad_accept_counters(
    num_correct_drafts: torch.Tensor,
    num_accept_tokens: torch.Tensor,
    num_tokens_per_req: int,
) -> None:
    """Fill padded rows as a fully accepted chain of `num_tokens_per_req` tokens."""
    num_correct_drafts.fill_(num_tokens_per_req - 1)
    num_accept_tokens.fill_(num_tokens_per_req)


def stage_accept_counters(
    num_correct_drafts_buf: torch.Tensor,
    num_accept_tokens_buf: torch.Tensor,
    spec_info,
    raw_bs: int,
) -> None:
    """Copy the batch's counters into the first `raw_bs` rows of the graph's buffers."""
    if spec_info.num_correct_drafts is not None:
        num_correct_drafts_buf[:raw_bs].copy_(spec_info.num_correct_drafts)
    if spec_info.num_accept_tokens is not None:
        num_accept_tokens_buf[:raw_bs].copy_(spec_info.num_accept_tokens)
