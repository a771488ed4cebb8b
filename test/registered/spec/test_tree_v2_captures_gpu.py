"""Routed experts (--enable-return-routed-experts) under tree speculation equal those without.

The target is a synthetic Qwen3-MoE (specpatch.testing.synth, family="qwen3_moe") whose greedy next
token is its bigram table and whose router sends each token to fixed experts in every layer,
with a wide logit gap; the draft is a dense EAGLE head agreeing on ~70% of tokens. sglang
returns one row of experts per position, read from the host cache by KV slot. Spec v2 trees
compact each accepted path to the front of its block: unless the captures move with it, a
committed position returns the experts of whichever tree node verify wrote to its slot.

Run on the GPU host (tools/gpu-tests.sh), or alone:
    python -m pytest -m gpu test/registered/spec/test_tree_v2_captures_gpu.py
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from specpatch.testing import engine as eng
from specpatch.testing import synth

pytestmark = pytest.mark.gpu

NUM_LAYERS = 2
MAX_NEW_TOKENS = 48
BATCH_SIZES = (1, 8)
# The trimmed GPU bundle has no FlashInfer JIT: keep the MoE on the triton kernels.
MOE_FLAGS = dict(enable_return_routed_experts=True, moe_runner_backend="triton")


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory) -> tuple[Path, Path]:
    """2-layer Qwen3-MoE target (8 experts, top 2) + dense EAGLE draft, made on the GPU."""
    cache = os.environ.get("SPECPATCH_MODEL_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("models")
    out = root / f"toy-qwen3-moe-l{NUM_LAYERS}-a0.7"
    if not (out / "draft" / synth.META).exists():
        synth.make_pair(
            out,
            "toy",
            0.7,
            device="cuda",
            family="qwen3_moe",
            moe=synth.MoeSpec(),
            num_layers=NUM_LAYERS,
        )
    return out / "target", out / "draft"


@pytest.fixture(scope="module")
def prompts(moe_pair) -> list[list[int]]:
    vocab = synth.load_meta(moe_pair[0])["spec"]["vocab"]
    return eng.random_prompts(max(BATCH_SIZES), vocab, seed=5)


@dataclass
class RoutedRun:
    output_ids: list[list[int]]
    # per request [prompt_len + output_len - 1, NUM_LAYERS, topk]: the experts of each position
    routed_experts: list[np.ndarray]
    accept_length: float


def routed_experts_of(meta_info: dict, topk: int) -> np.ndarray:
    from sglang.srt.state_capturer.routed_experts import (
        extract_routed_experts_from_meta_info,
    )

    flat = extract_routed_experts_from_meta_info({"meta_info": meta_info})
    return flat.reshape(-1, NUM_LAYERS, topk)


def routed_run(e, prompts: list[list[int]]) -> RoutedRun:
    outs = e.generate(
        input_ids=prompts,
        return_routed_experts=True,
        sampling_params=dict(
            temperature=0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True
        ),
    )
    topk = synth.MoeSpec().num_experts_per_tok
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verifies = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    return RoutedRun(
        output_ids=[list(o["output_ids"]) for o in outs],
        routed_experts=[routed_experts_of(o["meta_info"], topk) for o in outs],
        accept_length=completion / verifies if verifies else float("nan"),
    )


def runs_by_batch_size(
    kwargs: dict, prompts: list[list[int]], expect_spec_v2: bool | None
) -> dict[int, RoutedRun]:
    with eng.engine(**kwargs) as e:
        if expect_spec_v2 is not None:
            assert e.server_args.disable_overlap_schedule is (
                not expect_spec_v2
            ), "wrong spec version"
        return {bs: routed_run(e, prompts[:bs]) for bs in BATCH_SIZES}


@pytest.fixture(scope="module")
def no_spec(moe_pair, prompts) -> dict[int, RoutedRun]:
    target, _ = moe_pair
    runs = runs_by_batch_size(
        eng.engine_kwargs(target, None, None, **MOE_FLAGS), prompts, None
    )
    expected_ids = synth.table_continuations(target, prompts, MAX_NEW_TOKENS)
    for bs, run in runs.items():
        assert run.output_ids == expected_ids[:bs], "no-spec is not the bigram table"
        for prompt, out, experts in zip(prompts, run.output_ids, run.routed_experts):
            # Positions up to the last generated token's input: prompt + output[:-1].
            want = synth.expected_routed_experts(target, prompt + out[:-1]).numpy()
            assert experts.shape == want.shape
            # The model fixes each position's set of experts (their order is the kernel's).
            assert np.array_equal(
                np.sort(experts, axis=-1), np.sort(want, axis=-1)
            ), "no-spec routes off the table"
    return runs


SPECS = [
    pytest.param(eng.SpecConfig(4, 3, 8), True, id="v2-tree-k4s3d8-graph"),
    pytest.param(eng.SpecConfig(4, 3, 8), False, id="v2-tree-k4s3d8-eager"),
    # Controls: spec v1 keeps accepted tokens in their own slots; a chain's path is a prefix.
    pytest.param(
        eng.SpecConfig(4, 3, 8, overlap=False), True, id="v1-tree-k4s3d8-graph"
    ),
    pytest.param(eng.SpecConfig(1, 3, 4), True, id="v2-chain-k1s3d4-graph"),
]


def first_differing_position(a: np.ndarray, b: np.ndarray):
    if a.shape != b.shape:
        return f"shapes {a.shape} vs {b.shape}"
    rows = np.nonzero((a != b).reshape(a.shape[0], -1).any(axis=1))[0]
    return None if rows.size == 0 else int(rows[0])


@pytest.mark.parametrize("spec,cuda_graph", SPECS)
def test_routed_experts_under_speculation_equal_no_speculation(
    moe_pair, prompts, no_spec, spec, cuda_graph, record_metric
):
    target, draft = moe_pair
    kwargs = eng.engine_kwargs(target, draft, spec, cuda_graph=cuda_graph, **MOE_FLAGS)
    runs = runs_by_batch_size(kwargs, prompts, expect_spec_v2=spec.overlap)
    accept = {}
    for bs, run in runs.items():
        assert (
            run.output_ids == no_spec[bs].output_ids
        ), f"bs {bs}: tokens differ from no speculation"
        diverging = {
            i: first_differing_position(got, want)
            for i, (got, want) in enumerate(
                zip(run.routed_experts, no_spec[bs].routed_experts)
            )
            if not np.array_equal(got, want)
        }
        assert (
            not diverging
        ), f"bs {bs}: routed experts differ from no speculation (request: first position) {diverging}"
        accept[bs] = round(run.accept_length, 3)
    record_metric("accept_length_by_bs", accept)
    # Paths of several tokens were accepted: for the trees, many of them off the block's prefix.
    assert all(a > 1.3 for a in accept.values()), accept
