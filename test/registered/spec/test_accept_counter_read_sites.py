"""Downstream of verify, every reader takes the accept counter with the meaning it needs.

Each test hands the reader counters that do NOT satisfy num_accept_tokens == num_correct_drafts
+ 1. A reader that re-derived one counter from the other (the old `x - 1` / `+ bs` / `+ 1`)
would produce the other field's numbers and fail; a reader that reads its field passes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.utils.logprob import add_output_logprobs_for_spec_v1
from sglang.srt.managers.scheduler_output_processor_mixin import (
    SchedulerOutputProcessorMixin,
)
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.observability.scheduler_metrics_mixin import SchedulerMetricsMixin
from sglang.srt.speculative.eagle_info import EagleVerifyOutput

NUM_DRAFT_TOKENS = 4


class _Req:
    def __init__(self, finished: bool = False):
        self._finished = finished
        self.is_retracted = False
        self.kv_committed_len = 10
        self.spec_verify_ct = 0
        self.spec_num_correct_drafts = 0
        self.histogram: list[int] = []
        self.return_logprob = True
        self.top_logprobs_num = 0
        self.token_ids_logprob = None
        self.output_token_logprobs_val: list[float] = []
        self.output_token_logprobs_idx: list[int] = []

    def finished(self) -> bool:
        return self._finished

    def update_spec_correct_drafts_histogram(self, num_correct_drafts: int) -> None:
        self.histogram.append(num_correct_drafts)


def _spec_v2_result(
    accept_lens: list[int], correct_drafts: list[int] | None
) -> GenerationBatchResult:
    bs = len(accept_lens)
    return GenerationBatchResult(
        next_token_ids=torch.arange(bs * NUM_DRAFT_TOKENS),
        accept_lens=torch.tensor(accept_lens),
        correct_drafts=None if correct_drafts is None else torch.tensor(correct_drafts),
        speculative_num_draft_tokens=NUM_DRAFT_TOKENS,
    )


def _scheduler():
    seen = []
    return (
        SimpleNamespace(
            model_worker=SimpleNamespace(on_verify_complete_cpu=seen.append)
        ),
        seen,
    )


def test_spec_v2_output_processing_reads_each_counter_from_its_field():
    scheduler, adaptive_calls = _scheduler()
    reqs = [_Req(), _Req()]
    # Deliberately inconsistent: drafts are not tokens - 1.
    result = _spec_v2_result(accept_lens=[3, 2], correct_drafts=[0, 1])

    tokens = SchedulerOutputProcessorMixin._resolve_spec_overlap_tokens(
        scheduler, result, SimpleNamespace(reqs=reqs)
    )

    assert tokens == [
        [0, 1, 2],
        [4, 5],
    ]  # accept_lens tokens per request, from each block
    assert (
        result.num_accept_tokens_per_req_cpu == [3, 2] and result.num_accept_tokens == 5
    )
    assert (
        result.num_correct_drafts_per_req_cpu == [0, 1]
        and result.num_correct_drafts == 1
    )
    assert adaptive_calls == [[0, 1]]  # the adaptive controller is fed drafts
    assert [r.spec_num_correct_drafts for r in reqs] == [0, 1]
    assert [r.histogram for r in reqs] == [[0], [1]]


def test_spec_v2_result_without_drafts_counter_is_refused():
    scheduler, _ = _scheduler()
    with pytest.raises(AssertionError, match="correct_drafts"):
        SchedulerOutputProcessorMixin._resolve_spec_overlap_tokens(
            scheduler, _spec_v2_result([2], None), SimpleNamespace(reqs=[_Req()])
        )


def _metrics():
    m = SimpleNamespace(num_generated_tokens=0)
    SchedulerMetricsMixin.reset_metrics(m)
    return m


def test_spec_metrics_accumulate_both_counters_as_given():
    m = _metrics()
    assert m.spec_num_correct_drafts == 0
    SchedulerMetricsMixin.update_spec_metrics(
        m, bs=2, num_correct_drafts=3, num_accept_tokens=9
    )
    SchedulerMetricsMixin.update_spec_metrics(
        m, bs=1, num_correct_drafts=1, num_accept_tokens=2
    )
    assert (
        m.spec_num_accept_tokens,
        m.spec_num_correct_drafts,
        m.spec_num_forward_ct,
    ) == (11, 4, 3)
    assert (
        m.num_generated_tokens == 4
    )  # drafts here; the bonus tokens are counted per request elsewhere


def test_spec_v1_logprobs_cover_num_accept_tokens_per_request():
    reqs = [_Req(), _Req()]
    accept_tokens = torch.tensor([5, 6, 7, 8])
    logits = torch.randn(4, 16)
    batch = SimpleNamespace(
        reqs=reqs,
        top_logprobs_nums=[0, 0],
        token_ids_logprobs=[None, None],
        sampling_info=SimpleNamespace(temperatures=torch.ones(2, 1), device="cpu"),
        spec_info=SimpleNamespace(draft_token_num=NUM_DRAFT_TOKENS),
    )
    res = EagleVerifyOutput(
        draft_extend_input=None,
        logits_output=SimpleNamespace(
            next_token_logits=logits,
            next_token_top_logprobs_val=None,
            next_token_top_logprobs_idx=None,
            next_token_token_ids_logprobs_val=None,
            next_token_token_ids_logprobs_idx=None,
        ),
        accept_tokens=accept_tokens,
        num_correct_drafts_per_req_cpu=[0, 0],  # inconsistent on purpose
        num_accept_tokens_per_req_cpu=[3, 1],
        accept_indices=torch.tensor([0, 1, 2, 4]),
    )

    add_output_logprobs_for_spec_v1(batch, res)

    assert [r.output_token_logprobs_idx for r in reqs] == [[5, 6, 7], [8]]
    expected = torch.log_softmax(logits, dim=-1)[
        torch.arange(4), accept_tokens
    ].tolist()
    assert reqs[0].output_token_logprobs_val + reqs[
        1
    ].output_token_logprobs_val == pytest.approx(expected)
