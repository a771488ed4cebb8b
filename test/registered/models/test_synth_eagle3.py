"""The synthetic EAGLE3 pair (specpatch.testing.synth_eagle3): a dense Qwen3 target that transformers
runs as its bigram table, and an EAGLE3 draft whose first step agrees as tuned, in context."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from specpatch.testing import synth
from specpatch.testing import synth_eagle3 as e3


def _names(model_dir: Path) -> set[str]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    target, draft = e3.make_eagle3_pair(tmp_path_factory.mktemp("eagle3"), "toy", 0.7)
    return target.path, draft.path


def test_qwen3_target_is_its_bigram_table_in_transformers(pair):
    from transformers import Qwen3ForCausalLM

    target, _ = pair
    model = Qwen3ForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert set(model.state_dict()) == _names(
        target
    )  # exactly the HF Qwen3 names, q/k norms included
    prompt = torch.tensor([[5, 17, 300, 42], [1, 2, 3, 2047]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=24, do_sample=False)
    assert out[:, 4:].tolist() == synth.table_continuations(target, prompt.tolist(), 24)


def test_configs_have_what_sglang_reads(pair):
    from transformers import AutoConfig

    target, draft = pair
    spec = synth.PRESETS["toy"]
    target_cfg = AutoConfig.from_pretrained(target)
    assert (
        target_cfg.architectures == ["Qwen3ForCausalLM"]
        and target_cfg.model_type == "qwen3"
    )
    # sglang captures the input of layer id + 1: every aux layer needs a layer after it
    assert target_cfg.num_hidden_layers >= max(e3.AUX_LAYER_IDS) + 2
    draft_cfg = AutoConfig.from_pretrained(draft)
    assert (
        draft_cfg.architectures == ["LlamaForCausalLMEagle3"]
        and draft_cfg.num_hidden_layers == 1
    )
    assert draft_cfg.draft_vocab_size is None  # sglang then loads the target's lm_head
    assert draft_cfg.eagle_config["eagle_aux_hidden_state_layer_ids"] == list(
        e3.AUX_LAYER_IDS
    )
    assert (
        draft_cfg.num_key_value_heads == draft_cfg.num_attention_heads == spec.num_heads
    )
    assert draft_cfg.tie_word_embeddings is False and draft_cfg.eos_token_id is None


def test_draft_weight_names_are_what_sglang_eagle3_loads(pair):
    # From sglang/srt/models/llama_eagle3.py (0.5.12.post1): load_weights prefixes "model." to a
    # name it does not find, folds q/k/v and gate/up into the stacked params, and takes lm_head
    # from the target when draft_vocab_size is None. Layer 0 keeps input_layernorm and has a
    # hidden_norm; qkv reads cat(embeds, hidden), 2 h wide; fc has no bias.
    _, draft = pair
    h = synth.PRESETS["toy"].hidden
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
            "input_layernorm",
            "hidden_norm",
            "post_attention_layernorm",
        )
    }
    assert _names(draft) == layer | {"fc.weight", "norm.weight", "embed_tokens.weight"}
    w = synth.load_checkpoint(draft).weights
    assert (
        w["fc.weight"].shape == (h, len(e3.AUX_LAYER_IDS) * h)
        and torch.count_nonzero(w["fc.weight"]) == 0
    )
    for proj in ("q_proj", "k_proj", "v_proj"):
        weight = w[f"layers.0.self_attn.{proj}.weight"]
        assert (
            weight.shape == (h, 2 * h) and torch.count_nonzero(weight[:, h:]) == 0
        )  # embedding half only


@pytest.mark.parametrize("agreement", [1.0, 0.7])
def test_first_step_agrees_as_tuned_along_the_target_path(pair, tmp_path, agreement):
    """The reference EAGLE3 forward over whole sequences on the target's greedy path, in bf16:
    each position must attend to itself for the tuned agreement to hold in context."""
    target, _ = pair
    draft = e3.make_eagle3_draft(tmp_path / "draft", target, agreement=agreement)
    successor = synth.successor_table(target)
    hits = total = 0
    for start in range(0, 2048, 128):
        path = [start]
        for _ in range(127):
            path.append(int(successor[path[-1]]))
        ids = torch.tensor(path)
        predicted = e3.reference_first_step_logits(
            draft.path, target, ids, dtype=torch.bfloat16
        ).argmax(-1)
        hits += (predicted == successor[ids]).sum().item()
        total += len(path)
    meta = synth.load_meta(draft.path)
    assert meta["first_step_agreement"] == pytest.approx(agreement, abs=0.01)
    assert hits / total == pytest.approx(meta["first_step_agreement"], abs=0.03)


def test_unknown_target_family_is_refused(tmp_path):
    with pytest.raises(ValueError, match="family must be one of"):
        synth.make_target(tmp_path / "t", synth.PRESETS["toy"], family="mistral")


def test_target_meta_names_its_family(pair):
    target, _ = pair
    assert synth.load_meta(target)["family"] == "qwen3"
    config = json.loads((target / "config.json").read_text())
    assert config["layer_types"] == ["full_attention"] * config["num_hidden_layers"]


def test_draft_extend_graph_buffer_is_as_wide_as_fc_input(pair):
    """sglang sizes the draft-extend CUDA graph's hidden states from the target's config, not
    the draft's: the aux count must be the one it assumes there, or the capture fails.
    """
    from transformers import AutoConfig

    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    target, draft = pair
    target_cfg = AutoConfig.from_pretrained(target)
    model_config = SimpleNamespace(
        hf_config=target_cfg,
        hidden_size=target_cfg.hidden_size,
        spec_hidden_size=target_cfg.hidden_size,
    )
    worker = SimpleNamespace(
        speculative_algorithm=SpeculativeAlgorithm.EAGLE3,
        eagle_use_aux_hidden_state=True,
        target_worker=SimpleNamespace(
            model_runner=SimpleNamespace(model_config=model_config)
        ),
    )
    fc_input_width = synth.load_checkpoint(draft).weights["fc.weight"].shape[1]
    assert EagleDraftExtendInput.hidden_size_for(worker) == fc_input_width


def test_sglang_loads_both_checkpoints_as_written(pair):
    """sglang's Qwen3ForCausalLM and LlamaForCausalLMEagle3, built on the CPU in a process of
    their own: every parameter holds what the checkpoint wrote for it (q/k/v and gate/up fused).
    """
    target, draft = pair
    script = Path(__file__).with_name("sglang_loads_synth.py")
    done = subprocess.run(
        [sys.executable, str(script), str(target), str(draft)],
        capture_output=True,
        text=True,
        env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"target": [], "draft": [], "draft_loads_head_from_target": True}
