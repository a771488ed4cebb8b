"""Config-time checks for EAGLE flags: ServerArgs refuses inconsistent chain shapes before any
GPU work, on a CPU machine, with the synthetic pair's config."""

from __future__ import annotations

import pytest

from specpatch import synth


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    synth.make_pair(root, "toy", 0.7)
    return root / "target", root / "draft"


def server_args(pair, **spec):
    from sglang.srt.server_args import ServerArgs

    target, draft = pair
    spec.setdefault("attention_backend", "triton")
    return ServerArgs(model_path=str(target), speculative_algorithm="EAGLE", speculative_draft_model_path=str(draft),
                      skip_tokenizer_init=True, device="cuda", **spec)


def test_topk1_with_inconsistent_draft_tokens_is_a_config_error(pair):
    with pytest.raises(ValueError, match=r"--speculative-num-draft-tokens == --speculative-num-steps \+ 1 \(4\); "
                                         r"got --speculative-num-draft-tokens 6"):
        server_args(pair, speculative_eagle_topk=1, speculative_num_steps=3, speculative_num_draft_tokens=6)


def test_topk1_derives_draft_tokens_when_unset(pair):
    args = server_args(pair, speculative_eagle_topk=1, speculative_num_steps=5)
    assert args.speculative_num_draft_tokens == 6


def test_topk1_accepts_the_consistent_value(pair):
    args = server_args(pair, speculative_eagle_topk=1, speculative_num_steps=3, speculative_num_draft_tokens=4)
    assert args.speculative_num_draft_tokens == 4


# ----------------------------------------------------------------------------- tree drafting

import logging  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from sglang.srt.arg_groups import speculative_hook as hook  # noqa: E402


def spec_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "speculative decoding because" in r.getMessage()
            or "Spec v2 (overlap scheduler)" in r.getMessage()]


def test_tree_runs_spec_v2_with_page_size_1(pair, caplog):
    with caplog.at_level(logging.WARNING):
        args = server_args(pair, speculative_eagle_topk=16, speculative_num_steps=3,
                           speculative_num_draft_tokens=32, page_size=1)
    assert args.disable_overlap_schedule is False
    assert spec_warnings(caplog) == ["Spec v2 (overlap scheduler) is used for eagle speculative decoding (topk=16)."]


def test_tree_falls_back_to_spec_v1_with_one_warning_naming_page_size(pair, caplog):
    with caplog.at_level(logging.WARNING):
        args = server_args(pair, speculative_eagle_topk=4, speculative_num_steps=3, speculative_num_draft_tokens=8,
                           page_size=16, attention_backend="flashinfer")
    assert args.disable_overlap_schedule is True
    [message] = spec_warnings(caplog)
    assert "--page-size 1, got 16" in message and message.startswith("Spec v1")


def test_user_disabled_overlap_keeps_spec_v1(pair):
    args = server_args(pair, speculative_eagle_topk=4, speculative_num_steps=3, speculative_num_draft_tokens=8,
                       disable_overlap_schedule=True)
    assert args.disable_overlap_schedule is True


@pytest.mark.parametrize("topk,steps,tokens,match", [
    (4, 3, 100, r"--speculative-num-draft-tokens 100 is larger than the tree that --speculative-eagle-topk 4 "
                r"with --speculative-num-steps 3 can draft \(at most 37 nodes"),
    (2, 1, 4, r"at most 3 nodes"),
    (4, 3, 1, r"must be >= 2 for a tree, got 1"),
    (4, 3, None, r"drafts a tree: set --speculative-num-draft-tokens"),
    (0, 3, 4, r"--speculative-eagle-topk must be >= 1, got 0"),
    (4, 0, 4, r"--speculative-num-steps must be >= 1, got 0"),
])
def test_inconsistent_tree_shapes_are_config_errors(pair, topk, steps, tokens, match):
    with pytest.raises(ValueError, match=match):
        server_args(pair, speculative_eagle_topk=topk, speculative_num_steps=steps,
                    speculative_num_draft_tokens=tokens)


def test_tree_with_pages_on_a_backend_without_paged_trees_is_refused(pair):
    with pytest.raises(ValueError, match=r"--page-size 16 produces incorrect results with the triton"):
        server_args(pair, speculative_eagle_topk=4, speculative_num_steps=3, speculative_num_draft_tokens=8,
                    page_size=16)


def test_largest_tree_is_accepted(pair):
    args = server_args(pair, speculative_eagle_topk=2, speculative_num_steps=1, speculative_num_draft_tokens=3)
    assert args.disable_overlap_schedule is False


V2 = hook.SpecVersion(True, None)
BASE = dict(topk=4, page_size=1, overlap_disabled=False, spec_v2_env_enabled=True, multi_layer=False,
            recurrent_reason=None, attention_backends={"triton"})


@pytest.mark.parametrize("change,use_v2,reason", [
    ({}, True, None),
    ({"topk": 1, "page_size": 64, "attention_backends": {"fa3"}}, True, None),
    ({"overlap_disabled": True}, False, None),
    ({"spec_v2_env_enabled": False}, False, "SGLANG_ENABLE_SPEC_V2=False"),
    ({"page_size": 64}, False, "--page-size 1, got 64"),
    ({"recurrent_reason": "the target (Qwen3NextConfig) has mamba / linear-attention layers"}, False,
     "without recurrent state; the target (Qwen3NextConfig)"),
    ({"multi_layer": True}, False, "multi-layer EAGLE drafts chains"),
    ({"attention_backends": {"triton", "flashinfer"}}, False, "got flashinfer"),
    # Hopper's default backend: its v2 trees are token-identical on a GPU
    # (test_tree_v2_gpu.py::test_tree_v2_on_fa3_is_token_identical_to_no_spec) but slower than v1
    ({"attention_backends": {"fa3"}}, False,
     "an attention backend in ['triton'], got fa3 (fa3's spec v2 draft extend has no CUDA graph"),
    ({"attention_backends": {"fa3", "flashinfer"}}, False, "got fa3, flashinfer (fa3's spec v2"),
])
def test_spec_version_decision_table(change, use_v2, reason):
    version = hook.choose_spec_version(**{**BASE, **change})
    assert version.use_spec_v2 is use_v2
    if reason is None:
        assert version.spec_v1_reason is None
    else:
        assert reason in version.spec_v1_reason


def _dp_attention_args(**overrides):
    return SimpleNamespace(**{
        **dict(speculative_eagle_topk=4, speculative_num_steps=3, speculative_num_draft_tokens=8, page_size=1,
               attention_backend="triton", decode_attention_backend=None, prefill_attention_backend=None,
               disable_overlap_schedule=False, enable_multi_layer_eagle=False, enable_dp_attention=True,
               disable_cuda_graph=False, speculative_algorithm="EAGLE3"),
        **overrides,
    })


def test_dp_attention_tree_runs_spec_v2(caplog):
    # GPU: test_tree_v2_eagle3_gpu.py::test_tree_v2_with_dp_attention_and_an_idle_rank
    server_args = _dp_attention_args()
    with caplog.at_level(logging.WARNING):
        hook.handle_eagle_family(server_args, SimpleNamespace(), spec_v2_env_enabled=True)
    assert server_args.disable_overlap_schedule is False
    [message] = spec_warnings(caplog)
    assert message.startswith("Spec v2")


@pytest.mark.parametrize("overlap_disabled", [False, True], ids=["spec-v2", "spec-v1"])
def test_dp_attention_tree_without_cuda_graphs_is_refused(overlap_disabled):
    server_args = _dp_attention_args(disable_cuda_graph=True, disable_overlap_schedule=overlap_disabled)
    with pytest.raises(ValueError, match=r"--speculative-eagle-topk 4 with --enable-dp-attention needs CUDA graphs"):
        hook.handle_eagle_family(server_args, SimpleNamespace(), spec_v2_env_enabled=True)


def test_dp_attention_chain_without_cuda_graphs_is_left_to_upstream():
    server_args = _dp_attention_args(speculative_eagle_topk=1, speculative_num_draft_tokens=None,
                                          disable_cuda_graph=True)
    hook.handle_eagle_family(server_args, SimpleNamespace(), spec_v2_env_enabled=True)
    assert server_args.disable_overlap_schedule is False and server_args.speculative_num_draft_tokens == 4


def test_recurrent_targets_are_recognised():
    class Qwen3NextConfig:
        pass

    assert "Qwen3NextConfig" in hook.recurrent_layer_reason(Qwen3NextConfig())
    hybrid = SimpleNamespace(layer_types=["full_attention", "linear_attention"])
    assert hook.recurrent_layer_reason(hybrid) == "the target has linear_attention layers (layer_types)"
    assert hook.recurrent_layer_reason(SimpleNamespace(layer_types=["full_attention", "sliding_attention"])) is None


@pytest.mark.parametrize("topk,steps,expected", [(2, 1, 3), (4, 3, 37), (16, 5, 1 + 16 + 4 * 256), (1, 5, 6)])
def test_max_tree_draft_tokens(topk, steps, expected):
    assert hook.max_tree_draft_tokens(topk, steps) == expected


def test_server_args_refuse_a_dp_attention_tree_without_cuda_graphs(pair):
    # ServerArgs.__post_init__ reaches the hook; nothing has touched a GPU yet
    with pytest.raises(ValueError, match=r"--enable-dp-attention needs CUDA graphs"):
        server_args(pair, speculative_eagle_topk=4, speculative_num_steps=3, speculative_num_draft_tokens=8,
                    tp_size=2, dp_size=2, enable_dp_attention=True, disable_cuda_graph=True)
