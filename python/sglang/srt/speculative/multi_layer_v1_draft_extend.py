"""Spec v1 multi-layer EAGLE runs its draft extend eagerly; the target keeps its CUDA graphs.

sglang's draft-extend CUDA graph runner for the multi-layer (MTP) draft,
MultiLayerEagleDraftExtendCudaGraphRunner, belongs to the spec v2 worker:
- it captures ForwardMode.DRAFT_EXTEND_V2 (every request's whole verify block, the same row
  count for every request), while spec v1's draft extend after decode is DRAFT_EXTEND (each
  request's accepted tokens only, a length per request);
- its constructor only sizes the attention backend's graph state; its input buffers and graphs
  come from init_buffers_and_capture, which only the v2 wrapper
  (MultiLayerEagleMultiStepDraftExtendCudaGraphRunner) calls, with buffers it shares across steps.
The spec v1 worker (multi_layer_eagle_worker.py) built one per step and never captured it, so
its first replay raised AttributeError on the missing `buffers`: spec v1 with multi-layer EAGLE
and CUDA graphs failed on its first decode. Upstream later dropped the spec v1 multi-layer
worker (from 0.5.16 the v2 worker runs with the overlap scheduler off too). Capturing spec v1's
variable-length draft extend would need a runner of its own; here it runs eagerly instead, the
path spec v1 already takes for a batch that fits no graph, and the target's graphs stay.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

EAGER_DRAFT_EXTEND_MESSAGE = (
    "Spec v1 multi-layer EAGLE (--disable-overlap-schedule) runs its draft extend without "
    "CUDA graphs: sglang's multi-layer draft-extend graphs capture spec v2's draft extend "
    "only. The target model keeps its CUDA graphs."
)


def announce_eager_draft_extend(disable_cuda_graph: bool) -> None:
    """One warning when CUDA graphs are on: the user asked for graphs the draft extend won't use."""
    if not disable_cuda_graph:
        logger.warning(EAGER_DRAFT_EXTEND_MESSAGE)
