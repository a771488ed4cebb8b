"""Which pools and attention backend a multi-layer EAGLE draft step runs against.

Each MTP step has its own ModelRunner. They share the target's req_to_token_pool and KV
allocator (slot numbers mean the same thing in every step), but each owns a KV pool whose
single attention layer has the same layer id as the other steps', and its own attention
backend. A ForwardBatch built for step 0 carries step 0's pool and backend; if later steps
reuse it, step i writes its K/V over step 0's for the same slots, reads step 0's prefix
instead of its own, and its own pool never receives the prompt KV that its CUDA-graph
decode later reads. Outputs stay correct (the target verifies every token) but acceptance drops.
"""

from __future__ import annotations


def bind_draft_step(forward_batch, step_runner) -> None:
    """Point `forward_batch` at `step_runner`'s req_to_token_pool, token_to_kv_pool and
    attention backend before running that step's forward on it."""
    forward_batch.req_to_token_pool = step_runner.req_to_token_pool
    forward_batch.token_to_kv_pool = step_runner.token_to_kv_pool
    forward_batch.attn_backend = step_runner.attn_backend
