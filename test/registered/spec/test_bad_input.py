"""Speculative flag sets refused or warned about in ServerArgs.__post_init__, before any GPU
allocation (docs/bad-input.md lists every case and the test that keeps it)."""

from __future__ import annotations

import argparse
import logging
import re
from types import SimpleNamespace

import pytest

from sglang.srt.arg_groups import speculative_hook as hook
from specpatch.testing import synth

IGNORED = "speculative decoding is off and these flags are ignored"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    synth.make_pair(root, "toy", 0.7)
    return root / "target", root / "draft"


@pytest.fixture(autouse=True)
def no_gpu_is_touched():
    """Every case is decided from flags and configs alone: CUDA is never initialised."""
    import torch

    assert not torch.cuda.is_initialized()
    yield
    assert not torch.cuda.is_initialized()


def server_args(target, **flags):
    from sglang.srt.server_args import ServerArgs

    flags.setdefault("attention_backend", "triton")
    return ServerArgs(
        model_path=str(target), skip_tokenizer_init=True, device="cuda", **flags
    )


def ignored_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if IGNORED in r.getMessage()]


# ----------------------------------------------------------------------------- a draft to run


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE"])
def test_eagle_family_without_a_draft_path_is_refused(pair, algorithm):
    target, _ = pair
    with pytest.raises(
        ValueError,
        match=rf"--speculative-algorithm {algorithm} needs --speculative-draft-model-path \(a local directory "
        r"or a Hugging Face repo id\): the target \(LlamaForCausalLM\) has no draft \(MTP\) layers",
    ):
        server_args(target, speculative_algorithm=algorithm, speculative_eagle_topk=1)


@pytest.mark.parametrize(
    "architecture,draft_architecture",
    [
        ("Qwen3NextForCausalLM", "Qwen3NextForCausalLMMTP"),
        ("MiMoForCausalLM", "MiMoMTP"),
        ("DeepseekV3ForCausalLM", "DeepseekV3ForCausalLMNextN"),
        ("LlamaForCausalLM", None),
        ("Qwen3ForCausalLM", None),
    ],
)
def test_builtin_draft_is_what_upstreams_draft_config_step_makes_of_the_target(
    architecture, draft_architecture
):
    hf_config = SimpleNamespace(
        architectures=[architecture], num_nextn_predict_layers=1
    )
    assert hook.builtin_draft_architecture(hf_config) == draft_architecture
    assert hf_config.architectures == [
        architecture
    ]  # the target's own config is left alone


def test_a_target_with_draft_layers_needs_no_draft_path():
    hf_config = SimpleNamespace(architectures=["Qwen3NextForCausalLM"])
    args = SimpleNamespace(
        speculative_draft_model_path=None,
        speculative_algorithm="EAGLE",
        get_model_config=lambda: SimpleNamespace(hf_config=hf_config),
    )
    hook.check_draft_model_given(
        args
    )  # no ValueError: the draft is the target's MTP layers


# ----------------------------------------------------------------------------- the draft path


@pytest.mark.parametrize(
    "path",
    ["/no/such/draft", "./no-such-draft", "no such draft", "a/b/c", "org/name--x"],
)
@pytest.mark.parametrize("algorithm", ["EAGLE", None])
def test_a_draft_path_that_is_neither_local_nor_a_repo_id_is_refused(
    pair, path, algorithm
):
    target, _ = pair
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"--speculative-draft-model-path '{path}' does not exist locally and is not a Hugging Face repo id"
        ),
    ):
        server_args(
            target, speculative_algorithm=algorithm, speculative_draft_model_path=path
        )


@pytest.mark.parametrize("path", ["org/name", "name", "org/name-v1.5"])
def test_a_repo_id_that_is_not_local_is_left_for_the_server_to_download(path):
    hook.check_draft_model_path(
        path
    )  # no ValueError; ServerArgs would now fetch its config


def test_a_local_draft_path_is_accepted(pair, tmp_path):
    _, draft = pair
    hook.check_draft_model_path(str(draft))
    hook.check_draft_model_path(str(tmp_path / ".." / tmp_path.name))


# ----------------------------------------------------------------------------- flags without an algorithm


def test_shape_flags_without_an_algorithm_are_named_in_one_warning(pair, caplog):
    target, _ = pair
    with caplog.at_level(logging.WARNING):
        args = server_args(
            target,
            speculative_eagle_topk=4,
            speculative_num_steps=3,
            speculative_num_draft_tokens=8,
        )
    assert ignored_warnings(caplog) == [
        "No --speculative-algorithm is given, so speculative decoding is off and these flags are ignored: "
        "--speculative-num-steps 3, --speculative-eagle-topk 4, --speculative-num-draft-tokens 8"
    ]
    assert args.speculative_algorithm is None


def test_a_draft_path_without_an_algorithm_is_named_too(pair, caplog):
    target, draft = pair
    with caplog.at_level(logging.WARNING):
        args = server_args(target, speculative_draft_model_path=str(draft))
    [message] = ignored_warnings(caplog)
    assert f"--speculative-draft-model-path {draft}" in message
    assert args.speculative_algorithm is None


def test_no_speculative_flag_no_warning(pair, caplog):
    target, _ = pair
    with caplog.at_level(logging.WARNING):
        server_args(target, quantization=None)
    assert ignored_warnings(caplog) == []


def test_an_algorithm_silences_the_warning(pair, caplog):
    target, draft = pair
    with caplog.at_level(logging.WARNING):
        server_args(
            target,
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=str(draft),
            speculative_eagle_topk=4,
        )
    assert ignored_warnings(caplog) == []


def test_every_warned_field_is_a_real_flag():
    """The warning spells fields as flags: each spelling must be one the parser accepts."""
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    options = {option for action in parser._actions for option in action.option_strings}
    fields = [
        f.name
        for f in dataclasses.fields(ServerArgs)
        if f.name.startswith("speculative_")
    ]
    warned = [f for f in fields if f not in hook._SPECULATIVE_FIELDS_NOT_WARNED]
    assert len(warned) > 20
    assert [f for f in warned if "--" + f.replace("_", "-") not in options] == []
