"""topk=1 chain fast path: the real EagleDraftWorker.draft_forward, chain vs general path.

The draft model is a fake whose next-token logits are a fixed random table indexed by the
input token, so both paths see identical model outputs and any difference is the path's.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.speculative.chain_draft import (
    ChainDraft,
    ChainDraftTable,
    chain_parents,
)
from sglang.srt.speculative.draft_shape import resolve_chain_num_draft_tokens
from sglang.srt.speculative.eagle_utils import organize_draft_results
from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker
from sglang.srt.speculative.multi_layer_eagle_worker_v2 import (
    MultiLayerEagleDraftWorker,
)
from specpatch.testing import fake_draft
from specpatch.testing.fake_draft import TableDraftRunner, make_draft_worker

VOCAB, HIDDEN = 97, 8


@pytest.fixture(autouse=True)
def eager_torch():
    # select_top_k_tokens is torch.compile'd; compiling it on CPU costs minutes and tests nothing here.
    import torch._dynamo

    previous = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    yield
    torch._dynamo.config.disable = previous


def make_worker(num_steps: int, max_bs: int, cls=EagleDraftWorker):
    return make_draft_worker(
        cls, TableDraftRunner(VOCAB), num_steps=num_steps, max_bs=max_bs
    )


def make_forward_batch(bs: int, num_steps: int, first_token_width: int = 1):
    return fake_draft.make_forward_batch(
        bs,
        num_steps,
        vocab_size=VOCAB,
        hidden=HIDDEN,
        first_token_width=first_token_width,
    )


def run_draft_forward(worker, bs: int, num_steps: int):
    outputs = worker.draft_forward(make_forward_batch(bs, num_steps))
    return tuple(outputs), worker.draft_runner.calls


@pytest.mark.parametrize("num_steps", range(1, 9))
@pytest.mark.parametrize("bs", [1, 3, 64])
def test_chain_matches_general_path(num_steps, bs):
    chain_worker = make_worker(num_steps, max_bs=64)
    general_worker = make_worker(num_steps, max_bs=64)
    general_worker.chain_drafts = ChainDraftTable(
        topk=1, max_bs=64, device="cpu"
    )  # never prepared

    (parents, indices, tokens), chain_calls = run_draft_forward(
        chain_worker, bs, num_steps
    )
    (ref_parents, ref_indices, ref_tokens), general_calls = run_draft_forward(
        general_worker, bs, num_steps
    )

    assert parents.tolist() == ref_parents.long().tolist()
    assert indices.tolist() == ref_indices.tolist()
    assert tokens.tolist() == ref_tokens.tolist()
    assert chain_calls == general_calls  # same inputs and KV slots at every draft step
    assert len(chain_calls) == num_steps - 1
    for t in (parents, indices, tokens):
        assert t.dtype == torch.long
    # build_tree_kernel_efficient reads parents and indices through raw pointers
    assert parents.is_contiguous() and indices.is_contiguous()
    assert parents.shape == (bs, num_steps if num_steps > 1 else 0)
    assert tokens.shape == indices.shape == (bs, num_steps)


def test_general_path_matches_organize_draft_results():
    # The reference the chain is compared with must itself be upstream's organizer.
    bs, num_steps = 4, 3
    worker = make_worker(num_steps, max_bs=64)
    worker.chain_drafts = ChainDraftTable(topk=1, max_bs=64, device="cpu")
    parents, indices, tokens = worker.draft_forward(make_forward_batch(bs, num_steps))
    first = make_forward_batch(bs, num_steps).spec_info.topk_index
    token_list = [first] + [tokens[:, i : i + 1] for i in range(1, num_steps)]
    score_list = [torch.ones(bs, 1, 1) for _ in range(num_steps)]
    parents_list = [chain_parents(bs, 2)] + [
        torch.full((bs, 1), i) for i in range(1, num_steps)
    ]
    ref = organize_draft_results(score_list, token_list, parents_list, num_steps + 1)
    assert parents.tolist() == ref[0].tolist()
    assert indices.tolist() == ref[1].tolist()
    assert tokens.tolist() == ref[2].tolist()


def test_chain_path_skips_scoring_ops():
    bs, num_steps = 8, 4
    worker = make_worker(num_steps, max_bs=64)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        worker.draft_forward(make_forward_batch(bs, num_steps))
    ops = {e.key for e in prof.key_averages()}
    assert not ops & {
        "aten::topk",
        "aten::sort",
        "aten::gather",
        "aten::cat",
        "aten::softmax",
        "aten::_softmax",
    }, ops
    assert "aten::argmax" in ops


def test_general_path_does_launch_scoring_ops():
    # Guards the test above: the profiler does see these ops when the general path runs.
    bs, num_steps = 8, 4
    worker = make_worker(num_steps, max_bs=4)  # bs 8 does not fit -> general path
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        worker.draft_forward(make_forward_batch(bs, num_steps))
    ops = {e.key for e in prof.key_averages()}
    assert {"aten::topk", "aten::sort", "aten::gather", "aten::cat"} <= ops


def test_batch_larger_than_preallocation_falls_back():
    num_steps = 3
    small = make_worker(num_steps, max_bs=2)
    assert small.chain_drafts.lookup(num_steps, 2) is not None
    assert small.chain_drafts.lookup(num_steps, 3) is None
    big = make_worker(num_steps, max_bs=64)
    fallback, _ = run_draft_forward(small, 5, num_steps)
    chain, _ = run_draft_forward(big, 5, num_steps)
    for a, b in zip(fallback, chain):
        assert a.tolist() == b.tolist()


def test_rebuild_after_runtime_state_change():
    # Adaptive speculative decoding switches num_steps; init_cuda_graphs prepares each count.
    worker = make_worker(3, max_bs=16)
    worker.chain_drafts.prepare(5, 6)
    worker.speculative_num_steps, worker.speculative_num_draft_tokens = 5, 6
    worker.draft_attn_backend = SimpleNamespace(attn_backends=[object()] * 5)
    (parents, indices, tokens), _ = run_draft_forward(worker, 4, 5)
    reference = make_worker(5, max_bs=16)
    reference.chain_drafts = ChainDraftTable(topk=1, max_bs=16, device="cpu")
    (ref_parents, ref_indices, ref_tokens), _ = run_draft_forward(reference, 4, 5)
    assert worker.chain_drafts.lookup(5, 4).num_steps == 5
    assert (parents.tolist(), indices.tolist(), tokens.tolist()) == (
        ref_parents.tolist(),
        ref_indices.tolist(),
        ref_tokens.tolist(),
    )


def test_hot_token_map_is_applied():
    bs, num_steps = 3, 4
    hot_token_id = torch.randperm(VOCAB * 2)[:VOCAB]  # [hot_vocab] full-vocab ids
    chain_worker, general_worker = make_worker(num_steps, 64), make_worker(
        num_steps, 64
    )
    general_worker.chain_drafts = ChainDraftTable(topk=1, max_bs=64, device="cpu")
    logits_table = torch.randn(VOCAB * 2, VOCAB)  # [full vocab input, hot vocab logits]
    for w in (chain_worker, general_worker):
        w.hot_token_id = hot_token_id
        w.draft_runner.logits_table = logits_table
    chain, _ = run_draft_forward(chain_worker, bs, num_steps)
    general, _ = run_draft_forward(general_worker, bs, num_steps)
    assert chain[2].tolist() == general[2].tolist()
    assert set(chain[2].flatten().tolist()) <= set(hot_token_id.tolist())


def test_multi_layer_chain_organizes_without_kernels():
    # Upstream's general multi-layer path hardcodes device="cuda", so the CPU reference is
    # organize_draft_results on the lists that path builds from the MTP tokens.
    bs, num_steps = 5, 3
    worker = make_worker(num_steps, max_bs=8, cls=MultiLayerEagleDraftWorker)
    fb = make_forward_batch(bs, num_steps, first_token_width=num_steps)
    mtp_tokens = fb.spec_info.topk_index  # [bs, num_steps]
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        parents, indices, tokens = worker.draft_forward(fb)
    assert tokens is mtp_tokens  # used as they are
    score_list = [fb.spec_info.topk_p[:, i].view(bs, 1, 1) for i in range(num_steps)]
    token_list = [mtp_tokens[:, i : i + 1] for i in range(num_steps)]
    parents_list = [chain_parents(bs, 2)] + [
        torch.full((bs, 1), i) for i in range(1, num_steps)
    ]
    ref = organize_draft_results(score_list, token_list, parents_list, num_steps + 1)
    assert parents.tolist() == ref[0].tolist()
    assert indices.tolist() == ref[1].tolist()
    assert tokens.tolist() == ref[2].tolist()
    ops = {e.key for e in prof.key_averages()}
    assert not ops & {"aten::topk", "aten::sort", "aten::gather", "aten::cat"}, ops


def test_inconsistent_chain_shape_is_refused():
    with pytest.raises(ValueError, match="num-draft-tokens"):
        ChainDraft.allocate(num_steps=3, num_draft_tokens=3, max_bs=4, device="cpu")
    with pytest.raises(ValueError, match="num-draft-tokens"):
        ChainDraftTable(topk=1, max_bs=4, device="cpu").prepare(3, 8)
    with pytest.raises(ValueError, match="num-steps"):
        ChainDraft.allocate(num_steps=0, num_draft_tokens=1, max_bs=4, device="cpu")
    assert resolve_chain_num_draft_tokens(3, None) == 4
    assert resolve_chain_num_draft_tokens(3, 4) == 4
    with pytest.raises(
        ValueError,
        match=r"--speculative-num-draft-tokens == --speculative-num-steps \+ 1 \(4\)",
    ):
        resolve_chain_num_draft_tokens(3, 6)


def test_topk_above_one_never_uses_the_chain():
    table = ChainDraftTable(topk=4, max_bs=8, device="cpu")
    table.prepare(3, 8)  # no chain shape check for trees
    assert table.lookup(3, 1) is None


@pytest.mark.parametrize(
    "worker_cls_path",
    [
        "sglang.srt.speculative.eagle_worker_v2:EagleDraftWorker",
        # Its __init__ does not call EagleDraftWorker's: a table made only there was missing, and
        # every STANDALONE v2 engine died in init_cuda_graphs (AttributeError: chain_drafts).
        "sglang.srt.speculative.standalone_worker_v2:StandaloneDraftWorker",
    ],
)
def test_v2_draft_worker_init_makes_the_chain_table(worker_cls_path, monkeypatch):
    """The real __init__ (model loading and attention backends faked) leaves a draft worker
    whose topk=1 draft_forward takes the chain path."""
    import importlib

    from sglang.srt.layers.moe import utils as moe_utils
    from sglang.srt.speculative import eagle_worker_v2
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    module_name, cls_name = worker_cls_path.split(":")
    module = importlib.import_module(module_name)
    worker_cls = getattr(module, cls_name)
    num_steps, bs = 3, 5
    server_args = SimpleNamespace(
        device="cpu",
        speculative_algorithm=(
            "STANDALONE" if cls_name.startswith("Standalone") else "EAGLE"
        ),
        speculative_eagle_topk=1,
        speculative_num_steps=num_steps,
        speculative_num_draft_tokens=num_steps + 1,
        speculative_token_map=None,
        disable_cuda_graph=True,
        enable_dp_attention=False,
        model_impl="auto",
        cuda_graph_max_bs=8,
        max_running_requests=8,
    )
    runner = TableDraftRunner(VOCAB)
    runner.server_args, runner.tp_group = server_args, None
    runner.model = SimpleNamespace(set_embed_and_head=lambda embed, head: None)
    target_runner = SimpleNamespace(
        memory_pool_config=None,
        model=SimpleNamespace(get_embed_and_head=lambda: (None, None)),
    )
    target_worker = SimpleNamespace(
        model_runner=target_runner, get_memory_pool=lambda: (object(), object())
    )
    backends = SimpleNamespace(attn_backends=[object()] * num_steps)
    factory = SimpleNamespace(
        create_decode_backend=lambda: backends, create_draft_extend_backend=lambda: None
    )
    monkeypatch.setattr(
        module, "TpModelWorker", lambda **kwargs: SimpleNamespace(model_runner=runner)
    )
    monkeypatch.setattr(eagle_worker_v2, "DraftBackendFactory", lambda *args: factory)
    # Process-wide state the constructors set: put back afterwards.
    monkeypatch.setattr(EagleDraftInput, "ALLOC_LEN_PER_DECODE", None, raising=False)
    monkeypatch.setattr(
        moe_utils,
        "SPECULATIVE_MOE_RUNNER_BACKEND",
        moe_utils.SPECULATIVE_MOE_RUNNER_BACKEND,
    )
    monkeypatch.setattr(
        moe_utils, "SPECULATIVE_MOE_A2A_BACKEND", moe_utils.SPECULATIVE_MOE_A2A_BACKEND
    )

    worker = worker_cls(server_args, 0, 0, 0, 0, 0, 0, 0, target_worker)

    assert worker.chain_drafts.lookup(num_steps, bs) is not None
    (parents, indices, tokens), _ = run_draft_forward(worker, bs, num_steps)
    reference = make_worker(num_steps, max_bs=8)
    (ref_parents, ref_indices, ref_tokens), _ = run_draft_forward(
        reference, bs, num_steps
    )
    assert (parents.tolist(), indices.tolist(), tokens.tolist()) == (
        ref_parents.tolist(),
        ref_indices.tolist(),
        ref_tokens.tolist(),
    )
