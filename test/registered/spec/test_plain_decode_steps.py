"""speculative/plain_decode_steps.py: the shape policy's `none` steps (a plain decode inside a
spec v2 server) and the draft's catch-up on the rows they leave owing, on the CPU with fakes
for the batch, the draft input and the draft runner (docs/shape-policy.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.scheduler_output_processor_mixin import (
    SchedulerOutputProcessorMixin,
)
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor import forward_batch_info
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.observability.scheduler_metrics_mixin import SchedulerMetricsMixin
from sglang.srt.speculative import plain_decode_steps as pds
from sglang.srt.speculative import shape_runtime as rt
from sglang.srt.speculative.shape_policy import NONE, Shape
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

WIDE, NARROW, CHAIN = Shape(16, 3, 32), Shape(4, 3, 8), Shape(1, 3, 4)
HIDDEN = 6


@dataclass
class Batch:
    """The ModelWorkerBatch fields the `none` step and the catch-up read or replace."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    seq_lens_sum: int
    spec_info: object = None
    forward_mode: ForwardMode = ForwardMode.DECODE
    input_ids: Optional[torch.Tensor] = None
    orig_seq_lens: Optional[torch.Tensor] = None
    out_cache_loc: Optional[torch.Tensor] = None
    capture_hidden_mode: Optional[CaptureHiddenMode] = None
    return_logprob: bool = False
    has_grammar: bool = False


@dataclass
class Carried:
    """What a spec v2 decode step carries into the next (EagleDraftInput's fields)."""

    topk_p: torch.Tensor
    topk_index: torch.Tensor
    hidden_states: torch.Tensor
    bonus_tokens: torch.Tensor


def batch_of(slots, seq_lens, carried=None) -> Batch:
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    return Batch(
        req_pool_indices=torch.tensor(slots),
        seq_lens=lens,
        seq_lens_cpu=lens.clone(),
        seq_lens_sum=int(lens.sum()),
        spec_info=carried,
    )


def carried_of(bs: int, topk: int = 4) -> Carried:
    return Carried(
        topk_p=torch.full((bs, topk), 0.25),
        topk_index=torch.arange(bs * topk).view(bs, topk),
        hidden_states=torch.full((bs, HIDDEN), -1.0),
        bonus_tokens=torch.arange(100, 100 + bs, dtype=torch.int32),
    )


# ----------------------------------------------------------------------------- the ring


def test_the_ring_keeps_each_slots_owed_rows_in_order():
    ring = pds.DraftRowRing.allocate(6, 3, HIDDEN, torch.float32, "cpu")
    owed = {slot: [] for slot in range(6)}
    steps = [([4, 1], [7, 8]), ([4, 1], [9, 10]), ([2, 4], [11, 12])]
    for slots, tokens in steps:
        hidden = torch.tensor(tokens, dtype=torch.float32)[:, None].expand(-1, HIDDEN)
        ring.push(torch.tensor(slots), hidden, torch.tensor(tokens))
        for slot, token in zip(slots, tokens):
            owed[slot].append(token)
    hidden, tokens, lag = ring.owed(torch.tensor([1, 4, 2]))
    assert lag.tolist() == [len(owed[1]), len(owed[4]), len(owed[2])] == [2, 3, 1]
    rows = tokens.view(3, ring.width)
    for b, slot in enumerate([1, 4, 2]):
        n = len(owed[slot])
        assert rows[b, :n].tolist() == owed[slot]
        assert hidden.view(3, ring.width, HIDDEN)[b, :n, 0].tolist() == owed[slot]
    ring.clear(torch.tensor([4]))
    assert ring.owed(torch.tensor([4, 1]))[2].tolist() == [0, 2]


def steps_of(num_slots: int, width: int) -> pds.PlainDecodeSteps:
    return pds.PlainDecodeSteps(
        pds.DraftRowRing.allocate(num_slots, width, HIDDEN, torch.float32, "cpu")
    )


def test_steps_say_when_to_catch_up():
    steps = steps_of(num_slots=4, width=2)
    assert steps.width == 2
    assert not steps.owes_rows and not steps.must_catch_up
    steps.forget(torch.tensor([0]))  # before any `none` step: nothing to clear
    hidden = torch.zeros(2, HIDDEN)
    steps.decoded(torch.tensor([0, 3]), hidden, torch.tensor([5, 6]))
    assert steps.owes_rows and not steps.must_catch_up
    steps.decoded(torch.tensor([0, 3]), hidden, torch.tensor([5, 6]))
    assert steps.must_catch_up, "a third step would overflow a ring of two"
    steps.forget(torch.tensor([3]))
    assert steps.ring.lag.tolist() == [2, 0, 0, 0]
    steps.caught_up(torch.tensor([0]))
    assert not steps.owes_rows and steps.ring.lag.tolist() == [0, 0, 0, 0]


def test_a_ring_that_does_not_fit_is_an_error_naming_its_sizes(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(pds.DraftRowRing, "allocate", out_of_memory)
    with pytest.raises(RuntimeError) as err:
        pds.allocate_ring(4097, 32, 4096, torch.bfloat16, "cpu")
    message = str(err.value)
    # 4097 x 32 x 4096 bf16 hidden (1.00 GiB) and the int64 tokens and lag beside it.
    assert "4097 request slots x 32 rows" in message and "1.00 GiB" in message
    assert "--max-running-requests" in message and '"none"' in message


# ----------------------------------------------------------------------------- a `none` step


def test_a_none_step_decodes_the_carried_bonus_token_into_its_slot():
    req_to_token = torch.arange(4 * 50).view(4, 50)
    carried = carried_of(2)
    batch = batch_of([3, 1], [17, 5], carried)
    plain = pds.plain_decode_batch(batch, req_to_token)
    assert plain.forward_mode == ForwardMode.DECODE
    assert plain.input_ids.tolist() == [100, 101]
    assert plain.seq_lens.tolist() == plain.orig_seq_lens.tolist() == [18, 6]
    assert plain.seq_lens_cpu.tolist() == [18, 6] and plain.seq_lens_sum == 24
    assert plain.out_cache_loc.tolist() == [3 * 50 + 17, 1 * 50 + 5]
    assert plain.spec_info is None
    assert plain.capture_hidden_mode == CaptureHiddenMode.LAST
    # The spec v2 batch is what the next steps read: unchanged.
    assert batch.seq_lens.tolist() == [17, 5] and batch.spec_info is carried


def test_nones_state_builds_the_decode_position_kernel_at_start_up(monkeypatch):
    """A 7.24B mixed load (build bc660de8): the policy's first `none` step held its scheduler
    8.1 s with no Triton compile logged. On that step's path one kernel is built on first use:
    ForwardBatch's DECODE positions (forward_batch_info.clamp_position, nvcc through tvm-ffi,
    per dtype), and a spec v2 server's first DECODE batch is its first `none` step. `none`'s
    runtime state, built at start-up, builds it for the dtype that step's batch carries.
    """
    built = []

    def clamp_position(seq_lens):
        built.append(seq_lens.dtype)
        return (seq_lens - 1).clamp(min=0)

    monkeypatch.setattr(forward_batch_info, "clamp_position", clamp_position)
    runner = SimpleNamespace(
        init_new_workspace=False,
        device=torch.device("cpu"),
        _get_attention_backend=lambda init_new_workspace: "none's backend",
    )
    worker = SimpleNamespace(
        target_worker=SimpleNamespace(model_runner=runner),
        server_args=SimpleNamespace(disable_cuda_graph=True),
    )
    state = rt.build_plain_decode_state(worker)
    assert state.shape == NONE and built == [torch.int64]
    plain = pds.plain_decode_batch(
        batch_of([0], [9], carried_of(1)), torch.arange(50).view(1, 50)
    )
    assert plain.seq_lens.dtype in built


def test_a_none_result_commits_one_token_and_passes_the_draft_input_on():
    carried = carried_of(2)
    batch = batch_of([3, 1], [17, 5], carried)
    decoded = GenerationBatchResult(next_token_ids=torch.tensor([7, 9]))
    plain = pds.plain_decode_batch(batch, torch.arange(4 * 50).view(4, 50))
    result = pds.plain_decode_result(decoded, batch, plain.seq_lens, verify_done=None)
    assert result.speculative_num_draft_tokens == 1
    assert result.accept_lens.tolist() == [1, 1]
    assert result.correct_drafts.tolist() == [0, 0]
    nxt = result.next_draft_input
    assert nxt.bonus_tokens.tolist() == [7, 9]
    assert nxt.bonus_tokens.dtype == carried.bonus_tokens.dtype
    assert nxt.new_seq_lens.tolist() == [18, 6]
    assert nxt.topk_p is carried.topk_p and nxt.hidden_states is carried.hidden_states
    assert not pds.speculated(result)
    assert pds.speculated(GenerationBatchResult(speculative_num_draft_tokens=4))
    assert pds.speculated(GenerationBatchResult())  # spec v1 results carry no count


@pytest.mark.parametrize(
    "overrides,allowed",
    [({}, True), ({"return_logprob": True}, False), ({"has_grammar": True}, False)],
)
def test_grammar_and_logprob_batches_keep_speculating(overrides, allowed):
    batch = batch_of([0], [3])
    for key, value in overrides.items():
        setattr(batch, key, value)
    assert pds.plain_decode_allowed(batch) is allowed


def test_a_none_step_counts_no_verify_in_the_scheduler():
    """The accept counters keep their meaning (one verify, its correct drafts): a step without
    speculation commits its token and counts nothing."""

    def req():
        return SimpleNamespace(
            is_retracted=False,
            finished=lambda: False,
            kv_committed_len=10,
            spec_verify_ct=0,
            spec_num_correct_drafts=0,
            histogram=[],
            update_spec_correct_drafts_histogram=None,
        )

    reqs = [req(), req()]
    for r in reqs:
        r.update_spec_correct_drafts_histogram = r.histogram.append
    fed = []
    scheduler = SimpleNamespace(
        model_worker=SimpleNamespace(on_verify_complete_cpu=fed.append)
    )
    resolve = SchedulerOutputProcessorMixin._resolve_spec_overlap_tokens
    none = GenerationBatchResult(
        next_token_ids=torch.tensor([7, 9]),
        accept_lens=torch.tensor([1, 1]),
        correct_drafts=torch.tensor([0, 0]),
        speculative_num_draft_tokens=1,
    )
    assert resolve(scheduler, none, SimpleNamespace(reqs=reqs)) == [[7], [9]]
    assert [r.kv_committed_len for r in reqs] == [10, 10]
    assert [r.spec_verify_ct for r in reqs] == [0, 0]
    assert [r.histogram for r in reqs] == [[], []]
    assert fed == [[0, 0]], "the shape policy still hears of the step"
    chain = GenerationBatchResult(
        next_token_ids=torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]),
        accept_lens=torch.tensor([3, 1]),
        correct_drafts=torch.tensor([2, 0]),
        speculative_num_draft_tokens=4,
    )
    assert resolve(scheduler, chain, SimpleNamespace(reqs=reqs)) == [[1, 2, 3], [5]]
    assert [r.kv_committed_len for r in reqs] == [12, 10]
    assert [r.spec_verify_ct for r in reqs] == [1, 1]
    assert [r.histogram for r in reqs] == [[2], [0]]


def test_a_decode_log_window_without_a_verify_logs_no_accept_length(caplog):
    """A window of decode_log_interval steps that all ran without speculation has no verify:
    the decode log says so, and the accept-length gauges keep their last values (upstream
    divided by the window's zero verifies)."""
    pool_stats = SimpleNamespace(
        get_decode_usage_msg_parts=lambda: ["token usage: 0.01"]
    )
    scheduler = SimpleNamespace(
        running_batch=SimpleNamespace(reqs=[object()] * 2, forward_iter=None),
        current_scheduler_metrics_enabled=False,
        is_stats_logging_rank=True,
        forward_ct_decode=40,
        forward_ct=40,
        server_args=SimpleNamespace(
            decode_log_interval=40,
            speculative_num_draft_tokens=32,
            language_only=False,
        ),
        last_decode_stats_tic=0.0,
        num_generated_tokens=80,
        get_pool_stats=lambda: pool_stats,
        spec_algorithm=SpeculativeAlgorithm.EAGLE,
        spec_num_accept_tokens=0,
        spec_num_correct_drafts=0,
        spec_num_forward_ct=0,
        spec_total_num_accept_tokens=300,
        spec_total_num_forward_ct=100,
        stats=SimpleNamespace(spec_accept_length=3.0, spec_accept_rate=0.06),
        disaggregation_mode=DisaggregationMode.NULL,
        _graph_backend_label="cuda graph",
        waiting_queue=[],
        enable_mfu_metrics=False,
        _publish_kv_events=lambda: None,
    )
    with caplog.at_level("INFO"):
        SchedulerMetricsMixin.report_decode_stats(scheduler, can_run_cuda_graph=True)
    assert "accept len: -," in caplog.text
    assert (scheduler.stats.spec_accept_length, scheduler.stats.spec_accept_rate) == (
        3.0,
        0.06,
    )
    assert (
        scheduler.spec_total_num_accept_tokens,
        scheduler.spec_total_num_forward_ct,
    ) == (
        300,
        100,
    )


# ----------------------------------------------------------------------------- the catch-up


class FakeDraftInput:
    """EagleDraftInput as the catch-up uses it: the carried input (its topk_p, topk_index,
    hidden_states) and, made by type(carried)(...), the draft extend's input, which records
    what it was asked to prepare."""

    prepared = []

    def __init__(
        self,
        hidden_states=None,
        num_tokens_per_req=-1,
        num_tokens_for_logprob_per_req=-1,
        topk_p=None,
        topk_index=None,
    ):
        self.hidden_states = hidden_states
        self.num_tokens_per_req = num_tokens_per_req
        self.topk_p, self.topk_index = topk_p, topk_index

    def prepare_for_extend_to_fill_draft_kvcache(
        self, batch, predict, width, draft_runner, graph_runner, lists_unread_on_replay
    ):
        FakeDraftInput.prepared.append((batch, predict, width, graph_runner))
        return SimpleNamespace(spec_info=self, input_ids=predict)


class EchoDraft:
    """A draft whose row r predicts token (its input + 1) with certainty, and whose hidden
    state is its input token: what a catch-up selects is then readable."""

    def __init__(self, vocab: int = 64):
        self.vocab = vocab

    def forward(self, forward_batch, skip_attn_backend_init):
        tokens = forward_batch.input_ids
        logits = torch.full((tokens.shape[0], self.vocab), -30.0)
        logits[torch.arange(tokens.shape[0]), (tokens + 1) % self.vocab] = 30.0
        hidden = tokens.to(torch.float32)[:, None].expand(-1, HIDDEN)
        out = SimpleNamespace(next_token_logits=logits, hidden_states=hidden)
        return SimpleNamespace(logits_output=out)


def test_the_catch_up_runs_each_requests_owed_rows_and_refreshes_only_theirs():
    width, topk = 3, 2
    steps = steps_of(num_slots=8, width=width)
    # Slots 5 and 2 decoded two tokens without speculation; slot 6 joined after (no rows).
    for tokens in ([10, 20], [11, 21]):
        hidden = torch.tensor(tokens, dtype=torch.float32)[:, None].expand(-1, HIDDEN)
        steps.decoded(torch.tensor([5, 2]), hidden, torch.tensor(tokens))
    steps.decoded(torch.tensor([5]), torch.full((1, HIDDEN), 12.0), torch.tensor([12]))
    carried = FakeDraftInput(
        topk_p=torch.full((3, topk), 0.5),
        topk_index=torch.full((3, topk), 63),
        hidden_states=torch.full((3, HIDDEN), -1.0),
    )
    FakeDraftInput.prepared.clear()
    batch = batch_of([5, 2, 6], [40, 30, 9], carried)
    req_to_token = torch.arange(8 * 64).view(8, 64)
    draft_worker = SimpleNamespace(
        draft_runner=EchoDraft(),
        carried_topk=topk,
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
    )
    pds.catch_up(draft_worker, steps, batch, draft_extend_runner=None)

    ((prepared, predict, prepared_width, graph_runner),) = FakeDraftInput.prepared
    assert prepared_width == width and graph_runner is None
    # Each request's rows start where its owed positions start: seq_len - owed.
    assert prepared.seq_lens.tolist() == [37, 28, 9]
    assert prepared.seq_lens_cpu.tolist() == [37, 28, 9]
    assert prepared.seq_lens_sum == 74
    # The rows' KV slots: `width` positions from each start.
    assert prepared.out_cache_loc.view(3, width).tolist() == [
        [5 * 64 + p for p in (37, 38, 39)],
        [2 * 64 + p for p in (28, 29, 30)],
        [6 * 64 + p for p in (9, 10, 11)],
    ]
    assert predict.view(3, width)[:2].tolist() == [[10, 11, 12], [20, 21, 0]]
    # The next input of an owing request is its last owed row's; slot 6 keeps its own.
    assert carried.topk_index[:, 0].tolist() == [13, 22, 63]
    assert carried.hidden_states[:, 0].tolist() == [12.0, 21.0, -1.0]
    assert carried.topk_p[2].tolist() == [0.5, 0.5]
    assert not steps.owes_rows and steps.ring.lag.tolist() == [0] * 8


# ----------------------------------------------------------------------------- the policy's set


def write_config(tmp_path, **raw) -> str:
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(raw))
    return str(path)


@pytest.fixture(autouse=True)
def fresh_cache():
    rt._cached_policy.cache_clear()
    yield
    rt._cached_policy.cache_clear()


def server_args(path, backend="triton", **extra):
    values = dict(
        speculative_adaptive=True,
        speculative_adaptive_config=path,
        speculative_eagle_topk=16,
        speculative_num_steps=3,
        speculative_num_draft_tokens=32,
        speculative_algorithm="EAGLE",
        attention_backend=backend,
        decode_attention_backend=None,
        enable_dp_attention=False,
        enable_multi_layer_eagle=False,
        enable_two_batch_overlap=False,
        enable_pdmux=False,
    )
    values.update(extra)
    return SimpleNamespace(**values)


@pytest.mark.parametrize(
    "backend,ok", [("triton", True), ("fa3", True), ("flashinfer", False)]
)
def test_none_runs_on_backends_whose_decode_takes_spec_v2_lengths(
    tmp_path, backend, ok
):
    path = write_config(tmp_path, shapes=["16,3,32", "1,3,4", "none"])
    config = rt.read_shape_policy(path)
    assert NONE in config.policy.shapes
    why = rt.policy_unsupported(server_args(path, backend), config, use_spec_v2=True)
    if ok:
        assert why is None
    else:
        assert 'for "none"' in why and "flashinfer" in why


def eagle_draft_worker(algorithm: str, hidden_size: int, layer_ids=None):
    """What upstream reads off a draft worker for its draft extend's hidden width and dtype."""
    eagle_config = {"eagle_aux_hidden_state_layer_ids": layer_ids} if layer_ids else {}
    model_config = SimpleNamespace(
        spec_hidden_size=hidden_size,
        hidden_size=hidden_size,
        dtype=torch.bfloat16,
        hf_config=SimpleNamespace(eagle_config=eagle_config),
    )
    return SimpleNamespace(
        speculative_algorithm=SpeculativeAlgorithm.from_string(algorithm),
        eagle_use_aux_hidden_state=layer_ids is not None,
        target_worker=SimpleNamespace(
            model_runner=SimpleNamespace(model_config=model_config)
        ),
    )


def test_none_steps_exist_only_with_none_in_the_set(tmp_path):
    pool = ReqToTokenPool(
        size=64, max_context_len=8, device="cpu", enable_memory_saver=False
    )
    with_none = write_config(tmp_path, shapes=["16,3,32", "4,3,8", "none"])
    draft = eagle_draft_worker("EAGLE", HIDDEN)
    steps = rt.make_plain_decode_steps(server_args(with_none), pool, draft)
    assert steps.width == 32
    # Every slot the pool hands out has a ring row, its last (size: row 0 pads graphs) too.
    slots = torch.tensor([max(pool.free_slots), min(pool.free_slots)])
    steps.decoded(slots, torch.ones(2, HIDDEN), torch.tensor([5, 7]))
    assert steps.ring.lag[slots].tolist() == [1, 1]
    assert steps.ring.tokens[slots, 0].tolist() == [5, 7]
    rt._cached_policy.cache_clear()
    without = write_config(tmp_path, shapes=["16,3,32", "4,3,8"])
    assert rt.make_plain_decode_steps(server_args(without), pool, draft) is None


@pytest.mark.parametrize(
    "algorithm,layer_ids,width",
    [("EAGLE", None, HIDDEN), ("EAGLE3", [1, 5, 9], 3 * HIDDEN)],
)
def test_the_ring_is_allocated_at_start_up_at_the_draft_extends_hidden_width(
    tmp_path, algorithm, layer_ids, width
):
    """Before any `none` step, at the width a verify hands the draft extend (an EAGLE3
    target's captured layers side by side) and in the target's dtype."""
    pool = ReqToTokenPool(
        size=16, max_context_len=8, device="cpu", enable_memory_saver=False
    )
    path = write_config(tmp_path, shapes=["4,3,8", "1,3,4", "none"])
    draft = eagle_draft_worker(algorithm, HIDDEN, layer_ids)
    steps = rt.make_plain_decode_steps(
        server_args(path, speculative_eagle_topk=4, speculative_num_draft_tokens=8),
        pool,
        draft,
    )
    assert not steps.owes_rows
    assert steps.ring.hidden.shape == (pool.req_to_token.shape[0], 8, width)
    assert steps.ring.hidden.dtype == torch.bfloat16
    assert steps.ring.tokens.shape == (pool.req_to_token.shape[0], 8)


class FakeWorker:
    def __init__(self):
        self.built, self.applied = [], []

    def build_shape_runtime_state(self, shape):
        self.built.append(shape)
        runtime = SimpleNamespace(
            cuda_graph_runner_for_draft_extend=f"extend {shape.label}"
        )
        return rt.ShapeRuntimeState(shape, runtime, None)

    def apply_shape_runtime_state(self, state):
        self.applied.append(state.shape)


class UntimedClock:
    """A StepClock whose steps never finish timing (the choice here is forced)."""

    def mark(self):
        return None

    def seconds(self, start, end):
        return None


def controller_of(tmp_path, **raw):
    config = rt.read_shape_policy(write_config(tmp_path, **raw))
    worker = FakeWorker()
    controller = rt.ShapeController(worker, config, CHAIN, clock=UntimedClock())
    controller.register(worker.build_shape_runtime_state(CHAIN))
    worker.built.clear()
    controller.init_states()
    return controller, worker


def test_forced_switches_cycle_through_none_and_batches_that_must_speculate_skip_it(
    tmp_path,
):
    controller, worker = controller_of(
        tmp_path, shapes=["1,3,4", "none", "16,3,32"], force_switch_every=1
    )
    assert worker.built == [NONE, WIDE]
    assert [controller.before_decode(4) for _ in range(3)] == [CHAIN, NONE, WIDE]
    assert worker.applied == [NONE, WIDE]
    assert controller.before_decode(4) == CHAIN
    shape = controller.before_decode(4, plain_allowed=False)
    assert (
        shape.speculates
    ), "a logprob or grammar batch took a step without speculation"
    # The catch-up runs through the widest shape's draft-extend graph.
    assert controller.catch_up_runner == "extend 16,3,32"
