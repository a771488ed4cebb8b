"""Spec v2 tree rounds on a paged KV pool, on CPU: the real allocator, the real req_to_token
and draft kernels, the real prepare_for_decode and release path, a fake KV pool.

Each case runs a few requests through several decode rounds as the overlap scheduler does
(the next round's allocation before the last round's commit) and checks, every round:
- the draft's slots (assign_draft_cache_locs_page_size_1) are the flat layout's positions
  (paged_tree_layout.flat_draft_positions), and the draft-decode KV indices
  (generate_draft_decode_kv_indices with the layout's page size) read exactly the committed
  prefix and the branch's own slots, the last of them the one the forward writes;
- every position a round writes or reads lies below kv_allocated_len, and its slot is in a
  page that the request holds (not free, not another request's);
- the compaction kernel moves the same KV slots as its torch reference, and afterwards the
  committed positions hold the committed chain, page boundaries included;
- the scheduler's estimate (_new_tokens_required_next_decode_spec_v2) equals what the
  allocator takes, and after every request is released every page is free again.
Collected by test_paged_tree_layout.py through triton's interpreter (this file's tests run
only with TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.server_args import set_global_server_args_for_scheduler
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.eagle_info_v2 import assign_draft_cache_locs_page_size_1
from sglang.srt.speculative.paged_tree_layout import (
    draft_branch_page_size,
    draft_decode_kv_positions,
    flat_draft_positions,
)
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import generate_draft_decode_kv_indices
from sglang.srt.speculative.tree_compaction import (
    compact_path_rows_reference,
    compact_path_rows_triton,
)
from sglang.srt.utils.common import next_power_of_2

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs through test_paged_tree_layout.py, under triton's interpreter",
)

NOTHING, EVERYTHING, RANDOM = "nothing", "everything", "random"
POOL_PAGES = 64
ROW_WIDTH = 1024
VOCAB = 1000


@dataclass
class Case:
    name: str
    page_size: int
    topk: int
    num_steps: int
    num_draft_tokens: int
    prompt_lens: list[int]
    accept: str  # NOTHING: the root only; EVERYTHING: the deepest path; RANDOM
    rounds: int = 5
    seed: int = 0

    @property
    def max_accept(self) -> int:
        return self.num_steps + 1


CASES = [
    Case("bs1-mid-page-everything-accepted", 4, 4, 3, 8, [5], EVERYTHING),
    Case("bs1-page-boundary-nothing-accepted", 4, 4, 3, 8, [8], NOTHING),
    Case("bs1-page-boundary-everything-accepted", 16, 8, 3, 16, [16], EVERYTHING),
    Case("bs3-page16-mixed-prefixes", 16, 4, 3, 8, [16, 21, 47], RANDOM, 6, 1),
    Case("bs3-page64-around-a-boundary", 64, 8, 3, 16, [63, 64, 65], RANDOM, 5, 2),
    Case("bs2-page4-wide-tree", 4, 16, 3, 32, [3, 9], EVERYTHING, 4, 3),
    Case("bs4-page16-deep-tree", 16, 4, 5, 20, [1, 15, 16, 17], RANDOM, 6, 4),
    # topk * num_steps well past 2 * num_draft_tokens: the draft, not verify, sets alloc_len.
    Case("bs2-page16-draft-wider-than-verify", 16, 8, 5, 9, [30, 31], EVERYTHING, 4, 5),
]


class FakeReq(SimpleNamespace):
    """The fields and KV bookkeeping methods of a Req that decode and release touch."""

    pop_committed_kv_cache = Req.pop_committed_kv_cache
    pop_overallocated_kv_cache = Req.pop_overallocated_kv_cache
    _cache_commit_len = Req._cache_commit_len


class ChunkCacheStandIn:
    """ChunkCache's release: the committed KV goes straight back to the allocator."""

    def __init__(self, allocator, req_to_token_pool):
        self.token_to_kv_pool_allocator = allocator
        self.req_to_token_pool = req_to_token_pool

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def is_chunk_cache(self) -> bool:
        return True

    def cache_finished_req(self, req, is_insert: bool = True):
        committed = req.pop_committed_kv_cache()
        self.token_to_kv_pool_allocator.free(
            self.req_to_token_pool.req_to_token[req.req_pool_idx, :committed]
        )


class ReqToTokenPoolStandIn:
    def __init__(self, num_rows: int):
        self.req_to_token = torch.zeros((num_rows, ROW_WIDTH), dtype=torch.int32)
        self.freed: list[int] = []

    def free(self, req):
        self.freed.append(req.req_pool_idx)
        req.req_pool_idx = None


def install_server_args(case: Case):
    set_global_server_args_for_scheduler(
        SimpleNamespace(
            speculative_algorithm="EAGLE",
            speculative_eagle_topk=case.topk,
            speculative_num_steps=case.num_steps,
            speculative_num_draft_tokens=case.num_draft_tokens,
            page_size=case.page_size,
            attention_backend="triton",
            strip_thinking_cache=False,
            disable_overlap_schedule=False,
            # An eager server: prepare_for_decode keeps exact host lengths (bounded_host_lens).
            disable_cuda_graph=True,
        )
    )


@dataclass
class World:
    """The pools, the batch, and what each request's committed KV must hold."""

    case: Case
    allocator: PagedTokenToKVPoolAllocator
    req_to_token_pool: ReqToTokenPoolStandIn
    tree_cache: ChunkCacheStandIn
    batch: ScheduleBatch
    # What a position's KV was written from: target KV = the token at the position, draft KV =
    # the token after it (EAGLE's draft reads token p + 1 with hidden state p).
    target_kv: torch.Tensor
    draft_kv: torch.Tensor
    # Per request: the tokens of the committed chain, prompt first.
    chains: list[list[int]] = field(default_factory=list)
    rng: random.Random = field(default_factory=random.Random)

    @property
    def reqs(self) -> list[FakeReq]:
        return self.batch.reqs


def make_world(case: Case) -> World:
    install_server_args(case)
    ps = case.page_size
    size = POOL_PAGES * ps
    allocator = PagedTokenToKVPoolAllocator(
        size, ps, torch.int64, "cpu", kvcache=None, need_sort=False
    )
    pool = ReqToTokenPoolStandIn(len(case.prompt_lens))
    world = World(
        case=case,
        allocator=allocator,
        req_to_token_pool=pool,
        tree_cache=ChunkCacheStandIn(allocator, pool),
        batch=object.__new__(ScheduleBatch),
        target_kv=torch.full((size + ps,), -1, dtype=torch.int64),
        draft_kv=torch.full((size + ps,), -1, dtype=torch.int64),
        rng=random.Random(case.seed),
    )
    reqs = []
    for i, prompt_len in enumerate(case.prompt_lens):
        prompt = [world.rng.randrange(VOCAB) for _ in range(prompt_len)]
        slots = allocator.alloc(-(-prompt_len // ps) * ps)[:prompt_len]
        pool.req_to_token[i, :prompt_len] = slots.to(torch.int32)
        world.target_kv[slots] = torch.tensor(prompt)
        # The prefill's draft extend: the draft KV at p is keyed by the token after it; the
        # last one is the first bonus token, sampled by the prefill.
        bonus = world.rng.randrange(VOCAB)
        world.draft_kv[slots] = torch.tensor(prompt[1:] + [bonus])
        world.chains.append(prompt + [bonus])
        reqs.append(
            FakeReq(
                rid=i,
                req_pool_idx=i,
                kv_committed_len=prompt_len,
                kv_allocated_len=prompt_len,
                kv_committed_freed=False,
                kv_overallocated_freed=False,
                decode_batch_idx=0,
                reasoning_tokens=0,
            )
        )
    spec_info = EagleDraftInput.create_idle_input(
        device="cpu",
        hidden_size=8,
        dtype=torch.float32,
        topk=case.topk,
        capture_hidden_mode=None,
    )
    world.batch.__dict__.update(
        reqs=reqs,
        enable_overlap=True,
        spec_algorithm=SpeculativeAlgorithm.EAGLE,
        spec_info=spec_info,
        device="cpu",
        req_pool_indices=torch.arange(len(reqs), dtype=torch.int64),
        seq_lens=torch.tensor(case.prompt_lens, dtype=torch.int64),
        seq_lens_cpu=torch.tensor(case.prompt_lens, dtype=torch.int64),
        sampling_info=SimpleNamespace(
            penalizer_orchestrator=SimpleNamespace(is_required=False)
        ),
        tree_cache=world.tree_cache,
        token_to_kv_pool_allocator=allocator,
        req_to_token_pool=pool,
        hisparse_coordinator=None,
    )
    return world


# ----------------------------------------------------------------------------- invariants


def pages_of(world: World, req: FakeReq, length: int) -> set[int]:
    ps = world.case.page_size
    slots = world.req_to_token_pool.req_to_token[req.req_pool_idx, :length]
    return set((slots.to(torch.int64) // ps).tolist())


def check_page_ownership(world: World) -> None:
    """Each request's positions [0, kv_allocated_len) are page-contiguous in pages it alone
    holds, and those pages with the free ones are the whole pool, once each."""
    ps = world.case.page_size
    free = world.allocator.free_pages.tolist()
    assert len(free) == len(set(free)), "a page is free twice"
    held = []
    for req in world.reqs:
        n = req.kv_allocated_len
        slots = world.req_to_token_pool.req_to_token[req.req_pool_idx, :n].to(
            torch.int64
        )
        positions = torch.arange(n)
        assert torch.equal(slots % ps, positions % ps), "a slot off its page offset"
        first_of_page = slots[positions - positions % ps]
        assert torch.equal(slots // ps, first_of_page // ps), "a page split"
        held += sorted(set((slots // ps).tolist()))
    assert len(held) == len(set(held)), "two requests hold one page"
    assert set(held).isdisjoint(free), "a request writes a free page"
    assert len(held) + len(free) == POOL_PAGES, (
        f"pages lost: {POOL_PAGES - len(held) - len(free)} "
        f"(the last allocated pages extend past kv_allocated_len: allocated lens "
        f"{[r.kv_allocated_len for r in world.reqs]})"
    )


def allocated_positions_hold(world: World, req: FakeReq, positions) -> None:
    bad = [p for p in positions if p >= req.kv_allocated_len]
    assert not bad, (
        f"request {req.rid} uses positions {bad[:4]}... past kv_allocated_len "
        f"{req.kv_allocated_len}"
    )


# ----------------------------------------------------------------------------- one round


def draft_decode(world: World) -> None:
    """The v2 draft's slots and the draft-decode KV indices, as the triton multi-step backend
    builds them, read back per forward, branch and request."""
    case, batch = world.case, world.batch
    bs, topk, steps = len(world.reqs), case.topk, case.num_steps
    req_to_token = world.req_to_token_pool.req_to_token
    out_cache_loc = torch.empty(bs * topk * steps, dtype=torch.int64)
    assign_draft_cache_locs_page_size_1[(bs,)](
        batch.req_pool_indices,
        req_to_token,
        batch.seq_lens,
        out_cache_loc,
        req_to_token.shape[1],
        topk,
        steps,
    )
    positions = flat_draft_positions(batch.seq_lens, topk, steps)
    expected_slots = torch.stack(
        [
            req_to_token[req.req_pool_idx].to(torch.int64)[positions[b]]
            for b, req in enumerate(world.reqs)
        ]
    )
    assert torch.equal(out_cache_loc.view(bs, topk, steps), expected_slots)
    for b, req in enumerate(world.reqs):
        allocated_positions_hold(world, req, positions[b].flatten().tolist())

    kv_indices, kv_indptr = draft_decode_kv_indices(world, case.page_size)
    seq_lens = batch.seq_lens.tolist()
    for i in range(steps - 1):
        for b, req in enumerate(world.reqs):
            for t in range(topk):
                row = b * topk + t
                lo, hi = kv_indptr[i, row].item(), kv_indptr[i, row + 1].item()
                want = draft_decode_kv_positions(seq_lens[b], t, i, steps)
                allocated_positions_hold(world, req, want)
                read = kv_indices[i, lo:hi].tolist()
                assert read == req_to_token[req.req_pool_idx, want].tolist(), (
                    f"forward {i}, request {b}, branch {t}: the KV indices read other "
                    "slots than the prefix and the branch's own"
                )
                assert read[-1] == out_cache_loc[(b * topk + t) * steps + i].item()


def draft_decode_kv_indices(
    world: World, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """TritonMultiStepDraftBackend.common_template's kernel launch, with the branch layout's
    page size that the backend takes from paged_tree_layout."""
    layout_page_size = draft_branch_page_size(page_size, world.case.topk, spec_v2=True)
    return launch_draft_decode_kv_indices(world, layout_page_size)


def launch_draft_decode_kv_indices(
    world: World, layout_page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    case, batch = world.case, world.batch
    bs, topk, steps = len(world.reqs), case.topk, case.num_steps
    req_to_token = world.req_to_token_pool.req_to_token
    kv_indices = torch.full((steps, bs * topk * ROW_WIDTH), -1, dtype=torch.int64)
    kv_indptr = torch.zeros((steps, bs * topk + 1), dtype=torch.int32)
    generate_draft_decode_kv_indices[(steps, bs, topk)](
        batch.req_pool_indices,
        req_to_token,
        batch.seq_lens,
        kv_indices,
        kv_indptr,
        batch.seq_lens.repeat_interleave(topk),
        req_to_token.shape[1],
        kv_indices.shape[1],
        kv_indptr.shape[1],
        next_power_of_2(bs),
        next_power_of_2(steps),
        next_power_of_2(bs * topk),
        layout_page_size,
    )
    return kv_indices, kv_indptr


def accepted_paths(world: World) -> torch.Tensor:
    """[bs, max_accept] flat verify rows of each request's accepted path, -1 past its end."""
    case = world.case
    ndt, max_accept = case.num_draft_tokens, case.max_accept
    paths = torch.full((len(world.reqs), max_accept), -1, dtype=torch.int32)
    for b in range(len(world.reqs)):
        if case.accept == NOTHING:
            nodes = [0]
        elif case.accept == EVERYTHING:
            nodes = [0] + list(range(ndt - max_accept + 1, ndt))
        else:
            n = world.rng.randint(1, max_accept)
            nodes = [0] + sorted(world.rng.sample(range(1, ndt), n - 1))
        paths[b, : len(nodes)] = torch.tensor(nodes) + b * ndt
    return paths


def verify_and_compact(world: World) -> list[list[int]]:
    """Verify writes each tree node's token into the target KV at seq_len + j; the compaction
    kernel (checked against its reference) moves the accepted path to the front; draft extend
    writes the draft KV of the compacted block. Returns each request's new committed tokens:
    the accepted drafts and the bonus token."""
    case, batch = world.case, world.batch
    bs, ndt = len(world.reqs), case.num_draft_tokens
    req_to_token = world.req_to_token_pool.req_to_token
    verify_positions = batch.seq_lens[:, None] + torch.arange(ndt)
    for b, req in enumerate(world.reqs):
        allocated_positions_hold(world, req, verify_positions[b].tolist())
    out_cache_loc = torch.cat(
        [
            req_to_token[req.req_pool_idx].to(torch.int64)[verify_positions[b]]
            for b, req in enumerate(world.reqs)
        ]
    )
    accept_index = accepted_paths(world)
    paths = [[r for r in row if r >= 0] for row in accept_index.tolist()]
    # predict[r]: the target's token after node r. Node tokens (the verify input): the root is
    # the last round's bonus token; an accepted node is the prediction after its parent.
    predict = torch.randint(0, VOCAB, (bs * ndt,), dtype=torch.int32)
    node_tokens = torch.randint(0, VOCAB, (bs * ndt,))
    for b, path in enumerate(paths):
        node_tokens[path[0]] = world.chains[b][-1]
        for parent, child in zip(path, path[1:]):
            node_tokens[child] = predict[parent].item()
    world.target_kv[out_cache_loc] = node_tokens
    new_tokens = [predict[path].tolist() for path in paths]

    ref_predict = predict.clone()
    ref_tgt, ref_src, ref_bonus = compact_path_rows_reference(
        accept_index, ndt, out_cache_loc, ref_predict, None
    )
    tgt, src, bonus = compact_path_rows_triton(
        accept_index, ndt, out_cache_loc, predict, None
    )
    assert torch.equal(tgt, ref_tgt) and torch.equal(src, ref_src)
    assert torch.equal(bonus, ref_bonus) and torch.equal(predict, ref_predict)
    assert bonus.tolist() == [tokens[-1] for tokens in new_tokens]
    # move_kv_cache: every source is read before any target is written.
    world.target_kv[tgt] = world.target_kv[src].clone()
    # The draft extend runs over the compacted block: position seq_len + j, input predict[j].
    world.draft_kv[out_cache_loc] = predict.to(torch.int64)
    return new_tokens


def check_committed_chains(world: World) -> None:
    """Target KV at committed position p holds chain[p]; draft KV holds chain[p + 1]."""
    req_to_token = world.req_to_token_pool.req_to_token
    for b, (req, chain) in enumerate(zip(world.reqs, world.chains)):
        committed = world.batch.seq_lens[b].item()
        assert committed == len(chain) - 1  # the last token is the next round's root
        slots = req_to_token[req.req_pool_idx, :committed].to(torch.int64)
        assert (
            world.target_kv[slots].tolist() == chain[:committed]
        ), f"request {b}: committed target KV is not the chain"
        assert (
            world.draft_kv[slots].tolist() == chain[1 : committed + 1]
        ), f"request {b}: committed draft KV is not the chain shifted by one"


def run_rounds(world: World) -> None:
    case, batch = world.case, world.batch
    pending_commit = (
        None  # the launched round's accept lengths, processed one step later
    )
    for _ in range(case.rounds):
        estimate = ScheduleBatch._new_tokens_required_next_decode_spec_v2(
            batch, world.reqs, case.page_size
        )
        free_before = world.allocator.available_size()
        batch.spec_info.prepare_for_decode(batch)
        taken = free_before - world.allocator.available_size()
        assert taken == estimate, f"the estimate {estimate} != allocated {taken}"
        if pending_commit is not None:
            for req, accept_len in zip(world.reqs, pending_commit):
                req.kv_committed_len += accept_len - 1
        check_page_ownership(world)

        draft_decode(world)
        new_tokens = verify_and_compact(world)
        for chain, tokens in zip(world.chains, new_tokens):
            chain.extend(tokens)
        accept_lens = [len(t) for t in new_tokens]
        batch.seq_lens = batch.seq_lens + torch.tensor(accept_lens)
        check_committed_chains(world)
        pending_commit = accept_lens

    for req, accept_len in zip(world.reqs, pending_commit):
        req.kv_committed_len += accept_len - 1


def release_all(world: World) -> None:
    for req in world.reqs:
        release_kv_cache(req, world.tree_cache)
    free = world.allocator.free_pages.tolist()
    assert len(free) == len(set(free)), "a page was freed twice"
    assert (
        world.allocator.available_size() == POOL_PAGES * world.case.page_size
    ), f"{POOL_PAGES - len(free)} pages leaked"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rounds_keep_layout_and_accounting(case):
    world = make_world(case)
    check_page_ownership(world)
    run_rounds(world)
    release_all(world)


def test_spec_v1_branch_layout_reads_other_slots_than_v2_writes():
    """Control: with the server's page size (what the backend passed before
    the spec-v2-paged-trees patch) the
    KV indices read branch t >= 1 where spec v1 puts it, not where spec v2's draft wrote it.
    """
    case = Case("control", 4, 4, 3, 8, [5], NOTHING)
    world = make_world(case)
    world.batch.spec_info.prepare_for_decode(world.batch)
    flat_indices, flat_indptr = launch_draft_decode_kv_indices(world, 1)
    paged_indices, paged_indptr = launch_draft_decode_kv_indices(world, 4)
    assert torch.equal(flat_indptr, paged_indptr)
    row = 1  # request 0, branch 1
    lo, hi = flat_indptr[0, row].item(), flat_indptr[0, row + 1].item()
    assert flat_indices[0, lo:hi].tolist() != paged_indices[0, lo:hi].tolist()
