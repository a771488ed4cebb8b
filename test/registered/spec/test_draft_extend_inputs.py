"""Spec v2 draft extend after verify: positions made on the device (the
spec-v2-draft-extend-positions-on-device patch).

When the draft-extend CUDA graph replays the batch, EagleDraftInput.prepare_for_extend_to_fill_
draft_kvcache builds positions with one broadcast add and ForwardBatch.init_new skips the
per-request extend lists; otherwise it keeps the generic extend setup. Here the real method and
init_new run on CPU tensors (stub runners), and the fast batch is compared with the generic one
field by field."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers.schedule_batch import ModelWorkerBatch
from sglang.srt.model_executor import forward_batch_info
from sglang.srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    compute_position_torch,
)
from sglang.srt.speculative.draft_extend_inputs import (
    fixed_width_positions,
    positions_suffice,
)
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

WIDTH = 8  # num_draft_tokens: the verify block each request re-runs
EXTEND_LISTS = {
    "extend_seq_lens",
    "extend_prefix_lens",
    "extend_start_loc",
    "extend_prefix_lens_cpu",
    "extend_seq_lens_cpu",
    "extend_logprob_start_lens_cpu",
}


def reference_positions(prefix_lens: list[int], width: int) -> torch.Tensor:
    return torch.tensor(
        [p + j for p in prefix_lens for j in range(width)], dtype=torch.int64
    )


@pytest.mark.parametrize("prefix_lens", [[0], [5], [3, 0, 17, 1], list(range(40, 88))])
def test_positions_are_each_requests_rows_after_its_prefix(prefix_lens):
    prefix = torch.tensor(prefix_lens, dtype=torch.int32)

    got = fixed_width_positions(prefix, WIDTH)

    assert got.dtype == torch.int64
    assert torch.equal(got, reference_positions(prefix_lens, WIDTH))
    # The generic extend setup's positions (what init_new computed before).
    generic, _ = compute_position_torch(prefix, torch.full_like(prefix, WIDTH))
    assert torch.equal(got, generic)


class GraphRunner:
    def __init__(self, can_run: bool):
        self.answer = can_run

    def can_run(self, forward_batch) -> bool:
        return self.answer


class DraftRunner(SimpleNamespace):
    """What init_new and the prepare method read off a draft ModelRunner."""

    def __init__(self, **overrides):
        attn_backend = SimpleNamespace(planned=[])
        attn_backend.init_forward_metadata = attn_backend.planned.append
        super().__init__(
            device="cpu",
            spec_algorithm=SpeculativeAlgorithm.EAGLE,
            attn_backend=attn_backend,
            server_args=SimpleNamespace(
                attention_backend="torch_native", enable_lora=False
            ),
            model_is_mrope=False,
            use_ngram_embedding=False,
            is_hybrid_swa=False,
            req_to_token_pool=None,
            token_to_kv_pool=None,
        )
        self.__dict__.update(overrides)


def verified_decode_batch(prefix_lens: list[int]) -> SimpleNamespace:
    """A spec v2 decode ModelWorkerBatch after verify, as prepare_for_extend receives it."""
    bs = len(prefix_lens)
    batch = SimpleNamespace(
        **{f.name: None for f in dataclasses.fields(ModelWorkerBatch)}
    )
    seq_lens = torch.tensor(prefix_lens, dtype=torch.int64)
    batch.__dict__.update(
        forward_mode=ForwardMode.DECODE,
        reqs=[SimpleNamespace(rid=f"r{i}") for i in range(bs)],
        req_pool_indices=torch.arange(bs),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        seq_lens_sum=sum(prefix_lens),
        out_cache_loc=torch.arange(bs * WIDTH) + 100,
        spec_algorithm=SpeculativeAlgorithm.EAGLE,
        return_logprob=False,
    )
    return batch


def prepare(prefix_lens, draft_runner, graph_runner, lists_unread_on_replay=True):
    """As EAGLEWorkerV2's draft extend calls it (it opts in to skipping the lists)."""
    draft_input = EagleDraftInput(
        num_tokens_per_req=WIDTH, num_tokens_for_logprob_per_req=WIDTH
    )
    predict = torch.arange(len(prefix_lens) * WIDTH, dtype=torch.int32)
    batch = verified_decode_batch(prefix_lens)
    forward_batch = draft_input.prepare_for_extend_to_fill_draft_kvcache(
        batch,
        predict,
        WIDTH,
        draft_runner,
        graph_runner,
        lists_unread_on_replay=lists_unread_on_replay,
    )
    return forward_batch, draft_input


@pytest.fixture(autouse=True)
def no_expert_parallel(monkeypatch):
    # init_new asks the (uninitialised here) expert-parallel group whether to pad tokens.
    monkeypatch.setattr(
        forward_batch_info, "enable_num_token_non_padded", lambda: False
    )


PREFIX_LENS = [[9], [3, 0, 17, 1]]


@pytest.mark.parametrize("prefix_lens", PREFIX_LENS)
def test_a_graph_replay_gets_device_positions_and_no_extend_lists(prefix_lens):
    runner = DraftRunner()

    fast, draft_input = prepare(prefix_lens, runner, GraphRunner(can_run=True))

    assert fast.forward_mode == ForwardMode.DRAFT_EXTEND_V2
    assert torch.equal(fast.positions, reference_positions(prefix_lens, WIDTH))
    assert fast.positions is draft_input.positions
    assert all(getattr(fast, name) is None for name in EXTEND_LISTS)
    assert fast.extend_num_tokens == len(prefix_lens) * WIDTH
    assert runner.attn_backend.planned == []  # the graph runner plans at replay


@pytest.mark.parametrize("prefix_lens", PREFIX_LENS)
def test_the_fast_batch_differs_from_the_generic_one_only_by_the_extend_lists(
    prefix_lens,
):
    runner = DraftRunner()
    fast, _ = prepare(prefix_lens, runner, GraphRunner(can_run=True))
    generic, _ = prepare(prefix_lens, runner, graph_runner=None)

    assert generic.extend_seq_lens is not None  # the generic setup did run
    for field in dataclasses.fields(ForwardBatch):
        if field.name in EXTEND_LISTS or field.name == "spec_info":
            continue
        a, b = getattr(fast, field.name), getattr(generic, field.name)
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and torch.equal(a, b), field.name
        else:
            assert a is b or a == b, field.name


@pytest.mark.parametrize("prefix_lens", PREFIX_LENS)
def test_eager_fallback_keeps_the_generic_setup(prefix_lens):
    runner = DraftRunner()

    eager, draft_input = prepare(prefix_lens, runner, GraphRunner(can_run=False))

    assert draft_input.positions is None
    assert eager.extend_seq_lens.tolist() == [WIDTH] * len(prefix_lens)
    assert eager.extend_prefix_lens.tolist() == prefix_lens
    assert eager.extend_prefix_lens_cpu == prefix_lens
    assert torch.equal(eager.positions, reference_positions(prefix_lens, WIDTH))
    assert runner.attn_backend.planned == [eager]  # planned once, for the eager forward


def test_a_caller_that_reads_the_lists_after_replay_keeps_them():
    # The multi-layer EAGLE v2 worker updates its hidden-states pool from extend_seq_lens.
    kept, draft_input = prepare(
        [3, 0, 17, 1],
        DraftRunner(),
        GraphRunner(can_run=True),
        lists_unread_on_replay=False,
    )

    assert getattr(draft_input, "positions", None) is None
    assert kept.extend_seq_lens.tolist() == [WIDTH] * 4
    assert kept.extend_start_loc.tolist() == [0, WIDTH, 2 * WIDTH, 3 * WIDTH]


@pytest.mark.parametrize(
    "reads_lists", ["model_is_mrope", "use_ngram_embedding", "lora"]
)
def test_models_that_read_the_extend_lists_keep_them(reads_lists):
    runner = DraftRunner()
    assert positions_suffice(runner)
    if reads_lists == "lora":
        runner.server_args.enable_lora = True
    else:
        setattr(runner, reads_lists, True)

    assert not positions_suffice(runner)
