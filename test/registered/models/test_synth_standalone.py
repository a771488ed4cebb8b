"""The synthetic STANDALONE pair (specpatch.testing.synth_standalone): the Llama target, and a complete
Llama LM as its draft that transformers runs as a bigram table agreeing with the target's on
the fraction asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specpatch.testing import synth
from specpatch.testing import synth_standalone as sa

AGREEMENT = 0.7


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    target, draft = sa.make_standalone_pair(
        tmp_path_factory.mktemp("standalone"), "toy", AGREEMENT
    )
    return target.path, draft.path


def test_draft_agrees_on_the_fraction_asked_for(pair):
    target, draft = pair
    vocab = synth.PRESETS["toy"].vocab
    expected = 1 - round((1 - AGREEMENT) * vocab) / vocab
    target_next, draft_next = synth.successor_table(target), synth.successor_table(
        draft
    )
    assert (target_next == draft_next).float().mean().item() == pytest.approx(
        expected, abs=1e-9
    )
    assert synth.load_meta(draft)["agreement"] == pytest.approx(expected, abs=1e-9)
    # a draft that disagrees answers another of the moved tokens, never a token it agrees on
    disagreeing = target_next != draft_next
    assert set(draft_next[disagreeing].tolist()) == set(
        target_next[disagreeing].tolist()
    )


def test_draft_is_the_target_with_its_head_rows_moved(pair):
    target, draft = pair
    target_ckpt, draft_ckpt = synth.load_checkpoint(target), synth.load_checkpoint(
        draft
    )
    assert draft_ckpt.config == target_ckpt.config and draft_ckpt.config[
        "architectures"
    ] == ["LlamaForCausalLM"]
    assert set(draft_ckpt.weights) == set(target_ckpt.weights)
    for name, weight in target_ckpt.weights.items():
        if name != "lm_head.weight":
            assert torch.equal(draft_ckpt.weights[name], weight), name
    moved_rows = (
        draft_ckpt.weights["lm_head.weight"] != target_ckpt.weights["lm_head.weight"]
    ).any(-1)
    assert moved_rows.sum().item() == round(
        (1 - AGREEMENT) * synth.PRESETS["toy"].vocab
    )
    # the same rows, elsewhere: sorting each head's rows gives one matrix
    assert torch.equal(
        draft_ckpt.weights["lm_head.weight"].sort(dim=0).values,
        target_ckpt.weights["lm_head.weight"].sort(dim=0).values,
    )


def test_draft_runs_as_its_own_bigram_table_in_transformers(pair):
    from transformers import LlamaForCausalLM

    _, draft = pair
    model = LlamaForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    prompt = torch.tensor([[5, 17, 300, 42], [1, 2, 3, 2047]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=24, do_sample=False)
    assert out[:, 4:].tolist() == synth.table_continuations(draft, prompt.tolist(), 24)


@pytest.mark.parametrize("agreement", [1.0, 0.0])
def test_agreement_extremes(pair, tmp_path, agreement):
    target, _ = pair
    info = sa.make_standalone_draft(tmp_path / "draft", target, agreement=agreement)
    assert info.agreement == agreement
