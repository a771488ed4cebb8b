"""An EAGLE target's prefill replays the piecewise CUDA graphs captured for it
(sglang.srt.speculative.target_prefill_graphs).

The target's prefill asks for every token's hidden state (FULL): the draft's prefill reads them.
The piecewise graphs are captured in the mode the runner's prefill batches carry, so that
PiecewiseCudaGraphRunner.can_run accepts them instead of sending every speculating prefill to
eager. On the GPU: speculating engines with the piecewise graphs on keep the target's greedy
tokens through prefills of several graph buckets and prefills that extend a cached prefix,
for spec v2 chains and trees, spec v1 trees and an EAGLE3 target (aux hidden states).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.model_executor.piecewise_cuda_graph_runner import (
    PiecewiseCudaGraphRunner,
)
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.target_prefill_graphs import piecewise_capture_hidden_mode
from specpatch.testing import engine as eng
from specpatch.testing import synth

FULL, NULL = CaptureHiddenMode.FULL, CaptureHiddenMode.NULL


@pytest.mark.parametrize(
    "algorithm,is_draft_worker,return_hidden_states,expected",
    [
        (SpeculativeAlgorithm.EAGLE, False, False, FULL),
        (SpeculativeAlgorithm.EAGLE3, False, False, FULL),
        # The draft captures no piecewise graphs (ModelRunner.init_piecewise_cuda_graphs).
        (SpeculativeAlgorithm.EAGLE, True, False, NULL),
        # A STANDALONE draft is a plain LM: its target's prefill asks for no hidden states.
        (SpeculativeAlgorithm.STANDALONE, False, False, NULL),
        (SpeculativeAlgorithm.NONE, False, False, NULL),
        (SpeculativeAlgorithm.NONE, False, True, FULL),
    ],
)
def test_the_capture_mode_is_the_one_the_runners_prefill_asks_for(
    algorithm, is_draft_worker, return_hidden_states, expected
):
    assert (
        piecewise_capture_hidden_mode(algorithm, is_draft_worker, return_hidden_states)
        == expected
    )


def prefill_batch(capture_hidden_mode: CaptureHiddenMode) -> SimpleNamespace:
    """The fields PiecewiseCudaGraphRunner.can_run reads, of a 16-token prefill."""
    return SimpleNamespace(
        input_embeds=None,
        replace_embeds=None,
        forward_mode=ForwardMode.EXTEND,
        capture_hidden_mode=capture_hidden_mode,
        input_ids=torch.zeros(16, dtype=torch.int64),
        return_logprob=False,
    )


def runner_captured_with(mode: CaptureHiddenMode) -> PiecewiseCudaGraphRunner:
    runner = PiecewiseCudaGraphRunner.__new__(PiecewiseCudaGraphRunner)
    runner.capture_hidden_mode = mode
    runner.max_num_tokens = 64
    return runner


def test_an_eagle_targets_prefill_is_accepted_by_its_graphs():
    """The EAGLE workers' target prefill carries FULL (eagle_worker.py, eagle_worker_v2.py);
    a runner captured in the mode chosen for an EAGLE target runs it, one captured with
    upstream's NULL refuses it."""
    eagle_target = piecewise_capture_hidden_mode(
        SpeculativeAlgorithm.EAGLE, is_draft_worker=False, return_hidden_states=False
    )
    assert runner_captured_with(eagle_target).can_run(prefill_batch(FULL))
    assert not runner_captured_with(NULL).can_run(prefill_batch(FULL))


# ------------------------------------------------------------------------------ GPU

MAX_NEW_TOKENS = 32
PREFILL_CASES = [
    ("toy_pair", "EAGLE", eng.SpecConfig(1, 3, 4)),
    ("toy_pair", "EAGLE", eng.SpecConfig(4, 3, 8)),
    ("toy_pair", "EAGLE", eng.SpecConfig(4, 3, 8, overlap=False)),
    ("qwen3_eagle3_pair", "EAGLE3", eng.SpecConfig(4, 3, 8)),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "pair,algorithm,spec",
    PREFILL_CASES,
    ids=[f"{a.lower()}-{s.label}" for _, a, s in PREFILL_CASES],
)
def test_speculating_prefill_through_piecewise_graphs_keeps_tokens_and_accepts(
    request, pair, algorithm, spec, record_metric
):
    """Prompts of 8-64 tokens and of 200-600 (other graph buckets, padded), then the same
    prompts one token longer (radix-cache hits: prefills that extend a cached prefix).
    """
    target, draft = request.getfixturevalue(pair)
    vocab = synth.load_meta(target)["spec"]["vocab"]
    prompts = eng.random_prompts(8, vocab, seed=11) + eng.random_prompts(
        4, vocab, min_len=200, max_len=600, seed=12
    )
    expected = synth.table_continuations(target, prompts, MAX_NEW_TOKENS)
    kwargs = eng.engine_kwargs(
        target,
        draft,
        spec,
        speculative_algorithm=algorithm,
        disable_piecewise_cuda_graph=False,
    )
    with eng.engine(**kwargs) as e:
        assert e.server_args.disable_piecewise_cuda_graph is False
        first = eng.generate(e, prompts, MAX_NEW_TOKENS)
        again = eng.generate(e, [p + [p[-1]] for p in prompts], MAX_NEW_TOKENS)
    eng.assert_identical(first, expected, "first prefill")
    expected_again = synth.table_continuations(
        target, [p + [p[-1]] for p in prompts], MAX_NEW_TOKENS
    )
    eng.assert_identical(again, expected_again, "prefix-cached prefill")
    record_metric(
        "accept_length", [round(first.accept_length, 3), round(again.accept_length, 3)]
    )
