"""FlashInfer plans for fixed-width speculative forwards (tree verify, spec v2 draft extend),
made from host lengths: the index pointers here; the whole plan, whose KV slot list a triton
kernel builds, under triton's CPU interpreter (flashinfer_host_plan_cases.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.attention.flashinfer_host_plans import (
    draft_decode_indptrs,
    draft_decode_kv_slots,
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
        n = max(n, width)  # lifted, as fixed_width_kv_lens does on the device
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


def test_a_prefix_pass_lifts_padding_to_one_kv_row_only():
    """A cascade's prefix pass (KV rows without the query rows): a prefix shorter than the
    width keeps its length, on the device and on the host."""
    lens = torch.tensor([1, 40, 3, 0])
    assert fixed_width_kv_lens(lens, 8, min_kv_len=1).tolist() == [1, 40, 3, 1]
    got = fixed_width_indptrs(lens, 8, min_kv_len=1)
    assert got.kv_indptr.tolist() == [0, 1, 41, 44, 45]
    assert got.qo_indptr.tolist() == [0, 8, 16, 24, 32] and got.max_kv_len == 40


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
    "test_a_draft_decode_planned_at_capture_replays_without_plans[False]",
    "test_a_draft_decode_planned_at_capture_replays_without_plans[True]",
    "test_a_plan_from_bounds_leaves_the_kernels_the_exact_lengths[False]",
    "test_a_plan_from_bounds_leaves_the_kernels_the_exact_lengths[True]",
    "test_device_mask_indptrs_are_the_host_ones",
    "test_a_plan_from_bounds_refuses_kernels_that_read_lengths_from_the_plan",
]
# Upstream's create_flashinfer_kv_indices_triton bounds a loop by a one-element array, which the
# interpreter runs with a warning (numpy < 2.5, as CI has) and numpy 2.5 refuses.
interpreter_run, test_plan_under_interpreter = interpreter_suite(
    HERE / "flashinfer_host_plan_cases.py", NAMES, strict_numpy=False
)


def torch_fixed_width_indptrs(kv_lens_cpu, width):
    """The index pointers as torch ops on the lifted lengths (the formulas before numpy)."""
    kv_lens = kv_lens_cpu.clamp(min=width).to(torch.int64)
    bits = width * kv_lens
    zero = torch.zeros(1, dtype=torch.int64)
    return (
        torch.arange(0, (len(kv_lens) + 1) * width, width, dtype=torch.int32),
        torch.cat([zero, kv_lens.cumsum(0)]).to(torch.int32),
        torch.cat([zero, bits.cumsum(0)]).to(torch.int32),
        torch.cat([zero, ((bits + 7) // 8).cumsum(0)]).to(torch.int32),
        kv_lens.to(torch.int32),
    )


@pytest.mark.parametrize("bs", [1, 4, 16, 48])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_indptrs_equal_the_torch_formulas(bs, dtype):
    gen = torch.Generator().manual_seed(bs)
    kv_lens = torch.randint(1, 700, (bs,), generator=gen).to(dtype)
    kv_lens[0] = 3  # a CUDA-graph padding placeholder, below the width
    got = fixed_width_indptrs(kv_lens, 32)
    fields = (got.qo_indptr, got.kv_indptr, got.mask_indptr, got.packed_mask_indptr)
    for field, expect in zip(
        fields + (got.kv_lens,), torch_fixed_width_indptrs(kv_lens, 32)
    ):
        assert field.dtype == torch.int32 and torch.equal(field, expect)
    assert got.max_kv_len == int(kv_lens.clamp(min=32).max())
    assert isinstance(got.max_kv_len, int)


def torch_draft_decode_indptrs(seq_lens_cpu, topk, num_steps):
    branch_lens = seq_lens_cpu.to(torch.int64)[:, None].repeat(1, topk).view(-1)
    prefix = torch.zeros(len(branch_lens) + 1, dtype=torch.int64)
    torch.cumsum(branch_lens, 0, out=prefix[1:])
    branch = torch.arange(len(branch_lens) + 1)
    step = torch.arange(1, num_steps + 1)
    return (prefix[None, :] + step[:, None] * branch[None, :]).to(torch.int32)


@pytest.mark.parametrize("bs", [1, 4, 16, 48])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_draft_decode_indptrs_equal_the_torch_formulas(bs, dtype):
    gen = torch.Generator().manual_seed(bs)
    seq_lens = torch.randint(1, 700, (bs,), generator=gen).to(dtype)
    got = draft_decode_indptrs(seq_lens, 16, 3)
    assert got.dtype == torch.int32 and got.shape == (3, bs * 16 + 1)
    assert torch.equal(got, torch_draft_decode_indptrs(seq_lens, 16, 3))


# FlashInfer's own plan against plan_paged_prefill, on a wrapper of the installed FlashInfer
# living on the CPU: its pinned host buffer becomes a plain one and its compiled planner (a
# CUDA library) a recorder of its arguments.


class RecordingPlanner:
    def __init__(self):
        self.calls = []

    def plan(self, *args):
        self.calls.append(args)
        return [len(self.calls), 7, 11]


@pytest.fixture
def cpu_flashinfer(monkeypatch):
    import flashinfer.prefill as fi_prefill

    planner = RecordingPlanner()
    modules = []

    def get_module(*args):
        modules.append(args)
        return planner

    zeros = torch.zeros

    def empty(*args, pin_memory=False, **kwargs):
        return zeros(
            *args, **kwargs
        )  # zeros: two wrappers' unwritten buffers compare equal

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(fi_prefill, "get_batch_prefill_module", get_module)
    return SimpleNamespace(planner=planner, modules=modules)


def make_prefill_wrapper(backend, cuda_graph, bs, kv_slots):
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper

    graph_buffers = {}
    if cuda_graph:  # as the verify's and draft extend's CUDA graphs allocate them
        graph_buffers = dict(
            qo_indptr_buf=torch.full((bs + 1,), -1, dtype=torch.int32),
            paged_kv_indptr_buf=torch.full((bs + 1,), -1, dtype=torch.int32),
            paged_kv_indices_buf=torch.full((kv_slots,), -1, dtype=torch.int32),
            paged_kv_last_page_len_buf=torch.full((bs,), -1, dtype=torch.int32),
            custom_mask_buf=torch.zeros(kv_slots * 8, dtype=torch.uint8),
            mask_indptr_buf=torch.zeros(bs + 1, dtype=torch.int32),
        )
    return BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(4096, dtype=torch.uint8),
        "NHD",
        backend=backend,
        use_cuda_graph=cuda_graph,
        **graph_buffers,
    )


def assert_same_value(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.device == b.device, where
        assert a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_value(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, where


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("bs,width", [(1, 32), (4, 32), (16, 8), (48, 32)])
def test_plan_paged_prefill_is_flashinfers_plan(
    cpu_flashinfer, backend, cuda_graph, bs, width
):
    """The same wrapper fields, buffers and planner arguments as FlashInfer's plan, over
    several plans of one wrapper (as replays of one CUDA graph), padding requests included.
    """
    from sglang.srt.layers.attention.flashinfer_host_plans import (
        HeadConfig,
        plan_paged_prefill,
        plans_from_host_lengths,
    )

    heads = HeadConfig(32, 8, 128, torch.bfloat16, torch.float16)
    kv_slots = bs * 800
    theirs = make_prefill_wrapper(backend, cuda_graph, bs, kv_slots)
    ours = make_prefill_wrapper(backend, cuda_graph, bs, kv_slots)
    assert plans_from_host_lengths(ours)
    gen = torch.Generator().manual_seed(bs + width)
    for replay in range(3):
        kv_lens_cpu = torch.randint(1, 700, (bs,), generator=gen)
        if bs > 1:
            kv_lens_cpu[-1] = 1  # a CUDA-graph padding placeholder
        indptrs = fixed_width_indptrs(kv_lens_cpu, width)
        num_slots = int(indptrs.kv_indptr[-1])
        kv_indices = torch.randint(0, 10**6, (num_slots,), generator=gen).to(
            torch.int32
        )
        theirs.plan(
            indptrs.qo_indptr.clone(),
            indptrs.kv_indptr.clone(),
            kv_indices,
            torch.ones(bs, dtype=torch.int32),
            heads.num_qo_heads,
            heads.num_kv_heads,
            heads.head_dim,
            1,
            q_data_type=heads.q_data_type,
            kv_data_type=heads.kv_data_type,
            non_blocking=True,
        )
        plan_paged_prefill(ours, heads, indptrs, width, kv_indices)
        their_args, our_args = cpu_flashinfer.planner.calls[-2:]
        assert_same_value(their_args, our_args, f"planner args, replay {replay}")
        for arg, wrapper in ((their_args, theirs), (our_args, ours)):
            assert arg[0] is wrapper._float_workspace_buffer
            assert arg[1] is wrapper._int_workspace_buffer
            assert arg[2] is wrapper._pin_memory_int_workspace_buffer
        assert cpu_flashinfer.modules[-1] == cpu_flashinfer.modules[-2]
        assert sorted(vars(ours)) == sorted(vars(theirs))
        for name, value in vars(theirs).items():
            if name == "_plan_info":  # the recorder's answer counts its calls
                continue
            assert_same_value(value, getattr(ours, name), f"{name}, replay {replay}")
    assert ours._plan_info == [6, 7, 11], "the planner's answer is the plan"


def test_other_prefill_backends_keep_flashinfers_plan(cpu_flashinfer):
    from sglang.srt.layers.attention.flashinfer_host_plans import (
        plans_from_host_lengths,
    )

    assert not plans_from_host_lengths(make_prefill_wrapper("auto", False, 2, 64))
    assert not plans_from_host_lengths(make_prefill_wrapper("cudnn", False, 2, 64))


@pytest.mark.parametrize(
    "backend,cuda_graph", [("fa2", True), ("fa2", False), ("fa3", True)]
)
def test_an_unsplit_plan_is_made_once_per_graph_shape(
    cpu_flashinfer, backend, cuda_graph
):
    """SGLANG_FLASHINFER_SPEC_UNSPLIT_PLAN: an fa2 CUDA-graph wrapper is planned without
    split-KV on its first plan, and later plans of its shape only refresh the buffers its
    kernels read; eager and fa3 wrappers plan every time."""
    from sglang.srt.layers.attention.flashinfer_host_plans import (
        HeadConfig,
        plan_paged_prefill,
    )

    heads = HeadConfig(32, 8, 128, torch.bfloat16, torch.bfloat16)
    bs, width = 4, 8
    wrapper = make_prefill_wrapper(backend, cuda_graph, bs, kv_slots=bs * 800)
    gen = torch.Generator().manual_seed(3)
    for replay in range(3):
        indptrs = fixed_width_indptrs(
            torch.randint(1, 700, (bs,), generator=gen), width
        )
        kv_indices = torch.arange(int(indptrs.kv_indptr[-1]), dtype=torch.int32)
        plan_paged_prefill(
            wrapper, heads, indptrs, width, kv_indices, unsplit_once=True
        )
        if cuda_graph:
            assert torch.equal(wrapper._paged_kv_indptr_buf, indptrs.kv_indptr)
            assert torch.equal(
                wrapper._paged_kv_indices_buf[: len(kv_indices)], kv_indices
            )
        else:
            assert torch.equal(wrapper._paged_kv_indptr_buf, indptrs.kv_indptr)
    once = backend == "fa2" and cuda_graph
    assert len(cpu_flashinfer.planner.calls) == (1 if once else 3)
    if backend == "fa2":
        disable_split_kv = cpu_flashinfer.planner.calls[0][-2]
        assert disable_split_kv is once


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_a_fixed_partition_is_unsplit_and_sized_by_its_rows(cpu_flashinfer, cuda_graph):
    """fixed_partition: the planner runs unsplit and as for an eager wrapper (the query
    tile from the sequences' rows, no padded grid), once per graph shape of a CUDA-graph
    wrapper (later plans refresh its buffers), every time eagerly."""
    from sglang.srt.layers.attention.flashinfer_host_plans import (
        HeadConfig,
        plan_paged_prefill,
    )

    heads = HeadConfig(32, 8, 128, torch.bfloat16, torch.bfloat16)
    bs, width = 16, 4  # four requests' 16 rows as four sequences each
    wrapper = make_prefill_wrapper("fa2", cuda_graph, bs, kv_slots=bs * 800)
    gen = torch.Generator().manual_seed(5)
    for replay in range(3):
        indptrs = fixed_width_indptrs(
            torch.randint(1, 700, (bs,), generator=gen), width, min_kv_len=1
        )
        kv_indices = torch.arange(int(indptrs.kv_indptr[-1]), dtype=torch.int32)
        plan_paged_prefill(
            wrapper, heads, indptrs, width, kv_indices, fixed_partition=True
        )
        assert torch.equal(wrapper._paged_kv_indptr_buf, indptrs.kv_indptr)
    calls = cpu_flashinfer.planner.calls
    assert len(calls) == (1 if cuda_graph else 3)
    for args in calls:
        enable_cuda_graph, disable_split_kv = args[11], args[-2]
        assert enable_cuda_graph is False and disable_split_kv is True
    # sm90's planner takes no disable_split_kv: a graph wrapper of it plans for the graph.
    sm90 = make_prefill_wrapper("fa3", True, bs, kv_slots=bs * 800)
    plan_paged_prefill(sm90, heads, indptrs, width, kv_indices, fixed_partition=True)
    assert cpu_flashinfer.planner.calls[-1][11] is True


def test_the_unsplit_plan_is_off_unless_the_env_says_1():
    from sglang.srt.layers.attention import flashinfer_host_plans as plans

    assert not plans.unsplit_plan_by_env({})
    assert plans.unsplit_plan_by_env({"SGLANG_FLASHINFER_SPEC_UNSPLIT_PLAN": "1"})
    assert not plans.unsplit_plan_by_env({"SGLANG_FLASHINFER_SPEC_UNSPLIT_PLAN": "0"})


@pytest.mark.parametrize(
    "unsplit_plan,tensor_cores,planned_at_capture_only",
    [
        (True, [True, True], True),
        (True, [True, False], False),
        (False, [True, True], False),
        (True, [], True),  # one draft step: no step backend to plan
    ],
)
def test_the_draft_decode_is_planned_at_capture_only_on_tensor_cores_when_unsplit(
    unsplit_plan, tensor_cores, planned_at_capture_only
):
    """Only FlashInfer's tensor-core decode plan takes disable_split_kv, so only that decode,
    planned unsplit at capture, may replay without a plan."""
    from sglang.srt.layers.attention.flashinfer_host_plans import (
        draft_decode_planned_at_capture_only,
    )

    steps = [
        SimpleNamespace(decode_use_tensor_cores=tc, disable_cuda_graph_kv_split=False)
        for tc in tensor_cores
    ]
    got = draft_decode_planned_at_capture_only(steps, unsplit_plan=unsplit_plan)
    assert got is planned_at_capture_only
    assert [s.disable_cuda_graph_kv_split for s in steps] == [got] * len(steps)


@pytest.mark.parametrize("topk", [1, 4, 16])
def test_the_draft_decode_slot_buffer_holds_requests_at_the_row_width(topk):
    """What the multi-step draft decode lays out per step (draft_decode_indptrs, equal to the
    kernel's pointers: flashinfer_host_plan_cases) fits its buffer for 8 requests whose
    prefixes fill req_to_token rows (a 160-token context plus spec v2's slack), whatever the
    topk. Upstream's buffer (8 x the context length) overflows near the context length: a
    chain by its draft tokens, a tree about topk times over."""
    context_len, row_width, num_steps, bs = 160, 260, 3, 8
    seq_lens = torch.full((bs,), row_width - num_steps, dtype=torch.int64)
    written = int(draft_decode_indptrs(seq_lens, topk, num_steps)[:, -1].max())
    assert written <= draft_decode_kv_slots(bs * topk, row_width)
    at_context = torch.full((bs,), context_len - 2, dtype=torch.int64)
    upstream = bs * context_len
    written_at_context = int(
        draft_decode_indptrs(at_context, topk, num_steps)[:, -1].max()
    )
    assert written_at_context > upstream
    assert written_at_context >= (topk - 1) * upstream
