"""The EAGLE draft's shape: topk, num_steps and num_draft_tokens, checked and completed.

topk == 1 drafts a chain of num_steps tokens (num_draft_tokens is num_steps + 1, the bonus
token included); topk > 1 drafts a tree whose node budget num_draft_tokens must fit what the
steps can produce and sgl_kernel's tree build. `complete_shape` fills the flags a user left
unset from those given (rules in its docstring). Each refusal is a ValueError naming the flags,
raised from ServerArgs.__post_init__ (arg_groups/speculative_hook.py) before any GPU allocation.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

# sgl_kernel's build_tree_kernel_efficient launches one thread per draft token in one block.
MAX_DRAFT_TOKENS = 1024

# Steps a tree drafts when only its width (--speculative-eagle-topk) is given.
DEFAULT_TREE_STEPS = 3

TOPK_FLAG = "--speculative-eagle-topk"
STEPS_FLAG = "--speculative-num-steps"
DRAFT_TOKENS_FLAG = "--speculative-num-draft-tokens"


def check_at_least_one(flag: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")


def check_draft_token_cap(num_draft_tokens: int, why: str = "") -> None:
    """Chains and trees alike reach sgl_kernel's tree build, which launches one thread per
    draft token in one block."""
    if num_draft_tokens > MAX_DRAFT_TOKENS:
        raise ValueError(
            f"--speculative-num-draft-tokens must be <= {MAX_DRAFT_TOKENS}, got {num_draft_tokens}{why}: "
            "sgl_kernel's tree build launches one thread per draft token in one block"
        )


def check_chain_shape(num_steps: int, num_draft_tokens: int) -> None:
    """topk == 1 drafts a chain: num_steps draft tokens plus the bonus token."""
    check_at_least_one(STEPS_FLAG, num_steps)
    if num_draft_tokens != num_steps + 1:
        raise ValueError(
            "--speculative-eagle-topk 1 drafts a chain, which needs "
            f"--speculative-num-draft-tokens == --speculative-num-steps + 1 ({num_steps + 1}); "
            f"got --speculative-num-draft-tokens {num_draft_tokens}"
        )
    check_draft_token_cap(
        num_draft_tokens, f" (a chain of --speculative-num-steps {num_steps})"
    )


def resolve_chain_num_draft_tokens(
    num_steps: int, num_draft_tokens: Optional[int]
) -> int:
    """num_draft_tokens for topk == 1: derived when unset, refused when inconsistent."""
    if num_draft_tokens is None:
        num_draft_tokens = num_steps + 1
    check_chain_shape(num_steps, num_draft_tokens)
    return num_draft_tokens


def max_tree_draft_tokens(topk: int, num_steps: int) -> int:
    """Largest tree the draft can hand to verify: the root plus every scored candidate.

    Step 0 scores topk candidates; every later step scores topk children of each of the topk
    expanded nodes. draft_forward keeps the best num_draft_tokens - 1 of them.
    """
    return 1 + topk + (num_steps - 1) * topk * topk


def check_tree_shape(
    topk: int, num_steps: int, num_draft_tokens: Optional[int]
) -> None:
    """topk > 1 drafts a tree of num_draft_tokens nodes (root included)."""
    check_at_least_one(STEPS_FLAG, num_steps)
    if num_draft_tokens is None:
        raise ValueError(
            f"--speculative-eagle-topk {topk} drafts a tree: set --speculative-num-draft-tokens "
            f"(tree nodes including the root, 2..{max_tree_draft_tokens(topk, num_steps)})"
        )
    if num_draft_tokens < 2:
        raise ValueError(
            f"--speculative-num-draft-tokens must be >= 2 for a tree, got {num_draft_tokens}"
        )
    check_draft_token_cap(num_draft_tokens)
    limit = max_tree_draft_tokens(topk, num_steps)
    if num_draft_tokens > limit:
        raise ValueError(
            f"--speculative-num-draft-tokens {num_draft_tokens} is larger than the tree that "
            f"--speculative-eagle-topk {topk} with --speculative-num-steps {num_steps} can draft "
            f"(at most {limit} nodes: 1 + topk + (num_steps - 1) * topk^2)"
        )


def check_shape(topk: int, num_steps: int, num_draft_tokens: Optional[int]) -> None:
    """A chain (topk == 1) or a tree (topk > 1) that the draft worker can run."""
    check_at_least_one(TOPK_FLAG, topk)
    if topk == 1:
        check_chain_shape(num_steps, num_draft_tokens)
    else:
        check_tree_shape(topk, num_steps, num_draft_tokens)


# ----------------------------------------------------------------------------- completion


class DraftShape(NamedTuple):
    topk: int
    num_steps: int
    num_draft_tokens: int
    # Flags whose value was derived from the others (empty when all three were given, or when
    # auto_chosen).
    derived: tuple[str, ...]
    # None of the three was set: upstream's auto_choose_speculative_params picked them.
    auto_chosen: bool


def _default_tree_draft_tokens(topk: int, num_steps: int) -> int:
    return min(
        max(2 * topk, num_steps + 1),
        max_tree_draft_tokens(topk, num_steps),
        MAX_DRAFT_TOKENS,
    )


def _min_tree_steps(topk: int, num_draft_tokens: int) -> int:
    """Smallest num_steps whose tree (max_tree_draft_tokens) holds num_draft_tokens nodes."""
    if num_draft_tokens <= max_tree_draft_tokens(topk, 1):
        return 1
    return 1 + -(-(num_draft_tokens - 1 - topk) // (topk * topk))


def _derive(
    topk: Optional[int], num_steps: Optional[int], num_draft_tokens: Optional[int]
) -> tuple[int, int, int]:
    if topk is None:
        if num_steps is None:
            chain = (
                f"1 for a chain of {num_draft_tokens - 1} steps, or "
                if num_draft_tokens >= 2
                else ""
            )
            raise ValueError(
                f"{DRAFT_TOKENS_FLAG} {num_draft_tokens} alone does not give the draft's shape: "
                f"set {TOPK_FLAG} ({chain}> 1 for a tree)"
            )
        if num_draft_tokens is None or num_draft_tokens == num_steps + 1:
            return 1, num_steps, num_steps + 1
        raise ValueError(
            f"{STEPS_FLAG} {num_steps} with {DRAFT_TOKENS_FLAG} {num_draft_tokens} is not a chain "
            f"({num_steps + 1} tokens) and a tree's width cannot be derived: set {TOPK_FLAG}"
        )
    if num_steps is None:
        if num_draft_tokens is None:
            num_steps = DEFAULT_TREE_STEPS
        elif topk == 1:
            if num_draft_tokens < 2:
                raise ValueError(
                    f"{DRAFT_TOKENS_FLAG} must be >= 2 for a chain (steps + 1), got {num_draft_tokens}"
                )
            num_steps = num_draft_tokens - 1
        elif num_draft_tokens <= max_tree_draft_tokens(topk, DEFAULT_TREE_STEPS):
            num_steps = DEFAULT_TREE_STEPS
        else:
            num_steps = _min_tree_steps(topk, num_draft_tokens)
    if num_draft_tokens is None:
        num_draft_tokens = (
            num_steps + 1 if topk == 1 else _default_tree_draft_tokens(topk, num_steps)
        )
    return topk, num_steps, num_draft_tokens


def complete_shape(
    topk: Optional[int],
    num_steps: Optional[int],
    num_draft_tokens: Optional[int],
    auto: Callable[[], tuple[int, int, int]],
) -> DraftShape:
    """The draft shape from the flags given (None: unset), checked.

    None set: auto() (upstream's auto_choose_speculative_params: num_steps, topk,
    num_draft_tokens). Otherwise, for what is unset:
    - topk alone: 1 -> a chain of 3 steps (4 tokens); k > 1 -> 3 steps and
      min(2k, max_tree_draft_tokens(k, 3), MAX_DRAFT_TOKENS) tokens.
    - topk and steps: 1 -> steps + 1 tokens; k > 1 -> min(max(2k, steps + 1),
      max_tree_draft_tokens(k, steps), MAX_DRAFT_TOKENS) tokens.
    - topk and tokens: 1 -> tokens - 1 steps; k > 1 -> 3 steps if that tree holds the tokens,
      else the fewest steps whose tree does.
    - steps alone, or steps and steps + 1 tokens: a chain (topk 1).
    - tokens alone, or steps and tokens other than steps + 1: a ValueError (the width is unknown).
    Values < 1 and shapes the draft worker cannot run are ValueErrors naming the flag.
    """
    given = {
        TOPK_FLAG: topk,
        STEPS_FLAG: num_steps,
        DRAFT_TOKENS_FLAG: num_draft_tokens,
    }
    if all(value is None for value in given.values()):
        num_steps, topk, num_draft_tokens = auto()
        check_shape(topk, num_steps, num_draft_tokens)
        return DraftShape(
            topk, num_steps, num_draft_tokens, derived=(), auto_chosen=True
        )
    for flag, value in given.items():
        if value is not None:
            check_at_least_one(flag, value)
    shape = _derive(topk, num_steps, num_draft_tokens)
    check_shape(*shape)
    derived = tuple(flag for flag, value in given.items() if value is None)
    return DraftShape(*shape, derived=derived, auto_chosen=False)
