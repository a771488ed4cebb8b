"""Spec v2 decode without waiting on the host for the launched verify: host lengths as bounds.

Under the overlap scheduler, the scheduler prepares decode step k + 1 while the GPU still runs
step k. Upstream's `EagleDraftInputV2Mixin.prepare_for_decode` ends by waiting for step k's
verify and copying its sequence lengths to the host (its "FIXME: make this sync optional"), so
everything the host does after that wait, until step k + 1's kernels are launched, is time
the GPU may sit idle: it has only step k's draft extend left to run.

What the host reads from those lengths in a spec v2 decode step on the triton backend with
CUDA graphs is sizes: `seq_lens_sum` sizes the multi-step draft backend's KV-index slices and
eager index buffers. The graphs' metadata, the tree mask and the KV indices are computed on the
device from the device lengths. So a bound on each request's length does as well, and the host
knows one without waiting: a request's committed KV length (`Req.kv_committed_len`, already
advanced for the step being prepared) plus the most tokens one step may commit. The device
lengths stay exact; only the wait goes, replaced by a stream-side wait that keeps the
schedule stream's later reads of them ordered after the verify.

On by default (SGLANG_SPEC_V2_BOUNDED_HOST_LENS=0 turns it off), and only where nothing reads
the host lengths as exact: triton, FA3 or FlashInfer attention (target and draft; FlashInfer
chains only where SGLANG_SPEC_V2_BOUNDED_HOST_LENS=1 asks for it) with CUDA graphs, at page
size 1 or drafting trees (laid out flat at every page size), no two-batch overlap, DP attention
or pipeline stages; and per step, a batch the graphs cover, with no logprobs, grammar,
penalizers, multimodal inputs or mamba state. Such a batch never takes an eager path that
builds per-request host lists from the lengths; the eager draft extend, which does, reads them
from the device once bounds have been issued (exact_prefix_lens).
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

import torch

logger = logging.getLogger(__name__)

ENV = "SGLANG_SPEC_V2_BOUNDED_HOST_LENS"
# What the log has said about the switch: once a refusal, once the first bounded step.
BOUNDS_IN_USE = (
    "Spec v2 decode: host sequence lengths are bounds, no host wait for verify"
)
KEEPS_EXACT_LENS = "Spec v2 decode keeps exact host sequence lengths"
_logged: set[str] = set()


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


def enabled_by_env(environ=os.environ) -> bool:
    return environ.get(ENV, "1") != "0"


def requested_by_env(environ=os.environ) -> bool:
    """Whether the user set the switch on, rather than left it at its default."""
    return environ.get(ENV) == "1"


_ENABLED = enabled_by_env()

# Attention backends whose spec v2 decode metadata may be built from bounds. Triton reads the
# host lengths only as sizes. FA3's graph replay reads them as the width of the page-table rows
# it copies (max_seq_len_k), its kernels reading the device lengths; its tables are as wide as
# req_to_token's rows and the copies stop at that width (fa3_tree_metadata.page_table_columns),
# so a bound past a real length copies columns no kernel reads. FlashInfer plans from them,
# sizing the work from the bounds while the lengths its kernels read are rewritten on the
# device (docs/flashinfer-overlap.md), and its draft decode moves to the tensor-core kernel,
# which clamps each KV chunk to the real length.
BOUNDS_BACKENDS = frozenset({"triton", "fa3", "flashinfer"})
# Backends that take bounds for trees (topk > 1) by default and for chains only when the user
# asks (SGLANG_SPEC_V2_BOUNDED_HOST_LENS=1). FlashInfer's trees gain from bounds where the
# host's wait for the verify shows (small batch) and keep their speed where it does not
# (docs/benchmarks.md, "Spec v2 trees on FlashInfer"); its chains with bounds are
# token-identical but their speed unmeasured, and flashinfer is sglang's default backend for
# chains off Hopper, so they keep upstream's exact lengths unless asked. A shape policy whose
# set holds a tree takes them for its chains too: one answer holds for every shape
# (_step_topks), and a chain's FlashInfer backends built expecting bounds are token-identical.
TREES_ONLY_BACKENDS = frozenset({"flashinfer"})
# Set once this process has issued bounds: only then may an eager draft extend see them.
_bounds_issued = False


def _step_topks(server_args) -> frozenset[int]:
    """The draft top-k of every shape a decode step may take. A shape policy points the flags
    at the running shape (shape_runtime.apply_shape_runtime_state), but the scheduler
    prepares a step, bounds included, before the worker picks its shape, and each shape's
    backends are built while the flags name that shape: an answer read from the running
    shape would let a step prepared under a tree run on a chain's backends, built not to
    expect bounds. So every answer here is the same for all shapes of the policy's set.
    """
    if getattr(server_args, "speculative_adaptive", False):
        from sglang.srt.speculative.shape_runtime import shape_policy_of

        config = shape_policy_of(server_args)
        if config is not None:
            return frozenset(s.topk for s in config.policy.shapes if s.speculates)
    return frozenset({getattr(server_args, "speculative_eagle_topk", None) or 1})


def _may_draft_trees(server_args) -> bool:
    return any(topk > 1 for topk in _step_topks(server_args))


def _may_draft_chains(server_args) -> bool:
    return 1 in _step_topks(server_args)


def server_refusal(server_args) -> Optional[str]:
    """Why this server's spec v2 decode must keep upstream's exact host lengths, or None."""
    # The prefill backend runs the target verify and the draft extend under sglang's hybrid
    # backend (--speculative-attention-mode prefill, its default): it reads them too.
    backends = {
        server_args.attention_backend,
        getattr(server_args, "prefill_attention_backend", None),
        getattr(server_args, "decode_attention_backend", None),
        getattr(server_args, "speculative_draft_attention_backend", None),
    } - {None}
    if not backends <= BOUNDS_BACKENDS:
        return (
            f"attention backends {sorted(backends)}: only "
            f"{', '.join(sorted(BOUNDS_BACKENDS))} take bounds"
        )
    trees_only = backends & TREES_ONLY_BACKENDS
    if trees_only and not _may_draft_trees(server_args):
        if not requested_by_env():
            return (
                f"attention backends {sorted(backends)}: {', '.join(sorted(trees_only))} "
                f"take bounds for chains only with {ENV}=1 (opt-in)"
            )
    if server_args.disable_cuda_graph:
        return "no CUDA graphs: eager metadata reads the host lengths"
    if getattr(server_args, "disable_cuda_graph_padding", False):
        return "no CUDA-graph padding: batches between captured sizes run eager"
    if server_args.page_size != 1 and _may_draft_chains(server_args):
        # Trees lay every round out flat and every backend reads them by token slot or
        # through pages of one token (paged_tree_layout): bounds read what they read at page
        # size 1. A chain with pages reads its KV through FA3's page table of real pages,
        # which has not run with bounds; nor has a shape policy with a chain in its set.
        return f"page size {server_args.page_size} with a chain"
    if getattr(server_args, "enable_two_batch_overlap", False):
        return "two-batch overlap splits the batch by host lengths"
    if server_args.enable_dp_attention:
        return "DP attention"
    if server_args.pp_size != 1:
        return "pipeline parallelism"
    if getattr(server_args, "speculative_adaptive", False):
        from sglang.srt.speculative.shape_runtime import shape_policy_of

        if shape_policy_of(server_args) is None:
            # Upstream's adaptive steps change how many tokens a step may commit between
            # the launched step and the one prepared; the shape policy reserves its largest.
            return "--speculative-adaptive without a shape policy"
    return None


def may_issue_bounds(server_args) -> bool:
    """Whether this server's spec v2 decode steps may carry bounds as host lengths: what an
    attention backend that plans from host lengths must be ready for."""
    return (
        _ENABLED
        and server_args.speculative_algorithm is not None
        and not server_args.disable_overlap_schedule
        and server_refusal(server_args) is None
    )


def graph_batch_limit(server_args) -> int:
    """The largest batch the decode-step graphs are captured for."""
    if server_args.cuda_graph_bs:
        return max(server_args.cuda_graph_bs)
    return server_args.cuda_graph_max_bs or 0


def batch_allows_bounds(batch, server_args) -> bool:
    """Whether this decode step's host lengths may be bounds (see the module docstring)."""
    return (
        _ENABLED
        and server_refusal(server_args) is None
        and step_allows_bounds(batch, server_args)
    )


def step_allows_bounds(batch, server_args) -> bool:
    """The per-step half of batch_allows_bounds: a batch the graphs cover, and nothing in it
    that reads exact host lengths."""
    return (
        batch.batch_size() <= graph_batch_limit(server_args)
        and not batch.return_logprob
        and not batch.has_grammar
        and not batch.sampling_info.penalizer_orchestrator.is_required
        and getattr(batch.req_to_token_pool, "mamba_pool", None) is None
        and all(r.multimodal_inputs is None for r in batch.reqs)
    )


def seq_len_bounds(committed_lens: Sequence[int], max_step_tokens: int) -> torch.Tensor:
    """[bs] int64: an upper bound of each request's length entering the step being prepared.

    committed_lens holds Req.kv_committed_len after prepare_for_decode's pre-claim of this
    step's bonus slot: the length after the last processed step, plus one pre-claimed slot
    per launched step whose result is not processed yet (at most one under the overlap
    scheduler) and this one. The launched step commits between 1 and max_step_tokens
    tokens, so the length entering this step is at most committed - 2 + max_step_tokens;
    the bound adds the 2 back, slack that only sizes buffers."""
    return torch.tensor(
        [n + max_step_tokens for n in committed_lens], dtype=torch.int64
    )


def set_host_seq_lens(batch, max_step_tokens: int, server_args=None) -> None:
    """End of a spec v2 prepare_for_decode: batch.seq_lens_cpu / seq_lens_sum, as bounds
    where allowed (no host wait), else upstream's exact copy after the verify. server_args:
    the server's (default: the global ones, read only when bounds are on)."""
    bounded = False
    if _ENABLED:
        if server_args is None:
            from sglang.srt.server_args import get_global_server_args

            server_args = get_global_server_args()
        refusal = server_refusal(server_args)
        if refusal is not None:
            # A server that could not use bounds anyway says so quietly, unless asked for them.
            level = logging.WARNING if requested_by_env() else logging.INFO
            _log_once(level, f"{KEEPS_EXACT_LENS}: {refusal}")
        bounded = refusal is None and step_allows_bounds(batch, server_args)
    if not bounded:
        batch.maybe_wait_verify_done()
        batch.seq_lens_cpu = batch.seq_lens.cpu()
        batch.seq_lens_sum = batch.seq_lens_cpu.sum().item()
        return
    verify_done = getattr(batch.spec_info, "verify_done", None)
    if verify_done is not None:
        # The device lengths are the verify's output: later work on this stream reads
        # them after it, without the host waiting.
        torch.get_device_module().current_stream().wait_event(verify_done)
    global _bounds_issued
    _bounds_issued = True
    _log_once(logging.INFO, BOUNDS_IN_USE)
    bounds = seq_len_bounds([r.kv_committed_len for r in batch.reqs], max_step_tokens)
    batch.seq_lens_cpu = bounds
    batch.seq_lens_sum = int(bounds.sum())


def exact_prefix_lens(
    device_seq_lens: torch.Tensor, host_prefix_lens: list[int]
) -> list[int]:
    """Per-request prefix lengths for an eager draft extend, which builds its KV indices from
    them: the host's list when it is exact, the device lengths (a sync) where host lengths
    may be bounds. Bounds are used only where the draft-extend graph runs, so this is a guard,
    and a server that never issued bounds keeps the host's list without a sync.
    """
    if _bounds_issued:
        return device_seq_lens.tolist()
    return host_prefix_lens
