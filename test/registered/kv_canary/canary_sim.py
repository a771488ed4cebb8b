"""A small simulated engine that drives the canary the way sglang's EAGLE v2 worker will.

No model and no K/V: only what the canary sees. A request row in req_to_token, slots from a
free list, and the forwards of a request's life, each built as a ForwardBatch stand-in and run
through the canary's brackets exactly as the integration plan wires them:

    admit      target EXTEND (optionally borrowing a live request's prefix, as the radix
               cache does), then the draft's extend of the same batch with ids shifted by one
    spec_round draft decode steps (one single forward each), target verify, acceptance (a tree
               compacts its accepted path with move_fingerprints), draft extend v2
    decode     plain target decode (no speculation)
    finish     slots go back to the allocator (on_free), the row is released (on_row_free)
    retract    ScheduleBatch.release_req: the row is released, a prefix of the request's KV stays
               in the radix cache, the rest goes back to the allocator
    readmit    the retracted request (same rid) is prefilled again on top of that prefix
"""

from __future__ import annotations

import collections
import enum
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch

from sglang.srt.kv_canary import api
from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode


class Mode(enum.Enum):
    """Stand-in for sglang's ForwardMode: the canary reads only `.name`."""

    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5
    DRAFT_EXTEND = 6
    DRAFT_EXTEND_V2 = 7
    PREBUILT = 8
    SPLIT_PREFILL = 9
    DLLM_EXTEND = 10


class FakePool:
    """A KV pool as far as the canary cares: an identity and a size."""

    def __init__(self, size: int):
        self.size = size
        self.page_size = 1


class FakeReqToTokenPool:
    def __init__(self, rows: int, context: int, device: torch.device):
        self.req_to_token = torch.zeros(rows, context, dtype=torch.int32, device=device)


class FakeAllocator:
    def __init__(self, num_slots: int):
        self.free_slots = list(range(1, num_slots + 1))  # slot 0 takes padded writes

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free_slots):
            raise RuntimeError("simulated KV pool is full")
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def free(self, slots: list[int]) -> None:
        self.free_slots.extend(slots)


@dataclass
class Batch:
    """ForwardBatch stand-in with the fields batch_view reads."""

    forward_mode: Mode
    batch_size: int
    req_pool_indices: torch.Tensor
    positions: torch.Tensor
    input_ids: torch.Tensor
    out_cache_loc: torch.Tensor
    token_to_kv_pool: object
    extend_seq_lens: Optional[torch.Tensor] = None
    rids: Optional[list] = None


@dataclass
class Req:
    rid: str
    row: Optional[int]  # None while retracted
    tokens: list  # committed tokens; tokens[kv_len] is the bonus token not yet in KV
    kv_len: int
    owned: list = field(default_factory=list)  # slots this request allocated
    rows_held: list = field(default_factory=list)  # every row it was given, in order


def spec_server_args(
    algorithm: Optional[str],
    *,
    num_steps: int = 3,
    radix: bool = False,
    overlap: bool = True,
    multi_layer: bool = False,
) -> SimpleNamespace:
    """What install_kv_canary reads from ServerArgs, including what SpeculativeAlgorithm.create_worker
    reads to pick the worker class whose draft extend sets the draft's token offset."""
    return SimpleNamespace(
        speculative_algorithm=algorithm,
        speculative_num_steps=num_steps if algorithm else None,
        disable_radix_cache=not radix,
        disable_overlap_schedule=not overlap,
        enable_multi_layer_eagle=multi_layer,
    )


class SimEngine:
    """`algorithm` is what install_kv_canary is told; the draft extends below are always built
    the way sglang's EAGLE, EAGLE3 and STANDALONE workers build them (ids rotated by one).
    """

    def __init__(
        self,
        *,
        rows: int = 12,
        context: int = 96,
        slots: int = 2048,
        eagle: bool = True,
        algorithm: str = "EAGLE",
        num_steps: int = 3,
        topk: int = 1,
        num_draft_tokens: Optional[int] = None,
        radix: bool = False,
        mode: CanaryMode = CanaryMode.RAISE,
        sample_every: int = 1,
        device: str = "cpu",
        seed: int = 0,
        vocab: int = 1000,
    ):
        self.rng = random.Random(seed)
        self.device = torch.device(device)
        self.vocab = vocab
        self.eagle = eagle
        self.num_steps = num_steps
        self.topk = topk
        self.num_draft_tokens = num_draft_tokens or (
            num_steps + 1 if topk == 1 else num_steps * topk
        )
        self.req_to_token_pool = FakeReqToTokenPool(rows, context, self.device)
        self.allocator = FakeAllocator(slots)
        self.free_rows = list(range(1, rows))  # row 0 takes padded rows
        self.slot_refs: dict[int, int] = {}  # slot -> live requests pointing at it
        self.reqs: dict[str, Req] = {}
        # Retracted requests, oldest first, and the radix cache's hold on their KV prefix
        self.retracted: dict[str, Req] = {}
        self.cached: dict[str, list[int]] = {}  # rid -> slots of positions [0, len)
        # sglang's ReqToTokenPool.free reports every row it takes back; with this off, a
        # request back in a row it held before is checked against that stay's token record
        self.report_row_frees = True
        self._next_rid = 0
        # What the workload exercised: "borrowed", "moved", "freed", "row_reused", "rounds",
        # "retracted", "readmitted", "readmitted_in_old_row"
        self.counts: collections.Counter = collections.Counter()
        self._rows_seen: set[int] = set()
        self._slots_seen: set[int] = set()

        config = CanaryConfig(mode=mode, sample_every=sample_every)
        server_args = spec_server_args(
            algorithm if eagle else None, num_steps=num_steps, radix=radix
        )
        self.target_pool = FakePool(slots + 1)
        self.target = api.install_kv_canary(
            self._runner(self.target_pool, False), server_args, config=config
        )
        self.draft_pool = FakePool(slots + 1) if eagle else None
        self.draft = (
            api.install_kv_canary(
                self._runner(self.draft_pool, True), server_args, config=config
            )
            if eagle
            else None
        )

    def _runner(self, pool, is_draft: bool):
        return SimpleNamespace(
            token_to_kv_pool=pool,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            is_draft_worker=is_draft,
            device=self.device,
        )

    # ------------------------------------------------------------------ helpers

    @property
    def r2t(self) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token

    def _t(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _token(self) -> int:
        return self.rng.randrange(self.vocab)

    def _ensure_slots(self, req: Req, upto: int) -> None:
        """Give req its own slots for positions [len(allocated), upto)."""
        have = self._allocated_len(req)
        if upto <= have:
            return
        new = self.allocator.alloc(upto - have)
        self.counts["slot_reused"] += sum(s in self._slots_seen for s in new)
        self._slots_seen.update(new)
        self.r2t[req.row, have:upto] = self._t(new, torch.int32)
        req.owned += new
        for s in new:
            self.slot_refs[s] = self.slot_refs.get(s, 0) + 1
        req.alloc_len = upto

    def _allocated_len(self, req: Req) -> int:
        return getattr(req, "alloc_len", 0)

    def slots_of(self, req: Req, start: int, end: int) -> list[int]:
        return self.r2t[req.row, start:end].tolist()

    # ------------------------------------------------------------------ lifecycle

    def admit(
        self,
        prompt_len: int,
        borrow_from: Optional[Req] = None,
        borrow_len: int = 0,
        *,
        row: Optional[int] = None,
    ) -> Req:
        """A new request; `row` picks its req_to_token row (default: the free list's head)."""
        rid = f"req-{self._next_rid}"
        self._next_rid += 1
        tokens = [self._token() for _ in range(prompt_len)]
        req = Req(rid, self._take_row(row), tokens, kv_len=0)
        req.rows_held.append(req.row)
        if borrow_from is not None and borrow_len > 0:
            # The radix cache hands out another request's slots for a shared prefix (bigram
            # matching for EAGLE: the token after the prefix matches too).
            req.tokens[: borrow_len + 1] = borrow_from.tokens[: borrow_len + 1]
            shared = self.slots_of(borrow_from, 0, borrow_len)
            self.r2t[req.row, :borrow_len] = self._t(shared, torch.int32)
            for s in shared:
                self.slot_refs[s] += 1
            req.borrowed = shared
            req.alloc_len = borrow_len
            self.counts["borrowed"] += 1
        prefix = borrow_len if borrow_from is not None else 0
        self.reqs[rid] = req
        self._prefill(req, prefix, prompt_len)
        return req

    def _take_row(self, row: Optional[int]) -> int:
        if row is None:
            row = self.free_rows.pop(0)
        else:
            self.free_rows.remove(row)
        self.counts["row_reused"] += row in self._rows_seen
        self._rows_seen.add(row)
        return row

    def _release_row(self, req: Req) -> None:
        """ReqToTokenPool.free: the row goes to the back of the free list."""
        if self.report_row_frees:
            api.on_row_free(self.req_to_token_pool, req.row)
        self.free_rows.append(req.row)
        req.row = None

    def _prefill(self, req: Req, prefix: int, fill_len: int) -> None:
        """Target extend of positions [prefix, fill_len) (slots of [0, prefix) already in the
        row), then the draft's extend of the same batch; the target samples tokens[fill_len].
        """
        self._ensure_slots(req, fill_len)
        req.tokens.append(self._token())  # sampled by the target at position fill_len

        positions = list(range(prefix, fill_len))
        slots = self.slots_of(req, prefix, fill_len)
        batch = Batch(
            forward_mode=Mode.EXTEND,
            batch_size=1,
            req_pool_indices=self._t([req.row]),
            positions=self._t(positions),
            input_ids=self._t(req.tokens[prefix:fill_len]),
            out_cache_loc=self._t(slots),
            token_to_kv_pool=self.target_pool,
            extend_seq_lens=self._t([fill_len - prefix], torch.int32),
            rids=[req.rid],
        )
        self.forward(self.target, batch)
        if self.eagle:
            # Draft extend after prefill: the same batch, ids shifted left, the bonus appended.
            draft_batch = Batch(**{**batch.__dict__})
            draft_batch.input_ids = self._t(req.tokens[prefix + 1 : fill_len + 1])
            draft_batch.token_to_kv_pool = self.draft_pool
            self.forward(self.draft, draft_batch, draft_extend=True)
        req.kv_len = fill_len

    def forward(self, manager, batch: Batch, *, draft_extend: bool = False) -> None:
        if draft_extend and batch.forward_mode is not Mode.DRAFT_EXTEND_V2:
            # The prefill's draft extend: the worker brackets it.
            with api.draft_extend_brackets(manager, batch):
                api.pre_ops(manager, batch)
        else:
            # ModelRunner.forward's own bracket: a target forward, a draft extend v2.
            with api.runner_bracket(manager, batch):
                api.pre_ops(manager, batch)

    def run_draft_steps(self, staged: Batch, step_batches: list[Batch]) -> None:
        """All inner draft steps: one host bracket, one single forward per step (eager here;
        a CUDA-graph replay of all steps in the real worker and in the GPU tests)."""
        with api.outside_graph(
            self.draft, staged, indices=range(max(len(step_batches), 1))
        ):
            for i, step in enumerate(step_batches):
                self._draft_step(step, None, i)

    @api.in_draft_step
    def _draft_step(self, step: Batch, out_cache_loc, i: int) -> None:
        """EagleDraftWorker._draft_step: its forward (and the runner's bracket, a no-op
        inside the worker's) with single forward i active."""
        with api.runner_bracket(self.draft, step):
            api.pre_ops(self.draft, step)

    @property
    def draft_runner(self):
        """What api.in_draft_step reads the canary from, as on the worker."""
        return SimpleNamespace(kv_canary=self.draft)

    def decode(self, reqs: list[Req]) -> None:
        """One plain decode step: the last sampled token goes into KV, a new one is sampled."""
        self.forward(self.target, self.decode_batch(reqs))
        for req in reqs:
            req.kv_len += 1
            req.tokens.append(self._token())

    def decode_batch(self, reqs: list[Req]) -> Batch:
        """The target batch of a decode step over reqs (their next slot allocated)."""
        for req in reqs:
            self._ensure_slots(req, req.kv_len + 1)
        return Batch(
            forward_mode=Mode.DECODE,
            batch_size=len(reqs),
            req_pool_indices=self._t([r.row for r in reqs]),
            positions=self._t([r.kv_len for r in reqs]),
            input_ids=self._t([r.tokens[r.kv_len] for r in reqs]),
            out_cache_loc=self._t([int(self.r2t[r.row, r.kv_len]) for r in reqs]),
            token_to_kv_pool=self.target_pool,
            rids=[r.rid for r in reqs],
        )

    def spec_round(self, reqs: list[Req]) -> None:
        bs, topk, steps, ndt = (
            len(reqs),
            self.topk,
            self.num_steps,
            self.num_draft_tokens,
        )
        for req in reqs:
            self._ensure_slots(req, req.kv_len + max(topk * steps, ndt))
        seq_lens = [r.kv_len for r in reqs]
        rows = self._t([r.row for r in reqs])

        # Draft decode: one bracket for all inner steps (one graph replay in the real worker).
        staged = Batch(
            forward_mode=Mode.DECODE,
            batch_size=bs,
            req_pool_indices=rows,
            positions=self._t([L for L in seq_lens for _ in range(topk)]),
            input_ids=self._t([0] * (bs * topk)),
            out_cache_loc=self._t([0] * (bs * topk * steps)),
            token_to_kv_pool=self.draft_pool,
            rids=[r.rid for r in reqs],
        )
        step_batches = [
            Batch(
                forward_mode=Mode.DECODE,
                batch_size=bs,
                req_pool_indices=rows,
                positions=self._t([L + i for L in seq_lens for _ in range(topk)]),
                input_ids=self._t([self._token() for _ in range(bs * topk)]),
                out_cache_loc=self._t(
                    [
                        int(self.r2t[r.row, r.kv_len + k * steps + i])
                        for r in reqs
                        for k in range(topk)
                    ]
                ),
                token_to_kv_pool=self.draft_pool,
            )
            for i in range(steps - 1)
        ]
        self.run_draft_steps(staged, step_batches)

        # Target verify over a chain or a tree of ndt nodes (node 0 is the bonus token).
        depths, parents = self._tree_shape(ndt)
        node_tokens = [
            [r.tokens[r.kv_len]] + [self._token() for _ in range(ndt - 1)] for r in reqs
        ]
        verify = Batch(
            forward_mode=Mode.TARGET_VERIFY,
            batch_size=bs,
            req_pool_indices=rows,
            positions=self._t([L + d for L in seq_lens for d in depths]),
            input_ids=self._t([t for toks in node_tokens for t in toks]),
            out_cache_loc=self._t(
                [s for r in reqs for s in self.slots_of(r, r.kv_len, r.kv_len + ndt)]
            ),
            token_to_kv_pool=self.target_pool,
            rids=[r.rid for r in reqs],
        )
        self.forward(self.target, verify)

        # Accept a path per request; a tree moves the path's K/V to the front of its block.
        next_ids = []
        for b, req in enumerate(reqs):
            path = self._accepted_path(parents)
            L = req.kv_len
            tgt = [int(self.r2t[req.row, L + i]) for i in range(len(path))]
            src = [int(self.r2t[req.row, L + j]) for j in path]
            if tgt != src:
                api.on_kv_move(self.target_pool, self._t(tgt), self._t(src))
                self.counts["moved"] += 1
            accepted = [node_tokens[b][j] for j in path]  # bonus + accepted drafts
            new_bonus = self._token()
            req.tokens[L:] = accepted + [new_bonus]
            req.kv_len = L + len(path)
            shifted = accepted[1:] + [new_bonus]
            next_ids.append(
                shifted + [self._token() for _ in range(ndt - len(shifted))]
            )

        # Draft extend v2 over the whole (now chain-shaped) block of every request.
        extend = Batch(
            forward_mode=Mode.DRAFT_EXTEND_V2,
            batch_size=bs,
            req_pool_indices=rows,
            positions=self._t([L + j for L in seq_lens for j in range(ndt)]),
            input_ids=self._t([t for ids in next_ids for t in ids]),
            out_cache_loc=self._t(
                [
                    s
                    for L, r in zip(seq_lens, reqs)
                    for s in self.slots_of(r, L, L + ndt)
                ]
            ),
            token_to_kv_pool=self.draft_pool,
            extend_seq_lens=self._t([ndt] * bs, torch.int32),
            rids=[r.rid for r in reqs],
        )
        self.forward(self.draft, extend, draft_extend=True)
        self.counts["spec_rounds"] += 1

    def _tree_shape(self, ndt: int) -> tuple[list[int], list[int]]:
        """Depth and parent of each node; a chain when topk == 1."""
        if self.topk == 1:
            return list(range(ndt)), [-1] + list(range(ndt - 1))
        depths, parents = [0], [-1]
        for j in range(1, ndt):
            parent = self.rng.randrange(j)
            while depths[parent] >= self.num_steps:
                parent = self.rng.randrange(j)
            parents.append(parent)
            depths.append(depths[parent] + 1)
        return depths, parents

    def _accepted_path(self, parents: list[int]) -> list[int]:
        path = [0]
        while True:
            children = [j for j, p in enumerate(parents) if p == path[-1]]
            if not children or self.rng.random() < 0.3:
                return path
            path.append(self.rng.choice(children))

    def finish(self, req: Req) -> None:
        # The radix cache lets go of the request's cached prefix once it is done (evicted).
        self._drop_refs(req.owned + getattr(req, "borrowed", []))
        self._drop_refs(self.cached.pop(req.rid, []))
        self._release_row(req)
        del self.reqs[req.rid]

    def _drop_refs(self, slots: list) -> None:
        freed = []
        for s in slots:
            self.slot_refs[s] -= 1
            if self.slot_refs[s] == 0:
                del self.slot_refs[s]
                freed.append(s)
        if freed:
            api.on_free(self.allocator, self._t(freed))
            self.allocator.free(freed)
            self.counts["freed"] += len(freed)

    def retract(self, req: Req, keep: int) -> None:
        """ScheduleBatch.release_req (sglang retracts without inserting into the radix cache):
        positions [0, keep) stay cached, as an earlier cache_unfinished_req left them; every
        other slot the request held goes back to the allocator, and so does its row. Its
        committed tokens stay: a re-prefill recomputes [keep, kv_len + 1)."""
        assert 0 <= keep <= req.kv_len
        kept = self.slots_of(req, 0, keep)
        for s in kept:
            self.slot_refs[s] += 1
        self._drop_refs(self.cached.get(req.rid, []))
        self.cached[req.rid] = kept
        self._drop_refs(req.owned + getattr(req, "borrowed", []))
        req.owned, req.borrowed, req.alloc_len = [], [], 0
        self._release_row(req)
        del self.reqs[req.rid]
        self.retracted[req.rid] = req
        self.counts["retracted"] += 1

    def readmit(self, req: Req, *, row: Optional[int] = None) -> None:
        """Prefill a retracted request again (same rid) on top of its cached prefix, which was
        written in whatever rows it held before; the target samples one more token."""
        del self.retracted[req.rid]
        req.row = self._take_row(row)
        self.counts["readmitted"] += 1
        self.counts["readmitted_in_old_row"] += req.row in req.rows_held
        req.rows_held.append(req.row)
        cached = self.cached[req.rid]
        self.r2t[req.row, : len(cached)] = self._t(cached, torch.int32)
        for s in cached:
            self.slot_refs[s] += 1
        req.borrowed, req.alloc_len = list(cached), len(cached)
        self.reqs[req.rid] = req
        self._prefill(req, len(cached), req.kv_len + 1)

    # ------------------------------------------------------------------ a random workload

    def run_random(
        self,
        rounds: int,
        *,
        max_live: int = 4,
        spec: bool = True,
        retract_every: Optional[int] = None,
    ) -> None:
        """retract_every: every that many rounds the newest live request is retracted (as
        SGLANG_TEST_RETRACT does, from the back of the batch) with a random prefix kept
        cached; retracted requests are readmitted first, oldest first, into the head of the
        free row list."""
        for round_index in range(rounds):
            if self.retracted and self.free_rows:
                self.readmit(next(iter(self.retracted.values())))
                continue
            live = list(self.reqs.values())
            if retract_every and live and round_index % retract_every == 0:
                victim = live[-1]
                self.retract(victim, self.rng.randint(0, victim.kv_len))
                continue
            if len(live) < max_live and self.free_rows and self.rng.random() < 0.5:
                donor = (
                    self.rng.choice(live) if live and self.rng.random() < 0.5 else None
                )
                borrow = (
                    self.rng.randrange(1, donor.kv_len)
                    if donor is not None and donor.kv_len > 1
                    else 0
                )
                low = max(borrow + 1, 3)
                self.admit(
                    self.rng.randrange(low, max(low + 1, 24)),
                    donor if borrow else None,
                    borrow,
                )
                continue
            room = self.r2t.shape[1] - 2 * (
                self.num_draft_tokens + self.num_steps * self.topk
            )
            done = [r for r in live if r.kv_len >= room or self.rng.random() < 0.08]
            for req in done:
                self.finish(req)
            live = [r for r in live if r not in done]
            if live:
                batch = self.rng.sample(live, self.rng.randrange(1, len(live) + 1))
                self.spec_round(batch) if spec and self.eagle else self.decode(batch)


def draft_step_batch(engine: "SimEngine", step: int) -> Batch:
    """The batch of inner draft step `step` over every admitted request (slots ensured)."""
    reqs = list(engine.reqs.values())
    for r in reqs:
        engine._ensure_slots(r, r.kv_len + engine.num_steps)
    return Batch(
        forward_mode=Mode.DECODE,
        batch_size=len(reqs),
        req_pool_indices=torch.tensor([r.row for r in reqs]),
        positions=torch.tensor([r.kv_len + step for r in reqs]),
        input_ids=torch.tensor([5] * len(reqs)),
        out_cache_loc=torch.tensor(
            [int(engine.r2t[r.row, r.kv_len + step]) for r in reqs]
        ),
        token_to_kv_pool=engine.draft_pool,
        rids=[r.rid for r in reqs],
    )
