"""GPU: the chain fast path's draft_forward launches no sort/topk/gather/cat kernels."""

from __future__ import annotations

import re

import pytest
import torch

from specpatch.testing.fake_draft import (
    DenseDraftRunner,
    make_draft_worker,
    make_forward_batch,
)

pytestmark = pytest.mark.gpu

SCORING_KERNELS = re.compile(r"sort|topk|gather|CatArray|cat_|softmax", re.IGNORECASE)
HIDDEN, VOCAB, NUM_STEPS = 512, 4096, 4


def cuda_kernels(fn) -> list[str]:
    fn()  # warm up (torch.compile of the general path's helpers)
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        fn()
        torch.cuda.synchronize()
    return [
        e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    ]


def draft_forward_kernels(worker, bs: int) -> list[str]:
    def run():
        batch = make_forward_batch(
            bs,
            NUM_STEPS,
            vocab_size=VOCAB,
            hidden=HIDDEN,
            device="cuda",
            dtype=torch.bfloat16,
        )
        worker.draft_forward(batch)

    return cuda_kernels(run)


def model_kernels(runner, bs: int) -> set[str]:
    """Kernels of the fake draft model itself (its embedding lookup is a gather kernel)."""
    batch = make_forward_batch(
        bs,
        NUM_STEPS,
        vocab_size=VOCAB,
        hidden=HIDDEN,
        device="cuda",
        dtype=torch.bfloat16,
    )
    batch.input_ids = batch.spec_info.topk_index.reshape(-1)
    return set(cuda_kernels(lambda: runner.forward(batch)))


@pytest.mark.parametrize("bs", [1, 32])
def test_chain_draft_launches_no_scoring_kernels(bs, record_metric):
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    runner = DenseDraftRunner(HIDDEN, 2 * HIDDEN, VOCAB)
    chain = draft_forward_kernels(
        make_draft_worker(
            EagleDraftWorker, runner, num_steps=NUM_STEPS, max_bs=64, device="cuda"
        ),
        bs,
    )
    general = draft_forward_kernels(
        make_draft_worker(
            EagleDraftWorker,
            runner,
            num_steps=NUM_STEPS,
            max_bs=64,
            chain=False,
            device="cuda",
        ),
        bs,
    )
    own = model_kernels(runner, bs)
    scoring_in_chain = sorted(
        {k for k in chain if SCORING_KERNELS.search(k) and k not in own}
    )
    scoring_in_general = sorted(
        {k for k in general if SCORING_KERNELS.search(k) and k not in own}
    )
    record_metric(
        "chain_kernels_outside_model", sorted({k for k in chain if k not in own})
    )
    record_metric("chain_kernels", len(chain))
    record_metric("general_kernels", len(general))
    record_metric("chain_kernel_names", sorted(set(chain)))
    record_metric("general_scoring_kernels", scoring_in_general)
    assert scoring_in_chain == []
    assert (
        scoring_in_general
    ), "the profiler must see the general path's scoring kernels"
    assert len(chain) < len(general)
