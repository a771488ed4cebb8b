"""Spec v2 tree drafting with an EAGLE3 draft on a dense Qwen3 target (specpatch.testing.synth_eagle3),
on one GPU and with DP attention on two.

With DP attention a rank that has no request still runs the draft, verify and draft extend of
each step (an IDLE batch padded for the MLP sync). Trees with DP attention need CUDA graphs
(speculative_hook.DP_ATTENTION_EAGER_TREE_ERROR says why), so that test captures them.
"""

from __future__ import annotations

import pytest

from specpatch.testing import engine as eng
from specpatch.testing import synth
from specpatch.testing.marks import FA3_SKIP, FLASHINFER_SKIP, gpu_count

pytestmark = pytest.mark.gpu

MAX_NEW_TOKENS = 48
TREE = eng.SpecConfig(4, 3, 8)


def _prompts(target, n: int) -> list[list[int]]:
    return eng.random_prompts(n, synth.load_meta(target)["spec"]["vocab"], seed=5)


def _assert_table(run, expected, label):
    diverged = {
        i: eng.first_divergence(a, b)
        for i, (a, b) in enumerate(zip(run.output_ids, expected))
        if a != b
    }
    assert (
        not diverged
    ), f"{label}: {len(diverged)}/{len(expected)} requests diverge at {diverged}"


def test_eagle3_tree_v2_is_token_identical_to_no_spec(qwen3_eagle3_pair, record_metric):
    target, draft = qwen3_eagle3_pair
    prompts = _prompts(target, 48)
    expected = synth.table_continuations(target, prompts, MAX_NEW_TOKENS)
    with eng.engine(
        **eng.engine_kwargs(target, draft, TREE, speculative_algorithm="EAGLE3")
    ) as e:
        assert (
            e.server_args.disable_overlap_schedule is False
        ), "tree drafting fell back to spec v1"
        for bs in (1, 48):
            run = eng.generate(e, prompts[:bs], MAX_NEW_TOKENS)
            _assert_table(run, expected[:bs], f"bs {bs}")
    record_metric("accept_length", round(run.accept_length, 3))
    assert run.accept_length > 1.3  # the first draft step alone agrees on ~70 %


@pytest.mark.skipif(
    gpu_count() < 2, reason="--dp 2 --tp 2 needs two GPUs (the nvidia-h200-x2 kind)"
)
@pytest.mark.parametrize(
    "backend",
    [
        "triton",
        pytest.param("flashinfer", marks=FLASHINFER_SKIP),
        pytest.param("fa3", marks=FA3_SKIP),
    ],
)
def test_tree_v2_with_dp_attention_and_an_idle_rank(
    qwen3_eagle3_pair, backend, record_metric
):
    """The hook puts DP-attention trees on spec v2; one request leaves the other rank idle, whose
    draft, verify and draft extend (fa3's captured by the fa3-spec-v2-draft-extend-graph patch)
    replay their CUDA graphs on
    padding rows with an idle spec input. Run eagerly, its padded IDLE batches reach the
    backend's metadata instead (the *-idle-speculative-metadata patches; CPU-tested in
    test_*_idle_metadata).
    """
    target, draft = qwen3_eagle3_pair
    prompts = _prompts(target, 48)
    expected = synth.table_continuations(target, prompts, MAX_NEW_TOKENS)
    # enable_dp_lm_head: the synthetic draft borrows the target's lm_head, and the draft runs
    # in the attention-TP group (size 1 here). Without it the borrowed head is the target's
    # half-vocabulary TP shard and the draft's logits are 1024 wide instead of 2048.
    kwargs = eng.engine_kwargs(
        target,
        draft,
        TREE,
        speculative_algorithm="EAGLE3",
        tp_size=2,
        dp_size=2,
        enable_dp_attention=True,
        enable_dp_lm_head=True,
        attention_backend=backend,
    )
    with eng.engine(**kwargs) as e:
        assert (
            e.server_args.disable_overlap_schedule is False
        ), "tree drafting fell back to spec v1"
        alone = eng.generate(
            e, prompts[:1], MAX_NEW_TOKENS
        )  # one request: the other rank idles
        _assert_table(alone, expected[:1], "one request, one idle rank")
        run = eng.generate(e, prompts, MAX_NEW_TOKENS)
        _assert_table(run, expected, "48 requests on both ranks")
    record_metric("accept_length", round(run.accept_length, 3))
    assert run.accept_length > 1.3
