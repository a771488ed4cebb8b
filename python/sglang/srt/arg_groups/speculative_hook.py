"""Config-time decisions for the EAGLE family (EAGLE, EAGLE3, STANDALONE).

Everything here runs inside ServerArgs.__post_init__, before any GPU allocation, so a bad
combination of flags fails with a ValueError that names the flags.

The decisions, in order (`handle_eagle_family`):
1. The draft shape: topk == 1 drafts a chain (num_draft_tokens is num_steps + 1, derived when
   unset); topk > 1 drafts a tree whose node budget num_draft_tokens must fit in what the steps
   can produce.
2. Which scheduler runs it: spec v2 (the overlap scheduler) or spec v1. Tree drafting runs on
   spec v2 only where its accepted-path compaction is implemented and tested: page_size == 1,
   no recurrent (mamba / linear-attention) state, a backend with spec-v2 tree metadata, and not
   the multi-layer (MTP) worker, which drafts chains only. Anything else runs spec v1 and says
   why in exactly one warning.
3. Trees with DP attention need CUDA graphs, in either version (DP_ATTENTION_EAGER_TREE_ERROR).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Attention backends whose target-verify, draft-decode and draft-extend metadata (eager and
# CUDA graph) are exercised by the spec-v2 tree tests on a GPU.
SPEC_V2_TREE_ATTENTION_BACKENDS = frozenset({"triton"})

# Backends whose spec-v2 trees are token-identical on a GPU but run faster on spec v1, and why.
# FA3: eagle_worker_v2 captures draft-extend CUDA graphs for triton only, so a v2 tree's draft
# extend (num_draft_tokens rows per request) runs eagerly; v1 graphs it. On an H100 (1.21B
# target, tree 16,3,32, one bench run) v2 / v1 tok/s was 1.12x at bs 1 and 0.88x at bs 16.
SPEC_V1_FASTER_TREE_BACKENDS = {
    "fa3": "fa3's spec v2 draft extend has no CUDA graph, so its trees are faster on spec v1",
}

# Trees with DP attention and no CUDA graphs crash at this base, in either version. Seen on two
# H200s (Qwen3 target, EAGLE3 draft, tree 4,3,8, --tp 2 --dp 2, one request then 48): spec v2's
# eager draft decode failed triton's `q.shape[0] <= kv_indptr.shape[0] - 1` (more query rows than
# the draft's attention metadata covers), and spec v1 hit an illegal memory access in verify.
# With CUDA graphs, spec v2 was token-identical to no speculation, idle rank included.
DP_ATTENTION_EAGER_TREE_ERROR = (
    "--speculative-eagle-topk {topk} with --enable-dp-attention needs CUDA graphs: eager tree "
    "steps with DP attention crash at this base (spec v1 and v2); drop --disable-cuda-graph"
)

# Backends that have no tree (topk > 1) support at all with page_size > 1, in either version.
PAGED_TREE_ATTENTION_BACKENDS = frozenset({"flashinfer", "fa3"})

# Config classes of targets whose layers keep recurrent state, which a tree verify would have
# to roll back per branch (eagle_worker_v2's mamba update handles chains only).
_RECURRENT_CONFIG_CLASSES = frozenset(
    {
        "BailingHybridConfig",
        "FalconH1Config",
        "InternS2PreviewConfig",
        "JetNemotronConfig",
        "JetVLMConfig",
        "KimiLinearConfig",
        "Lfm2Config",
        "MambaConfig",
        "Mamba2Config",
        "NemotronHConfig",
        "Qwen3NextConfig",
        "Qwen3_5Config",
        "Qwen3_5MoeConfig",
    }
)
_RECURRENT_LAYER_TYPES = frozenset({"mamba", "mamba2", "linear_attention", "linear_attn", "gdn"})


# ----------------------------------------------------------------------------- draft shape


def check_chain_shape(num_steps: int, num_draft_tokens: int) -> None:
    """topk == 1 drafts a chain: num_steps draft tokens plus the bonus token."""
    if num_steps < 1:
        raise ValueError(f"--speculative-num-steps must be >= 1, got {num_steps}")
    if num_draft_tokens != num_steps + 1:
        raise ValueError(
            "--speculative-eagle-topk 1 drafts a chain, which needs "
            f"--speculative-num-draft-tokens == --speculative-num-steps + 1 ({num_steps + 1}); "
            f"got --speculative-num-draft-tokens {num_draft_tokens}"
        )


def resolve_chain_num_draft_tokens(num_steps: int, num_draft_tokens: Optional[int]) -> int:
    """num_draft_tokens for topk == 1: derived when unset, refused when inconsistent."""
    if num_draft_tokens is None:
        num_draft_tokens = num_steps + 1
    check_chain_shape(num_steps, num_draft_tokens)
    return num_draft_tokens


def max_tree_draft_tokens(topk: int, num_steps: int) -> int:
    """Largest tree the draft can hand to verify: the root plus every scored candidate.

    Step 0 scores topk candidates; every later step scores topk children of each of the topk
    expanded nodes. draft_forward keeps the best num_draft_tokens - 1 of them.
    """
    return 1 + topk + (num_steps - 1) * topk * topk


def check_tree_shape(topk: int, num_steps: int, num_draft_tokens: Optional[int]) -> None:
    """topk > 1 drafts a tree of num_draft_tokens nodes (root included)."""
    if num_steps < 1:
        raise ValueError(f"--speculative-num-steps must be >= 1, got {num_steps}")
    if num_draft_tokens is None:
        raise ValueError(
            f"--speculative-eagle-topk {topk} drafts a tree: set --speculative-num-draft-tokens "
            f"(tree nodes including the root, 2..{max_tree_draft_tokens(topk, num_steps)})"
        )
    if num_draft_tokens < 2:
        raise ValueError(
            f"--speculative-num-draft-tokens must be >= 2 for a tree, got {num_draft_tokens}"
        )
    limit = max_tree_draft_tokens(topk, num_steps)
    if num_draft_tokens > limit:
        raise ValueError(
            f"--speculative-num-draft-tokens {num_draft_tokens} is larger than the tree that "
            f"--speculative-eagle-topk {topk} with --speculative-num-steps {num_steps} can draft "
            f"(at most {limit} nodes: 1 + topk + (num_steps - 1) * topk^2)"
        )


# ----------------------------------------------------------------------------- spec version


def recurrent_layer_reason(hf_config) -> Optional[str]:
    """Why the target keeps recurrent state (mamba / linear attention), or None."""
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    for config in (hf_config, text_config):
        name = type(config).__name__
        if name in _RECURRENT_CONFIG_CLASSES:
            return f"the target ({name}) has mamba / linear-attention layers"
        for field in ("layer_types", "layers_block_type"):
            layer_types = getattr(config, field, None) or ()
            found = sorted({str(t).lower() for t in layer_types} & _RECURRENT_LAYER_TYPES)
            if found:
                return f"the target has {'/'.join(found)} layers ({field})"
    return None


@dataclass(frozen=True)
class SpecVersion:
    use_spec_v2: bool
    # Why spec v1 runs; None when spec v2 runs or when the user disabled the overlap scheduler.
    spec_v1_reason: Optional[str]


def choose_spec_version(
    *,
    topk: int,
    page_size: int,
    overlap_disabled: bool,
    spec_v2_env_enabled: bool,
    multi_layer: bool,
    recurrent_reason: Optional[str],
    attention_backends: Iterable[str],
) -> SpecVersion:
    """Spec v2 unless the user or a tree-drafting limit says otherwise (first reason wins)."""
    if overlap_disabled:
        return SpecVersion(False, None)
    if not spec_v2_env_enabled:
        return SpecVersion(False, "SGLANG_ENABLE_SPEC_V2=False")
    if topk == 1:
        return SpecVersion(True, None)

    prefix = f"spec v2 tree drafting (--speculative-eagle-topk {topk}) needs "
    if page_size != 1:
        return SpecVersion(False, prefix + f"--page-size 1, got {page_size}")
    if recurrent_reason is not None:
        return SpecVersion(False, prefix + f"a target without recurrent state; {recurrent_reason}")
    if multi_layer:
        return SpecVersion(False, prefix + "the single-layer draft worker; multi-layer EAGLE drafts chains")
    unsupported = sorted(set(attention_backends) - SPEC_V2_TREE_ATTENTION_BACKENDS)
    if unsupported:
        why = [SPEC_V1_FASTER_TREE_BACKENDS[b] for b in unsupported if b in SPEC_V1_FASTER_TREE_BACKENDS]
        return SpecVersion(
            False,
            prefix + f"an attention backend in {sorted(SPEC_V2_TREE_ATTENTION_BACKENDS)}, "
            f"got {', '.join(unsupported)}" + "".join(f" ({w})" for w in why),
        )
    return SpecVersion(True, None)


def _attention_backends(server_args: ServerArgs) -> set[str]:
    backend = server_args.attention_backend
    return {
        b
        for b in (
            server_args.decode_attention_backend or backend,
            server_args.prefill_attention_backend or backend,
        )
        if b is not None
    }


def handle_eagle_family(server_args: ServerArgs, hf_config, spec_v2_env_enabled: bool) -> None:
    """Validate the draft shape and pick spec v1/v2 (sets disable_overlap_schedule).

    Called after speculative_num_steps / topk / num_draft_tokens are resolved.
    """
    topk = server_args.speculative_eagle_topk
    num_steps = server_args.speculative_num_steps
    if topk < 1:
        raise ValueError(f"--speculative-eagle-topk must be >= 1, got {topk}")

    backends = _attention_backends(server_args)
    if topk == 1:
        server_args.speculative_num_draft_tokens = resolve_chain_num_draft_tokens(
            num_steps, server_args.speculative_num_draft_tokens
        )
    else:
        check_tree_shape(topk, num_steps, server_args.speculative_num_draft_tokens)
        if server_args.page_size > 1 and not backends <= PAGED_TREE_ATTENTION_BACKENDS:
            raise ValueError(
                f"--speculative-eagle-topk {topk} with --page-size {server_args.page_size} "
                "produces incorrect results with the "
                f"{', '.join(sorted(backends - PAGED_TREE_ATTENTION_BACKENDS))} attention backend; "
                f"use one of {sorted(PAGED_TREE_ATTENTION_BACKENDS)} or --page-size 1"
            )
        if server_args.enable_dp_attention and server_args.disable_cuda_graph:
            raise ValueError(DP_ATTENTION_EAGER_TREE_ERROR.format(topk=topk))

    version = choose_spec_version(
        topk=topk,
        page_size=server_args.page_size,
        overlap_disabled=server_args.disable_overlap_schedule,
        spec_v2_env_enabled=spec_v2_env_enabled,
        multi_layer=server_args.enable_multi_layer_eagle,
        recurrent_reason=recurrent_layer_reason(hf_config) if topk > 1 else None,
        attention_backends=backends,
    )
    server_args.disable_overlap_schedule = not version.use_spec_v2
    if version.use_spec_v2:
        logger.warning(
            "Spec v2 (overlap scheduler) is used for %s speculative decoding (topk=%d).",
            server_args.speculative_algorithm.lower(),
            topk,
        )
    else:
        logger.warning(
            "Spec v1 is used for %s speculative decoding because %s.",
            server_args.speculative_algorithm.lower(),
            version.spec_v1_reason or "the overlap scheduler is disabled",
        )
