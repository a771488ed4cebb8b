"""Run as a script: build sglang's own model classes on the CPU, load a synthetic checkpoint
through their load_weights, and print (JSON) every parameter that does not hold the value the
checkpoint meant for it. sglang picks CPU kernels at import time from SGLANG_USE_CPU_ENGINE,
which is why this runs in its own process.

    SGLANG_USE_CPU_ENGINE=1 python sglang_loads_synth.py TARGET_DIR DRAFT_DIR
    SGLANG_USE_CPU_ENGINE=1 python sglang_loads_synth.py --qwen3-moe TARGET_DIR
    SGLANG_USE_CPU_ENGINE=1 python sglang_loads_synth.py --step3p5-mtp MODEL_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tools"))

from specpatch.testing import cudastub  # noqa: E402

cudastub.preload()

import torch  # noqa: E402

from specpatch.testing import synth  # noqa: E402
from specpatch.testing.single_rank import init_model_parallel_on_cpu  # noqa: E402

# sglang fuses these checkpoint tensors into one parameter, in this order.
STACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


# sglang's FusedMoE stacks every expert's checkpoint tensors into one parameter per layer:
# w13_weight [num_experts, 2 * inter, h] = cat(gate_proj, up_proj), w2_weight = down_proj.
FUSED_EXPERTS = {"w13_weight": ("gate_proj", "up_proj"), "w2_weight": ("down_proj",)}


def expected_experts(
    param_name: str, weights: dict[str, torch.Tensor]
) -> torch.Tensor | None:
    layer, _, fused = param_name.rpartition(".experts.")
    if fused not in FUSED_EXPERTS:
        return None
    experts = []
    while all(
        f"{layer}.experts.{len(experts)}.{p}.weight" in weights
        for p in FUSED_EXPERTS[fused]
    ):
        e = len(experts)
        experts.append(
            torch.cat(
                [
                    weights[f"{layer}.experts.{e}.{p}.weight"]
                    for p in FUSED_EXPERTS[fused]
                ]
            )
        )
    return torch.stack(experts) if experts else None


def expected_value(
    param_name: str, weights: dict[str, torch.Tensor]
) -> torch.Tensor | None:
    if ".experts." in param_name:
        return expected_experts(param_name, weights)
    for prefix in ("", "model."):
        if param_name.startswith(prefix) and param_name[len(prefix) :] in weights:
            return weights[param_name[len(prefix) :]]
    if param_name in weights:
        return weights[param_name]
    for fused, parts in STACKED.items():
        if f".{fused}." in param_name:
            names = [param_name.replace(fused, part) for part in parts]
            found = [expected_value(name, weights) for name in names]
            return None if any(t is None for t in found) else torch.cat(found)
    return None


def mismatches(
    model: torch.nn.Module,
    model_dir: Path,
    skip: tuple[str, ...] = (),
    expected: dict[str, torch.Tensor] | None = None,
) -> list[str]:
    """`expected`: the tensors the model's parameters should hold, under its names where they
    differ from the checkpoint's (default: the checkpoint's own)."""
    weights = synth.load_checkpoint(model_dir, dtype=torch.float32).weights
    model.load_weights(list(weights.items()))
    weights = weights if expected is None else expected
    bad = []
    for name, param in model.named_parameters():
        if name in skip:
            continue
        want = expected_value(name, weights)
        if want is None:
            bad.append(f"{name}: no checkpoint tensor")
        elif want.shape != param.shape or not torch.equal(
            want.to(param.dtype), param.detach()
        ):
            bad.append(f"{name}: not loaded as written")
    return bad


def init_sglang_on_cpu(target_dir: Path) -> None:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    init_model_parallel_on_cpu()
    server_args = ServerArgs(
        model_path=str(target_dir),
        device="cpu",
        attention_backend="torch_native",
        skip_tokenizer_init=True,
    )
    set_global_server_args_for_scheduler(server_args)
    initialize_dp_attention(server_args, ModelConfig.from_server_args(server_args))


def main_qwen3_moe(target_dir: Path) -> None:
    from transformers import AutoConfig

    init_sglang_on_cpu(target_dir)
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    target = Qwen3MoeForCausalLM(AutoConfig.from_pretrained(target_dir)).to(
        torch.float32
    )
    print(json.dumps({"target": mismatches(target, target_dir)}))


def main(target_dir: Path, draft_dir: Path) -> None:
    from transformers import AutoConfig

    init_sglang_on_cpu(target_dir)

    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM

    target = Qwen3ForCausalLM(AutoConfig.from_pretrained(target_dir)).to(torch.float32)
    draft = LlamaForCausalLMEagle3(AutoConfig.from_pretrained(draft_dir)).to(
        torch.float32
    )
    print(
        json.dumps(
            {
                "target": mismatches(target, target_dir),
                # the draft's lm_head is the target's, set by the worker after loading
                "draft": mismatches(draft, draft_dir, skip=("lm_head.weight",)),
                "draft_loads_head_from_target": bool(draft.load_lm_head_from_target),
            }
        )
    )


def mtp_layer_as_loaded(
    weights: dict[str, torch.Tensor], layer: int
) -> dict[str, torch.Tensor]:
    """Step-3.5-Flash's MTP layer `layer` under the names of sglang's Step3p5MTP, which holds
    one layer: the block at model.mtp_block.*, fusion and head at model.*, the target's
    embedding."""
    prefix = f"model.layers.{layer}."
    out = {"model.embed_tokens.weight": weights["model.embed_tokens.weight"]}
    for name, weight in weights.items():
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix) :]
        if rest.startswith("transformer.shared_head."):
            head = rest.removeprefix("transformer.").replace(".output.", ".head.")
            out[f"model.{head}"] = weight
        elif rest.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
            out[f"model.{rest}"] = weight
        else:
            out[f"model.mtp_block.{rest}"] = weight
    return out


def main_step3p5_mtp(model_dir: Path) -> None:
    """The target (Step3p5ForCausalLM) and one Step3p5MTP per draft step (draft_model_idx k
    loads checkpoint layer num_hidden_layers + k), from the one checkpoint."""
    from sglang.srt.configs.model_config import ModelConfig

    init_sglang_on_cpu(model_dir)
    from sglang.srt.models.step3p5 import Step3p5ForCausalLM
    from sglang.srt.models.step3p5_mtp import Step3p5MTP

    target_config = ModelConfig(str(model_dir)).hf_config
    target = Step3p5ForCausalLM(target_config).to(torch.float32)
    report = {"target": mismatches(target, model_dir)}
    draft_config = ModelConfig(str(model_dir), is_draft_model=True).hf_config
    weights = synth.load_checkpoint(model_dir, dtype=torch.float32).weights
    attention_layer_ids = []
    for k in range(draft_config.num_nextn_predict_layers):
        draft = Step3p5MTP(draft_config, draft_model_idx=k).to(torch.float32)
        expected = mtp_layer_as_loaded(weights, draft_config.num_hidden_layers + k)
        report[f"mtp{k}"] = mismatches(draft, model_dir, expected=expected)
        attention_layer_ids.append(draft.model.mtp_block.self_attn.attn.layer_id)
    # each step's KV pool holds one layer, id 0
    report["mtp_attention_layer_ids"] = attention_layer_ids
    print(json.dumps(report))


if __name__ == "__main__":
    if sys.argv[1] == "--qwen3-moe":
        main_qwen3_moe(Path(sys.argv[2]))
    elif sys.argv[1] == "--step3p5-mtp":
        main_step3p5_mtp(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]), Path(sys.argv[2]))
