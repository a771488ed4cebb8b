"""FA3 tree-verify metadata from one triton program per draft token (fa3_tree_metadata.py),
compared with its plain-torch reference and upstream's replay arithmetic under triton's CPU
interpreter (fa3_tree_metadata_cases.py)."""

from __future__ import annotations

from pathlib import Path

import fa3_tree_metadata_cases
import pytest
import torch

from specpatch.testing.interpret import interpreter_suite
from specpatch.testing.sm90_compile import launches_compile_for_sm90

HERE = Path(__file__).resolve().parent

NAMES = [
    *(
        f"test_kernel_matches_reference_and_upstream[{case}]"
        for case in (
            "bs1",
            "ragged",
            "graph-padding",
            "all-visible",
            "root-only",
            "wide",
            "width-not-a-power-of-two",
        )
    ),
    "test_fill_tree_verify_metadata_writes_the_prefix_with_upstreams_fused_kernel",
    "test_fill_draft_decode_metadata_matches_upstreams_replay",
    "test_prefix_pages_stay_within_the_page_table_row",
]

# Upstream's normal_decode_set_metadata kernel bounds a loop by a one-element array, which the
# interpreter runs with a warning under numpy < 2.5 (as CI has).
interpreter_run, test_fa3_tree_metadata_under_interpreter = interpreter_suite(
    HERE / "fa3_tree_metadata_cases.py", NAMES, strict_numpy=False
)


@pytest.mark.parametrize("seq_lens,D,num_real,shape", fa3_tree_metadata_cases.CASES)
def test_kernel_compiles_for_sm90(seq_lens, D, num_real, shape):
    """Triton's compiler, which the interpreter does not run, takes each case's types (the
    FA3 backend's: int32 page table and prefix offsets)."""
    b = fa3_tree_metadata_cases.make_batch(seq_lens, D, num_real, shape)
    rows = len(seq_lens) * D
    with launches_compile_for_sm90() as compiled:
        fa3_tree_metadata_cases.fill_expand(
            b,
            page_table=torch.zeros(rows, D, dtype=torch.int32),
            cache_seqlens=torch.zeros(rows, dtype=torch.int32),
            cu_seqlens_k=torch.zeros(rows + 1, dtype=torch.int32),
        )
    assert compiled == ["_tree_verify_expand_kernel"]
