"""FlashInfer plans for fixed-width speculative forwards (tree verify, spec v2 draft extend),
made from host lengths: the index pointers here; the whole plan, whose KV slot list a triton
kernel builds, under triton's CPU interpreter (flashinfer_host_plan_cases.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang.srt.layers.attention.flashinfer_host_plans import (
    fixed_width_indptrs,
    fixed_width_kv_lens,
)
from specpatch.testing.interpret import interpreter_suite

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("kv_lens,width", [([9], 4), ([5, 40, 17], 8), ([33] * 48, 32)])
def test_indptrs_count_rows_kv_and_mask_bits(kv_lens, width):
    lens = torch.tensor(kv_lens)
    got = fixed_width_indptrs(lens, width)
    expect_kv, expect_bits, expect_bytes = [0], [0], [0]
    for n in kv_lens:
        expect_kv.append(expect_kv[-1] + n)
        expect_bits.append(expect_bits[-1] + width * n)
        expect_bytes.append(expect_bytes[-1] + (width * n + 7) // 8)
    assert got.qo_indptr.tolist() == [b * width for b in range(len(kv_lens) + 1)]
    assert got.kv_indptr.tolist() == expect_kv
    assert got.mask_indptr.tolist() == expect_bits
    assert got.packed_mask_indptr.tolist() == expect_bytes
    for field in (
        got.qo_indptr,
        got.kv_indptr,
        got.mask_indptr,
        got.packed_mask_indptr,
    ):
        assert field.dtype == torch.int32 and field.device.type == "cpu"


def test_kv_lens_lift_padding_placeholders_to_the_width():
    assert fixed_width_kv_lens(torch.tensor([1, 40, 8, 3]), 8).tolist() == [8, 40, 8, 8]


NAMES = [
    "test_causal_draft_extend_plan[1-4]",
    "test_causal_draft_extend_plan[5-8]",
    "test_causal_draft_extend_plan[16-32]",
    "test_tree_verify_plan_packs_the_mask[1-8-False]",
    "test_tree_verify_plan_packs_the_mask[1-8-True]",
    "test_tree_verify_plan_packs_the_mask[6-16-False]",
    "test_tree_verify_plan_packs_the_mask[6-16-True]",
    "test_padding_requests_see_everything_and_get_width_kv_rows",
    "test_draft_decode_indptrs_match_the_kernel_and_its_slot_list[seq_lens0-4-3]",
    "test_draft_decode_indptrs_match_the_kernel_and_its_slot_list[seq_lens1-2-5]",
    "test_draft_decode_indptrs_match_the_kernel_and_its_slot_list[seq_lens2-8-3]",
    "test_draft_decode_indptrs_equal_upstreams_for_real_requests",
]
# Upstream's create_flashinfer_kv_indices_triton bounds a loop by a one-element array, which the
# interpreter runs with a warning (numpy < 2.5, as CI has) and numpy 2.5 refuses.
interpreter_run, test_plan_under_interpreter = interpreter_suite(
    HERE / "flashinfer_host_plan_cases.py", NAMES, strict_numpy=False
)
