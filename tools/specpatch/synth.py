"""Synthetic target/draft model pairs for speculative-decoding tests, made at test time.

Target: a Llama whose greedy next token is a bigram table `successor[token]` with a large
logit margin. Its residual stream carries the token embedding; lm_head row successor[t] is
the unit embedding of t, so after the final RMSNorm the right logit is ~LOGIT_PEAK and every
other is a random-vector cosine of it. All transformer layers have small random weights: they
read the KV cache and cost a realistic step, but cannot move the argmax. So greedy decoding is
token-identical across kernels (decode, tree-masked verify) even in bf16, where a random-weight
model diverges within a few dozen tokens.

Draft: an EAGLE head (LlamaForCausalLMEagle). sglang gives it the target's embedding and
lm_head, computes fc(cat(embed(token), target_hidden)) -> one layer -> hidden + residual (no
final norm) -> lm_head. Our fc keeps only the embedding half, as A = I + sigma * G / sqrt(h):
at sigma 0 the draft predicts the table exactly; noise turns a deterministic subset of tokens
wrong, with the right successor often still among the next choices, so topk > 1 finds it.
sigma is found by bisection for a requested top-1 agreement.

    python -m specpatch.synth --out DIR --preset toy --agreement 0.7 [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LOGIT_PEAK = 40.0  # target logit of the table's successor, in nats
LAYER_SCALE = 0.1  # each layer adds ~LAYER_SCALE**2 of the residual's norm: never moves the argmax
META = "synth_meta.json"


@dataclass(frozen=True)
class TargetSpec:
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    vocab: int
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def num_params(self) -> int:
        h, kv = self.hidden, self.num_kv_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab * h + h


PRESETS = {
    "toy": TargetSpec(num_layers=1, hidden=256, intermediate=512, num_heads=4, num_kv_heads=2, vocab=2048),
    "small": TargetSpec(num_layers=4, hidden=512, intermediate=1024, num_heads=8, num_kv_heads=4, vocab=4096),
    # ~1.4B parameters: a target step that costs what a real 1B model's does.
    "bench": TargetSpec(num_layers=24, hidden=2048, intermediate=5632, num_heads=16, num_kv_heads=8, vocab=32000),
}


def llama_config(spec: TargetSpec, architecture: str, num_layers: int) -> dict:
    return {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


def _small_layer(spec: TargetSpec, prefix: str, g: torch.Generator, device, with_input_norm: bool) -> dict:
    h, kv, inter = spec.hidden, spec.num_kv_heads * spec.head_dim, spec.intermediate
    std = LAYER_SCALE / math.sqrt(h)

    def w(rows, cols):
        return torch.randn(rows, cols, generator=g, device=device) * std

    layer = {
        f"{prefix}.self_attn.q_proj.weight": w(h, h),
        f"{prefix}.self_attn.k_proj.weight": w(kv, h),
        f"{prefix}.self_attn.v_proj.weight": w(kv, h),
        f"{prefix}.self_attn.o_proj.weight": w(h, h),
        f"{prefix}.mlp.gate_proj.weight": w(inter, h),
        f"{prefix}.mlp.up_proj.weight": w(inter, h),
        f"{prefix}.mlp.down_proj.weight": w(h, inter),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(h, device=device),
    }
    if with_input_norm:
        layer[f"{prefix}.input_layernorm.weight"] = torch.ones(h, device=device)
    return layer


def target_weights(spec: TargetSpec, device="cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(spec.seed)
    embed = torch.randn(spec.vocab, spec.hidden, generator=g, device=device)  # [vocab, hidden]
    successor = torch.randperm(spec.vocab, generator=g, device=device)  # [vocab]
    unit = embed / embed.norm(dim=-1, keepdim=True)
    lm_head = torch.empty_like(embed)
    lm_head[successor] = unit * (LOGIT_PEAK / math.sqrt(spec.hidden))  # RMSNorm output has norm sqrt(h)
    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head,
               "model.norm.weight": torch.ones(spec.hidden, device=device)}
    for i in range(spec.num_layers):
        weights.update(_small_layer(spec, f"model.layers.{i}", g, device, with_input_norm=True))
    return weights


def _save(out_dir: Path, config: dict, weights: dict[str, torch.Tensor], meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.to(torch.bfloat16).contiguous().cpu() for k, v in weights.items()},
              str(out_dir / "model.safetensors"))
    (out_dir / META).write_text(json.dumps(meta, indent=1))


def make_target(out_dir: Path, spec: TargetSpec, device="cpu") -> dict:
    weights = target_weights(spec, device)
    meta = {"kind": "target", "spec": asdict(spec), "num_params": spec.num_params(), "logit_peak": LOGIT_PEAK}
    _save(out_dir, llama_config(spec, "LlamaForCausalLM", spec.num_layers), weights, meta)
    return meta


def load_meta(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / META).read_text())


def successor_table(model_dir: Path, device="cpu") -> torch.Tensor:
    """[vocab] the target's greedy next token for each token, read back from lm_head."""
    w = load_file(str(Path(model_dir) / "model.safetensors"), device=str(device))
    embed, lm_head = w["model.embed_tokens.weight"].float(), w["lm_head.weight"].float()
    return (embed @ lm_head.t()).argmax(dim=-1)


# ---------------------------------------------------------------- draft

def draft_logits(fc_embed: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[n, vocab] the draft's logits for `tokens` ([n]); its layer is small enough to leave out."""
    return (embed[tokens] @ fc_embed.t()) @ lm_head.t()


def draft_stats(fc_embed, embed, lm_head, successor, tokens, ks=(1, 2, 4, 8, 16)) -> dict[int, float]:
    """Fraction of `tokens` whose true successor is in the draft's top-k, for each k."""
    top = draft_logits(fc_embed, embed, lm_head, tokens).topk(max(ks), dim=-1).indices
    hit = top == successor[tokens].unsqueeze(-1)
    return {k: hit[:, :k].any(dim=-1).float().mean().item() for k in ks}


def calibrate_sigma(embed, lm_head, successor, noise, agreement: float, tokens, iters: int = 30) -> float:
    """Bisect sigma (log scale) so that top-1 agreement over `tokens` is about `agreement`."""
    eye = torch.eye(embed.shape[1], device=embed.device)
    hidden = embed.shape[1]

    def top1(sigma: float) -> float:
        return draft_stats(eye + sigma * noise / math.sqrt(hidden), embed, lm_head, successor, tokens, ks=(1,))[1]

    if agreement >= top1(0.0):
        return 0.0
    lo, hi = 1e-3, 1e3
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if top1(mid) > agreement else (lo, mid)
    return math.sqrt(lo * hi)


def make_eagle_draft(out_dir: Path, target_dir: Path, agreement: float, seed: int = 1, device="cpu",
                     calibration_tokens: int = 4096) -> dict:
    if not 0.0 <= agreement <= 1.0:
        raise ValueError(f"agreement must be in [0, 1], got {agreement}")
    target_meta = load_meta(target_dir)
    spec = TargetSpec(**target_meta["spec"])
    w = load_file(str(Path(target_dir) / "model.safetensors"), device=str(device))
    embed, lm_head = w["model.embed_tokens.weight"].float(), w["lm_head.weight"].float()
    successor = (embed @ lm_head.t()).argmax(dim=-1)
    g = torch.Generator(device=device).manual_seed(seed)
    noise = torch.randn(spec.hidden, spec.hidden, generator=g, device=device)  # [hidden, hidden]
    tokens = torch.randperm(spec.vocab, generator=g, device=device)[:calibration_tokens]
    sigma = calibrate_sigma(embed, lm_head, successor, noise, agreement, tokens)
    fc_embed = torch.eye(spec.hidden, device=device) + sigma * noise / math.sqrt(spec.hidden)
    coverage = draft_stats(fc_embed, embed, lm_head, successor, tokens)

    weights = {
        # fc: [hidden, 2 * hidden] over cat(token embedding, target hidden); the hidden half is zero.
        "fc.weight": torch.cat([fc_embed, torch.zeros_like(fc_embed)], dim=1),
        "fc.bias": torch.zeros(spec.hidden, device=device),
        "embed_tokens.weight": embed,  # replaced by the target's at load; kept so nothing is uninitialized
    }
    weights.update(_small_layer(spec, "layers.0", g, device, with_input_norm=False))  # layer 0 skips input norm
    meta = {"kind": "eagle_draft", "target_spec": asdict(spec), "requested_agreement": agreement,
            "sigma": sigma, "agreement": coverage[1], "topk_coverage": {str(k): v for k, v in coverage.items()}}
    _save(out_dir, llama_config(spec, "LlamaForCausalLMEagle", 1), weights, meta)
    return meta


def expected_chain_accept_length(agreement: float, num_steps: int) -> float:
    """Mean tokens per verify (drafts + bonus) when each draft is right with prob `agreement`."""
    return sum(agreement**i for i in range(num_steps + 1))


def make_pair(out_root: Path, preset: str = "toy", agreement: float = 0.7, device="cpu") -> tuple[Path, Path]:
    out_root = Path(out_root)
    target, draft = out_root / "target", out_root / "draft"
    make_target(target, PRESETS[preset], device)
    make_eagle_draft(draft, target, agreement, device=device)
    return target, draft


# ---------------------------------------------------------------- reference forward

def _rms_norm(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, positions, theta=10000.0):
    # x: [seq, heads, head_dim]; HF Llama rotates the two halves of each head.
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = positions[:, None].float() * freqs[None, :]  # [seq, half]
    cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_target_logits(model_dir: Path, input_ids: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """[seq, vocab] logits of the target for one sequence `input_ids` ([seq]), in plain torch."""
    spec = TargetSpec(**load_meta(model_dir)["spec"])
    w = {k: v.to(dtype) for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}
    seq, hd = input_ids.shape[0], spec.head_dim
    positions = torch.arange(seq)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][input_ids]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        h = _rms_norm(x, w[f"{p}.input_layernorm.weight"])
        q = _rope((h @ w[f"{p}.self_attn.q_proj.weight"].t()).view(seq, spec.num_heads, hd), positions)
        k = _rope((h @ w[f"{p}.self_attn.k_proj.weight"].t()).view(seq, spec.num_kv_heads, hd), positions)
        v = (h @ w[f"{p}.self_attn.v_proj.weight"].t()).view(seq, spec.num_kv_heads, hd)
        groups = spec.num_heads // spec.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        attn = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        x = x + torch.einsum("hqk,khd->qhd", attn, v).reshape(seq, -1) @ w[f"{p}.self_attn.o_proj.weight"].t()
        h = _rms_norm(x, w[f"{p}.post_attention_layernorm.weight"])
        gate, up = h @ w[f"{p}.mlp.gate_proj.weight"].t(), h @ w[f"{p}.mlp.up_proj.weight"].t()
        x = x + (torch.nn.functional.silu(gate) * up) @ w[f"{p}.mlp.down_proj.weight"].t()
    return (_rms_norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].t()).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="toy", choices=sorted(PRESETS))
    parser.add_argument("--agreement", type=float, default=0.7)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    target, draft = make_pair(Path(args.out), args.preset, args.agreement, args.device)
    print(f"target: {target} ({load_meta(target)['num_params'] / 1e9:.2f}B params)")
    meta = load_meta(draft)
    print(f"draft:  {draft} (sigma {meta['sigma']:.3f}, top-1 agreement {meta['agreement']:.3f}, "
          f"top-k coverage {meta['topk_coverage']})")


if __name__ == "__main__":
    main()
