"""Synthetic model pairs: tunable draft agreement, large target margins, valid HF checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specpatch import synth


@pytest.fixture(scope="module")
def toy_target(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy") / "target"
    synth.make_target(out, synth.PRESETS["toy"])
    return out


@pytest.mark.parametrize("agreement", [0.0, 0.5, 0.7, 1.0])
def test_draft_agreement_is_tunable(toy_target, tmp_path, agreement):
    meta = synth.make_eagle_draft(tmp_path / "draft", toy_target, agreement)
    if agreement == 0.0:
        assert meta["agreement"] <= 0.03
    else:
        assert abs(meta["agreement"] - agreement) <= 0.03
    coverage = [meta["topk_coverage"][k] for k in ("1", "2", "4", "8", "16")]
    assert coverage == sorted(coverage)  # a wider tree never finds less
    if 0.0 < agreement < 1.0:
        assert meta["topk_coverage"]["4"] >= agreement + 0.1  # topk > 1 has something to find


def test_agreement_measured_on_the_saved_bf16_weights(toy_target, tmp_path):
    meta = synth.make_eagle_draft(tmp_path / "draft", toy_target, 0.7)
    with safe_open(str(tmp_path / "draft" / "model.safetensors"), "pt") as f:
        fc = f.get_tensor("fc.weight").float()
    with safe_open(str(toy_target / "model.safetensors"), "pt") as f:
        embed, lm_head = f.get_tensor("model.embed_tokens.weight").float(), f.get_tensor("lm_head.weight").float()
    hidden = embed.shape[1]
    assert torch.count_nonzero(fc[:, hidden:]) == 0  # the draft ignores the target hidden state
    tokens = torch.arange(embed.shape[0])
    successor = synth.successor_table(toy_target)
    bf16_agreement = synth.draft_stats(fc[:, :hidden], embed, lm_head, successor, tokens, ks=(1,))[1]
    assert abs(bf16_agreement - meta["agreement"]) <= 0.03


def test_target_greedy_margin_is_large_in_bf16(toy_target):
    successor = synth.successor_table(toy_target)
    g = torch.Generator().manual_seed(0)
    for length in (1, 7, 64):
        ids = torch.randint(0, synth.PRESETS["toy"].vocab, (length,), generator=g)
        logits = synth.reference_target_logits(toy_target, ids)  # [seq, vocab]
        assert torch.equal(logits.argmax(-1), successor[ids])
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() >= 10.0


def test_checkpoint_is_a_valid_hf_llama_with_the_same_greedy_tokens(toy_target):
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(toy_target, torch_dtype=torch.float32).eval()
    successor = synth.successor_table(toy_target)
    prompt = torch.tensor([[5, 17, 300, 42]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    generated = out[0, prompt.shape[1]:].tolist()
    expected, token = [], prompt[0, -1].item()
    for _ in range(24):
        token = successor[token].item()
        expected.append(token)
    assert generated == expected


def test_reference_forward_matches_transformers(toy_target):
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(toy_target, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, synth.PRESETS["toy"].vocab, (33,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = model(ids[None]).logits[0]
    ours = synth.reference_target_logits(toy_target, ids, dtype=torch.float32)
    torch.testing.assert_close(ours, hf, atol=2e-3, rtol=1e-3)


def test_checkpoint_names_match_what_sglang_loads(toy_target, tmp_path):
    synth.make_eagle_draft(tmp_path / "draft", toy_target, 0.7)
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["num_hidden_layers"] == 1
    with safe_open(str(tmp_path / "draft" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # LlamaForCausalLMEagle.load_weights prefixes "model." and skips lm_head (shared from the
    # target); layer 0 has no input_layernorm; params missing from a checkpoint stay uninitialized,
    # so every parameter of the eagle LlamaModel must be present.
    layer = {f"layers.0.{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                              "mlp.down_proj", "post_attention_layernorm")}
    assert names == layer | {"fc.weight", "fc.bias", "embed_tokens.weight"}


def test_expected_chain_accept_length():
    assert synth.expected_chain_accept_length(1.0, 3) == 4
    assert synth.expected_chain_accept_length(0.0, 3) == 1
    assert synth.expected_chain_accept_length(0.5, 2) == pytest.approx(1.75)


def test_bench_preset_is_at_least_1b_parameters():
    assert synth.PRESETS["bench"].num_params() >= 1_000_000_000
