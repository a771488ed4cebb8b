"""topk == 1 drafting: the draft tree is a chain, so its shape is a constant.

With one candidate per step, the general draft path's cat(scores) -> topk -> sort -> gather
is an identity and the per-step select_top_k_tokens only copies. Here the parents and score
indices are preallocated constants, each step's greedy token is written straight into its row
of a static buffer, and draft_forward launches only the draft model's own kernels, one copy
and one argmax per step. The argmax reads the logits directly: softmax is monotonic, so the
general path's softmax -> top-1 picks the same token (up to exact float ties) without a
vocab-wide kernel.

Shapes use `bs` for the batch and `num_steps` for speculative_num_steps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from sglang.srt.speculative.draft_shape import check_chain_shape


class DraftTree(NamedTuple):
    """What draft_forward hands to build_tree_kernel_efficient."""

    # [bs, num_parents] parent node of each draft node (-1: the verified bonus token)
    parent_list: torch.Tensor
    # [bs, num_draft_tokens - 1] position of each kept draft node in score order, ascending
    top_scores_index: torch.Tensor
    # [bs, num_draft_tokens - 1] draft token ids of the kept nodes
    draft_tokens: torch.Tensor


def chain_parents(
    bs: int, num_steps: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[bs, num_steps if num_steps > 1 else 0]: node j's parent is node j - 1, the first's is -1.

    The general path emits one parent entry per expanded step except the last, so a
    one-step draft has no parent entries at all.
    """
    width = num_steps if num_steps > 1 else 0
    return torch.arange(-1, width - 1, dtype=torch.long, device=device).repeat(bs, 1)


def chain_score_indices(
    bs: int, num_steps: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[bs, num_steps]: every chain node is kept, in order."""
    return torch.arange(num_steps, dtype=torch.long, device=device).repeat(bs, 1)


# Runs draft step `i` on `input_ids: [bs]` with `hidden_states: [bs, hidden]`; returns the
# model's LogitsProcessorOutput (next_token_logits: [bs, vocab], hidden_states: [bs, hidden]).
StepForward = Callable[[int, torch.Tensor, Optional[torch.Tensor]], object]


@dataclass
class ChainDraft:
    """Static buffers for one (num_steps, max_bs) chain configuration."""

    num_steps: int
    # [max_bs, num_parents] constant, see chain_parents
    parents: torch.Tensor
    # [max_bs, num_steps] constant, see chain_score_indices
    score_indices: torch.Tensor
    # [num_steps, max_bs] step i's draft token per request; rows are contiguous so each
    # step's tokens can be written by argmax(out=...) and fed as the next input_ids
    tokens_by_step: torch.Tensor

    @classmethod
    def allocate(
        cls, num_steps: int, num_draft_tokens: int, max_bs: int, device
    ) -> "ChainDraft":
        check_chain_shape(num_steps, num_draft_tokens)
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        return cls(
            num_steps=num_steps,
            parents=chain_parents(max_bs, num_steps, device),
            score_indices=chain_score_indices(max_bs, num_steps, device),
            tokens_by_step=torch.zeros(
                (num_steps, max_bs), dtype=torch.long, device=device
            ),
        )

    @property
    def max_bs(self) -> int:
        return self.parents.shape[0]

    def fits(self, bs: int) -> bool:
        return bs <= self.max_bs

    def run(
        self,
        first_tokens: torch.Tensor,
        hidden_states: Optional[torch.Tensor],
        step_forward: StepForward,
        token_map: Optional[torch.Tensor] = None,
    ) -> DraftTree:
        """Greedy chain draft.

        first_tokens: [bs, 1] the draft's top-1 after the last verify (already in full vocab).
        token_map: [hot_vocab] full-vocab id of each hot-vocab logit column, if the draft
            model predicts over a reduced vocabulary.
        """
        bs = first_tokens.shape[0]
        tokens = self.tokens_by_step[:, :bs]
        tokens[0].copy_(first_tokens.reshape(-1))
        # The last token needs no forward: the first came from draft-extend.
        for i in range(self.num_steps - 1):
            logits_output = step_forward(i, tokens[i], hidden_states)
            logits = logits_output.next_token_logits
            if token_map is None:
                torch.argmax(logits, dim=-1, out=tokens[i + 1])
            else:
                torch.index_select(
                    token_map, 0, torch.argmax(logits, dim=-1), out=tokens[i + 1]
                )
            hidden_states = logits_output.hidden_states
        return DraftTree(self.parents[:bs], self.score_indices[:bs], tokens.t())

    def organize(self, tokens: torch.Tensor) -> DraftTree:
        """For drafts that already produced every step's token (multi-layer EAGLE).

        tokens: [bs, num_steps] draft token of each step.
        """
        bs = tokens.shape[0]
        return DraftTree(self.parents[:bs], self.score_indices[:bs], tokens)


class ChainDraftTable:
    """ChainDraft per num_steps, so adaptive speculative decoding can switch step counts.

    `prepare` allocates outside CUDA-graph capture (call it from init_cuda_graphs, which the
    adaptive runtime-state builder runs for every step count); `lookup` never allocates.
    """

    def __init__(self, topk: int, max_bs: int, device) -> None:
        self.enabled = topk == 1
        self.max_bs = max_bs
        self.device = device
        self._by_num_steps: dict[int, ChainDraft] = {}

    @classmethod
    def for_server_args(cls, server_args, device) -> "ChainDraftTable":
        """Sized for the largest batch a draft worker can see (CUDA-graph or eager).

        SGLANG_SPEC_CHAIN_FAST_PATH=0 keeps topk == 1 on the general path, for A/B benchmarks.
        """
        max_bs = chain_max_bs(
            server_args.cuda_graph_max_bs, server_args.max_running_requests
        )
        table = cls(server_args.speculative_eagle_topk, max_bs, device)
        table.enabled = (
            table.enabled and os.environ.get("SGLANG_SPEC_CHAIN_FAST_PATH", "1") != "0"
        )
        return table

    def prepare(self, num_steps: int, num_draft_tokens: int) -> None:
        if not self.enabled:
            return
        current = self._by_num_steps.get(num_steps)
        if current is None or current.max_bs != self.max_bs:
            self._by_num_steps[num_steps] = ChainDraft.allocate(
                num_steps, num_draft_tokens, self.max_bs, self.device
            )
        else:
            check_chain_shape(num_steps, num_draft_tokens)

    def lookup(self, num_steps: int, bs: int) -> Optional[ChainDraft]:
        """The chain for this step count if it is prepared and `bs` fits, else None (general path)."""
        chain = self._by_num_steps.get(num_steps)
        return chain if chain is not None and chain.fits(bs) else None


def chain_max_bs(
    cuda_graph_max_bs: Optional[int], max_running_requests: Optional[int]
) -> int:
    return max(cuda_graph_max_bs or 0, max_running_requests or 0, 1)
