"""FA3 tree-verify metadata from one triton program per draft token (fa3_tree_metadata.py),
compared with its plain-torch reference and upstream's replay arithmetic under triton's CPU
interpreter (fa3_tree_metadata_cases.py)."""

from __future__ import annotations

from pathlib import Path

from specpatch.testing.interpret import interpreter_suite

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
]

# Upstream's normal_decode_set_metadata kernel bounds a loop by a one-element array, which the
# interpreter runs with a warning under numpy < 2.5 (as CI has).
interpreter_run, test_fa3_tree_metadata_under_interpreter = interpreter_suite(
    HERE / "fa3_tree_metadata_cases.py", NAMES, strict_numpy=False
)
