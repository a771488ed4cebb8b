"""plain_decode_kernels' triton kernels against their plain-torch references.

Each case is a `none` step's batch of requests in request slots (over rings of owed rows);
`check_decode_inputs` and `check_push_rows` run a kernel and its reference on copies and
compare every output.
Collected by test_plain_decode_kernels.py: on CUDA directly, on CPU through triton's
interpreter (this file's own tests, which only run with TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from sglang.srt.speculative.plain_decode_kernels import (
    decode_inputs_reference,
    decode_inputs_triton,
    push_rows_reference,
    push_rows_triton,
)

NUM_SLOTS, MAX_CONTEXT, WIDTH = 70, 96, 5


@dataclass(frozen=True)
class Case:
    name: str
    bs: int
    hidden_size: int
    hidden_dtype: torch.dtype = torch.bfloat16  # the target's; the ring's is bfloat16
    seq_lens_dtype: torch.dtype = torch.int64
    # Rows each slot's ring already holds before the push: "random" below WIDTH, "last"
    # (WIDTH - 1: the push fills the ring), or "empty".
    lag: str = "random"


CASES = [
    Case("bs1", 1, 64),
    Case("bs1_ring_filled_by_the_push", 1, 64, lag="last"),
    Case("bs7_empty_rings", 7, 96, lag="empty"),
    # hidden wider than the kernel's tile and not a multiple of it (EAGLE3: three layers)
    Case("bs48_wide_hidden", 48, 3 * 1000),
    Case("bs64_int32_lens_fp32_hidden", 64, 128, torch.float32, torch.int32),
    Case("bs300_several_programs", 300, 32),
]


def slots_of(case: Case) -> torch.Tensor:
    """Distinct request slots, 1..NUM_SLOTS - 1 (slot 0 pads CUDA graphs), in no order."""
    g = torch.Generator().manual_seed(0)
    return torch.randperm(num_slots_of(case) - 1, generator=g)[: case.bs] + 1


def num_slots_of(case: Case) -> int:
    return max(NUM_SLOTS, case.bs + 1)


def _batch(case: Case, device: str):
    """The spec v2 batch a `none` step reads: request slots, their lengths, their carried
    bonus tokens, and req_to_token rows of distinct KV slots."""
    g = torch.Generator().manual_seed(2)
    seq_lens = torch.randint(0, MAX_CONTEXT, (case.bs,), generator=g)
    bonus = torch.randint(0, 32000, (case.bs,), generator=g, dtype=torch.int32)
    num_slots = num_slots_of(case)
    req_to_token = torch.randperm(num_slots * MAX_CONTEXT, generator=g).view(
        num_slots, MAX_CONTEXT
    )
    return (
        req_to_token.to(torch.int32).to(device),
        slots_of(case).to(device),
        seq_lens.to(case.seq_lens_dtype).to(device),
        bonus.to(device),
    )


def check_decode_inputs(case: Case, device: str) -> None:
    req_to_token, slots, seq_lens, bonus = _batch(case, device)
    got = decode_inputs_triton(req_to_token, slots, seq_lens, bonus)
    want = decode_inputs_reference(
        req_to_token.cpu(), slots.cpu(), seq_lens.cpu(), bonus.cpu()
    )
    assert got.input_ids.dtype == got.out_cache_loc.dtype == torch.int64
    assert got.seq_lens.dtype == seq_lens.dtype
    assert torch.equal(got.input_ids.cpu(), want.input_ids)
    assert torch.equal(got.out_cache_loc.cpu(), want.out_cache_loc)
    assert torch.equal(got.seq_lens.cpu(), want.seq_lens)
    assert torch.equal(seq_lens.cpu(), want.seq_lens - 1), "input lengths changed"


def _rings(case: Case, num_slots: int, g: torch.Generator):
    hidden = torch.randn(num_slots, WIDTH, case.hidden_size, generator=g)
    tokens = torch.randint(0, 32000, (num_slots, WIDTH), generator=g)
    if case.lag == "random":
        lag = torch.randint(0, WIDTH, (num_slots,), generator=g)
    else:
        lag = torch.full((num_slots,), WIDTH - 1 if case.lag == "last" else 0)
    return hidden.to(torch.bfloat16), tokens, lag


def check_push_rows(case: Case, device: str) -> None:
    g = torch.Generator().manual_seed(1)
    slots = slots_of(case)
    ring = _rings(case, num_slots_of(case), g)
    # Values a bfloat16 holds exactly, so that a wider hidden dtype's cast into the ring is
    # exact whatever the rounding (triton's interpreter truncates, the GPU rounds to nearest).
    hidden = torch.randn(case.bs, case.hidden_size, generator=g).to(torch.bfloat16)
    hidden = hidden.to(case.hidden_dtype)
    # next_token_ids as the sampler hands them (int64) into the ring's int64 tokens
    tokens = torch.randint(0, 32000, (case.bs,), generator=g)

    want = [t.clone() for t in ring]
    push_rows_reference(*want, slots, hidden, tokens)
    got = [t.clone().to(device) for t in ring]
    push_rows_triton(*got, slots.to(device), hidden.to(device), tokens.to(device))
    for name, a, b in zip(("hidden", "tokens", "lag"), got, want):
        assert torch.equal(a.cpu(), b), f"ring {name} differs"
    # Every pushed row is where the reference put it, and nothing else moved.
    assert torch.equal(want[2][slots], ring[2][slots] + 1)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="run by test_plain_decode_kernels.py with TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_push_rows_kernel_matches_reference(case):
    check_push_rows(case, "cpu")


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="run by test_plain_decode_kernels.py with TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decode_inputs_kernel_matches_reference(case):
    check_decode_inputs(case, "cpu")
