"""Fault injection, to prove the canary sees the KV bugs it is meant for.

    SGLANG_KV_CANARY_FAULT       corrupt_slot | misroute_req_to_token | free_in_use
    SGLANG_KV_CANARY_FAULT_STEP  inject at the first bracketed forward >= this one (default 1)

corrupt_slot           another request's K/V (and fingerprint) lands in a live slot
misroute_req_to_token  a req_to_token entry points at another request's slot
free_in_use            a live slot is freed and handed out again: a new request writes it

The three functions are plain torch on the canary's tables and work on any device; the
injector picks a victim from a live batch (host reads allowed: it runs outside graphs, once).
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from sglang.srt.kv_canary import batch_view
from sglang.srt.kv_canary.fingerprint import fingerprint, pack_writer
from sglang.srt.kv_canary.tables import (
    FingerprintGroup,
    RequestRecord,
    move_fingerprints,
)

logger = logging.getLogger("sglang.srt.kv_canary")

ENV_FAULT = "SGLANG_KV_CANARY_FAULT"
ENV_FAULT_STEP = "SGLANG_KV_CANARY_FAULT_STEP"


class FaultKind(enum.Enum):
    CORRUPT_SLOT = "corrupt_slot"
    MISROUTE_REQ_TO_TOKEN = "misroute_req_to_token"
    FREE_IN_USE = "free_in_use"


@dataclass(frozen=True)
class FaultConfig:
    kind: FaultKind
    trigger_step: int = 1


def parse_fault_config(
    env: Optional[Mapping[str, str]] = None
) -> Optional[FaultConfig]:
    env = os.environ if env is None else env
    raw = env.get(ENV_FAULT, "").strip().lower()
    if not raw:
        return None
    try:
        kind = FaultKind(raw)
    except ValueError:
        choices = "|".join(k.value for k in FaultKind)
        raise ValueError(f"{ENV_FAULT}={raw!r}: expected one of {choices}") from None
    raw_step = env.get(ENV_FAULT_STEP, "1")
    try:
        step = int(raw_step)
    except ValueError:
        step = 0
    if step < 1:
        raise ValueError(f"{ENV_FAULT_STEP}={raw_step!r}: expected an integer >= 1")
    return FaultConfig(kind, step)


# ----------------------------------------------------------------------------- the faults


def corrupt_slot(
    group: FingerprintGroup, victim_slot: int, donor_slot: int, kv_pool=None
) -> None:
    """Copy the donor slot over the victim: its fingerprint, and its K/V when a pool is given."""
    device = group.slot_fp.device
    tgt = torch.tensor([victim_slot], dtype=torch.int64, device=device)
    src = torch.tensor([donor_slot], dtype=torch.int64, device=device)
    move_fingerprints(group, tgt, src)
    if kv_pool is not None:
        kv_pool.move_kv_cache(tgt, src)


def misroute_req_to_token(
    req_to_token: torch.Tensor,
    row: int,
    position: int,
    donor_row: int,
    donor_position: int,
) -> None:
    """Point req_to_token[row, position] at the slot of (donor_row, donor_position)."""
    req_to_token[row, position] = req_to_token[donor_row, donor_position]


def free_in_use(
    record: RequestRecord,
    slot: int,
    *,
    new_tag: int,
    new_row: int,
    new_position: int,
    new_token: int,
) -> None:
    """Free a live slot and let a (phantom) new request write it, in every pool.

    What the canary sees afterwards is the new request's write (the poison of the free is
    overwritten), so this writes that directly. The allocator itself is left alone: handing the
    slot out for real would keep corrupting outputs after the test.
    """
    device = record.device
    slots = torch.tensor([slot], dtype=torch.int64, device=device)
    tag = torch.tensor([new_tag], dtype=torch.int64, device=device)
    pos = torch.tensor([new_position], dtype=torch.int64, device=device)
    row = torch.tensor([new_row], dtype=torch.int64, device=device)
    token = torch.tensor([new_token], dtype=torch.int64, device=device)
    for group in record.groups:
        group.slot_fp[slots] = fingerprint(tag, pos, token, group.salt)
        group.slot_writer[slots] = pack_writer(row, pos)


# ----------------------------------------------------------------------------- the injector


@dataclass(frozen=True)
class InjectedFault:
    kind: FaultKind
    bracket: int  # which bracketed forward it was injected before
    victim_row: int
    victim_position: int
    victim_slot: int
    detail: str


class FaultInjector:
    """Injects one fault before the first bracketed forward >= trigger_step that has a victim.

    The victim is the last prefix position of a row the forward reads, so that very forward's
    check sees it.
    """

    def __init__(self, config: FaultConfig):
        self.config = config
        self.brackets = 0
        self.injected: Optional[InjectedFault] = None

    def maybe_inject(self, manager, forward_batch) -> Optional[InjectedFault]:
        self.brackets += 1
        if self.injected is not None or self.brackets < self.config.trigger_step:
            return None
        view = batch_view.view_of(forward_batch)
        if view.skipped:
            return None
        bs = view.batch_size
        rows = forward_batch.req_pool_indices[:bs].tolist()
        prefix = batch_view.read_prefix_lens(forward_batch, view).tolist()
        candidates = [b for b in range(bs) if prefix[b] >= 2] or [
            b for b in range(bs) if prefix[b] >= 1
        ]
        if not candidates:
            return None
        victim = candidates[0]
        row, position = rows[victim], prefix[victim] - 1
        slot = int(manager.record.req_to_token[row, position])
        # A donor at another position than the victim's, so even a borrowed position shows it.
        donor = next((b for b in candidates if b != victim), victim)
        donor_row, donor_position = rows[donor], 0 if position != 0 else 1
        if donor_position >= prefix[donor]:
            return None

        kind = self.config.kind
        if kind is FaultKind.CORRUPT_SLOT:
            donor_slot = int(manager.record.req_to_token[donor_row, donor_position])
            pool = getattr(forward_batch, "token_to_kv_pool", None)
            corrupt_slot(
                manager.group,
                slot,
                donor_slot,
                kv_pool=pool if hasattr(pool, "move_kv_cache") else None,
            )
            detail = f"copied slot {donor_slot} (row {donor_row} pos {donor_position}) over it"
        elif kind is FaultKind.MISROUTE_REQ_TO_TOKEN:
            misroute_req_to_token(
                manager.record.req_to_token, row, position, donor_row, donor_position
            )
            detail = f"req_to_token now points at row {donor_row} pos {donor_position}'s slot"
        else:
            free_in_use(
                manager.record,
                slot,
                new_tag=0x5EED,
                new_row=0,
                new_position=position + 1,
                new_token=0,
            )
            detail = "freed and rewritten by a phantom request"
        self.injected = InjectedFault(kind, self.brackets, row, position, slot, detail)
        logger.warning(
            f"KV canary fault injected ({kind.value}) before bracket {self.brackets}: "
            f"row {row} pos {position} slot {slot}: {detail}"
        )
        return self.injected
