"""Device state of the canary: one request record per req_to_token pool, one fingerprint group
per KV pool.

RequestRecord  what every request row should find in its slots. Shared by the target and the
               draft pools because they share req_to_token_pool (a slot number means the same
               thing in each pool, and so does a row).
FingerprintGroup  what every slot of one KV pool holds: the fingerprint of its last write and
               who wrote it. The target pool has one group, each draft KV pool another.

Borrowed prefixes. With the prefix cache on, a new request starts with slots another request
wrote. The row records when its current owner arrived (`row_own_from`, the prefix length of the
owner's first extend): positions before it were borrowed, and the row has no token record for
them, so they get a weaker check (the slot holds a live fingerprint written for that position).

Ownership lasts from a row's allocation to its free, not as long as the rid: a retracted request
comes back under the same rid, maybe into a row it held before, with a prefix the radix cache
kept from stays in other rows. Its token record in this row is from the old stay, so the row
must count as newly adopted (ReqToTokenPool.free reports the release: api.on_row_free). A
chunked prefill keeps its row between chunks and stays the owner.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sglang.srt.kv_canary.fingerprint import FREED, group_salt, request_tag

IDENTITY_REQUEST = "request"  # fingerprint tag = the request's hash
IDENTITY_CONTENT = (
    "content"  # tag 0: equal (position, token) is equal KV across requests
)
# row_owner of a row no request holds: released, or never allocated
NO_OWNER = 0


@dataclass
class FingerprintGroup:
    """Slot fingerprints of one KV pool."""

    name: str  # "target", "draft", "draft step 1" (multi-layer pools) ...
    index: int  # registration order in the record; picks the salt
    is_draft: bool
    # EAGLE draft pools store the K/V of token p + 1 at position p (offset 1); a standalone
    # draft model's pool is laid out like the target's (offset 0).
    token_offset: int
    salt: int
    # [num_slots] int64: fingerprint of the last write (fingerprint.NEVER_WRITTEN / FREED)
    slot_fp: torch.Tensor
    # [num_slots] int64: pack_writer(row, position) of the last write, for reports
    slot_writer: torch.Tensor

    @property
    def speculative_tail(self) -> int:
        """Trailing prefix positions whose token is not committed yet (multi-layer step i > 0)."""
        return max(0, self.token_offset - 1)


@dataclass
class _PendingFree:
    slots: torch.Tensor  # [n] slot indices, a private copy
    ready: Optional[torch.cuda.Event]  # recorded on the freeing stream (CUDA only)


class RequestRecord:
    """Per request row: identity, where the owner's own writes start, and its token ids."""

    def __init__(self, req_to_token: torch.Tensor, identity: str = IDENTITY_REQUEST):
        if identity not in (IDENTITY_REQUEST, IDENTITY_CONTENT):
            raise ValueError(
                f"identity={identity!r}: expected {IDENTITY_REQUEST!r} or {IDENTITY_CONTENT!r}"
            )
        rows, context_len = req_to_token.shape
        device = req_to_token.device
        self.identity = identity
        self.device = device
        # [rows, context_len] int32, the upstream tensor itself (not a copy)
        self.req_to_token = req_to_token
        # [rows] int64: tag mixed into fingerprints (request hash, or 0 for content identity)
        self.row_tag = torch.zeros(rows, dtype=torch.int64, device=device)
        # [rows] int64: request hash of the row's current owner, NO_OWNER once released
        self.row_owner = torch.full((rows,), NO_OWNER, dtype=torch.int64, device=device)
        # [rows] int32: first position the owner wrote itself; earlier ones are borrowed
        self.row_own_from = torch.zeros(rows, dtype=torch.int32, device=device)
        # [rows, context_len + 1] int32: token id at each position (one extra column: a draft
        # slot at the last position holds the token one past it)
        self.token_at = torch.zeros(
            rows, context_len + 1, dtype=torch.int32, device=device
        )
        self.groups: list[FingerprintGroup] = []
        # id(pool) -> (pool, group); the pool is held so its id cannot be reused
        self._group_of_pool: dict[int, tuple[object, FingerprintGroup]] = {}
        self._pending_frees: list[_PendingFree] = []
        # rows ReqToTokenPool.free took back since the last bracket
        self._released_rows: list[int] = []

    # ------------------------------------------------------------------ groups

    def register_group(
        self,
        pool: object,
        name: str,
        *,
        is_draft: bool,
        token_offset: int,
        num_slots: int,
    ) -> FingerprintGroup:
        if id(pool) in self._group_of_pool:
            raise ValueError(
                f"KV pool of group {self._group_of_pool[id(pool)][1].name!r} is already registered"
            )
        index = len(self.groups)
        group = FingerprintGroup(
            name=name,
            index=index,
            is_draft=is_draft,
            token_offset=token_offset,
            salt=group_salt(index),
            slot_fp=torch.zeros(num_slots, dtype=torch.int64, device=self.device),
            slot_writer=torch.zeros(num_slots, dtype=torch.int64, device=self.device),
        )
        self.groups.append(group)
        self._group_of_pool[id(pool)] = (pool, group)
        return group

    def group_of_pool(self, pool: object) -> Optional[FingerprintGroup]:
        entry = self._group_of_pool.get(id(pool))
        return entry[1] if entry is not None else None

    # ------------------------------------------------------------------ owners

    def adopt_owners(
        self,
        rows: torch.Tensor,
        rids: Optional[Sequence[str]],
        prefix_lens: torch.Tensor,
    ) -> None:
        """Note the owners of `rows` at an extend; a row whose owner changed borrowed its prefix.

        rows: [bs] req pool rows; prefix_lens: [bs] positions already in KV before this extend.
        """
        if rows.numel() == 0:
            return
        rows = rows.to(torch.int64)
        prefix_lens = prefix_lens.to(torch.int32)
        if rids is None:
            # No identities: treat every prefix as borrowed, which can only weaken checks.
            self.row_own_from[rows] = torch.maximum(
                self.row_own_from[rows], prefix_lens
            )
            return
        owners = torch.tensor([request_tag(r) for r in rids], dtype=torch.int64).to(
            self.device, non_blocking=True
        )
        is_new = self.row_owner[rows] != owners
        self.row_own_from[rows] = torch.where(
            is_new, prefix_lens, self.row_own_from[rows]
        )
        self.row_owner[rows] = owners
        if self.identity == IDENTITY_REQUEST:
            self.row_tag[rows] = owners

    # ------------------------------------------------------------------ frees

    def note_freed(self, slots: torch.Tensor) -> None:
        """Remember slots the allocator took back; they are poisoned at the next bracket.

        Deferred so the poison lands on the forward stream after every forward that was
        already launched (the overlap scheduler frees while the previous batch still runs).
        """
        if slots.numel() == 0:
            return
        private = slots.detach().to(torch.int64, copy=True)
        ready = None
        if private.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        self._pending_frees.append(_PendingFree(private, ready))

    def note_row_released(self, row: int) -> None:
        """Remember a row the request pool took back; its ownership ends at the next bracket.

        Host-side until then, so the owner reset lands on the forward stream before the stage
        of the next extend that adopts the row, whichever request that is.
        """
        self._released_rows.append(int(row))

    def apply_pending_frees(self) -> None:
        """End the ownership of every row released since the last call (one launch), and
        poison every slot freed since then, in every group (one launch per group)."""
        if self._released_rows:
            rows = torch.tensor(self._released_rows, dtype=torch.int64)
            self._released_rows = []
            self.row_owner.index_fill_(0, rows.to(self.device), NO_OWNER)
        if not self._pending_frees:
            return
        pending, self._pending_frees = self._pending_frees, []
        for item in pending:
            if item.ready is not None:
                stream = torch.cuda.current_stream(item.slots.device)
                stream.wait_event(item.ready)
                item.slots.record_stream(stream)
        slots = (
            pending[0].slots
            if len(pending) == 1
            else torch.cat([item.slots for item in pending])
        )
        for group in self.groups:
            poison_slots(group, slots)


def poison_slots(group: FingerprintGroup, slots: torch.Tensor) -> None:
    """Mark `slots` freed: a live row that still points at one reports it. The writer column
    keeps the last write, which the report names."""
    group.slot_fp.index_fill_(0, slots, FREED)


def move_fingerprints(
    group: FingerprintGroup, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """slot[tgt] = slot[src] for fingerprint and writer, next to the KV move it mirrors.

    Gather then scatter: a slot that is both a source and a target is read before it is
    overwritten, as in a compaction that shifts a path down by one. Sync-free (graph-safe).
    """
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    moved_fp = group.slot_fp.index_select(0, src)
    moved_writer = group.slot_writer.index_select(0, src)
    group.slot_fp.index_copy_(0, tgt, moved_fp)
    group.slot_writer.index_copy_(0, tgt, moved_writer)


_records: "weakref.WeakKeyDictionary[object, RequestRecord]" = (
    weakref.WeakKeyDictionary()
)


def record_of(req_to_token_pool: object) -> Optional[RequestRecord]:
    """The RequestRecord of a req_to_token pool, or None when no canary runner uses it."""
    return _records.get(req_to_token_pool)


def shared_record(req_to_token_pool: object, identity: str) -> RequestRecord:
    """The one RequestRecord of a req_to_token pool (target and draft runners share the pool)."""
    record = _records.get(req_to_token_pool)
    if record is None:
        record = RequestRecord(req_to_token_pool.req_to_token, identity)
        _records[req_to_token_pool] = record
    elif record.identity != identity:
        raise ValueError(
            f"req_to_token pool already has a {record.identity!r}-identity canary record"
        )
    return record
