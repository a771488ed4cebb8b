"""benchmark/spec/host_op_costs.py: it times plain_decode_kernels' kernels against their
torch references, loaded from their file (the GPU host runs it without sglang installed)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "spec"))
import host_op_costs  # noqa: E402


def test_the_kernels_it_times_are_loaded_from_their_file_and_match_on_the_cpu():
    kernels = host_op_costs.load_kernels()
    for name in (
        "decode_inputs_reference",
        "decode_inputs_triton",
        "push_rows_reference",
        "push_rows_triton",
    ):
        assert callable(getattr(kernels, name)), name
    # The loaded reference is the module's own: the DECODE inputs of one request.
    req_to_token = torch.arange(3 * 8, dtype=torch.int32).view(3, 8)
    inputs = kernels.decode_inputs_reference(
        req_to_token, torch.tensor([2]), torch.tensor([5]), torch.tensor([7])
    )
    assert inputs.out_cache_loc.tolist() == [2 * 8 + 5]
    assert inputs.input_ids.tolist() == [7] and inputs.seq_lens.tolist() == [6]
