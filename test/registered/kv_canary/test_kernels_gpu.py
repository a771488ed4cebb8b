"""The triton kernels on CUDA: against the reference, and captured in CUDA graphs the way the
model runner and the EAGLE draft graph runner will capture them."""

from __future__ import annotations

import kernel_cases
import pytest
import torch
from canary_sim import Batch, Mode, SimEngine

from sglang.srt.kv_canary import api, kernels, reference
from sglang.srt.kv_canary.report import STATS, KVCanaryViolationError

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    "case", kernel_cases.CASES, ids=[c.name for c in kernel_cases.CASES]
)
def test_kernel_matches_reference_on_cuda(case):
    assert kernel_cases.compare(case, kernels, CUDA) is None


@pytest.mark.parametrize(
    "case", kernel_cases.STAGE_CASES, ids=[c.name for c in kernel_cases.STAGE_CASES]
)
def test_stage_kernel_matches_reference_on_cuda(case):
    assert kernel_cases.compare_stage(case, kernels, CUDA) is None


def _pad(n: int) -> int:
    return next(b for b in (1, 2, 4, 8, 16, 32) if b >= n)


def _capture(manager, fn) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream, then capture, all under the canary's capture scope."""
    with api.capturing(manager):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    return graph


def _static(mode, bs, tokens_per_row, pool) -> Batch:
    n = bs * tokens_per_row
    zeros = lambda k: torch.zeros(k, dtype=torch.int64, device=CUDA)  # noqa: E731
    return Batch(mode, bs, zeros(bs), zeros(n), zeros(n), zeros(n), pool)


def _fill(static: Batch, batch: Batch) -> None:
    """What a graph runner's replay does: copy the live rows, zero the padding."""
    for name in ("req_pool_indices", "positions", "input_ids", "out_cache_loc"):
        dst, src = getattr(static, name), getattr(batch, name)
        dst.zero_()
        dst[: src.numel()].copy_(src)


class GraphSim(SimEngine):
    """SimEngine whose target decode and inner draft steps replay captured CUDA graphs."""

    def __init__(self, **kwargs):
        super().__init__(device="cuda", **kwargs)
        self._graphs: dict = {}

    def forward(self, manager, batch, *, draft_extend=False):
        if manager is not self.target or batch.forward_mode is not Mode.DECODE:
            return super().forward(manager, batch, draft_extend=draft_extend)
        graph, (static,) = self._graph("target", _pad(batch.batch_size), 1)
        _fill(static, batch)
        with api.outside_graph(manager, batch):
            graph.replay()

    def run_draft_steps(self, staged, step_batches):
        if not step_batches:
            return super().run_draft_steps(staged, step_batches)
        graph, statics = self._graph(
            "draft", _pad(staged.batch_size), len(step_batches)
        )
        for static, step in zip(statics, step_batches):
            _fill(static, step)
        with api.outside_graph(self.draft, staged, indices=range(len(step_batches))):
            graph.replay()

    def _graph(self, which, bs, num_forwards):
        key = (which, bs)
        if key not in self._graphs:
            manager, pool, per_row = (
                (self.target, self.target_pool, 1)
                if which == "target"
                else (self.draft, self.draft_pool, self.topk)
            )
            statics = [
                _static(Mode.DECODE, bs, per_row, pool) for _ in range(num_forwards)
            ]

            def forwards():
                for i, static in enumerate(statics):
                    with (
                        api.active_step(manager, i) if which == "draft" else _nothing()
                    ):
                        api.pre_ops(manager, static)

            self._graphs[key] = (_capture(manager, forwards), statics)
        return self._graphs[key]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _state(engine: SimEngine) -> list[torch.Tensor]:
    groups = [engine.target.group] + ([engine.draft.group] if engine.draft else [])
    return [t.cpu() for g in groups for t in (g.slot_fp, g.slot_writer)] + [
        engine.target.record.token_at.cpu()
    ]


@pytest.mark.parametrize("flavour", ["no_spec", "eagle_chain", "eagle_tree"])
def test_graph_replays_leave_the_same_state_as_the_eager_reference(flavour):
    kwargs = {
        "no_spec": dict(eagle=False),
        "eagle_chain": dict(num_steps=4),
        "eagle_tree": dict(num_steps=3, topk=2, num_draft_tokens=5, radix=True),
    }[flavour]
    eager = SimEngine(seed=21, slots=400, **kwargs)
    assert eager.target.impl is reference
    eager.run_random(200)
    graphed = GraphSim(seed=21, slots=400, **kwargs)
    assert graphed.target.impl is kernels and graphed._graphs == {}
    graphed.run_random(200)
    assert graphed._graphs, "no forward went through a graph"
    assert STATS.as_dict()["violations_total"] == 0
    for a, b in zip(_state(eager), _state(graphed)):
        assert torch.equal(a, b)


def test_graph_replay_detects_a_corrupted_target_slot():
    engine = GraphSim(seed=5, eagle=False)
    a, b = engine.admit(10), engine.admit(6)
    engine.decode([a, b])
    slot = int(engine.r2t[b.row, 3])
    engine.target.group.slot_fp[slot] ^= 1 << 33
    with pytest.raises(KVCanaryViolationError) as err:
        engine.decode([a, b])
    (v,) = err.value.violations
    assert (v.rid, v.position, v.slot, v.group) == (b.rid, 3, slot, "target")


def test_graph_replay_detects_in_each_draft_step():
    engine = GraphSim(seed=6, num_steps=4)
    a, b, c = engine.admit(9), engine.admit(5), engine.admit(7)
    engine.spec_round([a, b, c])  # bs 3 replays the graph captured for bs 4
    engine.draft.group.slot_fp[int(engine.r2t[c.row, 2])] = 2  # looks freed
    with pytest.raises(KVCanaryViolationError) as err:
        engine.spec_round([a, b, c])
    assert [(v.group, v.rid, v.position) for v in err.value.violations] == [
        (f"draft step {i}", c.rid, 2) for i in range(3)
    ]


def test_variable_extend_captures_and_replays():
    """A v1 draft extend (rows of different lengths) inside a graph: the token -> row map is
    built on the device from extend_seq_lens, sync-free."""
    engine = SimEngine(seed=9, device="cuda", eagle=False)
    rows = [engine.admit(4).row for _ in range(3)]
    static = _static(Mode.DRAFT_EXTEND, 3, 2, engine.target_pool)
    static.extend_seq_lens = torch.tensor([2, 2, 2], dtype=torch.int32, device=CUDA)
    graph = _capture(engine.target, lambda: api.pre_ops(engine.target, static))

    lens = [3, 1, 2]
    for r in engine.reqs.values():
        engine._ensure_slots(r, r.kv_len + 3)
    reqs = list(engine.reqs.values())
    batch = Batch(
        Mode.DRAFT_EXTEND,
        3,
        torch.tensor(rows, device=CUDA),
        torch.tensor(
            [r.kv_len + j for r, n in zip(reqs, lens) for j in range(n)], device=CUDA
        ),
        torch.tensor([7 + j for n in lens for j in range(n)], device=CUDA),
        torch.tensor(
            [
                int(engine.r2t[r.row, r.kv_len + j])
                for r, n in zip(reqs, lens)
                for j in range(n)
            ],
            device=CUDA,
        ),
        engine.target_pool,
        extend_seq_lens=torch.tensor(lens, dtype=torch.int32, device=CUDA),
        rids=[r.rid for r in reqs],
    )
    expected_fp, expected_tokens = (
        engine.target.group.slot_fp.clone(),
        engine.target.record.token_at.clone(),
    )
    twin = SimEngine(seed=9, device="cuda", eagle=False)
    # the eager twin runs the same forward through the kernels without a graph
    for _ in range(3):
        twin.admit(4)
    for r in twin.reqs.values():
        twin._ensure_slots(r, r.kv_len + 3)
    twin.forward(
        twin.target, Batch(**{**batch.__dict__, "token_to_kv_pool": twin.target_pool})
    )

    _fill(static, batch)
    static.extend_seq_lens.copy_(batch.extend_seq_lens)
    with api.outside_graph(engine.target, batch):
        graph.replay()
    assert not torch.equal(expected_fp, engine.target.group.slot_fp)  # it wrote
    assert torch.equal(engine.target.group.slot_fp, twin.target.group.slot_fp)
    assert torch.equal(engine.target.record.token_at, twin.target.record.token_at)
    assert not torch.equal(expected_tokens, engine.target.record.token_at)


def test_pre_op_cost(record_metric):
    """Verify + write for a decode batch of 64 rows with 2k-token prefixes (informational)."""
    engine = SimEngine(
        seed=1, device="cuda", eagle=False, rows=80, context=2100, slots=64 * 2100 + 8
    )
    reqs = [engine.admit(20) for _ in range(64)]
    for r in reqs:  # pretend each already has 2000 tokens in KV, written by the canary
        engine._ensure_slots(r, 2001)
        positions = torch.arange(20, 2000, device=CUDA)
        ids = torch.randint(0, 1000, (positions.numel(),), device=CUDA)
        engine.forward(
            engine.target,
            Batch(
                Mode.EXTEND,
                1,
                torch.tensor([r.row], device=CUDA),
                positions,
                ids,
                engine.r2t[r.row, 20:2000].to(torch.int64),
                engine.target_pool,
                extend_seq_lens=torch.tensor([1980], dtype=torch.int32, device=CUDA),
                rids=[r.rid],
            ),
        )
        r.kv_len = 2000
        r.tokens += [0] * (2001 - len(r.tokens))
    batch = Batch(
        Mode.DECODE,
        64,
        torch.tensor([r.row for r in reqs], device=CUDA),
        torch.full((64,), 2000, device=CUDA),
        torch.zeros(64, dtype=torch.int64, device=CUDA),
        torch.tensor([int(engine.r2t[r.row, 2000]) for r in reqs], device=CUDA),
        engine.target_pool,
        rids=[r.rid for r in reqs],
    )
    static = _static(Mode.DECODE, 64, 1, engine.target_pool)
    graph = _capture(engine.target, lambda: api.pre_ops(engine.target, static))
    _fill(static, batch)
    with api.outside_graph(engine.target, batch):
        graph.replay()
    assert (
        STATS.as_dict()["checks_total"] >= 64 * 2000
        and STATS.as_dict()["violations_total"] == 0
    )
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
        enable_timing=True
    )
    with api.outside_graph(engine.target, batch):
        start.record()
        for _ in range(100):
            graph.replay()
        end.record()
    torch.cuda.synchronize()
    record_metric("pre_op_us_bs64_ctx2000", round(start.elapsed_time(end) * 10, 2))
