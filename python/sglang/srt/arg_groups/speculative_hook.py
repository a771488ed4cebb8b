"""Config-time decisions for the EAGLE family (EAGLE, EAGLE3, STANDALONE).

Everything here runs inside ServerArgs.__post_init__, before any GPU allocation, so a bad
combination of flags fails with a ValueError that names the flags.
"""

from __future__ import annotations

from typing import Optional


def check_chain_shape(num_steps: int, num_draft_tokens: int) -> None:
    """topk == 1 drafts a chain: num_steps draft tokens plus the bonus token."""
    if num_steps < 1:
        raise ValueError(f"--speculative-num-steps must be >= 1, got {num_steps}")
    if num_draft_tokens != num_steps + 1:
        raise ValueError(
            "--speculative-eagle-topk 1 drafts a chain, which needs "
            f"--speculative-num-draft-tokens == --speculative-num-steps + 1 ({num_steps + 1}); "
            f"got --speculative-num-draft-tokens {num_draft_tokens}"
        )


def resolve_chain_num_draft_tokens(num_steps: int, num_draft_tokens: Optional[int]) -> int:
    """num_draft_tokens for topk == 1: derived when unset, refused when inconsistent."""
    if num_draft_tokens is None:
        num_draft_tokens = num_steps + 1
    check_chain_shape(num_steps, num_draft_tokens)
    return num_draft_tokens
