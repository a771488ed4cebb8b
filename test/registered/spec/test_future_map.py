"""The overlap scheduler's future map under spec v2 (patch spec-v2-decode-step-host-work).

Each decode step stores its next draft input at a run of slots and the next step reads it
back. While a batch is still exactly that run (nothing filtered or merged), the read is a
slice of the buffers, not a gather; once filter_batch or merge_batch changes the batch, it
is a gather over the kept slots. Both must return what was stored for each request."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers import overlap_utils
from sglang.srt.managers.overlap_utils import FutureIndices, FutureMap
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

MAX_RUNNING = 4
TOPK, HIDDEN = 3, 8


@pytest.fixture(params=[True, False], ids=["hidden", "no-hidden"])
def future_map(request, monkeypatch) -> FutureMap:
    monkeypatch.setattr(overlap_utils, "spec_need_hidden_states", lambda: request.param)
    # The gather path marks its indices as used on the forward stream, a CUDA caching-
    # allocator hint that CPU tensors reject.
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    # No chunked prefill: future_limit = 3 * MAX_RUNNING, so a few steps wrap the buffer.
    return FutureMap(
        MAX_RUNNING, 0, 4096, torch.device("cpu"), SpeculativeAlgorithm.EAGLE
    )


def step_output(bs: int, step: int) -> SimpleNamespace:
    """A verify step's next draft input whose every value names its step and request."""
    base = torch.arange(bs) + 100 * step
    return SimpleNamespace(
        topk_p=base[:, None].float() + torch.arange(TOPK) / 10,
        topk_index=base[:, None] * 10 + torch.arange(TOPK),
        bonus_tokens=base.to(torch.int32),
        new_seq_lens=(base + 7).to(torch.int32),
        hidden_states=base[:, None].float().expand(bs, HIDDEN).contiguous(),
    )


def resolve(future_map: FutureMap, future_indices: FutureIndices) -> EagleDraftInput:
    draft_input = EagleDraftInput(future_indices=future_indices)
    future_map.resolve_future(SimpleNamespace(spec_info=draft_input))
    return draft_input


def assert_rows(
    future_map: FutureMap, got: EagleDraftInput, stored: SimpleNamespace, rows
):
    rows = torch.as_tensor(rows)
    assert torch.equal(got.topk_p, stored.topk_p[rows])
    assert torch.equal(got.topk_index, stored.topk_index[rows])
    assert torch.equal(got.bonus_tokens, stored.bonus_tokens[rows])
    assert torch.equal(got.new_seq_lens, stored.new_seq_lens[rows])
    if future_map.need_hidden_states:
        assert torch.equal(got.hidden_states, stored.hidden_states[rows])
    else:
        assert got.hidden_states is None


def shares_buffer(view: torch.Tensor, buf: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


@pytest.mark.parametrize("bs", [1, 3, MAX_RUNNING])
def test_an_unchanged_batch_reads_slices_of_what_it_stored(future_map, bs):
    # Enough steps to wrap the circular buffer more than once.
    for step in range(3 * future_map.future_limit // bs):
        future_indices = future_map.alloc_future_indices(bs)
        assert torch.equal(
            future_indices.indices,
            torch.arange(future_indices.interval.start, future_indices.interval.stop),
        )
        assert future_indices.interval.stop <= future_map.future_buffer_len
        stored = step_output(bs, step)
        future_map.store_to_map_for_new_batch(future_indices, stored)

        got = resolve(future_map, future_indices)

        assert_rows(future_map, got, stored, range(bs))
        assert shares_buffer(got.topk_p, future_map.topk_p_buf)  # a view: no gather


def test_a_filtered_batch_gathers_its_kept_requests(future_map):
    future_indices = future_map.alloc_future_indices(MAX_RUNNING)
    stored = step_output(MAX_RUNNING, step=1)
    future_map.store_to_map_for_new_batch(future_indices, stored)
    draft_input = EagleDraftInput(future_indices=future_indices)

    draft_input.filter_batch(torch.tensor([0, 2, 3]))

    assert draft_input.future_indices.interval is None
    # The step's own object is untouched: a delayed store still writes to its interval.
    assert (
        future_indices.interval is not None
        and len(future_indices.indices) == MAX_RUNNING
    )
    got = resolve(future_map, draft_input.future_indices)
    assert_rows(future_map, got, stored, [0, 2, 3])
    assert not shares_buffer(got.topk_p, future_map.topk_p_buf)


def test_a_merged_batch_gathers_both_runs(future_map):
    running = future_map.alloc_future_indices(2)
    stored_running = step_output(2, step=1)
    future_map.store_to_map_for_new_batch(running, stored_running)
    prefill = future_map.alloc_future_indices(1)
    stored_prefill = step_output(1, step=2)
    future_map.store_to_map_for_new_batch(prefill, stored_prefill)
    draft_input = EagleDraftInput(future_indices=running)

    draft_input.merge_batch(EagleDraftInput(future_indices=prefill))

    assert draft_input.future_indices.interval is None
    got = resolve(future_map, draft_input.future_indices)
    both = SimpleNamespace(
        **{
            k: torch.cat([getattr(stored_running, k), getattr(stored_prefill, k)])
            for k in vars(stored_running)
        }
    )
    assert_rows(future_map, got, both, [0, 1, 2])
