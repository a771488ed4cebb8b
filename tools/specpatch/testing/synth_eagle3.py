"""A synthetic EAGLE3 pair: a dense Qwen3 target and an EAGLE3 draft of tunable agreement.

This is the pair DP-attention tests need: sglang's Llama splits its attention by the full TP
size and cannot run with --enable-dp-attention, Qwen3 can; and only EAGLE3 drafts are built
on the attention-TP group.

An EAGLE3 draft (sglang's LlamaForCausalLMEagle3) sees the current token only through its
attention: the residual stream starts from fc(the target's aux hidden states), and only q, k
and v read the token's embedding. This draft routes the token through attention:
- fc is zero, so the first step's residual starts at 0;
- q and k are `attention_scale` times the normalised embedding, head by head, so a position
  attends to itself: its score is 8 c^2 for head_dim 64, other tokens' are ~N(0, c^2) (and an
  equal token elsewhere carries the same value);
- v passes the embedding through and o_proj is A = I + sigma * G / sqrt(h), the noisy identity
  of the EAGLE draft's fc: the first step ranks successor[t] first exactly where
  lm_head @ (A E[t]) does, which is the agreement tuned and measured here.
A later draft step starts from the previous step's residual, so it sees the previous token as
well as the current one and agrees less often. That suits tests of token identity and of the
tree paths, not accept-length targets.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specpatch.testing import synth

# The target layers whose outputs feed the draft (sglang captures the input of layer id + 1).
# Three, sglang's default: the draft-extend CUDA graph sizes its hidden-states buffer from the
# target's config, where it finds no layer ids and assumes 3 (EagleDraftExtendInput.
# hidden_size_for), so a draft with another count fails its graph capture. fc's input (3 h)
# differs from h, so sglang applies fc on the first step.
AUX_LAYER_IDS = (0, 1, 2)
MIN_TARGET_LAYERS = max(AUX_LAYER_IDS) + 2


@dataclass
class Eagle3DraftInfo:
    path: Path
    target_path: Path
    sigma: float
    first_step_agreement: float  # fp32, from lm_head @ (A E[t])


def make_eagle3_draft(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    agreement: float,
    seed: int = 1,
    device="cpu",
    tolerance: float = 0.01,
    layer_gain: float = 0.02,
    attention_scale: float = 2.0,
) -> Eagle3DraftInfo:
    out_dir, target_dir = Path(out_dir), Path(target_dir)
    tuned = synth.tuned_draft_map(
        target_dir, agreement, seed=seed, device=device, tolerance=tolerance
    )
    spec, embed, gen, sigma, o_proj = (
        tuned.spec,
        tuned.embed,
        tuned.generator,
        tuned.sigma,
        tuned.matrix,
    )
    h, d, num_heads = spec.hidden, spec.head_dim, spec.num_heads
    assert (
        h == num_heads * d
    ), "the heads must tile the embedding for q/k/v to read it whole"
    hits = synth.draft_hits(embed, tuned.lm_head, tuned.successor, o_proj.float())[:, 0]

    def from_embedding(
        scale: float,
    ) -> torch.Tensor:  # [h, 2 h]: reads the embedding half only
        eye = scale * torch.eye(h, device=device)
        return torch.cat([eye, torch.zeros(h, h, device=device)], dim=1).to(
            torch.bfloat16
        )

    small = synth.small_layer_weights(spec, "layers.0", layer_gain, gen, device)
    ones = {
        name: torch.ones(h, device=device, dtype=torch.bfloat16)
        for name in (
            "layers.0.input_layernorm.weight",
            "layers.0.hidden_norm.weight",
            "layers.0.post_attention_layernorm.weight",
            "norm.weight",
        )
    }
    weights = {
        "embed_tokens.weight": embed.to(torch.bfloat16),
        "fc.weight": torch.zeros(
            h, len(AUX_LAYER_IDS) * h, device=device, dtype=torch.bfloat16
        ),
        "layers.0.self_attn.q_proj.weight": from_embedding(attention_scale),
        "layers.0.self_attn.k_proj.weight": from_embedding(attention_scale),
        "layers.0.self_attn.v_proj.weight": from_embedding(1.0),
        "layers.0.self_attn.o_proj.weight": o_proj,
        **{name: w for name, w in small.items() if ".mlp." in name},
        **ones,
    }
    config = {
        **synth.llama_config(spec, architecture="LlamaForCausalLMEagle3", num_layers=1),
        # one kv head per query head: head i's query and key read the same slice of the embedding
        "num_key_value_heads": num_heads,
        "draft_vocab_size": None,  # the target's lm_head and vocabulary, no hot-token map
        "target_hidden_size": h,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(AUX_LAYER_IDS),
            "use_aux_hidden_state": True,
        },
    }
    meta = {
        "kind": "eagle3_draft",
        "target_dir": str(target_dir),
        "seed": seed,
        "requested_agreement": agreement,
        "sigma": sigma,
        "attention_scale": attention_scale,
        "first_step_agreement": hits.float().mean().item(),
        "generated_on": str(torch.device(device).type),
    }
    synth.save_model(out_dir, config, weights, meta)
    return Eagle3DraftInfo(out_dir, target_dir, sigma, meta["first_step_agreement"])


def make_eagle3_pair(
    out_root: str | Path,
    preset: str = "toy",
    agreement: float = 0.7,
    *,
    seed: int = 0,
    device="cpu",
) -> tuple[synth.TargetInfo, Eagle3DraftInfo]:
    """-> out_root/target (Qwen3, at least MIN_TARGET_LAYERS layers) and out_root/draft."""
    out_root = Path(out_root)
    base = synth.PRESETS[preset]
    spec = replace(base, seed=seed, num_layers=max(base.num_layers, MIN_TARGET_LAYERS))
    target = synth.make_target(out_root / "target", spec, device=device, family="qwen3")
    draft = make_eagle3_draft(
        out_root / "draft",
        target.path,
        agreement=agreement,
        seed=seed + 1,
        device=device,
    )
    return target, draft


def reference_first_step_logits(
    draft: str | Path | synth.Checkpoint,
    target: str | Path | synth.Checkpoint,
    input_ids: torch.Tensor,
    aux_hidden: torch.Tensor | None = None,
    *,
    dtype=torch.float32,
) -> torch.Tensor:
    """sglang's LlamaForCausalLMEagle3 over a whole sequence (a draft extend), with the target's
    embedding and lm_head. input_ids [s], aux_hidden [s, n_aux * h] (zeros if None) -> [s, vocab].
    """
    device = input_ids.device
    dw = synth.as_checkpoint(draft, dtype, device)
    tw = synth.as_checkpoint(target, dtype, device)
    w, cfg = dw.weights, dw.config
    eps, num_heads, d = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["head_dim"]
    s = input_ids.shape[0]
    embeds = tw.weights["model.embed_tokens.weight"][input_ids]  # [s, h]
    if aux_hidden is None:
        aux_hidden = torch.zeros(s, w["fc.weight"].shape[1], dtype=dtype, device=device)
    residual = aux_hidden.to(dtype) @ w["fc.weight"].T  # [s, h]
    x = torch.cat(
        [
            synth.rms_norm(embeds, w["layers.0.input_layernorm.weight"], eps),
            synth.rms_norm(residual, w["layers.0.hidden_norm.weight"], eps),
        ],
        dim=-1,
    )  # [s, 2 h]

    def heads(proj: str) -> torch.Tensor:  # -> [1, heads, s, d]
        return (
            (x @ w[f"layers.0.self_attn.{proj}.weight"].T)
            .view(s, -1, d)
            .transpose(0, 1)[None]
        )

    positions = torch.arange(s, device=device)
    q = synth.rope(heads("q_proj"), positions, cfg["rope_theta"])
    k = synth.rope(heads("k_proj"), positions, cfg["rope_theta"])
    attn = F.scaled_dot_product_attention(
        q, k, heads("v_proj"), is_causal=True, enable_gqa=True
    )
    residual = (
        residual
        + attn[0].transpose(0, 1).reshape(s, num_heads * d)
        @ w["layers.0.self_attn.o_proj.weight"].T
    )
    m = synth.rms_norm(residual, w["layers.0.post_attention_layernorm.weight"], eps)
    gate, up = (
        m @ w["layers.0.mlp.gate_proj.weight"].T,
        m @ w["layers.0.mlp.up_proj.weight"].T,
    )
    residual = residual + (F.silu(gate) * up) @ w["layers.0.mlp.down_proj.weight"].T
    return (
        synth.rms_norm(residual, w["norm.weight"], eps) @ tw.weights["lm_head.weight"].T
    )
