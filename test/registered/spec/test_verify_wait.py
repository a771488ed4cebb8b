"""Spec v2 decode: where the host waits for the launched batch's verify (the
spec-v2-defer-verify-wait patch).

The next decode step is prepared while the GPU runs the launched batch. The host must block
on that batch's verify (its `verify_done` event) before it reads what the verify writes
(seq_lens) or frees KV the verify may still use, and not before: what comes earlier in the
step then overlaps the verify. Here the real ScheduleBatch / EagleDraftInput methods run on
CPU tensors, and a fake event and stand-ins for the allocator and the req_to_token kernel
record the order of what happened."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers import schedule_batch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.speculative import bounded_host_lens, eagle_info_v2, spec_utils
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

ALLOC_LEN = 4  # get_alloc_len_per_decode() of the stand-in server args


class VerifyDone:
    """A CUDA event the host can wait on: records each wait in the shared log."""

    def __init__(self, log: list):
        self.log = log

    def synchronize(self):
        self.log.append("wait")


class Req(SimpleNamespace):
    def __init__(self, rid: int, committed: int, finished: bool = False):
        super().__init__(
            rid=rid,
            kv_committed_len=committed,
            kv_allocated_len=committed + 2 * ALLOC_LEN,
            decode_batch_idx=0,
            output_ids=[7],
            origin_input_ids=[1, 2],
            done=finished,
            return_logprob=False,
            stream=False,
            grammar=None,
        )

    def finished(self) -> bool:
        return self.done


def launched_decode_batch(
    log: list, reqs: list[Req], penalized: bool = False
) -> ScheduleBatch:
    """A spec v2 decode batch whose last step is launched: seq_lens is that verify's output."""
    bs = len(reqs)
    batch = object.__new__(ScheduleBatch)
    seq_lens = torch.tensor([r.kv_committed_len + 3 for r in reqs], dtype=torch.int64)
    spec_info = EagleDraftInput.create_idle_input(
        device="cpu",
        hidden_size=8,
        dtype=torch.float32,
        topk=1,
        capture_hidden_mode=None,
    )
    spec_info.verify_done = VerifyDone(log)
    spec_info.filter_batch = lambda new_indices, has_been_filtered: log.append(
        "filter spec_info"
    )
    penalizers = SimpleNamespace(
        is_required=penalized, cumulate_output_tokens=lambda ids: log.append("penalize")
    )
    batch.__dict__.update(
        reqs=reqs,
        enable_overlap=True,
        spec_algorithm=SpeculativeAlgorithm.EAGLE,
        spec_info=spec_info,
        device="cpu",
        model_config=SimpleNamespace(is_encoder_decoder=False),
        multimodal_inputs=None,
        req_pool_indices=torch.arange(bs),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens - 3,
        orig_seq_lens=seq_lens.clone(),
        output_ids=None,
        out_cache_loc=None,
        sampling_info=SimpleNamespace(
            penalizer_orchestrator=penalizers,
            filter_batch=lambda keep, keep_device: log.append("filter sampling"),
        ),
        tree_cache=SimpleNamespace(supports_swa=lambda: False),
        token_to_kv_pool_allocator=SimpleNamespace(page_size=1),
        req_to_token_pool=SimpleNamespace(
            req_to_token=torch.zeros((bs, 64), dtype=torch.int32)
        ),
        hisparse_coordinator=None,
    )
    return batch


def test_a_step_that_drops_no_request_does_not_wait_in_filter_batch():
    log = []
    batch = launched_decode_batch(log, [Req(0, 10), Req(1, 20)])

    batch.filter_batch()

    assert log == []
    assert [r.rid for r in batch.reqs] == [0, 1]


def test_filtering_waits_for_the_verify_before_gathering_rows():
    log = []
    batch = launched_decode_batch(
        log, [Req(0, 10), Req(1, 20, finished=True), Req(2, 30)]
    )
    verified_seq_lens = batch.seq_lens.clone()

    batch.filter_batch()

    assert log[0] == "wait"
    assert log[1:] == ["filter sampling", "filter spec_info"]
    assert [r.rid for r in batch.reqs] == [0, 2]
    assert batch.seq_lens.tolist() == verified_seq_lens[[0, 2]].tolist()
    assert batch.seq_lens_sum == int(verified_seq_lens[[0, 2]].sum())


def test_a_batch_whose_requests_all_finished_empties_without_waiting():
    log = []
    batch = launched_decode_batch(log, [Req(0, 10, finished=True)])

    batch.filter_batch()

    assert log == [] and batch.is_empty()


@pytest.fixture
def stand_ins(monkeypatch):
    """The allocator and the req_to_token kernel, recording into a log (CPU has no triton)."""
    log = []

    def alloc_token_slots(tree_cache, num_tokens):
        log.append("alloc")
        return torch.arange(100, 100 + num_tokens, dtype=torch.int64)

    def assign_req_to_token_pool(
        req_pool_indices, req_to_token, start, end, out_cache_loc, bs
    ):
        log.append("assign")
        offset = 0
        for row, lo, hi in zip(req_pool_indices.tolist(), start.tolist(), end.tolist()):
            req_to_token[row, lo:hi] = out_cache_loc[offset : offset + hi - lo].to(
                req_to_token.dtype
            )
            offset += hi - lo

    # Upstream's exact host lengths (a server that cannot use bounds); the bounds path has
    # its own tests (test_bounded_host_lens.py).
    monkeypatch.setattr(bounded_host_lens, "_ENABLED", False)
    monkeypatch.setattr(eagle_info_v2, "alloc_token_slots", alloc_token_slots)
    monkeypatch.setattr(eagle_info_v2, "get_alloc_len_per_decode", lambda: ALLOC_LEN)
    monkeypatch.setattr(
        spec_utils, "assign_req_to_token_pool_func", assign_req_to_token_pool
    )
    return log


def test_prepare_for_decode_allocates_and_assigns_before_waiting_then_reads_seq_lens(
    stand_ins,
):
    log = stand_ins
    reqs = [Req(0, 10), Req(1, 20)]
    reqs[
        0
    ].kv_committed_len += 1  # one verify ahead of its allocation: needs a new chunk
    batch = launched_decode_batch(log, reqs)

    batch.spec_info.prepare_for_decode(batch)

    assert log == ["alloc", "assign", "wait"]
    assert batch.seq_lens_cpu.tolist() == batch.seq_lens.tolist()
    assert batch.seq_lens_sum == int(batch.seq_lens.sum())
    # Request 0 got the new chunk [kv_allocated_len, kv_committed_len + 2 * ALLOC_LEN).
    assert reqs[0].kv_allocated_len == 11 + 2 * ALLOC_LEN
    assert batch.req_to_token_pool.req_to_token[0, 18:19].tolist() == [100]
    assert reqs[1].kv_allocated_len == 20 + 2 * ALLOC_LEN


def test_penalizers_wait_for_the_verify_first(stand_ins):
    log = stand_ins
    batch = launched_decode_batch(log, [Req(0, 10)], penalized=True)

    batch.spec_info.prepare_for_decode(batch)

    assert log[:2] == ["wait", "penalize"]
    assert log[2:4] == ["alloc", "assign"]


def test_retraction_waits_for_the_verify_before_freeing_kv(monkeypatch):
    log = []
    monkeypatch.setattr(
        schedule_batch,
        "release_kv_cache",
        lambda req, tree_cache, is_insert: log.append("free"),
    )
    monkeypatch.setattr(
        schedule_batch, "evict_from_tree_cache", lambda tree_cache, n: None
    )
    reqs = [Req(0, 10), Req(1, 20)]
    for r in reqs:
        r.reset_for_retract = lambda: None
    batch = launched_decode_batch(log, reqs)

    batch.release_req(1, 1, SimpleNamespace(disaggregation_mode="null"))

    assert log[:2] == ["wait", "free"]
