"""Cases for flashinfer_host_plans, run under triton's CPU interpreter (build_kv_indices
launches a triton kernel) by test_flashinfer_host_plans.py.

The plan handed to FlashInfer is compared with a plain-torch reading of what the generic path
plans: per request, width query rows over its first kv_len req_to_token slots, and for a tree
verify the request's FULL_MASK bits packed eight to a byte, least significant bit first.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang.srt.layers.attention import flashinfer_host_plans as plans


class RecordingWrapper:
    """Stands in for BatchPrefillWithPagedKVCacheWrapper: keeps what plan_fixed_width hands it,
    and copies the planned KV index pointer and slots where FlashInfer's plan does: into the
    CUDA graph's buffers (kv_indptr_buf, kv_indices_buf), or its own tensors when eager.
    """

    def __init__(
        self,
        cuda_graph: bool,
        mask_buf_bytes: int = 0,
        max_bs: int = 0,
        kv_indptr_buf=None,
        kv_indices_buf=None,
    ):
        self.is_cuda_graph_enabled = cuda_graph
        self._paged_kv_indptr_buf = kv_indptr_buf
        self._paged_kv_indices_buf = kv_indices_buf
        self._custom_mask_buf = (
            torch.full((mask_buf_bytes,), 255, dtype=torch.uint8)
            if cuda_graph
            else None
        )
        self._mask_indptr_buf = (
            torch.full((max_bs + 1,), -1, dtype=torch.int32) if cuda_graph else None
        )
        self.planned = None

    def begin_forward(
        self, qo_indptr, kv_indptr, kv_indices, last_page_len, *args, **kwargs
    ):
        self.planned = SimpleNamespace(
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices.clone(),
            last_page_len=last_page_len,
            args=args,
            kwargs=kwargs,
        )
        if self.is_cuda_graph_enabled:
            if self._paged_kv_indptr_buf is not None:
                self._paged_kv_indptr_buf.copy_(kv_indptr)
                self._paged_kv_indices_buf[: len(kv_indices)].copy_(kv_indices)
        else:
            self._paged_kv_indptr_buf = kv_indptr.clone()  # .to(device): a new tensor
            self._paged_kv_indices_buf = kv_indices  # already on the device: itself
            self._custom_mask_buf = None  # FlashInfer's plan without a mask clears it


def reference_segment_packbits(x, indptr, indptr_new, bitorder, y):
    """FlashInfer's segment_packbits, on the CPU: each segment packed on its own."""
    for b in range(len(indptr) - 1):
        bits = x[indptr[b] : indptr[b + 1]].numpy().astype(np.uint8)
        y[indptr_new[b] : indptr_new[b + 1]] = torch.from_numpy(
            np.packbits(bits, bitorder=bitorder)
        )


@pytest.fixture(autouse=True)
def cpu_packbits(monkeypatch):
    # (the package exports a function of the module's name: import the module by path)
    packbits = importlib.import_module("flashinfer.quantization.packbits")
    monkeypatch.setattr(
        packbits,
        "get_quantization_module",
        lambda: SimpleNamespace(segment_packbits=reference_segment_packbits),
    )


HEADS = plans.HeadConfig(8, 2, 64, torch.bfloat16, torch.bfloat16)
POOL_LEN = 96


def shuffled_req_to_token(num_seqs: int, gen: torch.Generator) -> torch.Tensor:
    """[num_seqs, POOL_LEN] int32: distinct KV slots, so a slot read names its position."""
    return (
        torch.randperm(num_seqs * POOL_LEN, generator=gen)
        .to(torch.int32)
        .view(num_seqs, POOL_LEN)
    )


def make_batch(bs: int, width: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = bs + 3  # pool rows the batch does not use, so that the row lookup matters
    req_to_token = shuffled_req_to_token(rows, gen)
    req_pool_indices = torch.randperm(rows, generator=gen)[:bs].to(torch.int64)
    prefix = torch.randint(1, POOL_LEN - width, (bs,), generator=gen)
    return req_to_token, req_pool_indices, prefix


def reference_plan(req_to_token, req_pool_indices, kv_lens, width):
    kv_indices = torch.cat(
        [
            req_to_token[r, :n]
            for r, n in zip(req_pool_indices.tolist(), kv_lens.tolist())
        ]
    )
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), kv_lens.cumsum(0)]).to(
        torch.int32
    )
    qo_indptr = torch.arange(len(kv_lens) + 1, dtype=torch.int32) * width
    return qo_indptr, kv_indptr, kv_indices


def tree_mask(kv_lens, width, seed):
    """FULL_MASK bits: request after request, width rows of its kv_len columns."""
    gen = torch.Generator().manual_seed(seed)
    return torch.cat(
        [torch.rand(width * n, generator=gen) < 0.5 for n in kv_lens.tolist()]
    )


def reference_packed(mask, kv_lens, width):
    packed, indptr, start = [], [0], 0
    for n in kv_lens.tolist():
        bits = mask[start : start + width * n].numpy().astype(np.uint8)
        start += width * n
        packed.append(np.packbits(bits, bitorder="little"))
        indptr.append(indptr[-1] + len(packed[-1]))
    return torch.from_numpy(np.concatenate(packed)), torch.tensor(
        indptr, dtype=torch.int32
    )


def plan(
    wrapper,
    width,
    req_to_token,
    req_pool_indices,
    kv_lens,
    kv_indices_buf=None,
    custom_mask=None,
    bounds=None,
    kv_indptr_buf=None,
):
    """plan_fixed_width as the backend calls it: the same lengths on the device and the host,
    or with `bounds`, those on the host as bounds of the device's."""
    if kv_indptr_buf is None:
        kv_indptr_buf = torch.zeros(len(kv_lens) + 1, dtype=torch.int32)
    plans.plan_fixed_width(
        wrapper,
        HEADS,
        width=width,
        req_pool_indices=req_pool_indices,
        kv_lens=kv_lens,
        kv_lens_cpu=kv_lens.clone() if bounds is None else bounds,
        req_to_token=req_to_token,
        kv_indptr_buf=kv_indptr_buf,
        kv_indices_buf=kv_indices_buf,
        custom_mask=custom_mask,
        host_lens_are_bounds=bounds is not None,
    )


@pytest.mark.parametrize("bs,width", [(1, 4), (5, 8), (16, 32)])
def test_causal_draft_extend_plan(bs, width):
    req_to_token, req_pool_indices, prefix = make_batch(bs, width, seed=bs)
    kv_lens = prefix + width
    wrapper = RecordingWrapper(cuda_graph=False)
    plan(wrapper, width, req_to_token, req_pool_indices, kv_lens)
    qo, kv, idx = reference_plan(req_to_token, req_pool_indices, kv_lens, width)
    got = wrapper.planned
    assert torch.equal(got.qo_indptr, qo) and torch.equal(got.kv_indptr, kv)
    assert torch.equal(got.kv_indices, idx)
    assert (
        got.qo_indptr.device.type == got.kv_indptr.device.type == "cpu"
    ), "indptrs must not need a read-back"
    assert torch.equal(got.last_page_len, torch.ones(bs, dtype=torch.int32))
    assert got.args[:4] == (8, 2, 64, 1)
    assert wrapper._custom_mask_buf is None, "a draft extend is causal: no mask"


@pytest.mark.parametrize(
    "bs,width,cuda_graph", [(1, 8, False), (1, 8, True), (6, 16, False), (6, 16, True)]
)
def test_tree_verify_plan_packs_the_mask(bs, width, cuda_graph):
    req_to_token, req_pool_indices, prefix = make_batch(bs, width, seed=10 + bs)
    kv_lens = prefix + width
    mask = tree_mask(kv_lens, width, seed=bs)
    wrapper = RecordingWrapper(cuda_graph, mask_buf_bytes=4096, max_bs=bs)
    kv_indices_buf = torch.full((4096,), -1, dtype=torch.int32) if cuda_graph else None
    plan(wrapper, width, req_to_token, req_pool_indices, kv_lens, kv_indices_buf, mask)
    qo, kv, idx = reference_plan(req_to_token, req_pool_indices, kv_lens, width)
    assert torch.equal(wrapper.planned.kv_indices, idx)
    packed, packed_indptr = reference_packed(mask, kv_lens, width)
    if cuda_graph:
        assert torch.equal(
            kv_indices_buf[: len(idx)], idx
        ), "the graph's slot buffer holds the slots"
        assert torch.equal(wrapper._custom_mask_buf[: len(packed)], packed)
        assert torch.equal(wrapper._mask_indptr_buf, packed_indptr)
    else:
        assert torch.equal(wrapper._custom_mask_buf, packed)
        assert torch.equal(wrapper._mask_indptr_buf, packed_indptr)


def test_padding_requests_see_everything_and_get_width_kv_rows():
    """A CUDA graph pads the batch with requests of placeholder length 1, past the real mask."""
    width, real = 8, 2
    req_to_token, req_pool_indices, prefix = make_batch(3, width, seed=3)
    kv_lens = torch.cat([prefix[:real] + width, torch.ones(1, dtype=torch.int64)])
    mask = tree_mask(kv_lens[:real], width, seed=4)
    wrapper = RecordingWrapper(cuda_graph=True, mask_buf_bytes=4096, max_bs=3)
    plan(
        wrapper,
        width,
        req_to_token,
        req_pool_indices,
        kv_lens,
        torch.zeros(4096, dtype=torch.int32),
        mask,
    )
    lifted = torch.cat([kv_lens[:real], torch.tensor([width])])
    _, kv, idx = reference_plan(req_to_token, req_pool_indices, lifted, width)
    assert torch.equal(wrapper.planned.kv_indptr, kv)
    assert torch.equal(wrapper.planned.kv_indices, idx)
    full = torch.cat([mask, torch.ones(width * width, dtype=torch.bool)])
    packed, packed_indptr = reference_packed(full, lifted, width)
    assert torch.equal(wrapper._custom_mask_buf[: len(packed)], packed)
    assert torch.equal(wrapper._mask_indptr_buf, packed_indptr)


def reference_draft_decode_reads(
    req_to_token, req_pool_indices, seq_lens, topk, num_steps, step
):
    """Per draft branch b * topk + t, the KV slots it reads at draft decode `step`: its request's
    seq_len prefix, then the step + 1 draft slots of branch t (num_steps slots per branch after
    the prefix, as spec v2's assign_draft_cache_locs lays them out at page size 1)."""
    reads = []
    for b, seq_len in enumerate(seq_lens.tolist()):
        row = req_to_token[req_pool_indices[b]]
        for t in range(topk):
            draft = row[seq_len + t * num_steps : seq_len + t * num_steps + step + 1]
            reads.append(torch.cat([row[:seq_len], draft]))
    return reads


def assert_draft_decode_slots(
    kv_indices, indptrs, req_to_token, req_pool_indices, seq_lens, topk, num_steps
):
    """Each draft branch's slot list at each step, between its index pointers, is what
    reference_draft_decode_reads says it reads."""
    for step in range(num_steps):
        reads = reference_draft_decode_reads(
            req_to_token, req_pool_indices, seq_lens, topk, num_steps, step
        )
        for z, expected in enumerate(reads):
            got = kv_indices[step, indptrs[step, z] : indptrs[step, z + 1]]
            assert torch.equal(got, expected.to(torch.int32)), (step, z)


def run_upstream_draft_decode_kernel(
    req_to_token, req_pool_indices, seq_lens, positions, topk, num_steps
):
    from sglang.srt.speculative.spec_utils import generate_draft_decode_kv_indices
    from sglang.srt.utils import next_power_of_2

    num_seqs = seq_lens.shape[0]
    kv_indices = torch.full(
        (num_steps, num_seqs * topk * POOL_LEN), -1, dtype=torch.int32
    )
    kv_indptr = torch.zeros((num_steps, num_seqs * topk + 1), dtype=torch.int32)
    generate_draft_decode_kv_indices[(num_steps, num_seqs, topk)](
        req_pool_indices,
        req_to_token,
        seq_lens,
        kv_indices,
        kv_indptr,
        positions,
        POOL_LEN,
        kv_indices.shape[1],
        kv_indptr.shape[1],
        next_power_of_2(num_seqs),
        next_power_of_2(num_steps),
        next_power_of_2(num_seqs * topk),
        1,
    )
    return kv_indices, kv_indptr


@pytest.mark.parametrize(
    "seq_lens,topk,num_steps", [([7], 4, 3), ([5, 30, 12], 2, 5), ([9, 1, 1], 8, 3)]
)
def test_draft_decode_indptrs_match_the_kernel_and_its_slot_list(
    seq_lens, topk, num_steps
):
    """The last case is a CUDA graph's padded batch: two placeholder requests of length 1, whose
    positions the graph runner zeroes; the host pointers follow the slot list there as well.
    """
    seq_lens = torch.tensor(seq_lens, dtype=torch.int64)
    num_seqs = seq_lens.shape[0]
    gen = torch.Generator().manual_seed(11)
    req_to_token = shuffled_req_to_token(num_seqs, gen)
    req_pool_indices = torch.randperm(num_seqs, generator=gen)
    branch_lens = plans.draft_decode_branch_lens(seq_lens, topk)
    assert branch_lens.tolist() == [n for n in seq_lens.tolist() for _ in range(topk)]

    host = plans.draft_decode_indptrs(seq_lens, topk, num_steps)
    kv_indices, kv_indptr = run_upstream_draft_decode_kernel(
        req_to_token, req_pool_indices, seq_lens, branch_lens, topk, num_steps
    )
    assert host.dtype == torch.int32 and host.shape == (num_steps, num_seqs * topk + 1)
    assert torch.equal(host, kv_indptr)
    assert_draft_decode_slots(
        kv_indices, host, req_to_token, req_pool_indices, seq_lens, topk, num_steps
    )


class RecordingStepBackend:
    """Stands in for one draft step's FlashInferAttnBackend: counts its replay plans."""

    def __init__(self):
        self.replays = []

    def init_forward_metadata_replay_cuda_graph(self, bs, *args, **kwargs):
        self.replays.append(bs)


@pytest.mark.parametrize("planned_at_capture_only", [False, True])
def test_a_draft_decode_planned_at_capture_replays_without_plans(
    planned_at_capture_only,
):
    """FlashInferMultiStepDraftBackend's graph replay: planned at capture only, it lays out the
    KV slots and index pointers the captured kernels read and plans no step; otherwise every
    step but the last plans once."""
    from sglang.srt.layers.attention.flashinfer_backend import (
        FlashInferMultiStepDraftBackend,
    )
    from sglang.srt.speculative.spec_utils import generate_draft_decode_kv_indices

    seq_lens, topk, num_steps = torch.tensor([7, 12]), 4, 3
    num_seqs = seq_lens.shape[0]
    gen = torch.Generator().manual_seed(7)
    req_to_token = shuffled_req_to_token(num_seqs, gen)
    req_pool_indices = torch.tensor([1, 0])
    backend = object.__new__(FlashInferMultiStepDraftBackend)
    backend.topk = topk
    backend.speculative_num_steps = num_steps
    backend.generate_draft_decode_kv_indices = generate_draft_decode_kv_indices
    backend.page_size = 1
    backend.pool_len = POOL_LEN
    backend.kv_indptr = torch.zeros((num_steps, num_seqs * topk + 1), dtype=torch.int32)
    backend.cuda_graph_kv_indices = torch.full(
        (num_steps, num_seqs * topk * POOL_LEN), -1, dtype=torch.int32
    )
    backend.attn_backends = [RecordingStepBackend() for _ in range(num_steps - 1)]
    backend.planned_at_capture_only = planned_at_capture_only
    forward_batch = SimpleNamespace(
        batch_size=num_seqs,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        seq_lens_sum=int(seq_lens.sum()),
        positions=torch.zeros(num_seqs * topk, dtype=torch.int64),
        req_pool_indices=req_pool_indices,
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        spec_info=SimpleNamespace(
            is_draft_input=lambda: True, kv_indptr=None, kv_indices=None
        ),
    )

    backend.init_forward_metadata_replay_cuda_graph(forward_batch, num_seqs)

    expected_plans = [] if planned_at_capture_only else [num_seqs]
    assert [b.replays for b in backend.attn_backends] == [expected_plans] * (
        num_steps - 1
    )
    host = plans.draft_decode_indptrs(seq_lens, topk, num_steps)
    assert torch.equal(backend.kv_indptr, host)
    assert_draft_decode_slots(
        backend.cuda_graph_kv_indices,
        host,
        req_to_token,
        req_pool_indices,
        seq_lens,
        topk,
        num_steps,
    )


def test_draft_decode_indptrs_equal_upstreams_for_real_requests():
    """Upstream passes the positions (a request's seq_len per branch, zero for CUDA-graph
    padding): the pointers of real requests are the same, the padding's differ."""
    seq_lens, topk, num_steps, real = torch.tensor([9, 14, 1]), 4, 3, 2
    gen = torch.Generator().manual_seed(5)
    req_to_token = shuffled_req_to_token(3, gen)
    positions = torch.cat(
        [
            plans.draft_decode_branch_lens(seq_lens[:real], topk),
            torch.zeros(topk, dtype=torch.int64),
        ]
    )
    _, upstream = run_upstream_draft_decode_kernel(
        req_to_token, torch.arange(3), seq_lens, positions, topk, num_steps
    )
    host = plans.draft_decode_indptrs(seq_lens, topk, num_steps)
    assert torch.equal(host[:, : real * topk + 1], upstream[:, : real * topk + 1])
    assert not torch.equal(host, upstream)


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_a_plan_from_bounds_leaves_the_kernels_the_exact_lengths(cuda_graph):
    """Spec v2 may plan from bounds on the host lengths (bounded_host_lens): FlashInfer's plan
    sees the bounds, and what its kernels read, the KV index pointer and slots and the packed
    mask with its index pointer, is what exact host lengths would have planned."""
    bs, width = 4, 8
    req_to_token, req_pool_indices, prefix = make_batch(bs, width, seed=21)
    kv_lens = prefix + width
    bounds = kv_lens + torch.tensor([0, 1, width, 2 * width])
    mask = tree_mask(kv_lens, width, seed=22)
    kv_indptr_buf = torch.full((bs + 1,), -1, dtype=torch.int32)
    kv_indptr_buf[0] = 0  # as every backend allocates it
    kv_indices_buf = torch.full((4096,), -1, dtype=torch.int32) if cuda_graph else None
    wrapper = RecordingWrapper(
        cuda_graph,
        mask_buf_bytes=4096,
        max_bs=bs,
        kv_indptr_buf=kv_indptr_buf if cuda_graph else None,
        kv_indices_buf=kv_indices_buf,
    )
    plan(
        wrapper,
        width,
        req_to_token,
        req_pool_indices,
        kv_lens,
        kv_indices_buf,
        mask,
        bounds=bounds,
        kv_indptr_buf=kv_indptr_buf,
    )
    _, bounded_indptr, _ = reference_plan(req_to_token, req_pool_indices, bounds, width)
    assert torch.equal(wrapper.planned.kv_indptr, bounded_indptr), "planned from bounds"
    _, kv_indptr, kv_indices = reference_plan(
        req_to_token, req_pool_indices, kv_lens, width
    )
    assert torch.equal(wrapper._paged_kv_indptr_buf, kv_indptr)
    assert torch.equal(wrapper._paged_kv_indices_buf[: len(kv_indices)], kv_indices)
    packed, packed_indptr = reference_packed(mask, kv_lens, width)
    assert torch.equal(wrapper._mask_indptr_buf, packed_indptr)
    assert torch.equal(wrapper._custom_mask_buf[: len(packed)], packed)


def test_device_mask_indptrs_are_the_host_ones():
    kv_lens = torch.tensor(
        [1, 40, 8, 3, 700]
    )  # the first and fourth lifted to the width
    host = plans.fixed_width_indptrs(kv_lens, 8)
    mask_indptr, packed_indptr = plans.device_mask_indptrs(kv_lens, 8)
    assert mask_indptr.dtype == packed_indptr.dtype == torch.int32
    assert torch.equal(mask_indptr, host.mask_indptr)
    assert torch.equal(packed_indptr, host.packed_mask_indptr)


def test_a_plan_from_bounds_refuses_kernels_that_read_lengths_from_the_plan():
    wrapper = RecordingWrapper(cuda_graph=False)
    wrapper._backend = "fa3"
    req_to_token, req_pool_indices, prefix = make_batch(1, 4, seed=1)
    with pytest.raises(ValueError, match="needs FlashInfer's fa2 kernels, not fa3"):
        plan(wrapper, 4, req_to_token, req_pool_indices, prefix + 4, bounds=prefix + 8)
