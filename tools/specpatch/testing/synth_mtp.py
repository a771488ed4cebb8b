"""A synthetic Step-3.5 checkpoint with three MTP layers: a target and its multi-layer EAGLE
draft in one directory, as Step-3.5-Flash ships them.

sglang 0.5.12.post1 runs multi-layer EAGLE (one ModelRunner, KV pool and attention backend per
draft step) for two families only: under --speculative-algorithm EAGLE, ServerArgs turns
enable_multi_layer_eagle on for MiMoV2 and Step3p5 targets, and only their MTP classes take the
draft_model_idx that gives each step its own layer. Step3p5's config class is sglang's own;
MiMoV2's comes with the checkpoint's remote code, so Step3p5 is the one written here.

Target: synth's Qwen3 bigram target (greedy next token successor[t], a margin of ~20+ nats)
under Step3p5's names. A Step3p5 layer is a Qwen3 layer (per-head q/k RMSNorm before rope,
SwiGLU) whose RMSNorms scale by 1 + w, so every norm weight is stored as 0 (qwen3_twin turns
the checkpoint back into the Qwen3 it computes). Layers alternate full and sliding-window
attention like Step-3.5-Flash's; the window outlasts the tests' sequences.

Draft: checkpoint layer NUM_TARGET_LAYERS + k is MTP layer k, run by draft step k:
    logits = shared_head.output @ norm(block(eh_proj @ cat(enorm(E[t]), hnorm(hidden))))
eh_proj is [A_k | 0], A_k synth's noisy identity tuned so that lm_head @ (A_k E[t]) ranks
successor[t] first on agreements[k] of the vocabulary; the zero half makes the layer a function
of its input token alone (whichever hidden states the worker chains in), the block's weights are
small, and shared_head.output is the target's lm_head. The agreements differ per layer, so the
accept length tells whether each step runs its own layer.

    python -m specpatch.testing.synth_mtp --out DIR [--preset toy] [--device cuda]
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from specpatch.testing import synth

# sglang's Step3p5AMultiTokenPredictor builds its block as decoder layer 45 (a FIXME in
# step3p5_mtp.py) and gives its attention layer id 45 - num_hidden_layers, which must be 0: the
# draft runner's KV pool has that one layer. So the target has Step-3.5-Flash's 45 layers.
NUM_TARGET_LAYERS = 45
MTP_AGREEMENTS = (0.9, 0.7, 0.5)
# Step-3.5-Flash's pattern: layer i attends fully when i % 4 == 0, else in a window; the MTP
# layers are sliding (sglang's Step3p5MTP pool is a one-layer SWA pool).
FULL_ATTENTION_EVERY = 4
SLIDING_WINDOW = 512
MTP_LAYER_GAIN = 0.02


@dataclass
class MtpModelInfo:
    path: Path
    spec: synth.TargetSpec
    # per MTP layer, fp32 and bf16: the fraction of tokens t whose successor[t] it ranks first
    agreements: list[float]
    agreements_bf16: list[float]


def mtp_layer_ids(num_mtp_layers: int) -> list[int]:
    return [NUM_TARGET_LAYERS + k for k in range(num_mtp_layers)]


def layer_types(num_layers: int) -> list[str]:
    return [
        "full_attention" if i % FULL_ATTENTION_EVERY == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def step3p5_config(spec: synth.TargetSpec, num_mtp_layers: int) -> dict:
    """config.json as sglang's Step3p5Config reads it; per-layer lists cover the MTP layers."""
    num_layers = NUM_TARGET_LAYERS + num_mtp_layers
    types = layer_types(NUM_TARGET_LAYERS) + ["sliding_attention"] * num_mtp_layers
    return {
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": NUM_TARGET_LAYERS,
        "num_nextn_predict_layers": num_mtp_layers,
        "num_attention_heads": spec.num_heads,
        "num_attention_groups": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        # sliding layers' head counts; the same as the full layers' here
        "attention_other_setting": {
            "num_attention_heads": spec.num_heads,
            "num_attention_groups": spec.num_kv_heads,
        },
        "use_head_wise_attn_gate": False,
        "vocab_size": spec.vocab,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": [spec.rope_theta] * num_layers,
        "partial_rotary_factors": [1.0] * num_layers,
        "rope_scaling": None,
        "yarn_only_types": [],
        "layer_types": types,
        "sliding_window": SLIDING_WINDOW,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_seq_len": spec.max_position_embeddings,
        # Every layer is dense: sglang parses this as comma-separated layer ids and needs one,
        # so it names the id just past the last layer.
        "moe_layers_enum": str(num_layers),
        "moe_num_experts": 1,
        "moe_top_k": 1,
        "moe_intermediate_size": spec.intermediate,
        "share_expert_dim": spec.intermediate,
        "swiglu_limits": [0.0] * num_layers,
        "swiglu_limits_shared": [0.0] * num_layers,
        "tie_word_embeddings": False,
        # as synth.llama_config: every token is on the successor cycle, so no eos id
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": "bfloat16",
    }


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def shift_norms(weights: dict, by: float) -> dict:
    """Every RMSNorm weight plus `by`: -1 turns Qwen3's scale w into Step3p5's 1 + w, +1 back."""
    return {n: (w.float() + by if is_norm(n) else w) for n, w in weights.items()}


def mtp_layer_weights(
    spec: synth.TargetSpec,
    layer: int,
    tuned: synth.TunedDraftMap,
    device,
) -> dict:
    """MTP layer `layer` under Step-3.5-Flash's names (block weights at model.layers.L.*, the
    head under transformer.shared_head), norms at Step3p5's zero."""
    prefix, h = f"model.layers.{layer}", spec.hidden
    block = synth.small_layer_weights(
        spec, prefix, MTP_LAYER_GAIN, tuned.generator, device
    )
    for norm in ("q_norm", "k_norm"):
        block[f"{prefix}.self_attn.{norm}.weight"] = torch.ones(
            spec.head_dim, device=device
        )
    zeros = torch.zeros(h, h, device=device, dtype=torch.bfloat16)
    return {
        **shift_norms(block, -1.0),
        f"{prefix}.enorm.weight": torch.zeros(h, device=device),
        f"{prefix}.hnorm.weight": torch.zeros(h, device=device),
        # cat(enorm(embedding), hnorm(hidden)) -> A_k applied to the embedding half only
        f"{prefix}.eh_proj.weight": torch.cat([tuned.matrix, zeros], dim=1),
        f"{prefix}.transformer.shared_head.norm.weight": torch.zeros(h, device=device),
        f"{prefix}.transformer.shared_head.output.weight": tuned.lm_head.clone(),
    }


def expected_chain_accept_length(agreements: list[float]) -> float:
    """Tokens per verify for a chain whose step k is right with prob agreements[k], each step
    independently: the bonus token plus the accepted prefix."""
    total, reach = 1.0, 1.0
    for agreement in agreements:
        reach *= agreement
        total += reach
    return total


def make_mtp_model(
    out_dir: str | Path,
    preset: str = "toy",
    agreements: tuple[float, ...] = MTP_AGREEMENTS,
    *,
    seed: int = 0,
    device="cpu",
    tolerance: float = 0.01,
) -> MtpModelInfo:
    spec = replace(synth.PRESETS[preset], seed=seed, num_layers=NUM_TARGET_LAYERS)
    target, meta = synth.target_checkpoint(spec, device=device, family="qwen3")
    embed = target.weights["model.embed_tokens.weight"]
    lm_head = target.weights["lm_head.weight"]
    weights = shift_norms(target.weights, -1.0)
    measured, measured_bf16 = [], []
    for k, layer in enumerate(mtp_layer_ids(len(agreements))):
        tuned = synth.tuned_map_for(
            spec,
            embed,
            lm_head,
            agreements[k],
            seed=seed + 1 + k,
            device=device,
            tolerance=tolerance,
        )
        weights |= mtp_layer_weights(spec, layer, tuned, device)
        for dtype, out in ((torch.float32, measured), (torch.bfloat16, measured_bf16)):
            hits = synth.draft_hits(
                embed, lm_head, tuned.successor, tuned.matrix, dtype=dtype
            )
            out.append(hits[:, 0].float().mean().item())
    meta |= {
        "kind": "step3p5_mtp",
        "family": "step3p5",
        "spec": asdict(spec),
        "requested_mtp_agreements": list(agreements),
        "mtp_agreements": measured,
        "mtp_agreements_bf16": measured_bf16,
        "expected_chain_accept_length": expected_chain_accept_length(measured),
    }
    out_dir = Path(out_dir)
    synth.save_model(out_dir, step3p5_config(spec, len(agreements)), weights, meta)
    return MtpModelInfo(out_dir, spec, measured, measured_bf16)


def qwen3_twin(model_dir: str | Path, *, dtype=torch.float32) -> synth.Checkpoint:
    """The target layers of a make_mtp_model checkpoint as the Qwen3 checkpoint they compute
    (synth's qwen3 family: transformers runs it): Qwen3's norm weights, no MTP layers. Exact
    while sequences stay inside the sliding window (every layer then attends to all of them).
    """
    ckpt = synth.load_checkpoint(model_dir, dtype=dtype)
    target = {
        name: weight
        for name, weight in ckpt.weights.items()
        if not any(
            name.startswith(f"model.layers.{layer}.")
            for layer in mtp_layer_ids(ckpt.config["num_nextn_predict_layers"])
        )
    }
    spec = synth.TargetSpec(**synth.load_meta(model_dir)["spec"])
    config = synth.qwen3_config(spec, num_layers=NUM_TARGET_LAYERS)
    return synth.Checkpoint(config, shift_norms(target, 1.0))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m specpatch.testing.synth_mtp",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="toy", choices=sorted(synth.PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    info = make_mtp_model(args.out, args.preset, seed=args.seed, device=args.device)
    print(
        f"{info.path}: MTP agreements {[round(a, 4) for a in info.agreements]} "
        f"(bf16 {[round(a, 4) for a in info.agreements_bf16]})"
    )


if __name__ == "__main__":
    main()
