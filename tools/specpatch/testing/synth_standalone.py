"""A synthetic STANDALONE pair: the Llama target and an ordinary Llama LM as its draft, agreeing
with it on a chosen fraction of the vocabulary.

A STANDALONE draft is a complete language model with its own embedding and head (sglang's
StandaloneWorker loads it as it is, LlamaForCausalLM here). This one is the target's checkpoint
with some rows of lm_head moved: the target's greedy next token after `t` is `successor[t]`, the
row of lm_head that lines up with t's embedding; moving the rows of a set D of tokens one place
along a cycle through D makes the draft answer another token of D wherever the target answers a
token of D. So the draft agrees on exactly 1 - |D| / vocab of the current tokens, in any dtype
(rows only move), and it costs as much as the target, which correctness tests do not mind.

    python -m specpatch.testing.synth_standalone --out DIR --preset toy --agreement 0.7 [--device cuda]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from specpatch.testing import synth


@dataclass
class StandaloneDraftInfo:
    path: Path
    target_dir: Path
    requested_agreement: float
    # fraction of current tokens whose greedy next token the draft and the target share
    agreement: float


def moved_head(
    lm_head: torch.Tensor, agreement: float, gen: torch.Generator
) -> torch.Tensor:
    """lm_head [vocab, h] with the rows of round((1 - agreement) * vocab) random tokens moved
    one place along a cycle through them (no row stays, so none of them is predicted as before).
    """
    vocab = lm_head.shape[0]
    num_moved = round((1.0 - agreement) * vocab)
    if num_moved == 1:
        num_moved = 2  # one row cannot move
    moved = torch.randperm(vocab, generator=gen, device=gen.device)[:num_moved].to(
        lm_head.device
    )
    head = lm_head.clone()
    head[moved.roll(1)] = lm_head[moved]
    return head


def make_standalone_draft(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    agreement: float,
    seed: int = 1,
    device="cpu",
) -> StandaloneDraftInfo:
    assert 0.0 <= agreement <= 1.0
    out_dir, target_dir = Path(out_dir), Path(target_dir)
    target = synth.load_checkpoint(target_dir, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = dict(target.weights)
    weights["lm_head.weight"] = moved_head(
        target.weights["lm_head.weight"], agreement, gen
    )

    embed = weights["model.embed_tokens.weight"]
    target_next = synth.successor_from_weights(embed, target.weights["lm_head.weight"])
    draft_next = synth.successor_from_weights(embed, weights["lm_head.weight"])
    measured = (target_next == draft_next).float().mean().item()
    meta = {
        "kind": "standalone_draft",
        "target_dir": str(target_dir),
        "spec": synth.load_meta(target_dir)["spec"],
        "seed": seed,
        "requested_agreement": agreement,
        "agreement": measured,
        "generated_on": str(torch.device(device).type),
    }
    synth.save_model(out_dir, target.config, weights, meta)
    return StandaloneDraftInfo(out_dir, target_dir, agreement, measured)


def make_standalone_pair(
    out_root: str | Path,
    preset: str = "toy",
    agreement: float = 0.7,
    *,
    seed: int = 0,
    device="cpu",
) -> tuple[synth.TargetInfo, StandaloneDraftInfo]:
    """-> out_root/target (the Llama target of specpatch.testing.synth) and out_root/draft."""
    return synth.make_pair(
        out_root,
        preset,
        agreement,
        seed=seed,
        device=device,
        make_draft=make_standalone_draft,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m specpatch.testing.synth_standalone",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--out", required=True, help="writes OUT/target and OUT/draft")
    parser.add_argument("--preset", default="toy", choices=sorted(synth.PRESETS))
    parser.add_argument("--agreement", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    target, draft = make_standalone_pair(
        args.out, args.preset, args.agreement, seed=args.seed, device=args.device
    )
    print(f"target: {target.path}  params={target.num_params:,}")
    print(f"draft:  {draft.path}  agreement={draft.agreement:.4f}")


if __name__ == "__main__":
    main()
