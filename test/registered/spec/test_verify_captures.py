"""Per-token captures (routed experts, the NSA indexer's top-k) follow spec v2 tree compaction.

A capture row of a verify forward is written to the host cache at its row's KV slot
(TopkCaptureOutput.finalize) and read back by a request's slots (BaseTopkCapturer.get_topk).
After compaction a request's committed slots, positions seq_len .. seq_len + accept_len - 1,
must hold its accepted nodes' captures in path order, as they hold their KV. Each case below
runs compact_accepted_tree_path with the rows verify_capture_rows takes from a verify result,
then the scheduler's own finalize and get_topk, and compares with the accepted nodes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.speculative.tree_compaction import compact_accepted_tree_path
from sglang.srt.speculative.verify_captures import (
    verify_capture_rows,
    verify_topk_captures,
)
from sglang.srt.state_capturer.base import BaseTopkCapturer, TopkCaptureOutput

NUM_LAYERS = 3
TOPK = 4
# The routed-experts device cache holds extra columns for fused shared experts; the
# capturer hands out the [..., :TOPK] view, which is what moves.
DEVICE_TOPK = 5
INDEX_LAYERS = 2
INDEX_TOPK = 6


class NodeKVPool:
    """A KV pool whose slot holds the verify row (tree node) that wrote it; its move reads
    every source before it writes a target, as the real pools do."""

    def __init__(self, num_slots: int):
        self.writer_row = torch.full((num_slots,), -1, dtype=torch.int64)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        self.writer_row[tgt_loc] = self.writer_row[src_loc].clone()


@dataclass
class VerifyBatch:
    # [bs, max_accept] flat verify rows of each accepted path, root first, -1 past its end
    accept_index: torch.Tensor
    num_draft_tokens: int
    # [bs] KV length before verify: the root sits at position seq_lens[b]
    seq_lens: list[int]
    # [bs, max_len] KV slot of every position
    req_to_token: torch.Tensor
    # [bs * num_draft_tokens] KV slot verify wrote for each row
    out_cache_loc: torch.Tensor
    # [bs * num_draft_tokens, NUM_LAYERS, DEVICE_TOPK] the routed-experts device cache
    experts_cache: torch.Tensor
    # [bs * num_draft_tokens, INDEX_LAYERS, INDEX_TOPK] the indexer top-k device cache
    index_topk_cache: torch.Tensor
    pool: NodeKVPool
    num_slots: int

    @property
    def bs(self) -> int:
        return self.accept_index.shape[0]

    def path(self, b: int) -> list[int]:
        return [row for row in self.accept_index[b].tolist() if row >= 0]


def make_batch(accept_index: list[list[int]], num_draft_tokens: int, seed: int = 0):
    accept_index = torch.tensor(accept_index, dtype=torch.int32)
    bs = accept_index.shape[0]
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [5 + 3 * b for b in range(bs)]
    max_len = max(seq_lens) + num_draft_tokens
    num_slots = bs * max_len + 11
    # Slots scattered over the pool, as the allocator leaves them.
    req_to_token = torch.randperm(num_slots, generator=gen)[: bs * max_len].view(
        bs, max_len
    )
    out_cache_loc = torch.cat(
        [req_to_token[b, s : s + num_draft_tokens] for b, s in enumerate(seq_lens)]
    )
    rows = bs * num_draft_tokens
    # Every row's capture is distinct, so a row read from the wrong node shows.
    experts_cache = torch.randint(
        0, 1 << 20, (rows, NUM_LAYERS, DEVICE_TOPK), generator=gen
    )
    index_topk_cache = torch.randint(
        0, 1 << 20, (rows, INDEX_LAYERS, INDEX_TOPK), generator=gen
    )
    pool = NodeKVPool(num_slots)
    pool.writer_row[out_cache_loc] = torch.arange(rows)
    return VerifyBatch(
        accept_index,
        num_draft_tokens,
        seq_lens,
        req_to_token,
        out_cache_loc,
        experts_cache.to(torch.int32),
        index_topk_cache.to(torch.int32),
        pool,
        num_slots,
    )


def verify_result(batch: VerifyBatch) -> GenerationBatchResult:
    """A verify result as the overlap scheduler holds it: captures still on the device."""

    def capture(rows: torch.Tensor, num_layers: int, topk: int) -> TopkCaptureOutput:
        host = SimpleNamespace(
            buffer=torch.zeros((batch.num_slots, num_layers, topk), dtype=torch.int32)
        )
        return TopkCaptureOutput(
            out_cache_loc=batch.out_cache_loc, topk=rows, host_cache=host
        )

    return GenerationBatchResult(
        routed_experts_output=capture(
            batch.experts_cache[:, :, :TOPK], NUM_LAYERS, TOPK
        ),
        indexer_topk_output=capture(batch.index_topk_cache, INDEX_LAYERS, INDEX_TOPK),
    )


def compact(
    batch: VerifyBatch, result: GenerationBatchResult, *, with_captures: bool = True
):
    rows = batch.bs * batch.num_draft_tokens
    compact_accepted_tree_path(
        accept_index=batch.accept_index,
        num_draft_tokens=batch.num_draft_tokens,
        verify_out_cache_loc=batch.out_cache_loc,
        kv_pool=batch.pool,
        predict=torch.arange(rows, dtype=torch.int32),
        hidden_states=torch.randn(rows, 8),
        captures=(
            verify_capture_rows(result, batch.out_cache_loc) if with_captures else ()
        ),
    )


def read_committed(
    batch: VerifyBatch, output: TopkCaptureOutput, b: int
) -> torch.Tensor:
    """What the scheduler returns for request b's committed verify positions: get_topk over
    [seq_len, seq_len + accept_len), once the request holds accept_len more tokens in KV.
    """
    capturer = SimpleNamespace(host_cache=output.host_cache)
    accept_len = len(batch.path(b))
    return BaseTopkCapturer.get_topk(
        capturer,
        req_pool_idx=b,
        seqlen=batch.seq_lens[b] + accept_len + 1,  # + 1: the bonus token has no KV yet
        req_to_token_pool=SimpleNamespace(req_to_token=batch.req_to_token),
        start_len=batch.seq_lens[b],
    )


# (name, accept_index, num_draft_tokens)
PATTERNS = [
    ("bs1-nothing-accepted", [[0, -1, -1, -1]], 8),
    # The example: the path 0, 3, 5 sits at the slots of nodes 0, 1, 2.
    ("bs1-path-0-3-5", [[0, 3, 5, -1]], 8),
    ("bs4-nothing-accepted", [[0, -1, -1], [8, -1, -1], [16, -1, -1], [24, -1, -1]], 8),
    # The longest paths, through the last nodes of each block: every row but the root moves.
    ("bs2-everything-accepted", [[0, 5, 6, 7], [8, 13, 14, 15]], 8),
    # Ragged, and request 0's sources 2, 3 are also targets 1, 2.
    ("ragged", [[0, 2, 3, -1], [4, -1, -1, -1], [8, 9, 11, -1]], 4),
    (
        "ragged-bs5-d16",
        [
            [0, 4, 9, 15, -1, -1],
            [16, 17, -1, -1, -1, -1],
            [32, -1, -1, -1, -1, -1],
            [48, 49, 50, 51, 52, 53],
            [64, 70, -1, -1, -1, -1],
        ],
        16,
    ),
]


@pytest.mark.parametrize(
    "name,accept_index,num_draft_tokens", PATTERNS, ids=[p[0] for p in PATTERNS]
)
def test_committed_slots_hold_the_accepted_nodes_captures(
    name, accept_index, num_draft_tokens
):
    batch = make_batch(accept_index, num_draft_tokens)
    experts_before = batch.experts_cache[:, :, :TOPK].clone()
    index_topk_before = batch.index_topk_cache.clone()
    shared_columns_before = batch.experts_cache[:, :, TOPK:].clone()
    result = verify_result(batch)

    compact(batch, result)
    result.routed_experts_output.finalize()
    result.indexer_topk_output.finalize()

    for b in range(batch.bs):
        path = batch.path(b)
        committed = batch.req_to_token[
            b, batch.seq_lens[b] : batch.seq_lens[b] + len(path)
        ]
        # The KV moved along the path ...
        assert batch.pool.writer_row[committed].tolist() == path
        # ... and so did both captures.
        assert torch.equal(
            read_committed(batch, result.routed_experts_output, b), experts_before[path]
        )
        assert torch.equal(
            read_committed(batch, result.indexer_topk_output, b),
            index_topk_before[path],
        )
    # The fused shared experts' columns are not the capture's: left as they were.
    assert torch.equal(batch.experts_cache[:, :, TOPK:], shared_columns_before)


def test_without_the_captures_a_committed_slot_keeps_its_tree_node():
    """The bug this guards: the path 0, 3, 5 committed, but the slots returned nodes 0, 1, 2."""
    batch = make_batch([[0, 3, 5, -1]], 8)
    experts_before = batch.experts_cache[:, :, :TOPK].clone()
    result = verify_result(batch)

    compact(batch, result, with_captures=False)
    result.routed_experts_output.finalize()

    assert batch.pool.writer_row[batch.req_to_token[0, 5:8]].tolist() == [0, 3, 5]
    assert torch.equal(
        read_committed(batch, result.routed_experts_output, 0),
        experts_before[[0, 1, 2]],
    )


def test_nsa_indexer_keys_move_with_the_pool_and_its_top_k_with_the_captures():
    """NSA's per-slot indexer state, fp8 K and scales, lives in NSATokenToKVPool and moves with
    the KV (kv_move.move_nsa_kv); the indexer's top-k selection is not stored per slot and
    moves only as a capture."""
    from test_kv_move import NSA_PAGE, fill_random_bytes, index_tokens, make_nsa

    pool = make_nsa(size=4 * NSA_PAGE)
    assert [name for name in vars(pool) if "topk" in name.lower()] == []
    (index_buf,) = pool.index_k_with_scale_buffer[:1]
    fill_random_bytes(pool.index_k_with_scale_buffer, seed=3)
    batch = make_batch([[0, 2, 3, -1], [4, -1, -1, -1], [8, 9, 11, -1]], 4, seed=1)
    assert batch.num_slots <= pool.size
    keys_before, scales_before = index_tokens(pool, index_buf)
    index_topk_before = batch.index_topk_cache.clone()
    result = verify_result(batch)

    compact_accepted_tree_path(
        accept_index=batch.accept_index,
        num_draft_tokens=batch.num_draft_tokens,
        verify_out_cache_loc=batch.out_cache_loc,
        kv_pool=pool,
        predict=torch.zeros(batch.bs * batch.num_draft_tokens, dtype=torch.int32),
        hidden_states=None,
        captures=verify_capture_rows(result, batch.out_cache_loc),
    )
    result.indexer_topk_output.finalize()

    keys, scales = index_tokens(pool, index_buf)
    for b in range(batch.bs):
        path = batch.path(b)
        committed = batch.req_to_token[
            b, batch.seq_lens[b] : batch.seq_lens[b] + len(path)
        ]
        node_slots = batch.out_cache_loc[path]
        assert torch.equal(keys[committed], keys_before[node_slots])
        assert torch.equal(scales[committed], scales_before[node_slots])
        assert torch.equal(
            read_committed(batch, result.indexer_topk_output, b),
            index_topk_before[path],
        )


# --- verify_capture_rows --------------------------------------------------------------------


def test_capture_rows_are_the_device_views_of_every_capture_on():
    batch = make_batch([[0, 1, -1]], 4)
    result = verify_result(batch)
    rows = verify_capture_rows(result, batch.out_cache_loc)
    assert rows[0] is result.routed_experts_output.topk
    assert rows[1] is result.indexer_topk_output.topk
    assert len(rows) == 2


def test_no_capturer_on_means_no_rows():
    assert verify_capture_rows(GenerationBatchResult(), torch.arange(8)) == []
    result = GenerationBatchResult(
        indexer_topk_output=TopkCaptureOutput(
            torch.arange(8), torch.zeros(8, 1, 2), None
        )
    )
    assert [c.topk.shape for c in verify_topk_captures(result)] == [(8, 1, 2)]


def test_every_capture_field_of_a_verify_result_is_walked():
    """verify_topk_captures finds captures by type: these are the fields it covers today."""
    fields = {
        f.name
        for f in dataclasses.fields(GenerationBatchResult)
        if "TopkCaptureOutput" in str(f.type)
    }
    assert fields == {"routed_experts_output", "indexer_topk_output"}


def test_a_capture_of_other_rows_is_refused():
    loc = torch.arange(8)
    result = GenerationBatchResult(
        routed_experts_output=TopkCaptureOutput(loc, torch.zeros(6, 2, 2), None)
    )
    with pytest.raises(
        ValueError, match="holds 6 rows for 8 slots; the verify wrote 8"
    ):
        verify_capture_rows(result, loc)
    result = GenerationBatchResult(
        routed_experts_output=TopkCaptureOutput(loc[:4], torch.zeros(4, 2, 2), None)
    )
    with pytest.raises(ValueError, match="the verify wrote 8"):
        verify_capture_rows(result, loc)


def test_a_capture_already_on_another_device_is_refused():
    loc = torch.arange(8)
    result = GenerationBatchResult(
        routed_experts_output=TopkCaptureOutput(
            loc, torch.empty(8, 2, 2, device="meta"), None
        )
    )
    with pytest.raises(ValueError, match="already copied to the host"):
        verify_capture_rows(result, loc)


def test_compaction_refuses_a_capture_of_other_rows():
    with pytest.raises(ValueError, match="does not have the verify's 8 rows"):
        compact_accepted_tree_path(
            accept_index=torch.tensor([[0, 1], [4, -1]], dtype=torch.int32),
            num_draft_tokens=4,
            verify_out_cache_loc=torch.arange(8),
            kv_pool=NodeKVPool(8),
            predict=torch.zeros(8, dtype=torch.int32),
            hidden_states=None,
            captures=[torch.zeros(4, 2, 2, dtype=torch.int32)],
        )


# --- the draft model runner records no captures (spec-v2-tree-captures-follow-compaction) ---


@pytest.fixture
def global_capturers():
    from sglang.srt.state_capturer import indexer_topk, routed_experts

    saved = (
        routed_experts.get_global_experts_capturer(),
        indexer_topk.get_global_indexer_capturer(),
    )
    target_experts, target_indexer = object(), object()
    routed_experts.set_global_experts_capturer(target_experts)
    indexer_topk.set_global_indexer_capturer(target_indexer)
    yield target_experts, target_indexer
    routed_experts.set_global_experts_capturer(saved[0])
    indexer_topk.set_global_indexer_capturer(saved[1])


def test_a_draft_runner_keeps_the_targets_capturers(global_capturers):
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.state_capturer.indexer_topk import get_global_indexer_capturer
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    # Only is_draft_worker: the draft returns before reading its config or the server args.
    draft_runner = SimpleNamespace(is_draft_worker=True)
    ModelRunner.init_routed_experts_capturer(draft_runner)
    ModelRunner.init_indexer_capturer(draft_runner)
    assert (
        get_global_experts_capturer(),
        get_global_indexer_capturer(),
    ) == global_capturers


def test_a_dense_draft_config_has_no_experts_to_capture():
    """Why the draft runner must not build a capturer: its config has no num_experts_per_tok
    (before the spec-v2-tree-captures-follow-compaction patch, a dense EAGLE draft of an MoE
    target raised here at start-up).
    """
    from transformers import LlamaConfig

    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer

    draft_config = SimpleNamespace(hf_text_config=LlamaConfig(num_hidden_layers=1))
    with pytest.raises(AttributeError, match="num_experts_per_tok"):
        RoutedExpertsCapturer(
            draft_config,
            num_tokens=16,
            max_running_requests=4,
            num_fused_shared_experts=0,
            device="cpu",
        )


# --- a finished request returns the captures of the tokens it returns -----------------------
#
# Spec v2 commits a verify's accepted run, then checks the stop (Req.check_finished with
# new_accepted_len): output_ids may run past max_new_tokens or a stop token, finished_len
# marking where the returned output ends. The captures returned must end there too, or spec v2
# returns longer arrays than no speculation (the GPU test's v2 cases, chains included).

PROMPT = [11, 12, 13, 14, 15]
VOCAB = 64


def token_capture(token: int, num_layers: int, topk: int) -> torch.Tensor:
    """The synthetic model's capture of a position: a function of its token alone."""
    return (token * 1000 + torch.arange(num_layers * topk, dtype=torch.int32)).view(
        num_layers, topk
    )


class DecodedRequest:
    """A real Req decoded as the scheduler does (process_batch_result_decode: extend
    output_ids by each step's accepted tokens, then check_finished(new_accepted_len)), with
    every position the model was fed written to the host caches at its KV slot."""

    def __init__(self, steps: list[list[int]], **sampling):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(**sampling)
        params.normalize(None)
        self.req = Req(
            "r", "", list(PROMPT), params, vocab_size=VOCAB, return_routed_experts=True
        )
        self.req.req_pool_idx = 0
        for accepted in steps:
            assert not self.req.finished(), "decoded past the finish"
            self.req.output_ids.extend(accepted)
            self.req.check_finished(len(accepted))
        assert self.req.finished()
        fed = PROMPT + self.req.output_ids[:-1]  # the last token is sampled, not fed
        gen = torch.Generator().manual_seed(len(fed))
        self.num_slots = 4 * len(fed)
        slots = torch.randperm(self.num_slots, generator=gen)[: len(fed) + 1]
        self.req_to_token = slots.view(1, -1)
        self.experts = self._host_cache(fed, NUM_LAYERS, TOPK)
        self.index_topk = self._host_cache(fed, INDEX_LAYERS, INDEX_TOPK)

    def _host_cache(self, fed: list[int], num_layers: int, topk: int):
        capturer = BaseTopkCapturer.__new__(BaseTopkCapturer)
        capturer.host_cache = SimpleNamespace(
            buffer=torch.full((self.num_slots, num_layers, topk), -1, dtype=torch.int32)
        )
        for position, token in enumerate(fed):
            slot = self.req_to_token[0, position]
            capturer.host_cache.buffer[slot] = token_capture(token, num_layers, topk)
        return capturer

    def collect(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the scheduler returns for the finished request: (routed experts, top-k)."""
        from sglang.srt.managers.scheduler_output_processor_mixin import (
            SchedulerOutputProcessorMixin as Mixin,
        )
        from sglang.srt.state_capturer import indexer_topk, routed_experts

        saved = (
            routed_experts.get_global_experts_capturer(),
            indexer_topk.get_global_indexer_capturer(),
        )
        routed_experts.set_global_experts_capturer(self.experts)
        indexer_topk.set_global_indexer_capturer(self.index_topk)
        try:
            scheduler = SimpleNamespace(
                req_to_token_pool=SimpleNamespace(req_to_token=self.req_to_token)
            )
            Mixin.maybe_collect_routed_experts(scheduler, self.req)
            Mixin.maybe_collect_indexer_topk(scheduler, self.req)
        finally:
            routed_experts.set_global_experts_capturer(saved[0])
            indexer_topk.set_global_indexer_capturer(saved[1])
        return self.req.routed_experts, self.req.indexer_topk


def expected_captures(output: list[int], num_layers: int, topk: int) -> torch.Tensor:
    fed = PROMPT + output[:-1]
    return torch.stack([token_capture(t, num_layers, topk) for t in fed])


OUTPUT = [21, 22, 23, 24, 25, 26]
# (name, sampling params, spec v2 verify steps: accepted tokens per step, the returned output)
OVERSHOOTS = [
    # max_new_tokens 6 reached inside the second step's run of 4: 1 token past it.
    (
        "max-new-tokens",
        dict(max_new_tokens=6, ignore_eos=True),
        [OUTPUT[:3], OUTPUT[3:] + [27]],
        OUTPUT,
    ),
    # Reached at the first token of a run of 3: 2 tokens past it.
    (
        "max-new-tokens-by-2",
        dict(max_new_tokens=4, ignore_eos=True),
        [OUTPUT[:3], OUTPUT[3:]],
        OUTPUT[:4],
    ),
    # Stop token 23 is the first of a run of 3 accepted tokens.
    (
        "stop-token",
        dict(max_new_tokens=32, stop_token_ids=[23]),
        [OUTPUT[:2], OUTPUT[2:5]],
        OUTPUT[:3],
    ),
]


@pytest.mark.parametrize(
    "name,sampling,steps,returned", OVERSHOOTS, ids=[o[0] for o in OVERSHOOTS]
)
def test_spec_v2_overshoot_returns_the_captures_of_no_speculation(
    name, sampling, steps, returned
):
    no_spec = DecodedRequest([[t] for t in returned], **sampling)
    spec_v2 = DecodedRequest(steps, **sampling)
    assert no_spec.req.output_ids_through_stop == returned
    assert spec_v2.req.output_ids_through_stop == returned
    assert len(spec_v2.req.output_ids) > len(returned), "the case does not overshoot"

    got_experts, got_index_topk = spec_v2.collect()
    want_experts, want_index_topk = no_spec.collect()
    assert torch.equal(want_experts, expected_captures(returned, NUM_LAYERS, TOPK))
    assert torch.equal(got_experts, want_experts)
    assert torch.equal(
        want_index_topk, expected_captures(returned, INDEX_LAYERS, INDEX_TOPK)
    )
    assert torch.equal(got_index_topk, want_index_topk)


def test_read_by_req_seqlen_an_overshoot_returns_rows_the_user_never_got():
    """The bug this guards: Req.seqlen counts output_ids past finished_len."""
    spec_v2 = DecodedRequest(OVERSHOOTS[0][2], **OVERSHOOTS[0][1])
    req = spec_v2.req
    by_seqlen = spec_v2.experts.get_topk(
        req_pool_idx=0,
        seqlen=req.seqlen,
        req_to_token_pool=SimpleNamespace(req_to_token=spec_v2.req_to_token),
    )
    assert by_seqlen.shape[0] == len(PROMPT) + len(OUTPUT)  # one row too many
    assert spec_v2.collect()[0].shape[0] == len(PROMPT) + len(OUTPUT) - 1


def test_returned_seqlen():
    from sglang.srt.speculative.finished_captures import returned_seqlen

    assert (
        returned_seqlen(5, 7, None) == 12
    )  # not finished, or finished at its last token
    assert returned_seqlen(5, 7, 6) == 11  # spec v2 decoded one past the stop
    assert returned_seqlen(5, 7, 7) == 12
    assert returned_seqlen(5, 7, 9) == 12  # never more than it decoded
    with pytest.raises(ValueError, match="non-negative"):
        returned_seqlen(5, 7, -1)
