"""The verify-time KV-slot kernels of spec_utils (paged spec v1 and ngram) against plain torch.

After verify, each request's block of num_draft_tokens verify slots splits in two: its first
num_accept_tokens slots (rounded up to a page, capped at the block) stay, the rest are freed; when
some requests finished, the kept slots of the others are packed to the front. The references
below say that in a few lines each; `check` runs the kernels the way eagle_info.py calls them and
compares. Collected by test_spec_utils_kernels.py: on CUDA directly, on CPU through triton's
interpreter (this file's own tests, which only run with TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from sglang.srt.speculative.spec_utils import (
    create_num_accept_tokens_filter,
    filter_finished_cache_loc_kernel,
    get_src_tgt_cache_loc,
    get_target_cache_loc,
)
from sglang.srt.utils import next_power_of_2

# ------------------------------------------------------------------------------ references


def ref_kept_and_freed(
    seq_lens, num_accept_tokens, num_draft_tokens: int, page_size: int
):
    """Slots each request keeps (accepted tokens, page-rounded, capped at its block) and frees."""
    extended = seq_lens + num_draft_tokens
    kept_end = torch.minimum(
        (seq_lens + num_accept_tokens + page_size - 1) // page_size * page_size,
        extended,
    )
    return extended - kept_end  # to_free_num_slots: [bs]


def ref_split_block_slots(
    out_cache_loc, num_accept_tokens, to_free_num_slots, num_draft_tokens: int
):
    """First num_accept_tokens slots of each block to tgt, last to_free_num_slots to free."""
    blocks = out_cache_loc.view(-1, num_draft_tokens)
    keep = [block[:n] for block, n in zip(blocks, num_accept_tokens.tolist())]
    free = [
        block[num_draft_tokens - f :]
        for block, f in zip(blocks, to_free_num_slots.tolist())
    ]
    return torch.cat(keep), torch.cat(free)


def ref_pack_unfinished(
    out_cache_loc, tgt_cache_loc, num_accept_tokens, unfinished: list[int]
):
    """Kept slots of unfinished requests, packed to the front of out_cache_loc; the tail as it was.
    Also the filter (num_accept_tokens of unfinished requests, 0 for finished ones)."""
    starts = torch.cumsum(num_accept_tokens, 0) - num_accept_tokens
    segments = [
        tgt_cache_loc[starts[b] : starts[b] + num_accept_tokens[b]] for b in unfinished
    ]
    packed = torch.cat(segments) if segments else tgt_cache_loc[:0]
    out = out_cache_loc.clone()
    out[: len(packed)] = packed
    accept_filter = torch.zeros_like(num_accept_tokens)
    accept_filter[unfinished] = num_accept_tokens[unfinished]
    return out, accept_filter


# ------------------------------------------------------------------------------ cases


@dataclass
class Case:
    name: str
    # [bs]
    seq_lens: torch.Tensor
    # [bs] drafts + bonus, 1..num_draft_tokens
    num_accept_tokens: torch.Tensor
    # [bs * num_draft_tokens]
    out_cache_loc: torch.Tensor
    # [sum(num_accept_tokens)] flat verify positions of the accepted tokens, request by request
    accept_index: torch.Tensor
    num_draft_tokens: int
    page_size: int
    # requests still running after this verify (the rest finished)
    unfinished: list[int]

    def to(self, device) -> "Case":
        moved = {
            k: v.to(device) if isinstance(v, torch.Tensor) else v
            for k, v in self.__dict__.items()
        }
        return Case(**moved)


def make_case(
    name: str,
    bs: int,
    num_draft_tokens: int,
    page_size: int,
    *,
    accepted: Optional[int] = None,
    finished: float = 0.0,
    seed: int = 0,
) -> Case:
    """accepted: every request accepts this many tokens (1 = no draft, num_draft_tokens = all);
    None draws each request's count at random."""
    rng = random.Random(seed)
    counts = [accepted or rng.randint(1, num_draft_tokens) for _ in range(bs)]
    accept_index = []
    for b, n in enumerate(counts):
        nodes = [0] + sorted(rng.sample(range(1, num_draft_tokens), n - 1))
        accept_index += [b * num_draft_tokens + node for node in nodes]
    slots = rng.sample(range(1, 50_000), bs * num_draft_tokens)
    unfinished = [b for b in range(bs) if rng.random() >= finished]
    return Case(
        name=name,
        seq_lens=torch.tensor(
            [rng.randint(1, 300) for _ in range(bs)], dtype=torch.int64
        ),
        num_accept_tokens=torch.tensor(counts, dtype=torch.int32),
        out_cache_loc=torch.tensor(slots, dtype=torch.int64),
        accept_index=torch.tensor(accept_index, dtype=torch.int32),
        num_draft_tokens=num_draft_tokens,
        page_size=page_size,
        unfinished=unfinished,
    )


CASES = [
    make_case("bs1", 1, 4, 1, seed=1),
    make_case("bs1-all-accepted-page16", 1, 8, 16, accepted=8),
    make_case("nothing-accepted", 6, 4, 4, accepted=1, seed=2),
    make_case("everything-accepted", 5, 8, 4, accepted=8, seed=3),
    make_case("ragged-page1", 9, 8, 1, seed=4),
    make_case("ragged-page4-some-finished", 13, 16, 4, finished=0.4, seed=5),
    make_case("ragged-page64-all-finished", 7, 6, 64, finished=1.0, seed=6),
    make_case("bs48-page16", 48, 8, 16, finished=0.2, seed=7),
]


# ------------------------------------------------------------------------------ the check


def check(case: Case, device) -> None:
    """Run the kernels as eagle_info.py does and compare each output with the references."""
    c = case.to(device)
    bs, ndt = len(c.seq_lens), c.num_draft_tokens

    src, tgt, to_free_num_slots = get_src_tgt_cache_loc(
        c.seq_lens,
        c.out_cache_loc,
        c.accept_index,
        c.num_accept_tokens,
        ndt,
        c.page_size,
    )
    assert torch.equal(src, c.out_cache_loc[c.accept_index.long()])
    assert torch.equal(
        to_free_num_slots,
        ref_kept_and_freed(c.seq_lens, c.num_accept_tokens, ndt, c.page_size),
    )

    to_free_slots = torch.empty(
        (int(to_free_num_slots.sum()),), dtype=torch.int64, device=device
    )
    get_target_cache_loc[(bs,)](
        tgt,
        to_free_slots,
        c.num_accept_tokens,
        to_free_num_slots,
        c.out_cache_loc,
        ndt,
        next_power_of_2(ndt),
        next_power_of_2(bs),
    )
    want_tgt, want_free = ref_split_block_slots(
        c.out_cache_loc, c.num_accept_tokens, to_free_num_slots, ndt
    )
    assert torch.equal(tgt, want_tgt)
    assert torch.equal(to_free_slots, want_free)

    seq_lens = c.seq_lens.clone()
    unfinished = torch.tensor(c.unfinished, dtype=torch.int64, device=device)
    accept_filter = create_num_accept_tokens_filter(
        c.num_accept_tokens, unfinished, seq_lens
    )
    want_out, want_filter = ref_pack_unfinished(
        c.out_cache_loc, tgt, c.num_accept_tokens, c.unfinished
    )
    assert torch.equal(accept_filter, want_filter)
    assert torch.equal(seq_lens, c.seq_lens + c.num_accept_tokens)

    out_cache_loc = c.out_cache_loc.clone()
    filter_finished_cache_loc_kernel[(bs,)](
        out_cache_loc,
        tgt,
        c.num_accept_tokens,
        accept_filter,
        next_power_of_2(bs),
        next_power_of_2(ndt),
    )
    assert torch.equal(out_cache_loc, want_out)


# ------------------------------------------------------------------------------ interpreter run


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="run by test_spec_utils_kernels.py with TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernels_match_references(case):
    check(case, "cpu")
