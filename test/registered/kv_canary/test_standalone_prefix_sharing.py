"""STANDALONE shares prefixes through the radix cache: the draft KV must stay the request's own.

The GPU run that motivated these tests (STANDALONE chain and tree, SGLANG_TEST_RETRACT=1, 600
random prompts, raise mode) stopped on one request per run, at position 0 of the draft pool
only: the slot held the draft K/V another row wrote at position 0. STANDALONE runs EAGLE's
draft extend (ids rotated by one: the draft KV at p holds token p + 1), but upstream keyed its
radix cache on single tokens. Two prompts in one prefill that share only their first token both
write position 0; cache_unfinished_req then finds the first one's position 0 in the tree and
points the second one's row at it, so the second request's draft reads the first one's second
token at position 0. A request admitted on top of a cached prefix gets the same at the prefix's
last position. The target KV is right both ways. The scheduler now keys STANDALONE's cache on
bigrams, as EAGLE's (speculative/prefix_cache_keys.py).

sglang's own ReqToTokenPool, allocator and RadixCache run here; the forwards are canary_sim
batches through the canary's brackets, as the v2 worker runs them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from canary_sim import Batch, FakePool, Mode, spec_server_args

from sglang.srt.kv_canary import api
from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode
from sglang.srt.kv_canary.fingerprint import fingerprint
from sglang.srt.kv_canary.report import STATS, KVCanaryViolationError
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.speculative.prefix_cache_keys import prefix_cache_uses_bigram_keys
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

NUM_STEPS = 3  # two inner draft steps: "draft step 0" and "draft step 1"
SLOTS = 256
# Upstream's keys for STANDALONE, and the ones the patched scheduler picks.
KEYS = {
    "single-token-keys": False,
    "scheduler-keys": prefix_cache_uses_bigram_keys(SpeculativeAlgorithm.STANDALONE),
}


class StandaloneServer:
    """What the radix cache and the canary see of a STANDALONE spec v2 server."""

    def __init__(self, bigram_keys: bool, mode: CanaryMode = CanaryMode.LOG):
        self.r2t = ReqToTokenPool(
            size=16, max_context_len=64, device="cpu", enable_memory_saver=False
        )
        self.allocator = TokenToKVPoolAllocator(
            SLOTS, torch.float16, "cpu", None, need_sort=False
        )
        self.cache = RadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=self.r2t,
                token_to_kv_pool_allocator=self.allocator,
                page_size=1,
                is_eagle=bigram_keys,
            )
        )
        server_args = spec_server_args("STANDALONE", num_steps=NUM_STEPS, radix=True)
        config = CanaryConfig(mode=mode, sample_every=1)
        self.target_pool, self.draft_pool = FakePool(SLOTS + 1), FakePool(SLOTS + 1)
        self.target = api.install_kv_canary(
            self._runner(self.target_pool, False), server_args, config=config
        )
        self.draft = api.install_kv_canary(
            self._runner(self.draft_pool, True), server_args, config=config
        )
        self._sampled = 900  # the target's "sampled" tokens: 900, 901, ...

    def _runner(self, pool: FakePool, is_draft: bool) -> SimpleNamespace:
        return SimpleNamespace(
            token_to_kv_pool=pool,
            req_to_token_pool=self.r2t,
            token_to_kv_pool_allocator=self.allocator,
            is_draft_worker=is_draft,
            device=torch.device("cpu"),
        )

    def prefill(self, prompts: dict[str, list[int]]) -> dict[str, SimpleNamespace]:
        """One prefill batch, as the scheduler runs it: match a cached prefix (all but the
        last token at most), target extend, the draft's extend with ids rotated by one, then
        cache_unfinished_req for each request in batch order."""
        reqs = {rid: self._admit(rid, tokens) for rid, tokens in prompts.items()}
        batch = self._extend_batch(list(reqs.values()))
        with api.outside_graph(self.target, batch):
            api.pre_ops(self.target, batch)
        draft_batch = Batch(**batch.__dict__)
        draft_batch.token_to_kv_pool = self.draft_pool
        draft_batch.input_ids = torch.tensor(
            [t for r in reqs.values() for t in r.tokens[r.prefix_len + 1 :]]
        )
        with api.draft_extend_brackets(self.draft, draft_batch):
            api.pre_ops(self.draft, draft_batch)
        for req in reqs.values():
            self.cache.cache_unfinished_req(req)
        return reqs

    def _admit(self, rid: str, prompt: list[int]) -> SimpleNamespace:
        match = self.cache.match_prefix(
            MatchPrefixParams(key=RadixKey(token_ids=prompt[:-1], extra_key=None))
        )
        prefix = match.device_indices
        self.cache.inc_lock_ref(match.last_device_node)
        req = SimpleNamespace(
            rid=rid,
            req_pool_idx=None,
            extra_key=None,
            priority=0,
            fill_ids=list(prompt),
            prefix_indices=prefix,
            prefix_len=len(prefix),
            cache_protected_len=len(prefix),
            last_node=match.last_device_node,
            # the prompt and the token the target samples after it
            tokens=list(prompt) + [self._next_sampled()],
        )
        (row,) = self.r2t.alloc([req])
        new = self.allocator.alloc(len(prompt) - len(prefix))
        self.r2t.write((row, slice(0, len(prefix))), prefix.to(torch.int32))
        self.r2t.write((row, slice(len(prefix), len(prompt))), new.to(torch.int32))
        return req

    def _next_sampled(self) -> int:
        self._sampled += 1
        return self._sampled

    def _extend_batch(self, reqs: list[SimpleNamespace]) -> Batch:
        spans = [(r, range(r.prefix_len, len(r.fill_ids))) for r in reqs]
        return Batch(
            forward_mode=Mode.EXTEND,
            batch_size=len(reqs),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs]),
            positions=torch.tensor([p for _, span in spans for p in span]),
            input_ids=torch.tensor([r.tokens[p] for r, span in spans for p in span]),
            out_cache_loc=torch.tensor(
                [
                    int(self.r2t.req_to_token[r.req_pool_idx, p])
                    for r, s in spans
                    for p in s
                ]
            ),
            token_to_kv_pool=self.target_pool,
            extend_seq_lens=torch.tensor([len(s) for _, s in spans], dtype=torch.int32),
            rids=[r.rid for r in reqs],
        )

    def draft_decode(self, reqs: list[SimpleNamespace]) -> None:
        """The inner draft steps of one decode round: they read every committed position."""
        rows = torch.tensor([r.req_pool_idx for r in reqs])
        seq_lens = [len(r.fill_ids) for r in reqs]
        slots = self.allocator.alloc(len(reqs) * (NUM_STEPS - 1)).view(len(reqs), -1)
        staged = Batch(
            Mode.DECODE,
            len(reqs),
            rows,
            torch.tensor(seq_lens),
            rows * 0,
            slots[:, 0],
            self.draft_pool,
            rids=[r.rid for r in reqs],
        )
        with api.outside_graph(self.draft, staged, indices=range(NUM_STEPS - 1)):
            for step in range(NUM_STEPS - 1):
                batch = Batch(
                    Mode.DECODE,
                    len(reqs),
                    rows,
                    torch.tensor(seq_lens) + step,
                    rows * 0 + 5,
                    slots[:, step],
                    self.draft_pool,
                )
                with api.active_step(self.draft, step):
                    api.pre_ops(self.draft, batch)

    def draft_positions_not_its_own(self, req: SimpleNamespace) -> list[int]:
        """Positions whose draft slot holds another token than req's next one (p + 1)."""
        n = len(req.fill_ids)
        slots = self.r2t.req_to_token[req.req_pool_idx, :n].to(torch.int64)
        group = self.draft.group
        own = fingerprint(
            torch.zeros(n, dtype=torch.int64),
            torch.arange(n),
            torch.tensor(req.tokens[1 : n + 1]),
            group.salt,
        )
        return (group.slot_fp[slots] != own).nonzero().flatten().tolist()

    def row_slots(self, req: SimpleNamespace) -> list[int]:
        return self.r2t.req_to_token[req.req_pool_idx, : len(req.fill_ids)].tolist()


FIRST = [7, 100, 101, 102, 103, 104]


def _sharing(shared: int, length: int = 6) -> list[int]:
    """A prompt that shares exactly its first `shared` tokens with FIRST."""
    return FIRST[:shared] + [200 + i for i in range(length - shared)]


def test_single_token_keys_reproduce_the_gpu_report():
    """Upstream's keys, the GPU run's shape: one request, position 0, draft steps 0 and 1,
    the slot written for the other row's position 0, expecting this request's second token.
    """
    server = StandaloneServer(bigram_keys=False, mode=CanaryMode.RAISE)
    reqs = server.prefill({"y": FIRST, "x": _sharing(1, 5)})
    y, x = reqs["y"], reqs["x"]
    # cache_unfinished_req swapped x's own position-0 slot for y's
    assert server.row_slots(x)[0] == server.row_slots(y)[0]
    with pytest.raises(KVCanaryViolationError) as err:
        server.draft_decode([y, x])
    violations = err.value.violations
    assert sorted(v.group for v in violations) == ["draft step 0", "draft step 1"]
    for v in violations:
        assert (v.rid, v.req_row, v.forward_mode, v.position) == (
            "x",
            x.req_pool_idx,
            "DECODE",
            0,
        )
        assert (v.borrowed, v.expected_token) == (False, x.tokens[1])
        assert (v.found_writer_row, v.found_writer_pos) == (y.req_pool_idx, 0)
        assert v.slot == server.row_slots(y)[0]


def test_the_schedulers_keys_keep_a_neighbours_draft_kv_out():
    """The same batch under the patched scheduler's keys: nothing shared, nothing reported."""
    server = StandaloneServer(bigram_keys=KEYS["scheduler-keys"], mode=CanaryMode.RAISE)
    reqs = server.prefill({"y": FIRST, "x": _sharing(1, 5)})
    assert server.row_slots(reqs["x"])[0] != server.row_slots(reqs["y"])[0]
    server.draft_decode(list(reqs.values()))
    stats = STATS.as_dict()
    assert stats["violations_total"] == 0
    assert stats["checks_total"] >= 2 * (6 + 5)


@pytest.mark.parametrize("shared", [1, 3])
@pytest.mark.parametrize("path", ["same-prefill", "later-prefill"])
@pytest.mark.parametrize("keys", sorted(KEYS))
def test_a_shared_prefix_leaves_the_draft_kv_the_requests_own_only_with_bigram_keys(
    keys, path, shared
):
    """The token after a shared prefix differs: with single-token keys the prefix's last draft
    position holds the other request's token, whether the prefix was shared by
    cache_unfinished_req (same prefill) or at admission (later prefill)."""
    server = StandaloneServer(bigram_keys=KEYS[keys])
    if path == "same-prefill":
        reqs = server.prefill({"y": FIRST, "x": _sharing(shared)})
    else:
        reqs = server.prefill({"y": FIRST})
        reqs.update(server.prefill({"x": _sharing(shared)}))
    x = reqs["x"]
    reused = [s in server.row_slots(reqs["y"]) for s in server.row_slots(x)]
    if keys == "single-token-keys":
        assert reused == [True] * shared + [False] * (6 - shared)
        assert server.draft_positions_not_its_own(x) == [shared - 1]
    else:
        # bigrams: the prefix whose next token matches too, one position shorter
        assert reused == [True] * (shared - 1) + [False] * (7 - shared)
        assert server.draft_positions_not_its_own(x) == []
    assert server.draft_positions_not_its_own(reqs["y"]) == []


@pytest.mark.parametrize(
    "algorithm, bigrams",
    [
        ("EAGLE", True),
        ("EAGLE3", True),
        ("FROZEN_KV_MTP", True),
        ("STANDALONE", True),
        ("NGRAM", False),
        ("DFLASH", False),
        (None, False),
    ],
)
def test_prefix_cache_keys_are_bigrams_where_the_draft_kv_holds_the_next_token(
    algorithm, bigrams
):
    spec = SpeculativeAlgorithm.from_string(algorithm)
    assert prefix_cache_uses_bigram_keys(spec) is bigrams


class _CacheParamsSeen(Exception):
    pass


@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE3", "NGRAM"])
def test_the_scheduler_builds_its_prefix_cache_with_these_keys(monkeypatch, algorithm):
    """The patched call site: Scheduler.init_cache_with_memory_pool asks
    prefix_cache_uses_bigram_keys (upstream passed spec_algorithm.is_eagle())."""
    from sglang.srt.managers import scheduler as scheduler_module

    seen = {}

    def capture(**params):
        seen.update(params)
        raise _CacheParamsSeen

    monkeypatch.setattr(scheduler_module, "CacheInitParams", capture)
    monkeypatch.setattr(scheduler_module, "get_resolved_model_impl", lambda _: None)
    model_runner = SimpleNamespace(
        linear_attn_model_spec=None, hybrid_gdn_config=None, mamba2_config=None
    )
    scheduler = SimpleNamespace(
        server_args=SimpleNamespace(
            disable_radix_cache=False,
            disaggregation_decode_enable_radix_cache=False,
            disaggregation_mode="null",
            chunked_prefill_size=None,
            enable_dp_attention=False,
            radix_eviction_policy="lru",
            enable_mamba_extra_buffer=lambda: False,
        ),
        model_config=SimpleNamespace(is_multimodal=False),
        tp_worker=SimpleNamespace(
            is_hybrid_swa=False,
            model_runner=model_runner,
            get_memory_pool=lambda: (None, None),
        ),
        spec_algorithm=SpeculativeAlgorithm.from_string(algorithm),
        page_size=1,
        tp_cpu_group=None,
        attn_tp_cpu_group=None,
        attn_cp_cpu_group=None,
        enable_metrics=False,
        enable_kv_cache_events=False,
        pp_rank=0,
        pp_size=1,
    )
    with pytest.raises(_CacheParamsSeen):
        scheduler_module.Scheduler.init_cache_with_memory_pool(scheduler)
    assert seen["is_eagle"] is prefix_cache_uses_bigram_keys(scheduler.spec_algorithm)
    assert seen["is_eagle"] is (algorithm != "NGRAM")
