"""Spec v2 draft extend: the next round's input is read off each request's last accepted row.

select_next_draft_input runs inside the draft-extend CUDA graph and on the eager path; here it
is compared with the plain per-request reading: pick row b * T + accept_len - 1, then softmax
and top-k over the vocabulary."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.speculative.next_draft_input import (
    last_accepted_rows,
    select_next_draft_input,
)


def reference(logits, hidden, num_accept_tokens, tokens_per_req, topk):
    out = []
    for b, accepted in enumerate(num_accept_tokens.tolist()):
        row = b * tokens_per_req + accepted - 1
        probs = torch.softmax(logits[row], dim=-1)
        p, i = probs.topk(topk)
        out.append((p, i, None if hidden is None else hidden[row], logits[row]))
    return out


CASES = [
    # (bs, tokens_per_req, topk, accepted: "none" | "all" | "ragged", hidden states)
    (1, 8, 4, "none", True),
    (1, 8, 4, "all", True),
    (1, 4, 1, "ragged", True),  # chain: topk 1
    (7, 32, 16, "ragged", True),
    (48, 8, 4, "ragged", False),  # a draft without captured hidden states
]


@pytest.mark.parametrize("bs,tokens_per_req,topk,accepted,with_hidden", CASES)
def test_matches_the_per_request_reading(
    bs, tokens_per_req, topk, accepted, with_hidden
):
    gen = torch.Generator().manual_seed(bs * 100 + tokens_per_req)
    vocab, hidden_size = 257, 24
    logits = torch.randn(bs * tokens_per_req, vocab, generator=gen)
    hidden = (
        torch.randn(bs * tokens_per_req, hidden_size, generator=gen)
        if with_hidden
        else None
    )
    if accepted == "none":
        num_accept = torch.ones(bs, dtype=torch.int32)  # only the bonus token
    elif accepted == "all":
        num_accept = torch.full((bs,), tokens_per_req, dtype=torch.int32)
    else:
        num_accept = torch.randint(
            1, tokens_per_req + 1, (bs,), generator=gen, dtype=torch.int32
        )

    got = select_next_draft_input(logits, hidden, num_accept, tokens_per_req, topk)

    assert got.topk_p.shape == (bs, topk) and got.topk_index.shape == (bs, topk)
    for b, (p, i, h, row_logits) in enumerate(
        reference(logits, hidden, num_accept, tokens_per_req, topk)
    ):
        torch.testing.assert_close(got.topk_p[b], p)
        assert torch.equal(got.topk_index[b].to(torch.int64), i)
        assert torch.equal(got.next_token_logits[b], row_logits)
        if h is None:
            assert got.hidden_states is None
        else:
            assert torch.equal(got.hidden_states[b], h)


def test_rows_are_the_last_accepted_token_of_each_block():
    assert last_accepted_rows(
        torch.tensor([1, 3, 8], dtype=torch.int32), 8
    ).tolist() == [0, 10, 23]
