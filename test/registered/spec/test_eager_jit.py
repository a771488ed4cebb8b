"""sglang.srt.utils.eager_jit: the index kernels a decode step launches between CUDA-graph
replays compile once per set of constexpr values, whatever the alignment of the tensors and
the values of the integers they are launched with.

Checked on the CPU through Triton's own specialisation key (the binder its launcher runs
before looking a compiled kernel up), so it follows Triton's rules rather than restating them.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import triton
import triton.language as tl

from sglang.srt.speculative.eagle_info_v2 import fill_bonus_tokens
from sglang.srt.speculative.spec_utils import (
    assign_req_to_token_pool,
    assign_req_to_token_pool_func,
)
from sglang.srt.utils.eager_jit import eager_jit
from specpatch.testing.sm90_compile import launches_compile_for_sm90
from specpatch.testing.triton_keys import specialisation

# (module, kernel): every kernel the decode step launches eagerly that takes per-step slices
# or counts.
EAGER_KERNELS = [
    ("sglang.srt.speculative.spec_utils", "assign_req_to_token_pool"),
    ("sglang.srt.speculative.spec_utils", "generate_draft_decode_kv_indices"),
    ("sglang.srt.speculative.eagle_info_v2", "assign_extend_cache_locs"),
    ("sglang.srt.speculative.eagle_info_v2", "assign_draft_cache_locs_page_size_1"),
    ("sglang.srt.speculative.eagle_info_v2", "fill_bonus_tokens"),
    ("sglang.srt.mem_cache.memory_pool", "copy_all_layer_kv_cache_tiled"),
    ("sglang.srt.mem_cache.kv_move", "_assert_slots_in_range_kernel"),
    ("sglang.srt.mem_cache.common", "write_req_to_token_pool_triton"),
    ("sglang.srt.layers.attention.utils", "create_flashinfer_kv_indices_triton"),
    ("sglang.srt.layers.attention.triton_backend", "get_num_kv_splits_triton"),
    ("sglang.srt.layers.attention.fa3_tree_metadata", "_tree_verify_expand_kernel"),
    ("sglang.srt.model_executor.forward_batch_info", "compute_position_kernel"),
    ("sglang.srt.speculative.plain_decode_kernels", "_decode_inputs_kernel"),
    ("sglang.srt.speculative.plain_decode_kernels", "_push_rows_kernel"),
]


@triton.jit
def _plain_kernel(slots, n, BLOCK: tl.constexpr):
    pass


@eager_jit
def _eager_kernel(slots, n, BLOCK: tl.constexpr):
    pass


def keys(kernel, values) -> set:
    return {specialisation(kernel, v) for v in values}


SLOTS = torch.zeros(64, dtype=torch.int64)
# An aligned tensor and slices starting 8 and 24 bytes in: 16-byte aligned, then not.
TENSORS = [SLOTS, SLOTS[1:], SLOTS[3:]]
# Integers Triton treats apart: 1, multiples of 16, the rest.
COUNTS = [1, 16, 48, 7]


def test_the_key_tells_plain_triton_jit_launches_apart():
    """The measure below can fail: plain triton.jit specialises on both."""
    assert len(keys(_plain_kernel, TENSORS)) == 2
    assert len(keys(_plain_kernel, COUNTS)) == 3


def test_eager_jit_compiles_once_per_constexpr_set():
    assert len(keys(_eager_kernel, TENSORS)) == 1
    assert len(keys(_eager_kernel, COUNTS)) == 1
    assert specialisation(_eager_kernel, 7, constexpr=4) != specialisation(
        _eager_kernel, 7, constexpr=8
    )


def test_eager_jit_keeps_triton_jit_options():
    @eager_jit(debug=True)
    def checked(slots, n, BLOCK: tl.constexpr):
        pass

    assert checked.debug is True
    assert len(keys(checked, TENSORS)) == 1


@pytest.mark.parametrize(
    "module,name", EAGER_KERNELS, ids=[name for _, name in EAGER_KERNELS]
)
def test_decode_step_index_kernels_compile_once_per_constexpr_set(module, name):
    kernel = getattr(importlib.import_module(module), name)
    assert len(keys(kernel, TENSORS)) == 1, "specialises on pointer alignment"
    assert len(keys(kernel, COUNTS)) == 1, "specialises on integer values"


# Parameters that carry a buffer's row width: fixed by the engine's pool sizes and context
# length, so they differ between engines of one process and between server restarts.
ROW_WIDTHS = {
    "pool_len",
    "req_to_token_ptr_stride",
    "kv_indices_stride",
    "kv_indptr_stride",
}


# The decode step's index kernels that address req_to_token or the draft KV index buffers.
ROW_WIDTH_KERNELS = [
    ("sglang.srt.speculative.spec_utils", "assign_req_to_token_pool"),
    ("sglang.srt.speculative.spec_utils", "generate_draft_decode_kv_indices"),
    ("sglang.srt.speculative.eagle_info_v2", "assign_extend_cache_locs"),
    ("sglang.srt.speculative.eagle_info_v2", "assign_draft_cache_locs_page_size_1"),
    ("sglang.srt.mem_cache.common", "write_req_to_token_pool_triton"),
    ("sglang.srt.layers.attention.utils", "create_flashinfer_kv_indices_triton"),
]


@pytest.mark.parametrize(
    "module,name", ROW_WIDTH_KERNELS, ids=[name for _, name in ROW_WIDTH_KERNELS]
)
def test_decode_step_index_kernels_share_compiles_across_pool_sizes(module, name):
    """A second engine with a longer req_to_token row (or a restart with a longer context)
    finds every index kernel already compiled: no row width is a constexpr."""
    kernel = getattr(importlib.import_module(module), name)
    assert {p.name for p in kernel.params} & ROW_WIDTHS, "takes no row width"
    keys = {
        specialisation(kernel, SLOTS, **dict.fromkeys(ROW_WIDTHS, width))
        for width in (4096, 4112, 65536)
    }
    assert len(keys) == 1, "a row width selects a compile"


def test_decode_step_index_kernels_compile_for_sm90():
    """Without the specialisations the kernels still compile for an H100 (triton's compiler,
    which the interpreter does not run), with the argument types the server passes."""
    bs = 3
    with launches_compile_for_sm90() as compiled:
        assign_req_to_token_pool_func(
            torch.arange(1, bs + 1),  # req_pool_indices
            torch.zeros(bs + 1, 64, dtype=torch.int32),  # req_to_token
            torch.tensor([4, 5, 6], dtype=torch.int32)[1:],  # start_offset, a slice
            torch.tensor([9, 9, 9, 9], dtype=torch.int32)[1:],  # end_offset
            torch.arange(20, dtype=torch.int64)[1:],  # out_cache_loc
            bs,
        )
        fill_bonus_tokens[(bs,)](
            torch.zeros(bs * 4, dtype=torch.int64),
            torch.ones(bs, dtype=torch.int32),
            torch.zeros(bs, dtype=torch.int64),
            num_draft_tokens=4,
        )
    assert compiled == ["assign_req_to_token_pool", "fill_bonus_tokens"]


@pytest.mark.gpu
def test_slot_assignment_compiles_once_across_alignments_and_counts():
    """On the GPU: the decode step's KV slot assignment, launched as prepare_for_decode
    launches it (the lengths as rows of one [2, bs] tensor, the new slots a slice of the
    allocator's), at batch sizes 5-8 (one power of two) with every alignment those give and
    two req_to_token row widths, compiles once and writes what a torch loop writes."""
    device = torch.device("cuda")
    pools = {w: torch.zeros(9, w, dtype=torch.int32, device=device) for w in (64, 80)}
    free_slots = torch.arange(1000, 1400, dtype=torch.int64, device=device)
    variants = len(assign_req_to_token_pool.device_caches[device.index or 0][0])
    offset = 0
    for width, bs, first in [
        (64, 5, 1),
        (64, 6, 0),
        (80, 7, 3),
        (64, 8, 1),
        (80, 5, 2),
    ]:
        req_to_token = pools[width]
        cur = torch.arange(first, first + bs, dtype=torch.int32) % 4
        lens = torch.stack([cur, cur + torch.arange(1, bs + 1, dtype=torch.int32)])
        cur_kv_lens, nxt_kv_lens = lens.to(device)
        needed = int((lens[1] - lens[0]).sum())
        out_cache_loc = free_slots[offset : offset + needed]
        req_pool_indices = torch.arange(1, bs + 1, device=device)
        expected = req_to_token.clone()
        assign_req_to_token_pool_func(
            req_pool_indices, req_to_token, cur_kv_lens, nxt_kv_lens, out_cache_loc, bs
        )
        written = 0
        for b in range(bs):
            lo, hi = int(lens[0, b]), int(lens[1, b])
            expected[b + 1, lo:hi] = out_cache_loc[written : written + hi - lo].int()
            written += hi - lo
        torch.cuda.synchronize()
        assert torch.equal(req_to_token, expected), (width, bs, first)
        offset += needed + 1  # the next slice starts at the other alignment
    compiled = len(assign_req_to_token_pool.device_caches[device.index or 0][0])
    assert compiled - variants <= 1, f"{compiled - variants} compiles for one bs_upper"
