"""GPU: the accept counters at the spec-v2 verify boundary, chain and tree.

Draft trees come from the real draft_forward (general path, any topk) and build_tree_kernel_efficient;
EagleVerifyInput.sample runs the real verify kernel. Its outputs are checked against a plain-torch
greedy tree walk, and the counter contract: sample() returns num_correct_drafts (drafts only) and
accept_lens (drafts + bonus) == num_correct_drafts + 1, 1 <= accept_lens <= num_steps + 1, and the
draft-extend attention's extend lengths == num_accept_tokens. End to end, the scheduler's accept-length
metric (built from both counters) agrees with the requests' own counters.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specpatch.testing.engine import SpecConfig
from specpatch.testing.fake_draft import (
    TableDraftRunner,
    make_draft_worker,
    make_forward_batch,
)

pytestmark = pytest.mark.gpu

VOCAB, HIDDEN = 64, 8


def reference_greedy_accept(candidates, target_predict, next_token, next_sibling):
    """Walk each request's draft tree from the root, taking the child whose token the target
    predicts; returns the accepted node indices per request (root first).

    candidates, target_predict, next_token, next_sibling: [bs, num_draft_tokens]
    """
    paths = []
    for b in range(candidates.shape[0]):
        node, path = 0, [0]
        while True:
            child = int(next_token[b, node])
            while child != -1 and int(candidates[b, child]) != int(
                target_predict[b, node]
            ):
                child = int(next_sibling[b, child])
            if child == -1:
                break
            path.append(child)
            node = child
        paths.append(path)
    return paths


def make_tree(bs: int, topk: int, num_steps: int, num_draft_tokens: int, seed: int):
    from sglang.srt.speculative.eagle_utils import build_tree_kernel_efficient
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    worker = make_draft_worker(
        EagleDraftWorker,
        TableDraftRunner(VOCAB, seed=seed, device="cuda"),
        num_steps=num_steps,
        max_bs=64,
        chain=topk == 1,
        device="cuda",
    )
    worker.topk, worker.speculative_num_draft_tokens = topk, num_draft_tokens
    batch = make_forward_batch(
        bs,
        num_steps * topk,
        vocab_size=VOCAB,
        hidden=HIDDEN,
        seed=seed,
        first_token_width=topk,
        device="cuda",
    )
    batch.spec_info.topk_p = batch.spec_info.topk_p.softmax(-1)
    parent_list, top_scores_index, draft_tokens = worker.draft_forward(batch)
    bonus = torch.randint(0, VOCAB, (bs,), device="cuda")
    seq_lens = torch.randint(5, 50, (bs,), device="cuda")
    _, _, retrieve_index, next_token, next_sibling, flat_tokens = (
        build_tree_kernel_efficient(
            bonus,
            parent_list,
            top_scores_index,
            draft_tokens,
            seq_lens,
            int(seq_lens.sum()),
            topk,
            num_steps,
            num_draft_tokens,
        )
    )
    return SimpleNamespace(
        seq_lens=seq_lens,
        retrieve_index=retrieve_index,
        next_token=next_token,
        next_sibling=next_sibling,
        candidates=flat_tokens.view(bs, num_draft_tokens),
    )


@pytest.mark.parametrize("bs", [1, 8])
@pytest.mark.parametrize(
    "topk,num_steps,num_draft_tokens", [(1, 3, 4), (1, 5, 6), (4, 3, 8), (8, 5, 16)]
)
@pytest.mark.parametrize("agreement", [0.0, 0.6, 1.0])
def test_verify_counters_match_reference_walk(
    bs, topk, num_steps, num_draft_tokens, agreement, record_metric
):
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    tree = make_tree(bs, topk, num_steps, num_draft_tokens, seed=bs * 100 + topk)
    g = torch.Generator(device="cuda").manual_seed(7)
    # Target prediction per node: a child's token with probability `agreement`, else a token no
    # child holds (VOCAB + 1 never occurs), so nothing / everything / part of the tree is accepted.
    target_predict = torch.full(
        (bs, num_draft_tokens), VOCAB + 1, device="cuda", dtype=torch.long
    )
    for b in range(bs):
        for node in range(num_draft_tokens):
            child = int(tree.next_token[b, node])
            if child != -1 and torch.rand((), generator=g, device="cuda") < agreement:
                target_predict[b, node] = tree.candidates[b, child]
    logits = torch.full((bs * num_draft_tokens, VOCAB + 2), -10.0, device="cuda")
    logits.scatter_(1, target_predict.view(-1, 1), 10.0)

    verify = EagleVerifyInput(
        draft_token=tree.candidates.flatten(),
        custom_mask=None,
        positions=None,
        retrieve_index=tree.retrieve_index,
        retrieve_next_token=tree.next_token,
        retrieve_next_sibling=tree.next_sibling,
        retrieve_cum_len=None,
        spec_steps=num_steps,
        topk=topk,
        draft_token_num=num_draft_tokens,
        capture_hidden_mode=None,
        seq_lens_sum=None,
        seq_lens_cpu=None,
    )
    batch = SimpleNamespace(
        forward_mode=SimpleNamespace(is_idle=lambda: False),
        seq_lens=tree.seq_lens,
        input_ids=tree.candidates.flatten(),
        sampling_info=SimpleNamespace(
            is_all_greedy=True,
            acc_additive_penalties=None,
            acc_scaling_penalties=None,
            logit_bias=None,
        ),
    )
    predict, num_correct_drafts, accept_lens, accept_index = verify.sample(
        batch, SimpleNamespace(next_token_logits=logits)
    )

    paths = reference_greedy_accept(
        tree.candidates, target_predict, tree.next_token, tree.next_sibling
    )
    expected_tokens = torch.tensor(
        [len(p) for p in paths], device="cuda"
    )  # drafts + bonus
    assert torch.equal(accept_lens.long(), expected_tokens)
    assert torch.equal(num_correct_drafts.long(), expected_tokens - 1)
    assert torch.equal(num_correct_drafts.long(), (accept_index != -1).sum(dim=1) - 1)
    assert int(num_correct_drafts.min()) >= 0 and int(accept_lens.min()) >= 1
    assert int(accept_lens.max()) <= num_steps + 1
    for b, path in enumerate(paths):
        # accept_index holds flat positions of the accepted nodes; predict there holds the next token
        flat = [b * num_draft_tokens + n for n in path]
        assert accept_index[b, : len(path)].tolist() == flat
        assert predict[flat].tolist() == [int(target_predict[b, n]) for n in path]
    record_metric("mean_accept_lens", round(float(accept_lens.float().mean()), 3))


def test_draft_extend_attention_extend_lengths_are_num_accept_tokens():
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    bs, max_len = 5, 64
    num_correct_drafts = torch.tensor([0, 3, 1, 2, 0], dtype=torch.int32, device="cuda")
    spec_info = EagleDraftExtendInput(
        num_correct_drafts=num_correct_drafts,
        num_accept_tokens=num_correct_drafts + 1,
        num_accept_tokens_cpu=(num_correct_drafts + 1).tolist(),
    )
    req_to_token = torch.arange(bs * max_len, dtype=torch.int32, device="cuda").view(
        bs, max_len
    )
    seq_lens = torch.tensor([10, 20, 7, 33, 5], device="cuda")
    _, _, qo_indptr, _ = spec_info.generate_attn_arg_prefill(
        torch.arange(bs, device="cuda"), seq_lens, int(seq_lens.sum()), req_to_token
    )
    assert torch.equal(qo_indptr.diff().int(), spec_info.num_accept_tokens)


@pytest.mark.parametrize(
    "spec",
    [SpecConfig(1, 3, 4), SpecConfig(4, 3, 8), SpecConfig(4, 3, 8, overlap=False)],
    ids=lambda s: s.label,
)
def test_scheduler_accept_length_metric_agrees_with_request_counters(
    toy_pair, spec, record_metric
):
    from specpatch.testing import engine as eng
    from specpatch.testing import synth

    target, draft = toy_pair
    prompts = eng.random_prompts(16, synth.load_meta(target)["spec"]["vocab"], seed=11)
    # decode_log_interval=1 folds every step into the lifetime totals the metric reads.
    with eng.engine(
        **eng.engine_kwargs(target, draft, spec, decode_log_interval=1)
    ) as e:
        run = eng.generate(e, prompts, 64)
        states = e.get_server_info()["internal_states"]
    metric = states[0]["avg_spec_accept_length"]
    # Per request: drafts + one bonus per verify step. The requests' counters skip the step a
    # request finishes in, the metric counts it: they agree to within that last step.
    drafts = sum(m["spec_accepted_drafts"] for m in run.meta)
    per_request = (drafts + run.verify_count) / run.verify_count
    record_metric("metric_accept_length", round(metric, 3))
    record_metric("request_accept_length", round(per_request, 3))
    assert 1.0 < metric <= spec.num_steps + 1
    assert metric == pytest.approx(per_request, rel=0.1)
