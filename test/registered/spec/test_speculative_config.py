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
    return ServerArgs(model_path=str(target), speculative_algorithm="EAGLE", speculative_draft_model_path=str(draft),
                      skip_tokenizer_init=True, device="cuda", attention_backend="triton", **spec)


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
