"""The synthetic Qwen3-MoE target (specpatch.testing.synth, family="qwen3_moe"): transformers runs it as
its bigram table, its router sends every token to the experts synth says in every layer, and
sglang's Qwen3MoeForCausalLM loads it as written. The GPU test of routed experts under tree
speculation (test/registered/spec/test_tree_v2_captures_gpu.py) stands on these."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specpatch.testing import synth

NUM_LAYERS = 2


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    target, draft = synth.make_pair(
        tmp_path_factory.mktemp("moe"),
        "toy",
        0.7,
        family="qwen3_moe",
        moe=synth.MoeSpec(),
        num_layers=NUM_LAYERS,
    )
    return target.path, draft.path


def _hf_model(target: Path, dtype: torch.dtype):
    from transformers import Qwen3MoeForCausalLM

    model, info = Qwen3MoeForCausalLM.from_pretrained(
        target, dtype=dtype, output_loading_info=True
    )
    # transformers fuses the experts on load; every checkpoint tensor has a place.
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    return model.eval()


def _routed_experts(model, input_ids: torch.Tensor) -> torch.Tensor:
    """[tokens, layers, k]: each MoE layer's chosen experts (the router's top-k indices)."""
    picks: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda module, args, out, i=i: picks.__setitem__(i, out[2])
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([picks[i] for i in range(len(picks))], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_runs_the_table_and_routes_as_synth_says(pair, dtype):
    target, _ = pair
    model = _hf_model(target, dtype)
    prompt = torch.tensor([[5, 17, 300, 42], [1, 2, 3, 2047]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=24, do_sample=False)
    assert out[:, 4:].tolist() == synth.table_continuations(target, prompt.tolist(), 24)
    # In context, over prompts and continuations: every layer, every position, rank order.
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([out, torch.randint(0, 2048, (2, 40), generator=g)], dim=1)
    got = _routed_experts(model, ids)
    assert got.shape == (ids.numel(), NUM_LAYERS, synth.MoeSpec().num_experts_per_tok)
    assert torch.equal(
        got, synth.expected_routed_experts(target, ids.flatten().tolist())
    )


def test_routing_is_wide_apart_and_spread_over_the_experts(pair):
    target, _ = pair
    meta = synth.load_meta(target)
    moe = synth.MoeSpec(**meta["moe"])
    # The gap is router_gap over the embedding's rms (~1); the layers move logits by ~1%.
    assert meta["min_router_gap"] >= 0.75 * moe.router_gap
    table = synth.expert_table(target)
    assert table.shape == (2048, moe.num_experts_per_tok)
    assert torch.bincount(table.flatten(), minlength=moe.num_experts).min() > 0
    # Distinct per token, and most successive tokens differ: a capture read from the wrong
    # tree node shows.
    assert (table[:, 0] != table[:, 1]).all()
    successor = synth.successor_table(target)
    assert (table != table[successor]).any(dim=1).float().mean() > 0.8
    assert meta["min_embedding_margin"] >= 20


def test_configs_have_what_sglang_reads(pair):
    from transformers import AutoConfig

    target, draft = pair
    cfg = AutoConfig.from_pretrained(target)
    assert (
        cfg.architectures == ["Qwen3MoeForCausalLM"] and cfg.model_type == "qwen3_moe"
    )
    moe = synth.MoeSpec()
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (
        moe.num_experts,
        moe.num_experts_per_tok,
    )
    assert (
        cfg.moe_intermediate_size == moe.moe_intermediate and cfg.norm_topk_prob is True
    )
    assert cfg.decoder_sparse_step == 1 and cfg.mlp_only_layers == []
    assert cfg.num_hidden_layers == NUM_LAYERS and cfg.eos_token_id is None
    # The draft is a dense EAGLE head: no experts of its own (why the
    # spec-v2-tree-captures-follow-compaction patch keeps the
    # draft runner from building a routed-experts capturer).
    draft_cfg = AutoConfig.from_pretrained(draft)
    assert draft_cfg.architectures == ["LlamaForCausalLMEagle"]
    assert not hasattr(draft_cfg, "num_experts_per_tok")


def test_meta_counts_the_experts(pair):
    target, _ = pair
    meta = synth.load_meta(target)
    assert meta["family"] == "qwen3_moe"
    written = sum(t.numel() for t in synth.load_checkpoint(target).weights.values())
    assert meta["num_params"] == written


def test_a_moe_spec_goes_with_the_moe_family_only(tmp_path):
    with pytest.raises(ValueError, match="MoeSpec"):
        synth.make_target(tmp_path / "a", synth.PRESETS["toy"], family="qwen3_moe")
    with pytest.raises(ValueError, match="MoeSpec"):
        synth.make_target(tmp_path / "b", synth.PRESETS["toy"], moe=synth.MoeSpec())


def test_sglang_loads_the_moe_target_as_written(pair):
    """sglang's Qwen3MoeForCausalLM built on the CPU in a process of its own: every parameter
    holds what the checkpoint wrote (experts stacked into FusedMoE's w13 / w2, q/k/v fused).
    """
    target, _ = pair
    script = Path(__file__).with_name("sglang_loads_synth.py")
    done = subprocess.run(
        [sys.executable, str(script), "--qwen3-moe", str(target)],
        capture_output=True,
        text=True,
        env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"target": []}
