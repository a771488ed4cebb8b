"""The hidden states a target's piecewise CUDA graphs (its prefill) are captured to return.

An EAGLE target's prefill asks for every token's hidden state (CaptureHiddenMode.FULL, spec v1
and v2 alike): the draft's own prefill reads them. Upstream captures the piecewise graphs with
NULL unless --enable-return-hidden-states is set, and PiecewiseCudaGraphRunner.can_run refuses
a batch whose mode differs from the capture's, so every speculating prefill ran eager (a
Python launch per kernel of every layer) beside graphs captured at start-up and never replayed.
Captured with FULL, the graphs return every token's hidden state and the prefill replays them;
a STANDALONE target (a plain draft model, no hidden states) keeps NULL, as its prefill asks.
"""

from __future__ import annotations

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm


def piecewise_capture_hidden_mode(
    spec_algorithm: SpeculativeAlgorithm,
    is_draft_worker: bool,
    return_hidden_states: bool,
) -> CaptureHiddenMode:
    """The mode the piecewise graphs of a model runner are captured with: the mode its
    prefill batches carry, so that PiecewiseCudaGraphRunner.can_run accepts them."""
    eagle_target = spec_algorithm.is_eagle() and not is_draft_worker
    if return_hidden_states or eagle_target:
        return CaptureHiddenMode.FULL
    return CaptureHiddenMode.NULL
