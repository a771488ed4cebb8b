"""Synthetic model pairs (specpatch.testing.synth): tunable draft agreement, large target margins,
valid HF Llama checkpoints, and the weight names sglang's loaders expect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specpatch.testing import engine as eng
from specpatch.testing import synth


def _names(model_dir: Path) -> set[str]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def toy_target(tmp_path_factory) -> Path:
    return synth.make_target(
        tmp_path_factory.mktemp("toy") / "target", synth.PRESETS["toy"]
    ).path


@pytest.fixture(scope="module")
def toy_draft(toy_target) -> Path:
    return synth.make_eagle_draft(
        toy_target.parent / "draft", toy_target, agreement=0.7
    ).path


@pytest.fixture(scope="module")
def small_target(tmp_path_factory) -> Path:
    return synth.make_target(
        tmp_path_factory.mktemp("small") / "target", synth.PRESETS["small"]
    ).path


@pytest.mark.parametrize("agreement", [0.0, 0.5, 0.7, 1.0])
def test_draft_agreement_is_tunable(toy_target, tmp_path, agreement):
    info = synth.make_eagle_draft(tmp_path / "draft", toy_target, agreement=agreement)
    for measured in (info.agreement, info.agreement_bf16):
        if agreement == 0.0:  # chance level is 1/vocab; "~0" means at most 3% right
            assert measured <= 0.03
        else:
            assert abs(measured - agreement) <= 0.03
    assert info.topk_coverage[4] >= info.agreement
    coverage = [info.topk_coverage[k] for k in synth.TOPK_LEVELS]
    assert coverage == sorted(coverage)
    if 0.0 < agreement < 1.0:
        assert (
            info.topk_coverage[4] >= agreement + 0.1
        )  # tree drafting has something to find
    meta = synth.load_meta(tmp_path / "draft")
    assert (
        meta["requested_agreement"] == agreement and meta["agreement"] == info.agreement
    )
    assert meta["sigma"] == info.sigma and (info.sigma == 0.0) == (agreement == 1.0)


def test_reference_draft_matches_the_measured_table(toy_target, toy_draft):
    """The full draft (fc + tiny decoder layer, on real sequences with a random target hidden)
    predicts what the fc-only table says, so the measured agreement is what engines will see.
    """
    target = synth.load_checkpoint(toy_target)
    embed, lm_head = (
        target.weights["model.embed_tokens.weight"],
        target.weights["lm_head.weight"],
    )
    fc = synth.load_checkpoint(toy_draft).weights["fc.weight"]  # [h, 2h]
    h = embed.shape[1]
    table = synth._topk(embed @ fc[:, :h].T, lm_head, 1)[1][:, 0]  # [vocab]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, embed.shape[0], (8, 64), generator=g)
    hidden = torch.randn(8, 64, h, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        pred = synth.reference_draft_logits(
            toy_draft, toy_target, ids, hidden, dtype=dtype
        ).argmax(-1)
        assert (pred == table[ids]).float().mean() >= 0.99
    right = (table[ids] == synth.successor_table(toy_target)[ids]).float().mean()
    assert (
        abs(right - synth.load_meta(toy_draft)["agreement"]) <= 0.06
    )  # 512 samples of p=0.7


@pytest.mark.parametrize("preset", ["toy", "small"])
def test_target_greedy_margin_is_large_in_bf16(toy_target, small_target, preset):
    model_dir = {"toy": toy_target, "small": small_target}[preset]
    ckpt = synth.load_checkpoint(model_dir, dtype=torch.bfloat16)
    successor = synth.successor_table(model_dir)
    g = torch.Generator().manual_seed(0)
    for length in (1, 2, 7, 33, 64):
        ids = torch.randint(0, synth.PRESETS[preset].vocab, (4, length), generator=g)
        logits = synth.reference_target_logits(
            ckpt, ids, dtype=torch.bfloat16
        ).float()  # [4, length, vocab]
        assert torch.equal(
            logits.argmax(-1), successor[ids]
        )  # every position, not just the last
        top2 = logits.topk(2, dim=-1).values
        assert (top2[..., 0] - top2[..., 1]).min() >= 10.0


def test_transformers_loads_it_and_agrees(toy_target):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(toy_target, dtype=torch.float32).eval()
    assert set(model.state_dict()) == _names(toy_target)  # exactly the HF Llama names
    successor = synth.successor_table(toy_target)
    prompt = torch.tensor([[5, 17, 300, 42], [1, 2, 3, 2047]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=24, do_sample=False)
        hf_logits = model(prompt).logits  # [2, 4, vocab]
    assert out.shape == (2, 28)  # no eos: nothing stops early
    for row in out:
        chain = row[3:]
        assert torch.equal(chain[1:], successor[chain[:-1]])
    # what the GPU tests compare engines against
    assert out[:, 4:].tolist() == synth.table_continuations(
        toy_target, prompt.tolist(), 24
    )
    torch.testing.assert_close(
        synth.reference_target_logits(toy_target, prompt),
        hf_logits,
        atol=2e-3,
        rtol=1e-3,
    )


def test_configs_have_what_sglang_reads(toy_target, toy_draft):
    from transformers import AutoConfig

    spec = synth.PRESETS["toy"]
    for model_dir, arch, layers in (
        (toy_target, "LlamaForCausalLM", 1),
        (toy_draft, "LlamaForCausalLMEagle", 1),
    ):
        raw = json.loads((model_dir / "config.json").read_text())
        assert raw["architectures"] == [arch] and raw["model_type"] == "llama"
        assert raw["tie_word_embeddings"] is False and raw["torch_dtype"] == "bfloat16"
        assert raw["max_position_embeddings"] >= 4096
        cfg = AutoConfig.from_pretrained(model_dir)  # what sglang's get_config does
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (
            spec.hidden,
            spec.intermediate,
            layers,
        )
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (
            4,
            2,
            spec.vocab,
        )
        assert (
            cfg.rope_parameters["rope_theta"] == spec.rope_theta
            and cfg.eos_token_id is None
        )


def test_draft_weight_names_are_what_sglang_eagle_loads(toy_draft):
    # From sglang/srt/models/llama_eagle.py (0.5.12.post1): load_weights drops names containing
    # "lm_head" and prefixes the rest with "model."; LlamaModel there has embed_tokens, layers.N
    # and fc (Linear with bias) and no final norm; layer 0 deletes input_layernorm. Every name
    # below maps to a parameter (q/k/v and gate/up via the stacked mapping), none is left over.
    layer = {
        f"layers.0.{n}.weight"
        for n in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "post_attention_layernorm",
        )
    }
    assert _names(toy_draft) == layer | {"fc.weight", "fc.bias", "embed_tokens.weight"}
    w = synth.load_checkpoint(toy_draft).weights
    h = synth.PRESETS["toy"].hidden
    assert (
        w["fc.weight"].shape == (h, 2 * h)
        and torch.count_nonzero(w["fc.weight"][:, h:]) == 0
    )
    assert torch.count_nonzero(w["fc.bias"]) == 0
    assert all(
        torch.count_nonzero(t) > 0 for n, t in w.items() if n.startswith("layers.")
    )  # KV really used


def test_meta_and_accept_length(toy_target, toy_draft):
    meta = synth.load_meta(toy_target)
    assert (
        meta["spec"]["seed"] == 0
        and meta["num_params"] == synth.PRESETS["toy"].num_params
    )
    assert meta["min_embedding_margin"] >= 20
    draft_meta = synth.load_meta(toy_draft)
    a = draft_meta["agreement"]
    assert draft_meta["expected_chain_accept_length"]["3"] == pytest.approx(
        1 + a + a * a + a**3
    )
    assert synth.expected_chain_accept_length(1.0, 3) == 4
    assert synth.expected_chain_accept_length(0.0, 3) == 1
    assert synth.expected_chain_accept_length(0.5, 2) == pytest.approx(1.75)


def transformers_llama_num_params(spec) -> int:
    """Parameters of transformers' own Llama for `spec`, counted without allocating."""
    with torch.device("meta"):
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(
            LlamaConfig(
                **{
                    k: v
                    for k, v in synth.llama_config(
                        spec,
                        architecture="LlamaForCausalLM",
                        num_layers=spec.num_layers,
                    ).items()
                    if k not in ("architectures", "model_type", "dtype", "torch_dtype")
                }
            )
        )
    return sum(p.numel() for p in model.parameters())


def test_bench_preset_is_at_least_1b_params():
    spec = synth.PRESETS["bench"]
    assert spec.num_params >= 1_000_000_000 and spec.num_layers >= 24
    assert transformers_llama_num_params(spec) == spec.num_params


def test_llama8b_preset_is_llama_3_8b_shaped_and_its_pool_fits_an_h100():
    spec = synth.PRESETS["llama8b"]
    assert (
        spec.num_layers,
        spec.hidden,
        spec.intermediate,
        spec.num_heads,
        spec.num_kv_heads,
    ) == (32, 4096, 14336, 32, 8)
    assert transformers_llama_num_params(spec) == spec.num_params == 7_241_732_096
    # K and V, bf16, 32 layers x 8 KV heads x head_dim 128
    assert spec.kv_bytes_per_token == 131072
    tokens = eng.pool_tokens(spec)
    assert (
        64 * (256 + 512) <= tokens < eng.MAX_POOL_TOKENS
    )  # bs 64 of long requests fits
    weights_and_kv = 2 * spec.num_params + tokens * spec.kv_bytes_per_token
    assert (
        weights_and_kv < 0.55 * 80e9 * 0.8
    )  # leaves the draft, graphs and activations room


def test_small_presets_keep_the_full_pool():
    for name in ("toy", "small", "bench"):
        assert eng.pool_tokens(synth.PRESETS[name]) == eng.MAX_POOL_TOKENS, name


def test_cli_writes_both_dirs(tmp_path, capsys):
    synth.main(["--out", str(tmp_path), "--preset", "toy", "--agreement", "0.7"])
    printed = capsys.readouterr().out
    assert str(tmp_path / "target") in printed and str(tmp_path / "draft") in printed
    assert (tmp_path / "target" / "config.json").exists() and (
        tmp_path / "draft" / synth.META
    ).exists()
