"""Config-time decisions for the EAGLE family (EAGLE, EAGLE3, STANDALONE).

Everything here runs inside ServerArgs.__post_init__, before any GPU allocation, so a bad
combination of flags fails with a ValueError that names the flags.

Before any of them, for every algorithm (`check_speculative_flags`, first thing in
_handle_speculative_decoding): a --speculative-draft-model-path that is neither a local path
nor a Hugging Face repo id is a ValueError naming the flag, --speculative-* flags given
without --speculative-algorithm, which upstream ignores, get one warning naming them, and a
SGLANG_FEW_ROW_GEMM file that is not bench_verify_gemm's rows (the verify's GEMM table,
layers/few_row_gemm_table.py) is a ValueError naming the variable.

The decisions, in order:
0. A draft to run (`check_draft_model_given`): without --speculative-draft-model-path sglang
   drafts with the target's checkpoint, which only a target with draft (MTP) layers can do.
   Then shape completion (`complete_eagle_shape`): with none of --speculative-eagle-topk /
   --speculative-num-steps / --speculative-num-draft-tokens set, upstream's
   auto_choose_speculative_params picks all three; with some set, the others are derived from
   them (`speculative.draft_shape.complete_shape`, rules in its docstring) and one warning
   names the three values.
1. The draft shape (`handle_eagle_family` from here on): topk == 1 drafts a chain
   (num_draft_tokens is num_steps + 1); topk > 1 drafts a tree whose node budget
   num_draft_tokens must fit in what the steps can produce, and in sgl_kernel's tree build.
2. Which scheduler runs it: spec v2 (the overlap scheduler) or spec v1. Tree drafting runs on
   spec v2 only where its accepted-path compaction is implemented and tested: at any page size
   (docs/paged-trees.md), no recurrent (mamba / linear-attention) state, a backend with spec-v2
   tree metadata for every attention backend in play (the target's, and the draft's when
   --speculative-draft-attention-backend is set), flashinfer and fa3 only on a non-MLA target,
   and not the multi-layer (MTP) worker, which drafts chains only. Anything else runs spec v1
   and says why in exactly one warning. A tree with pages that lands on spec v1 with a backend
   other than flashinfer / fa3 is a ValueError: spec v1 gets those wrong (upstream's refusal).
3. Trees with DP attention need CUDA graphs, in either version (DP_ATTENTION_EAGER_TREE_ERROR);
   with them they run spec v2 on every backend in SPEC_V2_TREE_ATTENTION_BACKENDS.
4. A multi-layer EAGLE draft whose MTP layers attend in a sliding window (Step-3.5, MiMo-V2)
   cannot draft-extend on the triton backend except eagerly on spec v2
   (check_sliding_window_draft_extend): a ValueError naming the flags otherwise.

Earlier, where sglang picks the attention backend the user left unset
(_handle_attention_backend_compatibility), `default_tree_attention_backend` turns its pick for
a tree (flashinfer, on Hopper too) into triton when the tree will run spec v2: see
TREE_DEFAULT_ATTENTION_BACKEND.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable, Iterable, Optional

from sglang.srt.speculative.draft_shape import (
    DRAFT_TOKENS_FLAG,
    STEPS_FLAG,
    TOPK_FLAG,
    check_at_least_one,
    check_shape,
    check_tree_shape,
    complete_shape,
    resolve_chain_num_draft_tokens,
)

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Attention backends with spec-v2 tree metadata (target verify, draft decode, draft extend; eager
# and CUDA graph), each exercised by the spec-v2 tree tests on a GPU: flashinfer with its verify
# and draft extend planned on the host, fa3 with a draft-extend CUDA graph. Non-MLA targets only
# for those two, see MLA_TREE_V1_BACKENDS. With DP attention an idle rank's speculative IDLE
# batches get metadata on each of the three (the *-idle-speculative-metadata patches), so DP
# attention changes nothing here: its trees run spec v2 on all three.
SPEC_V2_TREE_ATTENTION_BACKENDS = frozenset({"triton", "flashinfer", "fa3"})

# The backend a spec-v2 tree gets on Hopper when the user names none, instead of sglang's
# flashinfer: triton's spec-v2 trees ran as fast or faster at every batch size measured on H100s,
# well ahead where the host bounds the step (docs/benchmarks.md, "Spec v2 trees on FlashInfer").
# FlashInfer plans each verify and draft extend on the host from exact lengths, so its step waits
# for the previous verify and pays the plan (docs/flashinfer-overlap.md); triton builds the same
# metadata on the device. Other GPUs keep sglang's choice until they are measured.
TREE_DEFAULT_ATTENTION_BACKEND = "triton"

# Backends whose MLA targets keep trees on spec v1, and why: "flashinfer" names another class
# there, and fa3's MLA kernels have not run a spec-v2 tree on a GPU.
MLA_TREE_V1_BACKENDS = {
    "flashinfer": "on an MLA target it runs flashinfer_mla, which has no spec v2 tree support",
    "fa3": "its MLA path has not run spec v2 trees on a GPU",
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

# sglang's triton backend builds sliding-window KV indices for decode, target verify and plain
# extend, but not for draft extend: not in its DRAFT_EXTEND metadata (spec v1, eager) nor in its
# draft-extend CUDA graph capture and replay (spec v2). A sliding-window draft layer then hands
# the extend kernel None for its KV indices, which triton fails to compile (seen on an H100 with
# the synthetic Step-3.5 MTP checkpoint, spec v2 with CUDA graphs). Spec v2's eager draft extend
# is planned as a plain extend, which builds them.
TRITON_SLIDING_WINDOW_DRAFT_EXTEND_ERROR = (
    "multi-layer EAGLE cannot run {where} on the triton attention backend: {why}, and sglang's "
    "triton backend builds no sliding-window KV indices for draft extend there (the draft "
    "extend's backend comes from {flag} triton). Use {flag} fa3 (sglang's choice on Hopper), "
    "or spec v2 without CUDA graphs (--disable-cuda-graph, overlap scheduler on)"
)

# Multi-layer EAGLE targets whose MTP layers attend in a sliding window whatever their config's
# layer_types say: MiMoV2's MTP block (models/mimo_v2_nextn.py) always passes its config's
# sliding_window_size to its attention.
SLIDING_WINDOW_MTP_ARCHITECTURES = frozenset({"MiMoV2ForCausalLM"})

# Backends whose spec v1 runs trees (topk > 1) with page_size > 1 correctly; spec v1 paged trees
# on any other backend produce incorrect results (upstream's refusal, kept).
PAGED_TREE_ATTENTION_BACKENDS = frozenset({"flashinfer", "fa3"})

# Spec v2 trees run at every page size on every backend in SPEC_V2_TREE_ATTENTION_BACKENDS
# (docs/paged-trees.md): the draft keeps the flat branch layout of page size 1, which triton reads
# by token slot, flashinfer through pages of one token, and fa3 through a page table of pages of
# one token (paged_tree_layout.attention_page_size).

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
_RECURRENT_LAYER_TYPES = frozenset(
    {"mamba", "mamba2", "linear_attention", "linear_attn", "gdn"}
)


ALGORITHM_FLAG = "--speculative-algorithm"
DRAFT_MODEL_PATH_FLAG = "--speculative-draft-model-path"

# speculative_* fields that a user's flag does not alone decide: upstream fills them before
# _handle_speculative_decoding (the draft's quantization from --quantization, the MoE backends
# from model-specific defaults), or refuses them itself without EAGLE (skip_dp_mlp_sync asserts).
_SPECULATIVE_FIELDS_NOT_WARNED = frozenset(
    {
        "speculative_algorithm",
        "speculative_draft_model_quantization",
        "speculative_moe_runner_backend",
        "speculative_moe_a2a_backend",
        "speculative_skip_dp_mlp_sync",
    }
)


# ----------------------------------------------------------------------------- flags and draft


def check_speculative_flags(server_args: ServerArgs) -> None:
    """Checks for every algorithm, before upstream reads any speculative flag."""
    from sglang.srt.layers import few_row_gemm_table

    check_draft_model_path(server_args.speculative_draft_model_path)
    few_row_gemm_table.check_env()
    if server_args.speculative_algorithm is None:
        warn_ignored_speculative_flags(server_args)


def check_draft_model_path(path: Optional[str]) -> None:
    """The draft path names a local path or looks like a Hugging Face repo id.

    Anything else reaches huggingface_hub (the algorithm alias check reads the draft's config
    first thing) and fails as "Repo id must be in the form ...", naming no flag. A repo id that
    is not a local directory stays allowed: the server may download it.
    """
    if path is None or os.path.exists(path):
        return
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        raise ValueError(
            f"{DRAFT_MODEL_PATH_FLAG} {path!r} does not exist locally and is not a Hugging Face "
            "repo id ('name' or 'namespace/name')"
        ) from None


def ignored_speculative_flags(server_args: ServerArgs) -> list[str]:
    """The --speculative-* flags set away from their defaults, as `--flag value`."""
    given = []
    for field in dataclasses.fields(type(server_args)):
        if (
            not field.name.startswith("speculative_")
            or field.name in _SPECULATIVE_FIELDS_NOT_WARNED
        ):
            continue
        value = getattr(server_args, field.name)
        if field.default is not dataclasses.MISSING and value != field.default:
            given.append(f"--{field.name.replace('_', '-')} {value}")
    return given


def warn_ignored_speculative_flags(server_args: ServerArgs) -> None:
    """Upstream runs without speculation when no algorithm is given and ignores the other
    speculative flags: say so, since the user evidently meant to speculate."""
    given = ignored_speculative_flags(server_args)
    if given:
        logger.warning(
            "No %s is given, so speculative decoding is off and these flags are ignored: %s",
            ALGORITHM_FLAG,
            ", ".join(given),
        )


def builtin_draft_architecture(hf_config) -> Optional[str]:
    """The draft model class sglang builds from the target's own checkpoint (MTP / NextN
    layers) when no draft path is given, or None when the target has none.

    Without a draft path the draft worker loads the target's checkpoint as a draft model, and
    upstream's draft-config step (ModelConfig._config_draft_model) renames the architecture of
    targets with draft layers (Qwen3NextForCausalLM -> Qwen3NextForCausalLMMTP); a target it
    leaves as is gets loaded as a draft it is not. Run on a copy: the step edits the config.
    """
    from sglang.srt.configs.model_config import ModelConfig

    target_architecture = hf_config.architectures[0]
    draft_config = copy.copy(hf_config)
    draft_config.architectures = list(hf_config.architectures)
    ModelConfig._config_draft_model(
        SimpleNamespace(is_draft_model=True, hf_config=draft_config)
    )
    draft_architecture = draft_config.architectures[0]
    return None if draft_architecture == target_architecture else draft_architecture


def check_draft_model_given(server_args: ServerArgs) -> None:
    """EAGLE, EAGLE3 and STANDALONE need --speculative-draft-model-path, unless the target
    carries its own draft layers (builtin_draft_architecture). Called after upstream fills the
    path in for the DeepSeek-style MTP targets it knows."""
    if server_args.speculative_draft_model_path is not None:
        return
    hf_config = server_args.get_model_config().hf_config
    if builtin_draft_architecture(hf_config) is not None:
        return
    raise ValueError(
        f"{ALGORITHM_FLAG} {server_args.speculative_algorithm} needs {DRAFT_MODEL_PATH_FLAG} "
        f"(a local directory or a Hugging Face repo id): the target ({hf_config.architectures[0]}) "
        "has no draft (MTP) layers of its own to draft with"
    )


def complete_eagle_shape(
    server_args: ServerArgs, auto_choose: Callable[[ServerArgs], tuple[int, int, int]]
) -> None:
    """Fill unset --speculative-eagle-topk / -num-steps / -num-draft-tokens (see complete_shape).

    auto_choose is upstream's auto_choose_speculative_params, called only when none is set.
    """
    shape = complete_shape(
        server_args.speculative_eagle_topk,
        server_args.speculative_num_steps,
        server_args.speculative_num_draft_tokens,
        auto=lambda: auto_choose(server_args),
    )
    server_args.speculative_eagle_topk = shape.topk
    server_args.speculative_num_steps = shape.num_steps
    server_args.speculative_num_draft_tokens = shape.num_draft_tokens
    if shape.derived:
        values = (
            (TOPK_FLAG, shape.topk),
            (STEPS_FLAG, shape.num_steps),
            (DRAFT_TOKENS_FLAG, shape.num_draft_tokens),
        )
        logger.warning(
            "%s draft shape completed: %s",
            server_args.speculative_algorithm,
            " ".join(
                f"{flag} {value}" + (" (derived)" if flag in shape.derived else "")
                for flag, value in values
            ),
        )


# ----------------------------------------------------------------------------- spec version


def recurrent_layer_reason(hf_config) -> Optional[str]:
    """Why the target keeps recurrent state (mamba / linear attention), or None."""
    text_config = (
        hf_config.get_text_config()
        if hasattr(hf_config, "get_text_config")
        else hf_config
    )
    for config in (hf_config, text_config):
        name = type(config).__name__
        if name in _RECURRENT_CONFIG_CLASSES:
            return f"the target ({name}) has mamba / linear-attention layers"
        for field in ("layer_types", "layers_block_type"):
            layer_types = getattr(config, field, None) or ()
            found = sorted(
                {str(t).lower() for t in layer_types} & _RECURRENT_LAYER_TYPES
            )
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
    overlap_disabled: bool,
    spec_v2_env_enabled: bool,
    multi_layer: bool,
    recurrent_reason: Optional[str],
    attention_backends: Iterable[str],
    mla_target: bool,
) -> SpecVersion:
    """Spec v2 unless the user or a tree-drafting limit says otherwise (first reason wins)."""
    if overlap_disabled:
        return SpecVersion(False, None)
    if not spec_v2_env_enabled:
        return SpecVersion(False, "SGLANG_ENABLE_SPEC_V2=False")
    if topk == 1:
        return SpecVersion(True, None)

    prefix = f"spec v2 tree drafting (--speculative-eagle-topk {topk}) needs "
    attention_backends = set(attention_backends)
    if recurrent_reason is not None:
        return SpecVersion(
            False, prefix + f"a target without recurrent state; {recurrent_reason}"
        )
    if multi_layer:
        return SpecVersion(
            False,
            prefix + "the single-layer draft worker; multi-layer EAGLE drafts chains",
        )
    unsupported = sorted(attention_backends - SPEC_V2_TREE_ATTENTION_BACKENDS)
    if unsupported:
        return SpecVersion(
            False,
            prefix
            + f"an attention backend in {sorted(SPEC_V2_TREE_ATTENTION_BACKENDS)}, "
            f"got {', '.join(unsupported)}",
        )
    on_mla = (
        sorted(attention_backends & MLA_TREE_V1_BACKENDS.keys()) if mla_target else []
    )
    if on_mla:
        return SpecVersion(
            False,
            prefix
            + "; ".join(
                f"a non-MLA target for the {b} attention backend: {MLA_TREE_V1_BACKENDS[b]}"
                for b in on_mla
            ),
        )
    return SpecVersion(True, None)


def check_spec_v1_paged_tree(
    topk: int, page_size: int, backends: set[str], version: SpecVersion
) -> None:
    """A tree with pages that runs spec v1 needs a backend whose v1 paged trees are right."""
    wrong = sorted(backends - PAGED_TREE_ATTENTION_BACKENDS)
    if page_size == 1 or not wrong:
        return
    why = version.spec_v1_reason or "the overlap scheduler is disabled"
    raise ValueError(
        f"--speculative-eagle-topk {topk} with --page-size {page_size} runs spec v1 here "
        f"({why}), which produces incorrect results with the {', '.join(wrong)} attention "
        f"backend; use one of {sorted(PAGED_TREE_ATTENTION_BACKENDS)}, --page-size 1, or spec "
        f"v2 with only {sorted(SPEC_V2_TREE_ATTENTION_BACKENDS)}"
    )


def mtp_sliding_window_reason(hf_config) -> Optional[str]:
    """Why the target checkpoint's MTP layers, the multi-layer EAGLE draft, attend in a sliding
    window, or None. Step-3.5 lists them in layer_types after the num_hidden_layers decoder
    layers (its config has 48 entries for 45 layers)."""
    architectures = sorted(
        set(getattr(hf_config, "architectures", None) or ())
        & SLIDING_WINDOW_MTP_ARCHITECTURES
    )
    if architectures:
        return f"{architectures[0]}'s MTP layers attend in a sliding window"
    num_hidden_layers = getattr(hf_config, "num_hidden_layers", None)
    layer_types = list(getattr(hf_config, "layer_types", None) or ())
    if num_hidden_layers is None or len(layer_types) <= num_hidden_layers:
        return None
    if "sliding_attention" in layer_types[num_hidden_layers:]:
        return (
            f"the draft's MTP layers are sliding-window "
            f"(layer_types[{num_hidden_layers}:] of the target's config)"
        )
    return None


def draft_extend_backend_flag(server_args: ServerArgs) -> tuple[str, Optional[str]]:
    """The flag that picks the draft extend's attention backend, and the backend, as
    DraftBackendFactory.create_draft_extend_backend resolves them."""
    if server_args.speculative_draft_attention_backend:
        return (
            "--speculative-draft-attention-backend",
            server_args.speculative_draft_attention_backend,
        )
    if server_args.speculative_attention_mode == "decode":
        mode_flag, mode_backend = (
            "--decode-attention-backend",
            server_args.decode_attention_backend,
        )
    else:
        mode_flag, mode_backend = (
            "--prefill-attention-backend",
            server_args.prefill_attention_backend,
        )
    if mode_backend:
        return mode_flag, mode_backend
    return "--attention-backend", server_args.attention_backend


def check_sliding_window_draft_extend(
    server_args: ServerArgs, hf_config, version: SpecVersion
) -> None:
    """A sliding-window multi-layer EAGLE draft draft-extends on triton only eagerly on spec v2
    (TRITON_SLIDING_WINDOW_DRAFT_EXTEND_ERROR says why)."""
    if not server_args.enable_multi_layer_eagle:
        return
    flag, backend = draft_extend_backend_flag(server_args)
    if backend != "triton":
        return
    if version.use_spec_v2 and server_args.disable_cuda_graph:
        return
    why = mtp_sliding_window_reason(hf_config)
    if why is None:
        return
    if version.use_spec_v2:
        where = "spec v2's draft-extend CUDA graphs"
    else:
        v1_reason = version.spec_v1_reason or "the overlap scheduler is disabled"
        where = f"spec v1's draft extend (spec v1 runs because {v1_reason})"
    raise ValueError(
        TRITON_SLIDING_WINDOW_DRAFT_EXTEND_ERROR.format(where=where, why=why, flag=flag)
    )


def _attention_backends(server_args: ServerArgs) -> set[str]:
    """The target's backends, and the draft worker's (draft decode and draft extend) when set."""
    backend = server_args.attention_backend
    return {
        b
        for b in (
            server_args.decode_attention_backend or backend,
            server_args.prefill_attention_backend or backend,
            server_args.speculative_draft_attention_backend,
        )
        if b is not None
    }


def shape_policy_for_flags(server_args: ServerArgs):
    """The shape policy of --speculative-adaptive-config (a "shapes" key), every shape checked
    as the shape flags are; None without one."""
    if not getattr(server_args, "speculative_adaptive", False):
        return None
    from sglang.srt.speculative.shape_runtime import read_shape_policy

    def check(shape) -> None:
        try:
            check_shape(shape.topk, shape.num_steps, shape.num_draft_tokens)
        except ValueError as err:
            raise ValueError(
                f"--speculative-adaptive-config: shape {shape.label}: {err}"
            ) from None

    return read_shape_policy(server_args.speculative_adaptive_config, check)


def policy_max_topk(policy) -> int:
    return max(s.topk for s in policy.policy.shapes if s.speculates)


def check_shape_policy_runs(server_args: ServerArgs, policy, use_spec_v2: bool) -> None:
    """What a shape policy needs besides its shapes (ValueError before any GPU allocation)."""
    from sglang.srt.speculative.shape_runtime import flags_shape, policy_unsupported

    labels = [s.label for s in policy.policy.shapes]
    own = flags_shape(server_args)
    if own not in policy.policy.shapes:
        raise ValueError(
            f"--speculative-adaptive-config: the shape flags' own shape {own.label} "
            f"(--speculative-eagle-topk, --speculative-num-steps, "
            f'--speculative-num-draft-tokens) must be one of "shapes" {labels}: it is '
            "the first shape run"
        )
    reason = policy_unsupported(server_args, policy, use_spec_v2)
    if reason is not None:
        raise ValueError(
            f'--speculative-adaptive-config with "shapes" {labels} needs {reason}'
        )


def handle_eagle_family(
    server_args: ServerArgs, hf_config, spec_v2_env_enabled: bool
) -> None:
    """Validate the draft shape and pick spec v1/v2 (sets disable_overlap_schedule).

    Called after speculative_num_steps / topk / num_draft_tokens are resolved (complete_eagle_shape).
    """
    topk = server_args.speculative_eagle_topk
    num_steps = server_args.speculative_num_steps
    check_at_least_one(TOPK_FLAG, topk)

    backends = _attention_backends(server_args)
    if topk == 1:
        server_args.speculative_num_draft_tokens = resolve_chain_num_draft_tokens(
            num_steps, server_args.speculative_num_draft_tokens
        )
    else:
        check_tree_shape(topk, num_steps, server_args.speculative_num_draft_tokens)
        if server_args.enable_dp_attention and server_args.disable_cuda_graph:
            raise ValueError(DP_ATTENTION_EAGER_TREE_ERROR.format(topk=topk))

    # A shape policy may run any shape of its set: the version must suit the widest.
    policy = shape_policy_for_flags(server_args)
    version_topk = topk if policy is None else policy_max_topk(policy)
    version = choose_spec_version(
        topk=version_topk,
        overlap_disabled=server_args.disable_overlap_schedule,
        spec_v2_env_enabled=spec_v2_env_enabled,
        multi_layer=server_args.enable_multi_layer_eagle,
        recurrent_reason=(
            recurrent_layer_reason(hf_config) if version_topk > 1 else None
        ),
        attention_backends=backends,
        mla_target=version_topk > 1 and server_args.use_mla_backend(),
    )
    if policy is not None:
        check_shape_policy_runs(server_args, policy, version.use_spec_v2)
    if topk > 1 and not version.use_spec_v2:
        check_spec_v1_paged_tree(topk, server_args.page_size, backends, version)
    check_sliding_window_draft_extend(server_args, hf_config, version)
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


def default_tree_attention_backend(
    server_args: ServerArgs,
    default_backend: str,
    hf_config,
    *,
    spec_v2_env_enabled: bool,
    on_hopper: bool,
    encoder_decoder: bool = False,
) -> str:
    """The attention backend for a server whose user named none: `default_backend` (sglang's
    pick) unless it is flashinfer for an EAGLE-family tree on Hopper that will run spec v2 on
    TREE_DEFAULT_ATTENTION_BACKEND, which it then is (one info line says so and how to keep
    flashinfer). The shape flags must name the topk: a partial shape is completed later.
    Encoder-decoder targets keep flashinfer, whose second wrapper serves their cross
    attention."""
    topk = server_args.speculative_eagle_topk
    named = (
        server_args.prefill_attention_backend,
        server_args.decode_attention_backend,
        server_args.speculative_draft_attention_backend,
    )
    if (
        default_backend != "flashinfer"
        or not on_hopper
        or server_args.speculative_algorithm not in ("EAGLE", "EAGLE3")
        or topk is None
        or topk <= 1
        or any(b is not None for b in named)
        or encoder_decoder
    ):
        return default_backend
    version = choose_spec_version(
        topk=topk,
        # Pipeline parallelism disables the overlap scheduler later in __post_init__.
        overlap_disabled=server_args.disable_overlap_schedule
        or server_args.pp_size > 1,
        spec_v2_env_enabled=spec_v2_env_enabled,
        multi_layer=server_args.enable_multi_layer_eagle,
        recurrent_reason=recurrent_layer_reason(hf_config),
        attention_backends={TREE_DEFAULT_ATTENTION_BACKEND},
        # sglang picks flashinfer on Hopper for MHA targets only (fa3 for MLA).
        mla_target=False,
    )
    if not version.use_spec_v2:
        return default_backend
    logger.info(
        "Spec v2 tree drafting (--speculative-eagle-topk %d) on Hopper uses the %s attention "
        "backend instead of %s: as fast or faster at every batch size measured; pass "
        "--attention-backend %s to keep it.",
        topk,
        TREE_DEFAULT_ATTENTION_BACKEND,
        default_backend,
        default_backend,
    )
    return TREE_DEFAULT_ATTENTION_BACKEND
