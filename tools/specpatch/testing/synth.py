"""Synthetic Llama target + EAGLE draft pair whose greedy answers are known in advance.

The target is a bigram machine: the greedy next token after `t` is `successor[t]` (a random
permutation), whatever the prefix, with a logit margin of ~20+ nats. Its transformer layers have
small random weights: they cost the compute of a real model and read the KV cache, but can never
move the argmax, so greedy speculative decoding in bf16 must be token-identical to plain decoding.

The EAGLE draft predicts `successor[t]` from the current token alone, correct on a tunable
fraction (`agreement`) of the vocabulary, so acceptance lengths are predictable.

A target can also be written as a dense Qwen3 (`family="qwen3"`, the same weights plus unit q/k
norms), which DP attention needs; `specpatch.testing.synth_eagle3` pairs it with an EAGLE3 draft. Or as
a Qwen3-MoE (`family="qwen3_moe"`, MoeSpec): its experts are small like the dense MLP, and its
router sends token t to the same experts in every layer, expert_table[t] in rank order, with a
wide router-logit gap, so routed experts (--enable-return-routed-experts) are known in advance too.

    python -m specpatch.testing.synth --out DIR --preset toy --agreement 0.7 [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

META = "synth_meta.json"
TOPK_LEVELS = (2, 4, 8, 16)
_EMBED_AND_HEAD = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class TargetSpec:
    num_layers: int = 1
    hidden: int = 256
    intermediate: int = 512
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab: int = 2048
    seed: int = 0
    logit_margin: float = (
        24.0  # nats between successor and runner-up, before the layers' noise
    )
    layer_gain: float = (
        0.1  # layer weights ~ N(0, gain^2 / fan_in): outputs ~1% of the residual
    )
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    @property
    def num_params(self) -> int:
        h, kv = self.hidden, self.num_kv_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab * h + h


PRESETS = {
    "toy": TargetSpec(),
    "small": TargetSpec(
        num_layers=4,
        hidden=512,
        intermediate=1024,
        num_heads=8,
        num_kv_heads=4,
        vocab=4096,
    ),
    # TinyLlama-like shape with 24 layers and head_dim 128: ~1.21B params.
    "bench": TargetSpec(
        num_layers=24,
        hidden=2048,
        intermediate=5632,
        num_heads=16,
        num_kv_heads=4,
        vocab=32000,
    ),
    # Llama-3-8B's shape with a 32000 vocab: ~7.24B params, 14.5 GB in bf16 (made on the GPU).
    "llama8b": TargetSpec(
        num_layers=32,
        hidden=4096,
        intermediate=14336,
        num_heads=32,
        num_kv_heads=8,
        vocab=32000,
    ),
}


@dataclass(frozen=True)
class MoeSpec:
    """The experts of a `qwen3_moe` target. Routing is a function of the current token alone:
    the last num_experts embedding dims carry a code that puts expert_table[t][r] at router
    logit (k - r) * router_gap (k = num_experts_per_tok) and every other expert at 0. The layers
    move the residual by ~1% of its norm, far less than the gap, so every layer routes alike.
    """

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate: int = 128
    router_gap: float = 4.0


@dataclass
class TargetInfo:
    path: Path
    spec: TargetSpec
    num_params: int
    lm_head_scale: float
    min_embedding_margin: float  # min over tokens of top1 - top2 logit, layers ignored


@dataclass
class DraftInfo:
    path: Path
    target_path: Path
    requested_agreement: float
    sigma: float
    agreement: float  # fp32
    agreement_bf16: float
    topk_coverage: dict[int, float] = field(default_factory=dict)  # fp32, k -> fraction


@dataclass
class Checkpoint:
    config: dict
    weights: dict[str, torch.Tensor]


# ---------------------------------------------------------------- files


def llama_config(spec: TargetSpec, *, architecture: str, num_layers: int) -> dict:
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
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        # Every token sits on the successor cycle, so any eos id would cut generations short at
        # a prompt-dependent point; without one, runs stop only at max_new_tokens.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
    }


def qwen3_config(spec: TargetSpec, *, num_layers: int) -> dict:
    """A dense Qwen3: Llama's shape plus per-head q/k RMSNorms. sglang's Qwen3 runs with DP
    attention (its attention is split by the attention-TP size); its Llama does not."""
    return {
        **llama_config(spec, architecture="Qwen3ForCausalLM", num_layers=num_layers),
        "model_type": "qwen3",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_layers,
        "layer_types": ["full_attention"] * num_layers,
    }


def _qwen3_moe_config(spec: TargetSpec, moe: MoeSpec, *, num_layers: int) -> dict:
    """A Qwen3-MoE whose every layer is sparse (decoder_sparse_step 1, no mlp_only_layers)."""
    return {
        **qwen3_config(spec, num_layers=num_layers),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.moe_intermediate,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
    }


TARGET_FAMILIES = ("llama", "qwen3", "qwen3_moe")


def save_model(
    out_dir: Path, config: dict, weights: dict[str, torch.Tensor], meta: dict
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    cpu = {name: t.to(torch.bfloat16).contiguous().cpu() for name, t in weights.items()}
    save_file(cpu, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    # Written last: callers treat an existing meta file as "this dir is complete" and reuse it.
    (out_dir / META).write_text(json.dumps(meta, indent=2) + "\n")


def load_meta(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / META).read_text())


def load_checkpoint(
    model_dir: str | Path, *, dtype=torch.float32, device="cpu", names=None
) -> Checkpoint:
    """All *.safetensors of a dir, or only `names` (the bench target is GBs; most uses need two)."""
    model_dir = Path(model_dir)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt", device=str(device)) as f:
            weights |= {
                n: f.get_tensor(n).to(dtype)
                for n in f.keys()
                if names is None or n in names
            }
    config = json.loads((model_dir / "config.json").read_text())
    return Checkpoint(config, weights)


def as_checkpoint(model: str | Path | Checkpoint, dtype, device) -> Checkpoint:
    if isinstance(model, Checkpoint):
        return Checkpoint(
            model.config, {n: t.to(device, dtype) for n, t in model.weights.items()}
        )
    return load_checkpoint(model, dtype=dtype, device=device)


# ---------------------------------------------------------------- generation


def small_layer_weights(
    spec: TargetSpec, prefix: str, gain: float, gen: torch.Generator, device
) -> dict:
    h, kv, inter = spec.hidden, spec.num_kv_heads * spec.head_dim, spec.intermediate

    def weight(out_features: int, in_features: int) -> torch.Tensor:  # [out, in]
        w = torch.randn(out_features, in_features, generator=gen, device=device)
        return (w * (gain / math.sqrt(in_features))).to(torch.bfloat16)

    def ones() -> torch.Tensor:  # separate tensors: safetensors refuses shared storage
        return torch.ones(h, device=device, dtype=torch.bfloat16)

    return {
        f"{prefix}.input_layernorm.weight": ones(),
        f"{prefix}.self_attn.q_proj.weight": weight(h, h),
        f"{prefix}.self_attn.k_proj.weight": weight(kv, h),
        f"{prefix}.self_attn.v_proj.weight": weight(kv, h),
        f"{prefix}.self_attn.o_proj.weight": weight(h, h),
        f"{prefix}.post_attention_layernorm.weight": ones(),
        f"{prefix}.mlp.gate_proj.weight": weight(inter, h),
        f"{prefix}.mlp.up_proj.weight": weight(inter, h),
        f"{prefix}.mlp.down_proj.weight": weight(h, inter),
    }


def _topk(hidden: torch.Tensor, lm_head: torch.Tensor, k: int, chunk: int = 4096):
    """hidden [n, h], lm_head [vocab, h] -> top-k (logits [n, k], token ids [n, k]); chunked
    because the full [vocab, vocab] logits of the bench preset are GBs."""
    parts = [
        (hidden[i : i + chunk] @ lm_head.T).topk(k, dim=-1)
        for i in range(0, len(hidden), chunk)
    ]
    return torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts])


def _unit_rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))


def successor_from_weights(embed: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """The target's greedy successor table [vocab], read off embed [vocab, h] and lm_head [vocab, h]."""
    return _topk(_unit_rms(embed.float()), lm_head.float(), 1)[1][:, 0]


def successor_table(model_dir: str | Path, device="cpu") -> torch.Tensor:
    """The target's greedy successor table [vocab], from its saved weights."""
    w = load_checkpoint(model_dir, device=device, names=_EMBED_AND_HEAD).weights
    return successor_from_weights(w["model.embed_tokens.weight"], w["lm_head.weight"])


def router_code_dims(hidden: int, moe: MoeSpec) -> slice:
    """The embedding dims that carry the routing code: expert e reads dim hidden - num_experts + e."""
    return slice(hidden - moe.num_experts, hidden)


def routing_codes(chosen_experts: torch.Tensor, moe: MoeSpec) -> torch.Tensor:
    """chosen_experts [vocab, k] (rank order) -> codes [vocab, num_experts]: rank r's expert at
    k - r, others 0 (small integers: exact in bf16)."""
    vocab, k = chosen_experts.shape
    levels = torch.arange(
        k, 0, -1, dtype=torch.float32, device=chosen_experts.device
    )  # [k]
    codes = torch.zeros(vocab, moe.num_experts, device=chosen_experts.device)
    return codes.scatter_(1, chosen_experts, levels.expand(vocab, k))


def router_weight(hidden: int, moe: MoeSpec, device) -> torch.Tensor:
    """[num_experts, hidden]: expert e's logit is router_gap times its code dim (after the
    post-attention RMSNorm, which keeps a code near its value: the embedding's rms is ~1).
    """
    weight = torch.zeros(moe.num_experts, hidden, device=device)
    experts = torch.arange(moe.num_experts, device=device)
    code_dims = torch.arange(hidden, device=device)[router_code_dims(hidden, moe)]
    weight[experts, code_dims] = moe.router_gap
    return weight.to(torch.bfloat16)


def routing_from_weights(
    embed: torch.Tensor, gate: torch.Tensor, k: int
) -> tuple[torch.Tensor, float]:
    """embed [vocab, h], gate [num_experts, h] -> (experts [vocab, k] in rank order, the smallest
    router-logit gap between consecutive ranks down to the first unchosen expert), layers ignored.
    """
    logits = _unit_rms(embed.float()) @ gate.float().T  # [vocab, num_experts]
    top = logits.topk(min(k + 1, logits.shape[1]), dim=-1)
    gaps = top.values[:, :-1] - top.values[:, 1:]
    return top.indices[:, :k], gaps.min().item()


def expert_table(model_dir: str | Path, device="cpu") -> torch.Tensor:
    """A qwen3_moe target's routed experts per token [vocab, k], rank order, from its weights."""
    names = ("model.embed_tokens.weight", "model.layers.0.mlp.gate.weight")
    ckpt = load_checkpoint(model_dir, device=device, names=names)
    k = ckpt.config["num_experts_per_tok"]
    return routing_from_weights(ckpt.weights[names[0]], ckpt.weights[names[1]], k)[0]


def expected_routed_experts(
    model_dir: str | Path, token_ids: list[int]
) -> torch.Tensor:
    """[len(token_ids), num_layers, k]: the experts every layer routes each token to, as sglang
    returns them per position (rank order; a set is what the model fixes, see MoeSpec).
    """
    table = expert_table(model_dir)
    num_layers = load_meta(model_dir)["spec"]["num_layers"]
    return table[torch.tensor(token_ids)][:, None, :].expand(-1, num_layers, -1).clone()


def table_continuations(
    model_dir: str | Path, prompts: list[list[int]], n: int
) -> list[list[int]]:
    """The target's greedy continuation of each prompt: n steps along its successor table."""
    return continuations(successor_table(model_dir).tolist(), prompts, n)


def continuations(
    successor: list[int], prompts: list[list[int]], n: int
) -> list[list[int]]:
    """n steps of each prompt along a successor table (successor_table(...).tolist())."""
    out = []
    for prompt in prompts:
        token, tokens = prompt[-1], []
        for _ in range(n):
            token = successor[token]
            tokens.append(token)
        out.append(tokens)
    return out


def make_target(
    out_dir: str | Path,
    spec: TargetSpec,
    *,
    device="cpu",
    family: str = "llama",
    moe: MoeSpec | None = None,
) -> TargetInfo:
    ckpt, meta = target_checkpoint(spec, device=device, family=family, moe=moe)
    save_model(Path(out_dir), ckpt.config, ckpt.weights, meta)
    return TargetInfo(
        Path(out_dir),
        spec,
        meta["num_params"],
        meta["lm_head_scale"],
        meta["min_embedding_margin"],
    )


def target_checkpoint(
    spec: TargetSpec,
    *,
    device="cpu",
    family: str = "llama",
    moe: MoeSpec | None = None,
) -> tuple[Checkpoint, dict]:
    """The target make_target writes, and its meta, in memory."""
    if family not in TARGET_FAMILIES:
        raise ValueError(f"family must be one of {TARGET_FAMILIES}, got {family!r}")
    if (family == "qwen3_moe") != (moe is not None):
        raise ValueError(
            "a MoeSpec is for family='qwen3_moe' and that family needs one"
        )
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    h = spec.hidden
    successor = torch.randperm(spec.vocab, generator=gen, device=device)  # [vocab]
    embed = torch.randn(spec.vocab, h, generator=gen, device=device).to(
        torch.bfloat16
    )  # [vocab, h]
    if moe is not None:
        assert (
            moe.num_experts <= h // 8
        ), "the routing code would crowd out the embedding"
        # [vocab, k]: a random ordered choice of k experts per token
        chosen = torch.rand(
            spec.vocab, moe.num_experts, generator=gen, device=device
        ).argsort(dim=1)
        chosen = chosen[:, : moe.num_experts_per_tok]
        embed[:, router_code_dims(h, moe)] = routing_codes(chosen, moe).to(
            torch.bfloat16
        )
    # After the final RMSNorm the hidden is ~E[t] at norm sqrt(h): the successor's logit is
    # ~scale*sqrt(h) and every other row is a random projection ~scale*N(0,1), whose max over the
    # vocab stays below ~5 sigma. So this scale gives about `logit_margin` nats.
    assert math.sqrt(h) > 8, "hidden too small for a large margin"
    scale = spec.logit_margin / (math.sqrt(h) - 5.0)
    lm_head = torch.empty(spec.vocab, h, device=device)  # [vocab, h]
    lm_head[successor] = scale * F.normalize(embed.float(), dim=-1)
    lm_head = lm_head.to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}
    for i in range(spec.num_layers):
        weights |= small_layer_weights(
            spec, f"model.layers.{i}", spec.layer_gain, gen, device
        )
        if family in ("qwen3", "qwen3_moe"):
            for norm in ("q_norm", "k_norm"):
                weights[f"model.layers.{i}.self_attn.{norm}.weight"] = torch.ones(
                    spec.head_dim, device=device, dtype=torch.bfloat16
                )
        if moe is not None:
            for proj in ("gate_proj", "up_proj", "down_proj"):  # every layer is sparse
                del weights[f"model.layers.{i}.mlp.{proj}.weight"]
            weights |= _moe_layer_weights(spec, moe, f"model.layers.{i}", gen, device)
    weights["model.norm.weight"] = torch.ones(h, device=device, dtype=torch.bfloat16)

    assert torch.equal(successor_from_weights(embed, lm_head), successor)
    top2 = _topk(_unit_rms(embed.float()), lm_head.float(), 2)[0]  # [vocab, 2]
    min_margin = (top2[:, 0] - top2[:, 1]).min().item()
    # The spec's count is the dense shape's; experts replace the MLP.
    num_params = (
        spec.num_params if moe is None else sum(t.numel() for t in weights.values())
    )
    meta = {
        "kind": "target",
        "family": family,
        "spec": asdict(spec),
        "num_params": num_params,
        "lm_head_scale": scale,
        "min_embedding_margin": min_margin,
        "generated_on": str(
            torch.device(device).type
        ),  # CPU and CUDA generators differ
    }
    if moe is not None:
        gate = weights["model.layers.0.mlp.gate.weight"]
        routed, min_gap = routing_from_weights(embed, gate, moe.num_experts_per_tok)
        assert torch.equal(routed, chosen), "the router does not pick the drawn experts"
        meta["moe"] = asdict(moe)
        meta["min_router_gap"] = min_gap
    if family == "qwen3_moe":
        config = _qwen3_moe_config(spec, moe, num_layers=spec.num_layers)
    elif family == "qwen3":
        config = qwen3_config(spec, num_layers=spec.num_layers)
    else:
        config = llama_config(
            spec, architecture="LlamaForCausalLM", num_layers=spec.num_layers
        )
    return Checkpoint(config, weights), meta


def _moe_layer_weights(
    spec: TargetSpec, moe: MoeSpec, prefix: str, gen: torch.Generator, device
) -> dict:
    """Qwen3-MoE's router and experts in place of the dense MLP (names as HF checkpoints write
    them: sglang's FusedMoE loads mlp.experts.E.{gate,up,down}_proj)."""
    h, inter = spec.hidden, moe.moe_intermediate

    def weight(out_features: int, in_features: int) -> torch.Tensor:  # [out, in]
        w = torch.randn(out_features, in_features, generator=gen, device=device)
        return (w * (spec.layer_gain / math.sqrt(in_features))).to(torch.bfloat16)

    weights = {f"{prefix}.mlp.gate.weight": router_weight(h, moe, device)}
    for e in range(moe.num_experts):
        expert = f"{prefix}.mlp.experts.{e}"
        weights[f"{expert}.gate_proj.weight"] = weight(inter, h)
        weights[f"{expert}.up_proj.weight"] = weight(inter, h)
        weights[f"{expert}.down_proj.weight"] = weight(h, inter)
    return weights


def noisy_identity(noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """A = I + sigma * G / sqrt(h) [h, h], rounded to bf16 as it will be stored."""
    h = noise.shape[0]
    eye = torch.eye(h, device=noise.device)
    return (eye + sigma * noise / math.sqrt(h)).to(torch.bfloat16)


def draft_hits(
    embed, lm_head, successor, fc_a, *, k: int = 1, dtype=torch.float32
) -> torch.Tensor:
    """For every token t, is successor[t] within the top-k of lm_head @ (A E[t])? -> [vocab, k] bool,
    column j = rank j. This is the draft's prediction with its (tiny) decoder layer left out.
    """
    hidden = embed.to(dtype) @ fc_a.to(dtype).T  # [vocab, h]
    return _topk(hidden, lm_head.to(dtype), k)[1] == successor[:, None]


def tune_draft_noise(
    embed, lm_head, successor, noise: torch.Tensor, agreement: float, tolerance: float
) -> float:
    """The sigma for which lm_head @ (A E[t]), A = I + sigma * noise / sqrt(h), ranks the target's
    successor first for `agreement` of the tokens (within tolerance)."""

    def measured(sigma: float) -> float:
        fc_a = noisy_identity(noise, sigma).float()
        return draft_hits(embed, lm_head, successor, fc_a)[:, 0].float().mean().item()

    # Agreement falls from 1 (sigma 0) towards 1/vocab as the noise swamps E[t]; it is not
    # strictly monotone for a fixed G, but close enough for bisection to land within tolerance.
    sigma, got = 0.0, measured(0.0)
    if abs(got - agreement) > tolerance:
        lo, hi = 0.0, 1.0
        while (got := measured(hi)) > agreement + tolerance and hi < 2.0**20:
            lo, hi = hi, hi * 2
        sigma = hi
        for _ in range(60):
            if abs(got - agreement) <= tolerance:
                break
            sigma = (lo + hi) / 2
            got = measured(sigma)
            lo, hi = (sigma, hi) if got > agreement else (lo, sigma)
    return sigma


@dataclass
class TunedDraftMap:
    """A target's token tables and the noisy identity A that makes a draft agree with it as asked."""

    spec: TargetSpec
    # [vocab, h]
    embed: torch.Tensor
    # [vocab, h]
    lm_head: torch.Tensor
    # [vocab]: the target's greedy next token
    successor: torch.Tensor
    # seeded, past the draw of A's noise: a draft takes its other weights from it
    generator: torch.Generator
    sigma: float
    # [h, h] bf16: A = I + sigma * G / sqrt(h)
    matrix: torch.Tensor


def tuned_draft_map(
    target_dir: Path, agreement: float, *, seed: int, device, tolerance: float
) -> TunedDraftMap:
    spec = TargetSpec(**load_meta(target_dir)["spec"])
    target = load_checkpoint(target_dir, device=device, names=_EMBED_AND_HEAD)
    return tuned_map_for(
        spec,
        target.weights["model.embed_tokens.weight"],
        target.weights["lm_head.weight"],
        agreement,
        seed=seed,
        device=device,
        tolerance=tolerance,
    )


def tuned_map_for(
    spec: TargetSpec,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    agreement: float,
    *,
    seed: int,
    device,
    tolerance: float,
) -> TunedDraftMap:
    """tuned_draft_map for a target given by its embed [vocab, h] and lm_head [vocab, h]."""
    assert 0.0 <= agreement <= 1.0
    successor = successor_from_weights(embed, lm_head)
    gen = torch.Generator(device=device).manual_seed(seed)
    noise = torch.randn(
        spec.hidden, spec.hidden, generator=gen, device=device
    )  # G [h, h]
    sigma = tune_draft_noise(embed, lm_head, successor, noise, agreement, tolerance)
    return TunedDraftMap(
        spec, embed, lm_head, successor, gen, sigma, noisy_identity(noise, sigma)
    )


def make_eagle_draft(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    agreement: float,
    seed: int = 1,
    device="cpu",
    tolerance: float = 0.01,
    layer_gain: float = 0.02,
) -> DraftInfo:
    out_dir, target_dir = Path(out_dir), Path(target_dir)
    tuned = tuned_draft_map(
        target_dir, agreement, seed=seed, device=device, tolerance=tolerance
    )
    spec, embed, lm_head, successor = (
        tuned.spec,
        tuned.embed,
        tuned.lm_head,
        tuned.successor,
    )
    gen, sigma, fc_a = tuned.generator, tuned.sigma, tuned.matrix
    hits = draft_hits(embed, lm_head, successor, fc_a.float(), k=max(TOPK_LEVELS))
    hits_bf16 = draft_hits(embed, lm_head, successor, fc_a, dtype=torch.bfloat16)
    coverage = {k: hits[:, :k].any(-1).float().mean().item() for k in TOPK_LEVELS}
    info = DraftInfo(
        out_dir,
        target_dir,
        agreement,
        sigma,
        hits[:, 0].float().mean().item(),
        hits_bf16[:, 0].float().mean().item(),
        coverage,
    )

    h = spec.hidden
    # Names as sglang's LlamaForCausalLMEagle.load_weights wants them: it prefixes "model." to
    # everything, drops lm_head.* (the target's head replaces it), and has no params for
    # layers.0.input_layernorm (deleted for layer 0) or a final norm, so those are left out.
    # embed_tokens is overwritten by the target's at load, but keeps the draft usable alone.
    layer = small_layer_weights(spec, "layers.0", layer_gain, gen, device)
    del layer["layers.0.input_layernorm.weight"]
    weights = {
        "embed_tokens.weight": embed.to(torch.bfloat16),
        # fc sees cat(embed(token), target_hidden); the zero half makes the draft a function of
        # the current token only, so its accuracy is exactly the table measured above.
        "fc.weight": torch.cat(
            [fc_a, torch.zeros(h, h, device=device, dtype=torch.bfloat16)], dim=1
        ),
        "fc.bias": torch.zeros(h, device=device, dtype=torch.bfloat16),
        **layer,
    }
    meta = {
        "kind": "eagle_draft",
        "target_dir": str(target_dir),
        "seed": seed,
        "layer_gain": layer_gain,
        "requested_agreement": agreement,
        "sigma": sigma,
        "agreement": info.agreement,
        "agreement_bf16": info.agreement_bf16,
        "topk_coverage": {str(k): v for k, v in coverage.items()},
        "expected_chain_accept_length": {
            str(n): expected_chain_accept_length(info.agreement, n) for n in range(1, 9)
        },
        "generated_on": str(torch.device(device).type),
    }
    save_model(
        out_dir,
        llama_config(spec, architecture="LlamaForCausalLMEagle", num_layers=1),
        weights,
        meta,
    )
    return info


def make_pair(
    out_root: str | Path,
    preset: str = "toy",
    agreement: float = 0.7,
    *,
    seed: int = 0,
    device="cpu",
    family: str = "llama",
    moe: MoeSpec | None = None,
    num_layers: int | None = None,
    make_draft=None,
) -> tuple[TargetInfo, DraftInfo]:
    """-> out_root/target and out_root/draft (the layout tests and benchmarks look for).
    num_layers overrides the preset's; make_draft (make_eagle_draft by default) writes the
    draft from the target's directory."""
    out_root = Path(out_root)
    spec = TargetSpec(**{**asdict(PRESETS[preset]), "seed": seed})
    if num_layers is not None:
        spec = replace(spec, num_layers=num_layers)
    target = make_target(
        out_root / "target", spec, device=device, family=family, moe=moe
    )
    draft = (make_draft or make_eagle_draft)(
        out_root / "draft",
        target.path,
        agreement=agreement,
        seed=seed + 1,
        device=device,
    )
    return target, draft


def expected_chain_accept_length(agreement: float, num_steps: int) -> float:
    """Tokens per verify for a chain of num_steps drafts, each right with prob `agreement`
    independently: the bonus token plus the accepted prefix."""
    return sum(agreement**i for i in range(num_steps + 1))


# ---------------------------------------------------------------- plain-torch reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()  # as HF: normalize in fp32, round, then scale
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(
        x.dtype
    )


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [b, heads, s, d], positions [s]; neox style (rotate halves), as HF Llama and sglang."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (
        torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d
    )
    angles = positions.float()[:, None] * inv_freq  # [s, d/2]
    cos, sin = torch.cat([angles, angles], -1).cos().to(x.dtype), torch.cat(
        [angles, angles], -1
    ).sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _decoder_layer(
    x: torch.Tensor,
    w: dict,
    prefix: str,
    cfg: dict,
    positions,
    *,
    input_norm: bool = True,
):
    """x [b, s, h] -> [b, s, h]: pre-norm attention + SwiGLU MLP, both residual."""
    b, s, _ = x.shape
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    a = rms_norm(x, w[f"{prefix}.input_layernorm.weight"], eps) if input_norm else x
    q = (a @ w[f"{prefix}.self_attn.q_proj.weight"].T).view(b, s, nh, d).transpose(1, 2)
    k = (
        (a @ w[f"{prefix}.self_attn.k_proj.weight"].T)
        .view(b, s, nkv, d)
        .transpose(1, 2)
    )
    v = (
        (a @ w[f"{prefix}.self_attn.v_proj.weight"].T)
        .view(b, s, nkv, d)
        .transpose(1, 2)
    )
    q, k = rope(q, positions, cfg["rope_theta"]), rope(k, positions, cfg["rope_theta"])
    attn = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    )  # [b, nh, s, d]
    x = (
        x
        + attn.transpose(1, 2).reshape(b, s, nh * d)
        @ w[f"{prefix}.self_attn.o_proj.weight"].T
    )
    m = rms_norm(x, w[f"{prefix}.post_attention_layernorm.weight"], eps)
    gate, up = (
        m @ w[f"{prefix}.mlp.gate_proj.weight"].T,
        m @ w[f"{prefix}.mlp.up_proj.weight"].T,
    )
    return x + (F.silu(gate) * up) @ w[f"{prefix}.mlp.down_proj.weight"].T


def reference_target_logits(
    model: str | Path | Checkpoint, input_ids: torch.Tensor, *, dtype=torch.float32
):
    """Llama forward. input_ids [b, s] -> logits [b, s, vocab] ([s] -> [s, vocab])."""
    if input_ids.dim() == 1:
        return reference_target_logits(model, input_ids[None], dtype=dtype)[0]
    ckpt = as_checkpoint(model, dtype, input_ids.device)
    cfg, w = ckpt.config, ckpt.weights
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    x = w["model.embed_tokens.weight"][input_ids]  # [b, s, h]
    for i in range(cfg["num_hidden_layers"]):
        x = _decoder_layer(x, w, f"model.layers.{i}", cfg, positions)
    return (
        rms_norm(x, w["model.norm.weight"], cfg["rms_norm_eps"]) @ w["lm_head.weight"].T
    )


def reference_draft_logits(
    draft: str | Path | Checkpoint,
    target: str | Path | Checkpoint,
    input_ids: torch.Tensor,
    target_hidden: torch.Tensor | None = None,
    *,
    dtype=torch.float32,
):
    """sglang's LlamaForCausalLMEagle with the target's embed/lm_head swapped in.
    input_ids [b, s], target_hidden [b, s, h] (zeros if None) -> logits [b, s, vocab].
    """
    device = input_ids.device
    d, t = as_checkpoint(draft, dtype, device), as_checkpoint(target, dtype, device)
    embed = t.weights["model.embed_tokens.weight"][input_ids]  # [b, s, h]
    if target_hidden is None:
        target_hidden = torch.zeros_like(embed)
    x = (
        torch.cat([embed, target_hidden.to(dtype)], -1) @ d.weights["fc.weight"].T
        + d.weights["fc.bias"]
    )
    # Layer 0 skips its input norm, and no final norm follows: the layer's residual sum goes
    # straight into the lm_head.
    positions = torch.arange(input_ids.shape[1], device=device)
    x = _decoder_layer(x, d.weights, "layers.0", d.config, positions, input_norm=False)
    return x @ t.weights["lm_head.weight"].T


# ---------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m specpatch.testing.synth", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", required=True, help="writes OUT/target and OUT/draft")
    p.add_argument("--preset", default="toy", choices=sorted(PRESETS))
    p.add_argument("--agreement", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    target, draft = make_pair(
        args.out, args.preset, args.agreement, seed=args.seed, device=args.device
    )
    print(
        f"target: {target.path}  params={target.num_params:,}  min_margin={target.min_embedding_margin:.1f}"
    )
    print(
        f"draft:  {draft.path}  sigma={draft.sigma:.4g}  agreement={draft.agreement:.4f}"
        f"  agreement_bf16={draft.agreement_bf16:.4f}  "
        + "  ".join(f"top{k}={v:.4f}" for k, v in draft.topk_coverage.items())
    )


if __name__ == "__main__":
    main()
