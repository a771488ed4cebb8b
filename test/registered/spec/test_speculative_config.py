"""Config-time checks for EAGLE flags: ServerArgs completes partially given draft shapes, refuses
inconsistent ones and picks spec v1/v2 before any GPU work, on a CPU machine, with the synthetic
pair's config."""

from __future__ import annotations

import json
import re

import pytest

from specpatch.testing import synth


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    synth.make_pair(root, "toy", 0.7)
    return root / "target", root / "draft"


def server_args(pair, **spec):
    from sglang.srt.server_args import ServerArgs

    target, draft = pair
    spec.setdefault("attention_backend", "triton")
    return ServerArgs(
        model_path=str(target),
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=str(draft),
        skip_tokenizer_init=True,
        device="cuda",
        **spec,
    )


def test_topk1_with_inconsistent_draft_tokens_is_a_config_error(pair):
    with pytest.raises(
        ValueError,
        match=r"--speculative-num-draft-tokens == --speculative-num-steps \+ 1 \(4\); "
        r"got --speculative-num-draft-tokens 6",
    ):
        server_args(
            pair,
            speculative_eagle_topk=1,
            speculative_num_steps=3,
            speculative_num_draft_tokens=6,
        )


def test_topk1_derives_draft_tokens_when_unset(pair):
    args = server_args(pair, speculative_eagle_topk=1, speculative_num_steps=5)
    assert args.speculative_num_draft_tokens == 6


def test_topk1_accepts_the_consistent_value(pair):
    args = server_args(
        pair,
        speculative_eagle_topk=1,
        speculative_num_steps=3,
        speculative_num_draft_tokens=4,
    )
    assert args.speculative_num_draft_tokens == 4


# ----------------------------------------------------------------------------- tree drafting

import logging  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from sglang.srt.arg_groups import speculative_hook as hook  # noqa: E402
from sglang.srt.speculative import draft_shape  # noqa: E402
from sglang.srt.speculative.paged_tree_layout import (  # noqa: E402
    attention_page_size_of,
)


def spec_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
        and "speculative decoding because" in r.getMessage()
        or "Spec v2 (overlap scheduler)" in r.getMessage()
    ]


def test_tree_runs_spec_v2_with_page_size_1(pair, caplog):
    with caplog.at_level(logging.WARNING):
        args = server_args(
            pair,
            speculative_eagle_topk=16,
            speculative_num_steps=3,
            speculative_num_draft_tokens=32,
            page_size=1,
        )
    assert args.disable_overlap_schedule is False
    assert spec_warnings(caplog) == [
        "Spec v2 (overlap scheduler) is used for eagle speculative decoding (topk=16)."
    ]


# Tree 4,3,8 with pages of 16: what the paged-tree decisions below start from.
PAGED_TREE = dict(
    speculative_eagle_topk=4,
    speculative_num_steps=3,
    speculative_num_draft_tokens=8,
    page_size=16,
)


def test_tree_with_pages_on_fa3_spec_v1_keeps_its_pages(pair, caplog):
    """Spec v1 lays branches out in their own pages, which fa3's page table reads as they are."""
    with caplog.at_level(logging.WARNING):
        args = server_args(
            pair,
            **PAGED_TREE,
            attention_backend="fa3",
            disable_overlap_schedule=True,
        )
    assert args.disable_overlap_schedule is True
    assert spec_warnings(caplog) == [
        "Spec v1 is used for eagle speculative decoding because the overlap scheduler is "
        "disabled."
    ]
    assert attention_page_size_of(args, args.page_size) == 16


def test_user_disabled_overlap_keeps_spec_v1(pair):
    args = server_args(
        pair,
        speculative_eagle_topk=4,
        speculative_num_steps=3,
        speculative_num_draft_tokens=8,
        disable_overlap_schedule=True,
    )
    assert args.disable_overlap_schedule is True


@pytest.mark.parametrize(
    "topk,steps,tokens,match",
    [
        (
            4,
            3,
            100,
            r"--speculative-num-draft-tokens 100 is larger than the tree that --speculative-eagle-topk 4 "
            r"with --speculative-num-steps 3 can draft \(at most 37 nodes",
        ),
        (2, 1, 4, r"at most 3 nodes"),
        (4, 3, 1, r"must be >= 2 for a tree, got 1"),
        (0, 3, 4, r"--speculative-eagle-topk must be >= 1, got 0"),
        (4, 0, 4, r"--speculative-num-steps must be >= 1, got 0"),
    ],
)
def test_inconsistent_tree_shapes_are_config_errors(pair, topk, steps, tokens, match):
    with pytest.raises(ValueError, match=match):
        server_args(
            pair,
            speculative_eagle_topk=topk,
            speculative_num_steps=steps,
            speculative_num_draft_tokens=tokens,
        )


@pytest.mark.parametrize(
    "backends",
    [
        {"attention_backend": "triton"},
        {"attention_backend": "flashinfer"},
        {"attention_backend": "fa3"},
        {"attention_backend": "fa3", "speculative_draft_attention_backend": "triton"},
        # sglang's hybrid backend: FA3 decode, triton verify and draft extend
        {"attention_backend": "fa3", "prefill_attention_backend": "triton"},
    ],
    ids=[
        "triton",
        "flashinfer",
        "fa3",
        "fa3-target-triton-draft",
        "fa3-decode-triton-verify",
    ],
)
def test_tree_with_pages_runs_spec_v2_on_every_tree_backend(pair, caplog, backends):
    with caplog.at_level(logging.WARNING):
        args = server_args(pair, **PAGED_TREE, **backends)
    assert args.disable_overlap_schedule is False
    assert spec_warnings(caplog) == [
        "Spec v2 (overlap scheduler) is used for eagle speculative decoding (topk=4)."
    ]
    # fa3 reads the flat draft layout through pages of one token; the pool keeps its pages.
    assert attention_page_size_of(args, args.page_size) == 1
    assert args.page_size == 16


def test_tree_with_pages_on_triton_spec_v1_is_refused(pair):
    """Spec v1's paged triton trees produce incorrect results (upstream's refusal)."""
    with pytest.raises(
        ValueError,
        match=r"--page-size 16 runs spec v1 here \(the overlap scheduler is disabled\), "
        r"which produces incorrect results with the triton attention backend",
    ):
        server_args(
            pair,
            **PAGED_TREE,
            disable_overlap_schedule=True,
        )


def test_largest_tree_is_accepted(pair):
    args = server_args(
        pair,
        speculative_eagle_topk=2,
        speculative_num_steps=1,
        speculative_num_draft_tokens=3,
    )
    assert args.disable_overlap_schedule is False


V2 = hook.SpecVersion(True, None)
BASE = dict(
    topk=4,
    overlap_disabled=False,
    spec_v2_env_enabled=True,
    multi_layer=False,
    recurrent_reason=None,
    attention_backends={"triton"},
    mla_target=False,
)


@pytest.mark.parametrize(
    "change,use_v2,reason",
    [
        ({}, True, None),
        ({"topk": 1, "attention_backends": {"fa3"}}, True, None),
        ({"overlap_disabled": True}, False, None),
        ({"spec_v2_env_enabled": False}, False, "SGLANG_ENABLE_SPEC_V2=False"),
        ({"attention_backends": {"triton", "fa3"}}, True, None),
        (
            {
                "recurrent_reason": "the target (Qwen3NextConfig) has mamba / linear-attention layers"
            },
            False,
            "without recurrent state; the target (Qwen3NextConfig)",
        ),
        ({"multi_layer": True}, False, "multi-layer EAGLE drafts chains"),
        ({"attention_backends": {"flashinfer"}}, True, None),
        ({"attention_backends": {"triton", "flashinfer"}}, True, None),
        # an MLA target's "flashinfer" is flashinfer_mla, which has no spec-v2 trees
        (
            {"attention_backends": {"flashinfer"}, "mla_target": True},
            False,
            "needs a non-MLA target for the flashinfer attention backend: on an MLA target it runs flashinfer_mla",
        ),
        (
            {"attention_backends": {"triton", "flashinfer"}, "mla_target": True},
            False,
            "flashinfer_mla",
        ),
        (
            {"attention_backends": {"flashinfer"}, "mla_target": True, "topk": 1},
            True,
            None,
        ),
        # Hopper's default backend: v2 trees with a draft-extend CUDA graph
        ({"attention_backends": {"fa3"}}, True, None),
        ({"attention_backends": {"fa3", "flashinfer"}}, True, None),
        (
            {"attention_backends": {"fa3"}, "mla_target": True},
            False,
            "a non-MLA target for the fa3 attention backend: its MLA path has not run spec v2 trees",
        ),
        (
            {"attention_backends": {"fa3", "flashinfer"}, "mla_target": True},
            False,
            "for the fa3 attention backend: its MLA path has not run spec v2 trees on a GPU; a non-MLA target "
            "for the flashinfer attention backend",
        ),
        (
            {"attention_backends": {"fa3", "aiter"}},
            False,
            "an attention backend in ['fa3', 'flashinfer', 'triton'], got aiter",
        ),
    ],
)
def test_spec_version_decision_table(change, use_v2, reason):
    version = hook.choose_spec_version(**{**BASE, **change})
    assert version.use_spec_v2 is use_v2
    if reason is None:
        assert version.spec_v1_reason is None
    else:
        assert reason in version.spec_v1_reason


def _hook_args(mla_target=False, **overrides):
    """What handle_eagle_family reads from ServerArgs, as a plain namespace."""
    return SimpleNamespace(
        **{
            **dict(
                speculative_eagle_topk=4,
                speculative_num_steps=3,
                speculative_num_draft_tokens=8,
                page_size=1,
                attention_backend="triton",
                decode_attention_backend=None,
                prefill_attention_backend=None,
                speculative_draft_attention_backend=None,
                speculative_attention_mode="prefill",
                disable_overlap_schedule=False,
                enable_multi_layer_eagle=False,
                enable_dp_attention=False,
                disable_cuda_graph=False,
                speculative_algorithm="EAGLE",
                use_mla_backend=lambda: mla_target,
            ),
            **overrides,
        }
    )


def _dp_attention_args(**overrides):
    return _hook_args(
        **{"enable_dp_attention": True, "speculative_algorithm": "EAGLE3", **overrides}
    )


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "fa3"])
def test_dp_attention_tree_runs_spec_v2(caplog, backend):
    # GPU: test_tree_v2_eagle3_gpu.py::test_tree_v2_with_dp_attention_and_an_idle_rank[backend]
    server_args = _dp_attention_args(attention_backend=backend)
    with caplog.at_level(logging.WARNING):
        hook.handle_eagle_family(
            server_args, SimpleNamespace(), spec_v2_env_enabled=True
        )
    assert server_args.disable_overlap_schedule is False
    [message] = spec_warnings(caplog)
    assert message.startswith("Spec v2")


@pytest.mark.parametrize("overlap_disabled", [False, True], ids=["spec-v2", "spec-v1"])
def test_dp_attention_tree_without_cuda_graphs_is_refused(overlap_disabled):
    server_args = _dp_attention_args(
        disable_cuda_graph=True, disable_overlap_schedule=overlap_disabled
    )
    with pytest.raises(
        ValueError,
        match=r"--speculative-eagle-topk 4 with --enable-dp-attention needs CUDA graphs",
    ):
        hook.handle_eagle_family(
            server_args, SimpleNamespace(), spec_v2_env_enabled=True
        )


def test_dp_attention_chain_without_cuda_graphs_is_left_to_upstream():
    server_args = _dp_attention_args(
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=None,
        disable_cuda_graph=True,
    )
    hook.handle_eagle_family(server_args, SimpleNamespace(), spec_v2_env_enabled=True)
    assert (
        server_args.disable_overlap_schedule is False
        and server_args.speculative_num_draft_tokens == 4
    )


def test_recurrent_targets_are_recognised():
    class Qwen3NextConfig:
        pass

    assert "Qwen3NextConfig" in hook.recurrent_layer_reason(Qwen3NextConfig())
    hybrid = SimpleNamespace(layer_types=["full_attention", "linear_attention"])
    assert (
        hook.recurrent_layer_reason(hybrid)
        == "the target has linear_attention layers (layer_types)"
    )
    assert (
        hook.recurrent_layer_reason(
            SimpleNamespace(layer_types=["full_attention", "sliding_attention"])
        )
        is None
    )


@pytest.mark.parametrize(
    "topk,steps,expected", [(2, 1, 3), (4, 3, 37), (16, 5, 1 + 16 + 4 * 256), (1, 5, 6)]
)
def test_max_tree_draft_tokens(topk, steps, expected):
    assert draft_shape.max_tree_draft_tokens(topk, steps) == expected


def test_server_args_refuse_a_dp_attention_tree_without_cuda_graphs(pair):
    # ServerArgs.__post_init__ reaches the hook; nothing has touched a GPU yet
    with pytest.raises(ValueError, match=r"--enable-dp-attention needs CUDA graphs"):
        server_args(
            pair,
            speculative_eagle_topk=4,
            speculative_num_steps=3,
            speculative_num_draft_tokens=8,
            tp_size=2,
            dp_size=2,
            enable_dp_attention=True,
            disable_cuda_graph=True,
        )


# ----------------------------------------------------------------------------- backends in play


@pytest.mark.parametrize(
    "backends,use_v2,reason",
    [
        # the draft worker runs draft decode and draft extend on --speculative-draft-attention-backend
        (
            dict(
                attention_backend="triton", speculative_draft_attention_backend="aiter"
            ),
            False,
            "got aiter",
        ),
        (
            dict(
                attention_backend="aiter", speculative_draft_attention_backend="triton"
            ),
            False,
            "got aiter",
        ),
        (
            dict(
                attention_backend="triton", speculative_draft_attention_backend="triton"
            ),
            True,
            None,
        ),
        (
            dict(
                attention_backend="flashinfer",
                speculative_draft_attention_backend="triton",
            ),
            True,
            None,
        ),
        (
            dict(attention_backend="flashinfer", mla_target=True),
            False,
            "it runs flashinfer_mla",
        ),
        (
            dict(
                attention_backend="triton",
                speculative_draft_attention_backend="flashinfer",
                mla_target=True,
            ),
            False,
            "it runs flashinfer_mla",
        ),
        (dict(attention_backend="triton", mla_target=True), True, None),
    ],
    ids=[
        "draft-aiter",
        "target-aiter",
        "draft-triton",
        "flashinfer-draft-triton",
        "flashinfer-mla",
        "draft-flashinfer-mla",
        "triton-mla",
    ],
)
def test_hook_decides_on_every_backend_in_play(backends, use_v2, reason, caplog):
    server_args = _hook_args(**backends)
    with caplog.at_level(logging.WARNING):
        hook.handle_eagle_family(
            server_args, SimpleNamespace(), spec_v2_env_enabled=True
        )
    assert server_args.disable_overlap_schedule is (not use_v2)
    [message] = spec_warnings(caplog)
    if use_v2:
        assert (
            message
            == "Spec v2 (overlap scheduler) is used for eagle speculative decoding (topk=4)."
        )
    else:
        assert message.startswith(
            "Spec v1 is used for eagle speculative decoding because spec v2 tree drafting"
        )
        assert reason in message


@pytest.mark.parametrize(
    "backends,use_v2,reason",
    [
        (
            dict(attention_backend="triton", speculative_draft_attention_backend="fa3"),
            True,
            None,
        ),
        (
            dict(attention_backend="fa3", speculative_draft_attention_backend="triton"),
            True,
            None,
        ),
        (
            dict(
                attention_backend="triton",
                speculative_draft_attention_backend="torch_native",
            ),
            False,
            "got torch_native",
        ),
        (dict(attention_backend="flashinfer"), True, None),
    ],
    ids=["draft-fa3", "target-fa3", "draft-torch-native", "flashinfer"],
)
def test_server_args_decide_on_the_draft_backend_too(
    pair, backends, use_v2, reason, caplog
):
    with caplog.at_level(logging.WARNING):
        args = server_args(
            pair,
            speculative_eagle_topk=4,
            speculative_num_steps=3,
            speculative_num_draft_tokens=8,
            page_size=1,
            **backends,
        )
    assert args.disable_overlap_schedule is (not use_v2)
    [message] = spec_warnings(caplog)
    assert message.startswith("Spec v2" if use_v2 else "Spec v1")
    if reason is not None:
        assert reason in message


def test_paged_tree_with_a_triton_draft_backend_on_spec_v1_is_refused(pair):
    """A paged tree that lands on spec v1 (overlap disabled here) with a triton draft is wrong."""
    with pytest.raises(
        ValueError,
        match=r"--page-size 16 runs spec v1 here \(the overlap scheduler is disabled\), "
        r"which produces incorrect results with the triton attention backend",
    ):
        server_args(
            pair,
            **PAGED_TREE,
            attention_backend="fa3",
            speculative_draft_attention_backend="triton",
            disable_overlap_schedule=True,
        )


# ----------------------------------------------------------------------------- default backend

MAMBA_TARGET = SimpleNamespace(layers_block_type=["attention", "mamba"])
MISSION_LOG = (
    "Spec v2 tree drafting (--speculative-eagle-topk 16) on Hopper uses the triton "
    "attention backend instead of flashinfer: as fast or faster at every batch size "
    "measured; pass --attention-backend flashinfer to keep it."
)


def _default_backend_args(**overrides):
    """The mission command's flags as _handle_attention_backend_compatibility sees them: no
    backend named, shape flags as given (topk 16 alone)."""
    return _hook_args(
        **{
            "attention_backend": None,
            "speculative_eagle_topk": 16,
            "speculative_num_steps": None,
            "speculative_num_draft_tokens": None,
            "pp_size": 1,
            **overrides,
        }
    )


def _decide_default_backend(
    default="flashinfer",
    hf_config=SimpleNamespace(),
    spec_v2_env_enabled=True,
    on_hopper=True,
    encoder_decoder=False,
    **overrides,
) -> str:
    """default_tree_attention_backend on the mission command's flags with `overrides`, as on
    an H100 where sglang just picked `default`."""
    return hook.default_tree_attention_backend(
        _default_backend_args(**overrides),
        default,
        hf_config,
        spec_v2_env_enabled=spec_v2_env_enabled,
        on_hopper=on_hopper,
        encoder_decoder=encoder_decoder,
    )


@pytest.mark.parametrize(
    "case,expected",
    [
        pytest.param({}, "triton", id="mission-command"),
        pytest.param(dict(speculative_algorithm="EAGLE3"), "triton", id="eagle3"),
        # Not measured off Hopper: sglang's pick stays.
        pytest.param(dict(on_hopper=False), "flashinfer", id="not-hopper"),
        # sglang's pick is not flashinfer (topk 1 on Hopper: fa3; attention sinks: triton).
        pytest.param(dict(default="fa3"), "fa3", id="sglang-picked-fa3"),
        pytest.param(dict(speculative_eagle_topk=1), "flashinfer", id="chain"),
        # Partial shape without topk: completed later, sglang's pick stays.
        pytest.param(
            dict(speculative_eagle_topk=None, speculative_num_draft_tokens=32),
            "flashinfer",
            id="topk-unset",
        ),
        pytest.param(
            dict(speculative_algorithm="STANDALONE"), "flashinfer", id="standalone"
        ),
        # A backend named for any phase or for the draft is the user's choice.
        pytest.param(
            dict(decode_attention_backend="flashinfer"),
            "flashinfer",
            id="decode-backend-named",
        ),
        pytest.param(
            dict(prefill_attention_backend="fa3"),
            "flashinfer",
            id="prefill-backend-named",
        ),
        pytest.param(
            dict(speculative_draft_attention_backend="flashinfer"),
            "flashinfer",
            id="draft-backend-named",
        ),
        # Trees that will run spec v1 anyway keep flashinfer (whose v1 trees are right).
        pytest.param(
            dict(disable_overlap_schedule=True), "flashinfer", id="overlap-disabled"
        ),
        pytest.param(
            dict(spec_v2_env_enabled=False), "flashinfer", id="spec-v2-env-off"
        ),
        pytest.param(dict(pp_size=2), "flashinfer", id="pipeline-parallel"),
        pytest.param(
            dict(enable_multi_layer_eagle=True), "flashinfer", id="multi-layer"
        ),
        pytest.param(dict(hf_config=MAMBA_TARGET), "flashinfer", id="recurrent-target"),
        # Their cross attention runs on flashinfer's second wrapper.
        pytest.param(dict(encoder_decoder=True), "flashinfer", id="encoder-decoder"),
    ],
)
def test_default_tree_attention_backend_table(case, expected, caplog):
    with caplog.at_level(logging.INFO):
        got = _decide_default_backend(**case)
    assert got == expected
    said = [r.getMessage() for r in caplog.records if "instead of" in r.getMessage()]
    assert said == ([MISSION_LOG] if expected == "triton" else [])


@pytest.fixture
def hopper_with_flashinfer(monkeypatch):
    """sglang's default-backend inputs as on an H100 with flashinfer installed."""
    import sglang.srt.server_args as upstream

    monkeypatch.setattr(upstream, "is_hopper_with_cuda_12_3", lambda: True)
    monkeypatch.setattr(upstream, "is_flashinfer_available", lambda: True)


def test_mission_command_gets_triton_spec_v2_trees_on_hopper(
    pair, hopper_with_flashinfer
):
    # GPU: test_eagle_engine_gpu.py::test_mission_command_runs_spec_v2_trees_on_default_flags
    args = server_args(
        pair, attention_backend=None, speculative_eagle_topk=16, page_size=1
    )
    assert args.attention_backend == "triton"
    assert args.disable_overlap_schedule is False
    shape = (
        args.speculative_eagle_topk,
        args.speculative_num_steps,
        args.speculative_num_draft_tokens,
    )
    assert shape == (16, 3, 32)


@pytest.mark.parametrize(
    "flags,backend,spec_v2",
    [
        # The user's backend stays, on spec v2.
        (dict(attention_backend="flashinfer"), "flashinfer", True),
        # sglang's pick for a chain on Hopper is untouched.
        (dict(speculative_eagle_topk=1), "fa3", True),
        # A tree on spec v1 keeps sglang's flashinfer.
        (dict(disable_overlap_schedule=True), "flashinfer", False),
    ],
    ids=["named-flashinfer", "chain-fa3", "spec-v1-tree"],
)
def test_other_hopper_servers_keep_their_backend(
    pair, hopper_with_flashinfer, flags, backend, spec_v2
):
    args = server_args(
        pair, **{"attention_backend": None, "speculative_eagle_topk": 16, **flags}
    )
    assert args.attention_backend == backend
    assert args.disable_overlap_schedule is (not spec_v2)


# ----------------------------------------------------------------------------- shape completion

TOPK, STEPS, TOKENS = (
    "--speculative-eagle-topk",
    "--speculative-num-steps",
    "--speculative-num-draft-tokens",
)

# (topk, num_steps, num_draft_tokens) given (None: unset) -> the completed shape
COMPLETIONS = [
    # topk alone: a chain of 3 steps, or 3 steps and 2k tokens (the benchmarked trees)
    ((1, None, None), (1, 3, 4)),
    ((2, None, None), (2, 3, 4)),
    ((4, None, None), (4, 3, 8)),
    ((8, None, None), (8, 3, 16)),
    ((16, None, None), (16, 3, 32)),
    # steps alone: a chain
    ((None, 5, None), (1, 5, 6)),
    # topk and steps
    ((1, 5, None), (1, 5, 6)),
    ((4, 3, None), (4, 3, 8)),
    ((4, 12, None), (4, 12, 13)),  # steps + 1 > 2k
    ((2, 1, None), (2, 1, 3)),  # the whole tree (1 + topk) < 2k
    # topk and tokens
    ((1, None, 6), (1, 5, 6)),
    ((4, None, 20), (4, 3, 20)),
    ((4, None, 38), (4, 4, 38)),  # 3 steps hold 37
    ((2, None, 20), (2, 6, 20)),  # 5 steps hold 19
    # steps and tokens: only a chain
    ((None, 3, 4), (1, 3, 4)),
]


def _completion_lines(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if "draft shape completed" in r.getMessage()
    ]


def _expected_line(given, shape) -> str:
    return "EAGLE draft shape completed: " + " ".join(
        f"{flag} {value}" + (" (derived)" if g is None else "")
        for flag, g, value in zip((TOPK, STEPS, TOKENS), given, shape)
    )


# All three set, or none (upstream's auto_choose_speculative_params, which picks (5, 4, 8) for a
# Llama target): nothing is completed, so nothing is logged.
UNCOMPLETED = [
    ((4, 3, 8), (4, 3, 8)),
    ((1, 2, 3), (1, 2, 3)),
    ((None, None, None), (4, 5, 8)),
]


@pytest.mark.parametrize(
    "given,expected",
    COMPLETIONS + UNCOMPLETED,
    ids=[str(g) for g, _ in COMPLETIONS + UNCOMPLETED],
)
def test_server_args_complete_a_partial_shape(pair, given, expected, caplog):
    topk, steps, tokens = given
    with caplog.at_level(logging.INFO):
        args = server_args(
            pair,
            speculative_eagle_topk=topk,
            speculative_num_steps=steps,
            speculative_num_draft_tokens=tokens,
        )
    assert (
        args.speculative_eagle_topk,
        args.speculative_num_steps,
        args.speculative_num_draft_tokens,
    ) == expected
    partial = (given, expected) not in UNCOMPLETED
    assert _completion_lines(caplog) == (
        [_expected_line(given, expected)] if partial else []
    )


REFUSED = [
    (
        (None, None, 8),
        r"--speculative-num-draft-tokens 8 alone does not give the draft's shape: set "
        r"--speculative-eagle-topk \(1 for a chain of 7 steps, or > 1 for a tree\)",
    ),
    ((None, 3, 8), r"a tree's width cannot be derived: set --speculative-eagle-topk"),
    ((1, None, 1), r"--speculative-num-draft-tokens must be >= 2 for a chain"),
    ((0, None, None), r"--speculative-eagle-topk must be >= 1, got 0"),
    ((-1, 3, None), r"--speculative-eagle-topk must be >= 1, got -1"),
    ((None, 0, None), r"--speculative-num-steps must be >= 1, got 0"),
    ((4, 0, None), r"--speculative-num-steps must be >= 1, got 0"),
    ((None, 0, 5), r"--speculative-num-steps must be >= 1, got 0"),
    ((None, None, 0), r"--speculative-num-draft-tokens must be >= 1, got 0"),
    ((4, None, 0), r"--speculative-num-draft-tokens must be >= 1, got 0"),
    ((4, None, 1), r"--speculative-num-draft-tokens must be >= 2 for a tree, got 1"),
    ((4, None, 1025), r"--speculative-num-draft-tokens must be <= 1024, got 1025"),
    ((16, 5, 1025), r"--speculative-num-draft-tokens must be <= 1024, got 1025"),
    (
        (None, 1024, None),
        r"--speculative-num-draft-tokens must be <= 1024, got 1025 \(a chain of --speculative-num-steps 1024\)",
    ),
    (
        (1, None, 1025),
        r"--speculative-num-draft-tokens must be <= 1024, got 1025 \(a chain of --speculative-num-steps 1024\)",
    ),
    (
        (1, 3, 5),
        r"--speculative-num-draft-tokens == --speculative-num-steps \+ 1 \(4\)",
    ),
]


@pytest.mark.parametrize("given,match", REFUSED, ids=[str(g) for g, _ in REFUSED])
def test_server_args_refuse_what_cannot_be_completed(pair, given, match, caplog):
    topk, steps, tokens = given
    with caplog.at_level(logging.INFO), pytest.raises(ValueError, match=match):
        server_args(
            pair,
            speculative_eagle_topk=topk,
            speculative_num_steps=steps,
            speculative_num_draft_tokens=tokens,
        )
    assert _completion_lines(caplog) == []


def test_largest_draft_token_count_is_accepted(pair):
    # 1 + 16 + 4 * 256 = 1041 nodes can be drafted; sgl_kernel's tree build takes 1024
    args = server_args(
        pair,
        speculative_eagle_topk=16,
        speculative_num_steps=5,
        speculative_num_draft_tokens=1024,
    )
    assert (
        args.speculative_num_draft_tokens == 1024
        and args.disable_overlap_schedule is False
    )


@pytest.mark.parametrize("attention_backend", ["triton", "flashinfer"])
def test_mission_command_topk_alone_runs_a_spec_v2_tree(
    pair, attention_backend, caplog
):
    # launch_server --speculative-eagle-topk 16 --page-size 1: upstream's bare AssertionError
    with caplog.at_level(logging.WARNING):
        args = server_args(
            pair,
            speculative_eagle_topk=16,
            page_size=1,
            attention_backend=attention_backend,
        )
    assert (
        args.speculative_eagle_topk,
        args.speculative_num_steps,
        args.speculative_num_draft_tokens,
    ) == (16, 3, 32)
    assert args.disable_overlap_schedule is False
    assert spec_warnings(caplog) == [
        "Spec v2 (overlap scheduler) is used for eagle speculative decoding (topk=16)."
    ]
    assert _completion_lines(caplog) == [
        "EAGLE draft shape completed: --speculative-eagle-topk 16 --speculative-num-steps 3 (derived) "
        "--speculative-num-draft-tokens 32 (derived)"
    ]


def test_shape_flags_help_says_unset_values_are_derived():
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert "those unset are derived from those set" in helps[STEPS]
    assert "Derived when unset" in helps[TOPK] and "Derived when unset" in helps[TOKENS]
    assert "at most 1024" in helps[TOKENS]


def test_shape_flags_help_states_the_rules_the_hook_enforces():
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    helps = {
        a.option_strings[0]: " ".join(a.help.split())
        for a in parser._actions
        if a.option_strings
    }
    # check_at_least_one
    assert "(>= 1)" in helps[STEPS] and "(>= 1;" in helps[TOPK]
    # complete_shape's rules, with the values COMPLETIONS and REFUSED pin
    for rule in (
        "topk 1 alone: a chain of 3 steps",
        "topk k > 1 alone: 3 steps and min(2k, 1024) draft tokens",
        "steps alone: a chain (topk 1)",
        "max(2k, steps + 1) for a tree (capped by the tree's size and 1024)",
        "3 for a tree or the fewest whose tree holds the tokens",
        "Tokens without topk are refused unless steps is set and tokens == steps + 1",
    ):
        assert rule in helps[STEPS], rule
    # check_chain_shape, check_tree_shape / max_tree_draft_tokens, check_draft_token_cap
    assert "exactly steps + 1 for a chain" in helps[TOKENS]
    assert "2 to 1 + topk + (steps - 1) * topk^2; at most 1024" in helps[TOKENS]
    # check_draft_model_given, check_draft_model_path
    assert (
        "required unless the target has draft (MTP) layers"
        in helps["--speculative-draft-model-path"]
    )


# ----------------------------------------------------------------------------- complete_shape (pure)


def _no_auto():
    raise AssertionError("auto-choice runs only when no shape flag is set")


@pytest.mark.parametrize(
    "given,expected", COMPLETIONS, ids=[str(g) for g, _ in COMPLETIONS]
)
def test_complete_shape_table(given, expected):
    shape = draft_shape.complete_shape(*given, auto=_no_auto)
    assert (shape.topk, shape.num_steps, shape.num_draft_tokens) == expected
    assert shape.derived == tuple(
        flag for flag, g in zip((TOPK, STEPS, TOKENS), given) if g is None
    )
    assert shape.auto_chosen is False


@pytest.mark.parametrize(
    "given,expected",
    [
        ((600, None, None), (600, 3, 1024)),  # 2k capped by sgl_kernel's tree build
        ((600, 2, None), (600, 2, 1024)),
        ((3, 2, None), (3, 2, 6)),
        ((2, None, 1000), (2, 251, 1000)),  # 250 steps hold 999
        ((16, None, 1024), (16, 5, 1024)),  # 4 steps hold 785
        ((2, 1, 3), (2, 1, 3)),
    ],
)
def test_complete_shape_caps_and_smallest_steps(given, expected):
    shape = draft_shape.complete_shape(*given, auto=_no_auto)
    assert (shape.topk, shape.num_steps, shape.num_draft_tokens) == expected
    topk, steps, tokens = expected
    if given[1] is None and topk > 1 and steps > draft_shape.DEFAULT_TREE_STEPS:
        assert (
            draft_shape.max_tree_draft_tokens(topk, steps - 1)
            < tokens
            <= draft_shape.max_tree_draft_tokens(topk, steps)
        )


def test_complete_shape_auto_chooses_only_when_nothing_is_set():
    calls = []

    def auto():
        calls.append(1)
        return 5, 4, 8  # (num_steps, topk, num_draft_tokens), upstream's order

    shape = draft_shape.complete_shape(None, None, None, auto=auto)
    assert shape == draft_shape.DraftShape(
        4, 5, 8, derived=(), auto_chosen=True
    ) and calls == [1]
    full = draft_shape.complete_shape(4, 5, 8, auto=_no_auto)
    assert full == draft_shape.DraftShape(4, 5, 8, derived=(), auto_chosen=False)


VALUES = [None, -1, 0, 1, 2, 3, 4, 16, 1024, 1025]


@pytest.mark.parametrize("topk", VALUES)
def test_complete_shape_returns_a_valid_shape_or_a_value_error_naming_a_flag(topk):
    for steps in VALUES:
        for tokens in VALUES:
            given = (topk, steps, tokens)
            if given == (None, None, None):
                continue
            try:
                shape = draft_shape.complete_shape(*given, auto=_no_auto)
            except ValueError as error:
                assert any(flag in str(error) for flag in (TOPK, STEPS, TOKENS)), (
                    given,
                    error,
                )
                continue
            completed = (shape.topk, shape.num_steps, shape.num_draft_tokens)
            assert all(g is None or g == c for g, c in zip(given, completed)), (
                given,
                completed,
            )
            draft_shape.check_shape(*completed)
            assert shape.num_draft_tokens <= draft_shape.MAX_DRAFT_TOKENS


def test_complete_eagle_shape_sets_the_fields_and_logs_once(caplog):
    args = SimpleNamespace(
        speculative_eagle_topk=None,
        speculative_num_steps=4,
        speculative_num_draft_tokens=None,
        speculative_algorithm="EAGLE3",
    )
    with caplog.at_level(logging.INFO):
        hook.complete_eagle_shape(args, auto_choose=lambda server_args: _no_auto())
    assert (
        args.speculative_eagle_topk,
        args.speculative_num_steps,
        args.speculative_num_draft_tokens,
    ) == (1, 4, 5)
    assert _completion_lines(caplog) == [
        "EAGLE3 draft shape completed: --speculative-eagle-topk 1 (derived) --speculative-num-steps 4 "
        "--speculative-num-draft-tokens 5 (derived)"
    ]


def test_complete_eagle_shape_passes_server_args_to_auto_choose():
    args = SimpleNamespace(
        speculative_eagle_topk=None,
        speculative_num_steps=None,
        speculative_num_draft_tokens=None,
        speculative_algorithm="STANDALONE",
    )
    seen = []
    hook.complete_eagle_shape(
        args, auto_choose=lambda server_args: seen.append(server_args) or (3, 1, 4)
    )
    assert seen == [args]
    assert (
        args.speculative_eagle_topk,
        args.speculative_num_steps,
        args.speculative_num_draft_tokens,
    ) == (1, 3, 4)


# ----------------------------------------------------------------------------- sliding-window MTP


def _step3p5_config(mtp_layer_type: str = "sliding_attention") -> SimpleNamespace:
    """What mtp_sliding_window_reason reads of a Step-3.5 config: layer_types lists the MTP
    layers after the num_hidden_layers decoder layers."""
    return SimpleNamespace(
        architectures=["Step3p5ForCausalLM"],
        num_hidden_layers=45,
        layer_types=["full_attention", "sliding_attention"] * 22
        + ["full_attention"]
        + [mtp_layer_type] * 3,
    )


@pytest.mark.parametrize(
    "config,expected",
    [
        (_step3p5_config(), "layer_types[45:]"),
        (_step3p5_config("full_attention"), None),
        # MiMoV2's MTP block is sliding-window whatever its config lists
        (SimpleNamespace(architectures=["MiMoV2ForCausalLM"]), "MiMoV2ForCausalLM"),
        # layer_types covering the decoder layers only: nothing said about MTP layers
        (
            SimpleNamespace(
                architectures=["X"],
                num_hidden_layers=2,
                layer_types=["sliding_attention"] * 2,
            ),
            None,
        ),
        (SimpleNamespace(), None),
    ],
    ids=["step3p5", "full-mtp", "mimo-v2", "decoder-only-types", "no-config"],
)
def test_mtp_sliding_window_reason(config, expected):
    reason = hook.mtp_sliding_window_reason(config)
    if expected is None:
        assert reason is None
    else:
        assert expected in reason


def _mtp_args(**overrides):
    return _hook_args(
        **{
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 4,
            "enable_multi_layer_eagle": True,
            **overrides,
        }
    )


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            dict(),
            r"spec v2's draft-extend CUDA graphs .* comes from --attention-backend",
        ),
        (
            dict(disable_overlap_schedule=True),
            r"spec v1's draft extend \(spec v1 runs because the overlap scheduler is "
            r"disabled\)",
        ),
        (
            dict(disable_overlap_schedule=True, disable_cuda_graph=True),
            r"spec v1's draft extend",
        ),
        (
            dict(attention_backend="fa3", speculative_draft_attention_backend="triton"),
            r"comes from --speculative-draft-attention-backend triton\)\. Use "
            r"--speculative-draft-attention-backend fa3",
        ),
        (
            dict(attention_backend="fa3", prefill_attention_backend="triton"),
            r"comes from --prefill-attention-backend triton",
        ),
    ],
    ids=["v2-graphs", "v1-graphs", "v1-eager", "draft-backend", "prefill-backend"],
)
def test_triton_draft_extend_of_a_sliding_window_mtp_draft_is_refused(overrides, match):
    # GPU, spec v2 with CUDA graphs: triton failed to compile its extend kernel, whose
    # sliding-window KV indices were None, while capturing the draft-extend graph.
    with pytest.raises(ValueError, match=match):
        hook.handle_eagle_family(
            _mtp_args(**overrides), _step3p5_config(), spec_v2_env_enabled=True
        )


@pytest.mark.parametrize(
    "overrides,config",
    [
        # spec v2's eager draft extend is planned as a plain extend, which builds the window
        # (GPU: test_multi_layer_eagle_gpu.py [triton-v2-eager])
        (dict(disable_cuda_graph=True), _step3p5_config()),
        (dict(attention_backend="fa3"), _step3p5_config()),
        # the triton target keeps its graphs; the draft extends on fa3
        (dict(speculative_draft_attention_backend="fa3"), _step3p5_config()),
        # speculative_attention_mode decode: the draft extend runs the decode backend
        (
            dict(
                prefill_attention_backend="triton",
                decode_attention_backend="fa3",
                speculative_attention_mode="decode",
            ),
            _step3p5_config(),
        ),
        (dict(), _step3p5_config("full_attention")),
        (dict(enable_multi_layer_eagle=False), _step3p5_config()),
    ],
    ids=[
        "v2-eager",
        "fa3",
        "draft-fa3",
        "decode-mode-fa3",
        "full-attention-mtp",
        "single-layer-draft",
    ],
)
def test_sliding_window_mtp_draft_extend_runs_where_it_can(overrides, config):
    server_args = _mtp_args(**overrides)
    hook.handle_eagle_family(server_args, config, spec_v2_env_enabled=True)
    assert server_args.disable_overlap_schedule is False


@pytest.fixture(scope="module")
def step3p5_config_dir(tmp_path_factory):
    """The synthetic Step-3.5 MTP checkpoint's config.json alone: ServerArgs reads no weights."""
    import json
    from dataclasses import replace

    from specpatch.testing import synth_mtp

    spec = replace(synth.PRESETS["toy"], num_layers=synth_mtp.NUM_TARGET_LAYERS)
    root = tmp_path_factory.mktemp("step3p5")
    (root / "config.json").write_text(json.dumps(synth_mtp.step3p5_config(spec, 3)))
    return root


def step3p5_server_args(model_dir, **flags):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=str(model_dir),
        speculative_algorithm="EAGLE",
        speculative_eagle_topk=1,
        speculative_num_steps=3,
        speculative_num_draft_tokens=4,
        skip_tokenizer_init=True,
        device="cuda",
        **flags,
    )


def test_server_args_refuse_the_triton_graph_case_of_the_mtp_gpu_test(
    step3p5_config_dir,
):
    with pytest.raises(ValueError, match=r"spec v2's draft-extend CUDA graphs"):
        step3p5_server_args(step3p5_config_dir, attention_backend="triton")


@pytest.mark.parametrize(
    "flags",
    [
        dict(attention_backend="triton", disable_cuda_graph=True),
        dict(attention_backend="fa3"),
        dict(attention_backend="fa3", disable_overlap_schedule=True),
    ],
    ids=["triton-v2-eager", "fa3-v2-graph", "fa3-v1-graph"],
)
def test_server_args_accept_the_mtp_gpu_test_cases(step3p5_config_dir, flags):
    args = step3p5_server_args(step3p5_config_dir, **flags)
    assert args.enable_multi_layer_eagle


# ----------------------------------------------------------------------------- shape policy


def _policy_args(tmp_path, shapes, **overrides):
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps({"shapes": shapes}))
    return _hook_args(
        **{
            "speculative_adaptive": True,
            "speculative_adaptive_config": str(path),
            "enable_two_batch_overlap": False,
            "enable_pdmux": False,
            **overrides,
        }
    )


def test_a_shape_policy_chooses_the_version_for_its_widest_tree(tmp_path, caplog):
    """The flags' chain alone would run spec v2 on any backend; the set's tree decides."""
    args = _policy_args(
        tmp_path,
        ["1,3,4", "16,3,32"],
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        attention_backend="flashinfer",
    )
    with caplog.at_level(logging.WARNING):
        hook.handle_eagle_family(args, SimpleNamespace(), spec_v2_env_enabled=True)
    assert args.disable_overlap_schedule is False

    args = _policy_args(
        tmp_path,
        ["1,3,4", "16,3,32"],
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        enable_multi_layer_eagle=True,
    )
    with pytest.raises(ValueError, match="needs spec v2"):
        hook.handle_eagle_family(args, SimpleNamespace(), spec_v2_env_enabled=True)


@pytest.mark.parametrize(
    "shapes,overrides,match",
    [
        (["16,3,32", "1,3,4"], {}, r"own shape 4,3,8 .* must be one of"),
        (
            ["4,3,8", "16,1,32"],
            {},
            r"shape 16,1,32: --speculative-num-draft-tokens 32 is larger",
        ),
        (["4,3,8", "1,3,4"], {"disable_overlap_schedule": True}, "needs spec v2"),
        (
            ["4,3,8", "1,3,4"],
            {"enable_dp_attention": True, "speculative_algorithm": "EAGLE3"},
            "needs no --enable-dp-attention",
        ),
        (
            ["4,3,8", "1,3,4"],
            {"speculative_algorithm": "STANDALONE"},
            "EAGLE or EAGLE3",
        ),
        (["4,3,8", "1,3,4"], {"tp_size": 2}, r'needs "step_costs" with --tp-size 2'),
    ],
)
def test_shape_policies_that_cannot_run_are_refused_at_start_up(
    tmp_path, shapes, overrides, match
):
    args = _policy_args(tmp_path, shapes, **overrides)
    with pytest.raises(ValueError, match="--speculative-adaptive-config") as err:
        hook.handle_eagle_family(args, SimpleNamespace(), spec_v2_env_enabled=True)
    assert re.search(match, str(err.value)), str(err.value)


def test_server_args_keep_a_tree_policy_adaptive(pair, tmp_path):
    """Upstream turns --speculative-adaptive off for topk != 1; a shape policy keeps it, and
    the scheduler reserves KV for the set's largest shape."""
    from sglang.srt.managers.utils import get_alloc_len_per_decode
    from sglang.srt.speculative import shape_runtime

    shape_runtime._cached_policy.cache_clear()
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps({"shapes": ["4,3,8", "16,3,32"]}))
    args = server_args(
        pair,
        speculative_eagle_topk=4,
        speculative_num_steps=3,
        speculative_num_draft_tokens=8,
        speculative_adaptive=True,
        speculative_adaptive_config=str(path),
    )
    assert args.speculative_adaptive is True
    assert args.disable_overlap_schedule is False
    assert get_alloc_len_per_decode(args) == 48  # 16 x 3, not the running 4 x 3


def test_a_shape_policy_with_given_step_costs_runs_tensor_parallel(tmp_path):
    path = tmp_path / "adaptive.json"
    costs = {"4,3,8": {"1": 0.004}, "1,3,4": {"1": 0.003}}
    path.write_text(json.dumps({"shapes": ["4,3,8", "1,3,4"], "step_costs": costs}))
    args = _hook_args(
        speculative_adaptive=True,
        speculative_adaptive_config=str(path),
        enable_two_batch_overlap=False,
        enable_pdmux=False,
        tp_size=2,
    )
    hook.handle_eagle_family(args, SimpleNamespace(), spec_v2_env_enabled=True)
    assert args.disable_overlap_schedule is False
