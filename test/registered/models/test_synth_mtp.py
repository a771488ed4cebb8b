"""The synthetic Step-3.5 checkpoint with MTP layers (specpatch.testing.synth_mtp): sglang takes it
for multi-layer EAGLE and loads target and every MTP layer as written; in plain torch
(transformers' Qwen3 modules) the target is its bigram table and MTP layer k agrees with it as
tuned, on real sequences."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specpatch.testing import synth
from specpatch.testing import synth_mtp as mtp


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return mtp.make_mtp_model(tmp_path_factory.mktemp("mtp") / "model", "toy").path


def server_args(model: Path, **flags):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=str(model),
        speculative_algorithm="EAGLE",
        speculative_eagle_topk=1,
        speculative_num_steps=3,
        skip_tokenizer_init=True,
        device="cuda",
        attention_backend="fa3",
        **flags,
    )


def test_configs_are_step3p5_target_and_its_mtp_draft(model):
    from sglang.srt.configs.model_config import ModelConfig

    target = ModelConfig(str(model))
    assert target.hf_config.architectures == ["Step3p5ForCausalLM"]
    assert target.num_hidden_layers == mtp.NUM_TARGET_LAYERS
    assert target.is_hybrid_swa and target.sliding_window_size == mtp.SLIDING_WINDOW
    assert target.full_attention_layer_ids == list(range(0, 45, 4))
    assert len(target.swa_attention_layer_ids) == 45 - 12
    draft = ModelConfig(str(model), is_draft_model=True, is_multi_layer_eagle=True)
    assert draft.hf_config.architectures == ["Step3p5MTP"]
    assert draft.num_nextn_predict_layers == len(mtp.MTP_AGREEMENTS)
    assert (draft.swa_attention_layer_ids, draft.full_attention_layer_ids) == ([0], [])


@pytest.mark.parametrize("overlap", [True, False], ids=["v2", "v1"])
def test_eagle_on_it_runs_the_multi_layer_worker(model, overlap):
    """No draft path and no --enable-multi-layer-eagle: the Step3p5 target turns multi-layer
    EAGLE on; a chain runs spec v2 unless the overlap scheduler is off."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    args = server_args(model, disable_overlap_schedule=not overlap)
    assert args.enable_multi_layer_eagle
    assert args.speculative_draft_model_path is None
    assert args.speculative_num_draft_tokens == 4
    assert args.disable_overlap_schedule is (not overlap)
    worker = SpeculativeAlgorithm.from_string("EAGLE").create_worker(args)
    name = "MultiLayerEagleWorkerV2" if overlap else "MultiLayerEagleWorker"
    assert worker.__name__ == name


def test_sglang_loads_target_and_each_mtp_layer_as_written(model):
    """sglang's Step3p5ForCausalLM and one Step3p5MTP per draft step, built on the CPU in a
    process of their own: every parameter holds what the checkpoint wrote for it, step k holds
    layer 45 + k, and every step's attention is layer 0 of its one-layer KV pool."""
    script = Path(__file__).with_name("sglang_loads_synth.py")
    done = subprocess.run(
        [sys.executable, str(script), "--step3p5-mtp", str(model)],
        capture_output=True,
        text=True,
        env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "target": [],
        **{f"mtp{k}": [] for k in range(3)},
        "mtp_attention_layer_ids": [0, 0, 0],
    }


def test_target_is_its_bigram_table_in_plain_torch(model):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    twin = mtp.qwen3_twin(model)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**twin.config)).eval()
    qwen3.load_state_dict(twin.weights, strict=True)
    prompt = torch.tensor([[5, 17, 300, 42], [1, 2, 3, 2047]])
    with torch.no_grad():
        out = qwen3.generate(prompt, max_new_tokens=24, do_sample=False)
    assert out[:, 4:].tolist() == synth.table_continuations(model, prompt.tolist(), 24)


def reference_mtp_layer(model: Path, k: int, dtype):
    """MTP layer k in plain torch: (input_ids [s], hidden [s, h]) -> logits [s, vocab] over a
    sequence, as a draft extend runs it. Block and head are a one-layer Qwen3 fed eh_proj's
    output (Step3p5's norms scale by 1 + w)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    ckpt = synth.load_checkpoint(model, dtype=dtype)
    w, prefix = ckpt.weights, f"model.layers.{mtp.NUM_TARGET_LAYERS + k}."
    eps = ckpt.config["rms_norm_eps"]
    fusion = ("enorm", "hnorm", "eh_proj", "transformer")
    block = {
        "model.layers.0." + name[len(prefix) :]: weight
        for name, weight in w.items()
        if name.startswith(prefix) and name[len(prefix) :].split(".")[0] not in fusion
    }
    head = prefix + "transformer.shared_head."
    qwen3_weights = {
        **mtp.shift_norms(block, 1.0),
        "model.embed_tokens.weight": w["model.embed_tokens.weight"],
        "model.norm.weight": 1.0 + w[head + "norm.weight"],
        "lm_head.weight": w[head + "output.weight"],
    }
    spec = synth.TargetSpec(**synth.load_meta(model)["spec"])
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**synth.qwen3_config(spec, num_layers=1)))
    qwen3 = qwen3.to(dtype).eval()
    qwen3.load_state_dict({n: t.to(dtype) for n, t in qwen3_weights.items()})

    def gemma_norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return synth.rms_norm(x.to(dtype), 1.0 + w[prefix + name], eps)

    def logits(input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embeds = w["model.embed_tokens.weight"][input_ids]
        fused = torch.cat(
            [gemma_norm(embeds, "enorm.weight"), gemma_norm(hidden, "hnorm.weight")],
            dim=-1,
        )
        with torch.no_grad():
            inputs = (fused @ w[prefix + "eh_proj.weight"].T)[None]
            return qwen3(inputs_embeds=inputs).logits[0]

    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_mtp_layer_agrees_as_tuned_along_the_target_path(model, dtype):
    """Whole MTP layers, block and head included, over the target's greedy path with random
    target hidden states: layer k predicts successor[t] on its tuned fraction of positions.
    """
    meta = synth.load_meta(model)
    successor = synth.successor_table(model)
    g = torch.Generator().manual_seed(0)
    h = meta["spec"]["hidden"]
    for k, tuned in enumerate(meta["mtp_agreements"]):
        assert tuned == pytest.approx(mtp.MTP_AGREEMENTS[k], abs=0.01)
        layer = reference_mtp_layer(model, k, dtype)
        hits = total = 0
        for start in range(0, meta["spec"]["vocab"], 256):
            path = [start]
            for _ in range(255):
                path.append(int(successor[path[-1]]))
            ids = torch.tensor(path)
            hidden = torch.randn(len(path), h, generator=g)
            hits += (layer(ids, hidden).argmax(-1) == successor[ids]).sum().item()
            total += len(path)
        assert hits / total == pytest.approx(tuned, abs=0.03), k


def test_expected_chain_accept_length():
    assert mtp.expected_chain_accept_length([]) == 1.0
    assert mtp.expected_chain_accept_length([1.0, 1.0, 1.0]) == 4.0
    assert mtp.expected_chain_accept_length([0.5, 0.5]) == 1.75
    assert mtp.expected_chain_accept_length([0.0, 1.0]) == 1.0
