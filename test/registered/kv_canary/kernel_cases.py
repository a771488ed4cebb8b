"""Random write + verify scenarios, run through two implementations and compared bit for bit.

Shared by the interpreter tests (TRITON_INTERPRET=1, CPU tensors) and the GPU tests. A case
builds a history with the reference (rows with prefixes already in KV, some borrowed), damages
some of it, then runs one forward's verify + write with the implementation under test on a
copy of that state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from sglang.srt.kv_canary import reference
from sglang.srt.kv_canary.contract import (
    FingerprintCheck,
    FingerprintWrite,
    ForwardPlan,
    PlanBuffers,
    ViolationSink,
    ViolationSinks,
)
from sglang.srt.kv_canary.fingerprint import FREED
from sglang.srt.kv_canary.tables import RequestRecord


@dataclass(frozen=True)
class Case:
    name: str
    seed: int = 0
    rows: int = 10
    context: int = 64
    slots: int = 1024
    bs: int = 4
    prefix_max: int = 20
    new_tokens: int = 3  # per row; uniform layout unless variable=True
    variable: bool = False
    token_offset: int = 0
    borrowed: bool = False
    damage: float = 0.1  # fraction of prefix slots damaged
    padded_rows: int = 0  # trailing batch rows that are CUDA-graph padding
    verify_on: bool = True
    record_tokens: bool = True
    capacity: int = 64
    wrong_pool: bool = False  # the forward's storage group is not its owner's


CASES = [
    Case("clean", damage=0.0),
    Case("damaged"),
    Case("bs1", bs=1),
    Case("bs1_one_token", bs=1, prefix_max=1, new_tokens=1),
    Case("empty_batch", bs=0),
    Case("no_prefix", prefix_max=0),
    Case("all_bad_overflows_capacity", damage=1.0, capacity=8),
    Case("all_bad_fits", damage=1.0, capacity=512),
    Case("variable_extend", variable=True, new_tokens=6),
    Case("draft_offset", token_offset=1),
    Case("multi_layer_offset", token_offset=3),
    Case("borrowed_prefix", borrowed=True),
    Case("borrowed_damaged_overflow", borrowed=True, damage=0.5, capacity=16),
    Case("padding_rows", padded_rows=2),
    Case("verify_off", verify_on=False),
    Case("speculative_write", record_tokens=False),
    Case(
        "long_prefix",
        rows=4,
        bs=2,
        context=3000,
        slots=8000,
        prefix_max=2900,
        damage=0.01,
        capacity=256,
    ),
    Case("wrong_pool", wrong_pool=True, damage=0.0),
] + [
    Case(
        f"random_{i}",
        seed=100 + i,
        bs=1 + i % 5,
        variable=bool(i % 2),
        token_offset=i % 2,
        borrowed=i % 3 == 0,
    )
    for i in range(6)
]


@dataclass
class Built:
    record: RequestRecord
    storage: object
    owner: object
    write: FingerprintWrite
    check: FingerprintCheck
    sink: ViolationSink
    extra: dict = field(default_factory=dict)


def build(case: Case, device: torch.device) -> Built:
    """The state just before the forward, built on CPU with the reference, moved to device."""
    rng = random.Random(case.seed)
    torch.manual_seed(case.seed)
    cpu = torch.device("cpu")
    record = RequestRecord(torch.zeros(case.rows, case.context, dtype=torch.int32))
    owner = record.register_group(
        object(),
        "g",
        is_draft=case.token_offset > 0,
        token_offset=case.token_offset,
        num_slots=case.slots,
    )
    other = record.register_group(
        object(),
        "other",
        is_draft=False,
        token_offset=case.token_offset,
        num_slots=case.slots,
    )
    record.row_tag.copy_(torch.randint(-(2**62), 2**62, (case.rows,)))

    total_rows = case.bs + case.padded_rows
    rows = rng.sample(range(1, case.rows), case.bs) + [0] * case.padded_rows
    free_slots = list(range(1, case.slots))
    rng.shuffle(free_slots)
    prefix = [rng.randint(0, case.prefix_max) for _ in range(case.bs)] + [
        0
    ] * case.padded_rows
    new_lens = [
        rng.randint(1, case.new_tokens) if case.variable else case.new_tokens
        for _ in range(total_rows)
    ]
    max_col = case.context - case.new_tokens - case.token_offset - 1
    prefix = [min(p, max_col) for p in prefix]

    # History: each live row's prefix was written by earlier forwards (or borrowed).
    for b in range(case.bs):
        row, n = rows[b], prefix[b]
        if n == 0:
            continue
        slots = [free_slots.pop() for _ in range(n)]
        record.req_to_token[row, :n] = torch.tensor(slots, dtype=torch.int32)
        tokens = torch.randint(0, 50000, (n,))
        own_from = rng.randint(0, n) if case.borrowed else 0
        record.row_own_from[row] = own_from
        for group in (owner, other):  # each pool's runner stamps its own salt
            reference.write_fingerprints(
                record,
                group,
                group,
                FingerprintWrite(
                    out_cache_loc=torch.tensor(slots),
                    positions=torch.arange(n),
                    input_ids=tokens,
                    req_pool_indices=torch.tensor([row]),
                    token_batch_rows=None,
                    tokens_per_row=n,
                    live_rows=torch.tensor([1], dtype=torch.int32),
                    record_tokens=True,
                ),
            )
        if own_from:  # borrowed positions: the row has no token record of its own there
            record.token_at[row, : own_from + case.token_offset] = -7

    # Damage: flipped fingerprints, freed slots, rewritten positions, misrouted entries.
    live_slots = [(rows[b], p) for b in range(case.bs) for p in range(prefix[b])]
    damaged = rng.sample(live_slots, int(len(live_slots) * case.damage))
    for i, (row, pos) in enumerate(damaged):
        slot = int(record.req_to_token[row, pos])
        kind = i % 4
        if kind == 0:
            owner.slot_fp[slot] ^= 1 << rng.randrange(1, 63)
        elif kind == 1:
            owner.slot_fp[slot], owner.slot_writer[slot] = FREED, -1
        elif kind == 2:
            owner.slot_writer[slot] = (row << 32) | (pos + 1)
            owner.slot_fp[slot] ^= 4
        else:
            record.req_to_token[row, pos] = free_slots[-1 - i]  # a slot nobody wrote

    # The forward: verify each prefix, then write new_lens[b] tokens after it.
    n_tokens = sum(new_lens)
    write_slots = [free_slots.pop() for _ in range(n_tokens)]
    positions, batch_rows = [], []
    for b in range(total_rows):
        positions += [prefix[b] + j for j in range(new_lens[b])]
        batch_rows += [b] * new_lens[b]
    for b in range(case.bs, total_rows):  # padded rows write the dummy slot 0
        for j, br in enumerate(batch_rows):
            if br == b:
                write_slots[j] = 0
    verify_lens = torch.zeros(case.rows, dtype=torch.int32)
    verify_lens[:total_rows] = torch.tensor(prefix, dtype=torch.int32)
    live = torch.tensor([case.bs], dtype=torch.int32)
    write = FingerprintWrite(
        out_cache_loc=torch.tensor(write_slots, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        input_ids=torch.randint(0, 50000, (n_tokens,)),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64),
        token_batch_rows=(
            torch.tensor(batch_rows, dtype=torch.int32) if case.variable else None
        ),
        tokens_per_row=0 if case.variable else case.new_tokens,
        live_rows=live,
        record_tokens=case.record_tokens,
    )
    check = FingerprintCheck(
        req_pool_indices=write.req_pool_indices,
        verify_lens=verify_lens,
        live_rows=live,
        verify_on=torch.tensor([int(case.verify_on)], dtype=torch.int32),
    )
    built = Built(
        record,
        other if case.wrong_pool else owner,
        owner,
        write,
        check,
        ViolationSink.allocate(case.capacity, cpu),
    )
    return to_device(built, device)


def to_device(built: Built, device: torch.device) -> Built:
    def move(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    record = built.record
    moved = RequestRecord.__new__(RequestRecord)
    moved.__dict__.update({k: move(v) for k, v in record.__dict__.items()})
    moved.device = device
    moved.groups = [
        replace(g, slot_fp=move(g.slot_fp), slot_writer=move(g.slot_writer))
        for g in record.groups
    ]
    by_name = {g.name: g for g in moved.groups}
    return Built(
        record=moved,
        storage=by_name[built.storage.name],
        owner=by_name[built.owner.name],
        write=FingerprintWrite(**{k: move(v) for k, v in built.write.__dict__.items()}),
        check=FingerprintCheck(**{k: move(v) for k, v in built.check.__dict__.items()}),
        sink=ViolationSink(move(built.sink.storage)),
    )


def run(impl, built: Built) -> None:
    impl.verify_fingerprints(
        built.record, built.storage, built.owner, built.check, built.sink
    )
    impl.write_fingerprints(built.record, built.storage, built.owner, built.write)


@dataclass
class Outcome:
    slot_fp: torch.Tensor
    slot_writer: torch.Tensor
    token_at: torch.Tensor
    count: int
    checks: int
    records: set


def outcome(built: Built) -> Outcome:
    count = int(built.sink.count[0])
    kept = built.sink.records[: min(count, built.sink.capacity)].cpu()
    return Outcome(
        slot_fp=built.storage.slot_fp.cpu(),
        slot_writer=built.storage.slot_writer.cpu(),
        token_at=built.record.token_at.cpu(),
        count=count,
        checks=int(built.sink.checks[0]),
        records={tuple(r) for r in kept.tolist()},
    )


def compare(case: Case, impl, device: torch.device) -> Optional[str]:
    """Run `impl` on `device` and the reference on CPU; None when they agree."""
    ref_built = build(
        replace(case, capacity=max(case.capacity, 100_000)), torch.device("cpu")
    )
    run(reference, ref_built)
    expected = outcome(ref_built)

    built = build(case, device)
    run(impl, built)
    got = outcome(built)

    problems = []
    for name in ("slot_fp", "slot_writer", "token_at"):
        if not torch.equal(getattr(expected, name), getattr(got, name)):
            problems.append(f"{name} differs")
    if (expected.count, expected.checks) != (got.count, got.checks):
        problems.append(
            f"count/checks {got.count}/{got.checks} != reference {expected.count}/{expected.checks}"
        )
    if got.count <= case.capacity:
        if got.records != expected.records:
            problems.append(
                f"records differ: {sorted(got.records ^ expected.records)[:4]}"
            )
    elif len(got.records) != case.capacity or not got.records <= expected.records:
        problems.append("overflowing records are not a subset of the reference's")
    return "; ".join(problems) or None


def expected_violations(case: Case) -> int:
    built = build(replace(case, capacity=100_000), torch.device("cpu"))
    run(reference, built)
    return int(built.sink.count[0])


# ----------------------------------------------------------------------------- stage_plan


@dataclass(frozen=True)
class StageCase:
    name: str
    seed: int = 0
    bs: int = 4
    max_rows: int = 16
    tokens_per_row: int = 1  # uniform layout
    variable: bool = (
        False  # rows of random length (extend_seq_lens), zero-length rows included
    )
    speculative_tail: int = 0
    verify: bool = True
    positions_dtype: torch.dtype = torch.int64
    num_sinks: int = (
        1  # single forwards of the manager (EAGLE draft: inner draft steps)
    )


STAGE_CASES = [
    StageCase("idle", bs=0),
    StageCase("bs1_decode", bs=1),
    StageCase("bs1_verify_block", bs=1, tokens_per_row=8),
    StageCase("uniform_draft_extend", bs=5, tokens_per_row=4),
    StageCase("variable_extend", bs=6, variable=True),
    StageCase("variable_across_blocks", bs=300, max_rows=320, variable=True),
    StageCase("uniform_across_blocks", bs=300, max_rows=300, tokens_per_row=3),
    StageCase("speculative_tail_clamps", bs=6, speculative_tail=3),
    StageCase("not_sampled", verify=False),
    StageCase("int32_positions", bs=7, variable=True, positions_dtype=torch.int32),
    StageCase("draft_steps_share_one_stage", bs=3, tokens_per_row=4, num_sinks=4),
]


def build_stage(case: StageCase, device: torch.device):
    """(plan, buffers, sinks): buffers hold garbage past the batch, the sinks earlier forwards' counts."""
    gen = torch.Generator().manual_seed(case.seed)
    lens = None
    if case.variable:
        lens = torch.randint(0, 5, (case.bs,), generator=gen, dtype=torch.int32)
        num_tokens = int(lens.sum())
    else:
        num_tokens = case.bs * case.tokens_per_row
    positions = torch.randint(0, 1000, (max(num_tokens, 1),), generator=gen).to(
        case.positions_dtype
    )
    buffers = PlanBuffers.allocate(case.max_rows, device)
    buffers.verify_lens.copy_(
        torch.randint(-5, 50, (case.max_rows,), generator=gen, dtype=torch.int32)
    )
    buffers.live_rows.fill_(99)
    buffers.verify_on.fill_(7)
    # Every sink of the manager holds an earlier bracket's counts; stage empties them all.
    sinks = ViolationSinks.allocate(case.num_sinks, 8, device)
    sinks.storage[:, 0, :2] = torch.randint(1, 50, (case.num_sinks, 2), generator=gen)
    sinks.storage[:, 1:] = (
        5  # records of earlier forwards stay (past the count, never read)
    )
    plan = ForwardPlan(
        positions=positions.to(device),
        extend_seq_lens=None if lens is None else lens.to(device),
        tokens_per_row=0 if case.variable else case.tokens_per_row,
        batch_size=case.bs,
        speculative_tail=case.speculative_tail,
        verify=case.verify,
    )
    return plan, buffers, sinks


def compare_stage(case: StageCase, impl, device: torch.device) -> Optional[str]:
    """Run `impl.stage_plan` on `device` and the reference on CPU; None when every buffer agrees."""
    expected = build_stage(case, torch.device("cpu"))
    reference.stage_plan(*expected)
    got = build_stage(case, device)
    impl.stage_plan(*got)
    problems = []
    for name in ("verify_lens", "live_rows", "verify_on"):
        a, b = getattr(expected[1], name), getattr(got[1], name).cpu()
        if not torch.equal(a, b):
            problems.append(f"{name}: {b.tolist()[:8]} != reference {a.tolist()[:8]}")
    if not torch.equal(expected[2].storage, got[2].storage.cpu()):
        problems.append("sinks differ")
    return "; ".join(problems) or None
