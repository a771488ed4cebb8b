"""Multi-layer EAGLE (spec v2 and spec v1 workers): each draft step's forward runs on that
step's own req_to_token_pool, token_to_kv_pool and attention backend, in draft-extend after
prefill and after decode.

The worker and its draft-extend methods are sglang's own; the step runners are recording fakes
with distinct pools and backends, and the batch is an idle (DP-attention padding) batch so the
real ForwardBatch.init_new and EagleDraftInput code runs on the CPU.

The spec v1 worker is set up by its own init_cuda_graphs with CUDA graphs on: it builds no
draft-extend graphs (speculative/multi_layer_v1_draft_extend.py), so its draft extend after decode runs every step eagerly.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.draft_step_binding import bind_draft_step
from sglang.srt.speculative.multi_layer_eagle_worker_v2 import (
    MultiLayerEagleDraftWorker,
)
from specpatch.testing.single_rank import init_model_parallel_on_cpu

NUM_STEPS, VOCAB = 3, 11


@pytest.fixture(scope="module", autouse=True)
def single_process_groups():
    """ForwardBatch.init_new asks the MoE expert-parallel group its size: a 1-rank gloo world."""
    init_model_parallel_on_cpu()
    yield


class Named:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return self.name


class RecordingStepRunner:
    def __init__(self, step: int, seen: list):
        self.step = step
        self.req_to_token_pool = Named(f"req_to_token[{step}]")
        self.token_to_kv_pool = Named(f"kv_pool[{step}]")
        self.attn_backend = Named(f"attn_backend[{step}]")
        self.device = "cpu"
        self.spec_algorithm = SimpleNamespace(is_standalone=lambda: False)
        self.seen = seen

    def forward(self, forward_batch, skip_attn_backend_init=False):
        self.seen.append(
            SimpleNamespace(
                runner=self.step,
                req_to_token_pool=forward_batch.req_to_token_pool,
                token_to_kv_pool=forward_batch.token_to_kv_pool,
                attn_backend=forward_batch.attn_backend,
                plans_own_metadata=not skip_attn_backend_init,
            )
        )
        logits = SimpleNamespace(
            next_token_logits=torch.empty(0, VOCAB), hidden_states=None
        )
        return SimpleNamespace(logits_output=logits)


class IdleWorkerBatch(SimpleNamespace):
    """A ModelWorkerBatch for an idle rank: fields the idle path does not read are None."""

    def __getattr__(self, name):
        return None


def idle_batch() -> IdleWorkerBatch:
    return IdleWorkerBatch(
        forward_mode=ForwardMode.IDLE,
        seq_lens=torch.empty(0, dtype=torch.int64),
        seq_lens_cpu=torch.empty(0, dtype=torch.int64),
        seq_lens_sum=0,
        input_ids=torch.empty(0, dtype=torch.int64),
        reqs=[],
    )


def make_worker():
    seen: list = []
    worker = object.__new__(MultiLayerEagleDraftWorker)
    worker.speculative_num_steps = NUM_STEPS
    worker.speculative_num_draft_tokens = NUM_STEPS + 1
    worker.topk = 1
    worker.device = "cpu"
    worker.chain_mtp_hidden_states = False
    worker.draft_runner_list = [
        RecordingStepRunner(step, seen) for step in range(NUM_STEPS)
    ]
    worker.cuda_graph_runner_for_draft_extend = None
    worker.plan_stream, worker.plan_stream_ctx = None, contextlib.nullcontext()
    worker.req_to_hidden_states_pool = None
    return worker, seen


def assert_each_step_used_its_own(seen):
    assert [s.runner for s in seen] == list(range(NUM_STEPS))
    for s in seen:
        assert s.req_to_token_pool.name == f"req_to_token[{s.runner}]"
        assert s.token_to_kv_pool.name == f"kv_pool[{s.runner}]"
        assert s.attn_backend.name == f"attn_backend[{s.runner}]"


def test_draft_extend_for_prefill_binds_each_step():
    worker, seen = make_worker()
    worker._draft_extend_for_prefill(
        idle_batch(), torch.empty(0, 8), torch.empty(0, dtype=torch.int64)
    )
    assert_each_step_used_its_own(seen)
    assert all(s.plans_own_metadata for s in seen)


def test_draft_extend_for_decode_eager_binds_each_step():
    worker, seen = make_worker()
    batch_result = SimpleNamespace(
        logits_output=SimpleNamespace(hidden_states=torch.empty(0, 8)),
        next_token_ids=torch.empty(0, dtype=torch.int64),
        accept_lens=torch.empty(0, dtype=torch.int64),
        next_draft_input=SimpleNamespace(),
    )
    worker._draft_extend_for_decode(idle_batch(), batch_result)
    assert_each_step_used_its_own(seen)
    # Step 0's metadata is planned with the batch (on the plan stream); later steps plan their own,
    # since their backend was never initialised for this batch.
    assert [s.plans_own_metadata for s in seen] == [False] + [True] * (NUM_STEPS - 1)


def test_bind_draft_step_sets_all_three():
    runner = RecordingStepRunner(2, [])
    fb = SimpleNamespace(
        req_to_token_pool=None, token_to_kv_pool=None, attn_backend=None
    )
    bind_draft_step(fb, runner)
    assert (fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend) == (
        runner.req_to_token_pool,
        runner.token_to_kv_pool,
        runner.attn_backend,
    )


# ----------------------------------------------------------------------------- spec v1 worker


class IdleScheduleBatch(SimpleNamespace):
    """A ScheduleBatch for an idle rank, as far as the v1 draft-extend paths read it."""

    def get_model_worker_batch(self, seq_lens_cpu_cache=None):
        worker_batch = idle_batch()
        worker_batch.spec_info = self.spec_info
        worker_batch.capture_hidden_mode = getattr(
            self.spec_info, "capture_hidden_mode", None
        )
        return worker_batch

    def copy(self):
        return IdleScheduleBatch(**vars(self))

    def prepare_for_idle(self):
        pass


def idle_schedule_batch() -> IdleScheduleBatch:
    return IdleScheduleBatch(
        forward_mode=ForwardMode.IDLE,
        seq_lens=torch.empty(0, dtype=torch.int64),
        seq_lens_cpu=torch.empty(0, dtype=torch.int64),
        req_pool_indices=torch.empty(0),
        return_logprob=False,
        spec_info=None,
    )


class GraphlessBackend:
    """A draft-extend backend that fails if anyone sizes CUDA graph state on it."""

    def init_cuda_graph_state(self, *args, **kwargs):
        raise AssertionError("spec v1 sized draft-extend CUDA graph state")


def make_v1_worker(disable_cuda_graph: bool = False):
    """The spec v1 worker as its __init__ leaves it, CUDA graphs on unless asked: its own
    init_cuda_graphs decides which draft-extend graphs exist."""
    from sglang.srt.speculative.multi_layer_eagle_worker import MultiLayerEagleWorker

    seen: list = []
    worker = object.__new__(MultiLayerEagleWorker)
    worker.server_args = SimpleNamespace(disable_cuda_graph=disable_cuda_graph)
    worker.speculative_num_steps = NUM_STEPS
    worker.topk = 1
    worker.device = "cpu"
    worker.speculative_algorithm = SimpleNamespace(is_standalone=lambda: False)
    worker.model_runner_list = [
        RecordingStepRunner(step, seen) for step in range(NUM_STEPS)
    ]
    worker.draft_extend_attn_backend_list = [
        GraphlessBackend() for _ in range(NUM_STEPS)
    ]
    worker.init_cuda_graphs()
    return worker, seen


V1_EAGER_LOGGER = "sglang.srt.speculative.multi_layer_v1_draft_extend"


@pytest.mark.parametrize("disable_cuda_graph", [False, True], ids=["graphs", "eager"])
def test_v1_builds_no_draft_extend_graphs_and_says_why_once(disable_cuda_graph, caplog):
    # Upstream built one v2-only runner per step here, never captured, whose first replay
    # raised AttributeError ('no attribute buffers'); GPU: test_multi_layer_eagle_gpu.py
    # [fa3-v1-graph].
    from sglang.srt.speculative.multi_layer_v1_draft_extend import (
        EAGER_DRAFT_EXTEND_MESSAGE,
    )

    with caplog.at_level(logging.WARNING, logger=V1_EAGER_LOGGER):
        worker, _ = make_v1_worker(disable_cuda_graph)
    assert worker.cuda_graph_runner_for_draft_extend_list == []
    said = [r.getMessage() for r in caplog.records if r.name == V1_EAGER_LOGGER]
    assert said == ([] if disable_cuda_graph else [EAGER_DRAFT_EXTEND_MESSAGE])


def test_v1_draft_extend_after_prefill_binds_each_step():
    worker, seen = make_v1_worker()
    worker.forward_draft_extend(
        idle_schedule_batch(),
        torch.empty(0, 8),
        torch.empty(0, dtype=torch.int64),
        None,
    )
    assert_each_step_used_its_own(seen)


def test_v1_draft_extend_after_decode_with_graphs_on_binds_each_step_eagerly():
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    worker, seen = make_v1_worker()
    model_config = SimpleNamespace(spec_hidden_size=8, dtype=torch.float32)
    worker.speculative_algorithm = SimpleNamespace(
        is_standalone=lambda: False, is_eagle3=lambda: False
    )
    worker.target_worker = SimpleNamespace(
        model_runner=SimpleNamespace(model_config=model_config)
    )
    batch = idle_schedule_batch()
    # An empty draft-extend input: every request of the batch finished (or the rank is idle).
    batch.spec_info = EagleDraftExtendInput.create_idle_input(
        device="cpu", hidden_size=8, dtype=torch.float32, capture_hidden_mode=None
    )
    worker.forward_draft_extend_after_decode(batch)
    assert_each_step_used_its_own(seen)
