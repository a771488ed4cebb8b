"""The runtime side of the speculation shape policy (docs/shape-policy.md): its config, what the
scheduler reserves for a set of shapes, the per-shape runtime states and the switch between
them before each decode step. The choice itself is shape_policy.ShapePolicy.

A policy is configured by a "shapes" key in the --speculative-adaptive-config JSON that
upstream's --speculative-adaptive reads; without it that file is upstream's step-only adaptive
config and nothing here runs.

What stays fixed while shapes switch:
- the KV the scheduler reserves per request and step, and the req_to_token row slack: those
  of the set's largest shape (reserved_alloc_len), so the next step may take any shape;
- the draft's carried top-k (`EagleDraftInput.topk_p / topk_index: [bs, carried_topk]`),
  computed at the set's largest topk by every draft extend; a step of topk k reads its first k
  columns (top-k output is sorted, so they are the top-k of width k).
What switches: everything upstream's SpecRuntimeState holds (draft decode / draft extend /
target verify backends and CUDA graphs), the topk, and the topk == 1 chain table.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Deque, Mapping, Optional, Protocol, TextIO

from sglang.srt.speculative.shape_policy import (
    CONFIG_FLAG,
    NONE,
    PolicyConfig,
    Shape,
    ShapePolicy,
    StepCostTable,
)

if TYPE_CHECKING:
    from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState
    from sglang.srt.utils.jit_compile_log import JitCompileLog

logger = logging.getLogger(__name__)

# Keys a shape-policy config may hold (PolicyConfig's, and the test knob below).
POLICY_KEYS = frozenset(
    {
        "shapes",
        "margin",
        "decisive_margin",
        "patience",
        "probe_interval",
        "probe_steps",
        "ema_alpha",
        "accept_horizon",
        "force_switch_every",
        "time_every",
        "step_costs",
        "step_time",
        "trace",
    }
)
# How a measured decode step is timed on the device ("step_time"): SPAN from its first
# launch to its last; PERIOD from the end of the decode step before it (same shape, no other
# forward between) to its own end, so that host work between steps, during which the device
# waits when the host is the bottleneck, is charged to the shape whose steps need it. The
# overlap scheduler reads a forward's result after launching the next batch, so the first
# decode step after a prefill is followed by the prefill's result processing: a period does
# not start at that step's end.
SPAN, PERIOD = "span", "period"


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ShapePolicyConfig:
    policy: PolicyConfig
    # Testing: cycle through the speculating shapes every this many decode steps instead of
    # choosing (token identity under switches does not depend on the choice).
    force_switch_every: int = 0
    # Seconds per decode step by shape and batch size, given by the user (e.g. from a
    # benchmark: bench_e2e --write-policy-config). Given costs stay fixed, so every rank of a
    # tensor-parallel server makes the same choice from the same accept lengths; without
    # them the steps that run are measured (StepCostTable).
    step_costs: Optional[dict[Shape, dict[int, float]]] = None
    # A JSON-lines file that gets, per decode result, what the policy learnt from it and its
    # scores after (ShapeTrace): why it runs the shape it runs.
    trace: Optional[str] = None
    step_time: str = SPAN  # SPAN or PERIOD
    # Once a shape's price at a batch size is confirmed (StepCostTable.confirmed), one of its
    # steps there in this many is timed. A timed step costs the scheduler two CUDA events and
    # a table update, a few per cent of a host-bound step; a warm price moves slowly, and
    # every step is timed again wherever the price is a first step's or a guess.
    time_every: int = 4

    @property
    def deterministic(self) -> bool:
        """Whether every rank chooses alike (no wall-clock input)."""
        return bool(self.force_switch_every) or self.step_costs is not None


def read_shape_policy(
    path: Optional[str], check_shape: Optional[Callable[[Shape], None]] = None
) -> Optional[ShapePolicyConfig]:
    """The shape policy of a --speculative-adaptive-config file, or None when the file has no
    "shapes" key (upstream's step-only adaptive config). ValueError names what is wrong.
    """
    if path is None:
        return None
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as err:
        raise ValueError(f"{CONFIG_FLAG} {path}: cannot be read: {err}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{CONFIG_FLAG} {path}: not JSON: {err}") from None
    if not isinstance(raw, dict) or "shapes" not in raw:
        return None
    unknown = sorted(set(raw) - POLICY_KEYS)
    if unknown:
        raise ValueError(
            f'{CONFIG_FLAG} {path}: unknown keys {unknown} next to "shapes" '
            f"(known: {sorted(POLICY_KEYS)})"
        )
    every = raw.get("force_switch_every", 0)
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(
            f'{CONFIG_FLAG} {path}: "force_switch_every" must be an integer >= 0'
        )
    time_every = raw.get("time_every", ShapePolicyConfig.time_every)
    if (
        isinstance(time_every, bool)
        or not isinstance(time_every, int)
        or time_every < 1
    ):
        raise ValueError(f'{CONFIG_FLAG} {path}: "time_every" must be an integer >= 1')
    policy = PolicyConfig.from_dict(raw, check_shape)
    costs = None
    if "step_costs" in raw:
        costs = read_step_costs(raw["step_costs"], policy.shapes, path)
    trace = raw.get("trace")
    if trace is not None and (not isinstance(trace, str) or not trace):
        raise ValueError(f'{CONFIG_FLAG} {path}: "trace" must be a file path')
    if trace is not None and not Path(trace).absolute().parent.is_dir():
        raise ValueError(
            f'{CONFIG_FLAG} {path}: "trace" {trace}: its directory does not exist'
        )
    step_time = raw.get("step_time", SPAN)
    if step_time not in (SPAN, PERIOD):
        raise ValueError(
            f'{CONFIG_FLAG} {path}: "step_time" must be "{SPAN}" or "{PERIOD}", '
            f"got {step_time!r}"
        )
    return ShapePolicyConfig(policy, every, costs, trace, step_time, time_every)


def read_step_costs(
    raw: object, shapes: tuple[Shape, ...], path: str
) -> dict[Shape, dict[int, float]]:
    """{"16,3,32": {"1": 0.004, "16": 0.008}, ...}: seconds per step for every speculating
    shape of the set, at one batch size or more."""
    where = f'{CONFIG_FLAG} {path}: "step_costs"'
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must map shapes to {{batch size: seconds}}")
    costs = {}
    for label, by_bs in raw.items():
        shape = Shape.parse(label)
        if shape not in shapes:
            raise ValueError(f'{where} names {label}, which is not in "shapes"')
        if not isinstance(by_bs, dict) or not by_bs:
            raise ValueError(f"{where}[{label!r}] must map batch sizes to seconds")
        points = {}
        for bs, seconds in by_bs.items():
            try:
                size, value = int(bs), float(seconds)
            except (TypeError, ValueError):
                raise ValueError(
                    f"{where}[{label!r}]: {bs!r}: {seconds!r} is not batch size: seconds"
                ) from None
            if size < 1 or not value > 0:
                raise ValueError(
                    f"{where}[{label!r}]: batch size {size} must be >= 1 and its "
                    f"seconds > 0, got {seconds!r}"
                )
            points[size] = value
        costs[shape] = points
    missing = [s.label for s in shapes if s.speculates and s not in costs]
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    return costs


def policy_unsupported(
    server_args, config: ShapePolicyConfig, use_spec_v2: bool
) -> Optional[str]:
    """Why a shape policy cannot run with these flags (a phrase after "needs"), or None.

    Shapes switch in spec v2's single-layer EAGLE worker only (EAGLEWorkerV2); DP ranks would
    each choose on their own batch size, and the two-batch-overlap / PD-multiplexing wrappers
    hold backends a switch does not replace (the reasons upstream's adaptive steps give). Tensor
    and pipeline ranks each run the policy: they choose alike only without wall-clock inputs,
    i.e. with "step_costs" given (or forced switches); ranks on different shapes would deadlock
    in their collectives.
    """
    algorithm = server_args.speculative_algorithm
    if algorithm not in ("EAGLE", "EAGLE3"):
        return f"--speculative-algorithm EAGLE or EAGLE3, got {algorithm}"
    if not use_spec_v2:
        return "spec v2 (the overlap scheduler): these flags run spec v1"
    for flag, size in (
        ("--tp-size", getattr(server_args, "tp_size", 1)),
        ("--pp-size", getattr(server_args, "pp_size", 1)),
    ):
        if size > 1 and not config.deterministic:
            return (
                f'"step_costs" with {flag} {size} (ranks choosing from their own step '
                "times would choose apart)"
            )
    if NONE in config.policy.shapes:
        from sglang.srt.speculative.plain_decode_steps import PLAIN_DECODE_BACKENDS

        backends = {
            server_args.attention_backend,
            getattr(server_args, "decode_attention_backend", None),
        } - {None}
        if not backends <= PLAIN_DECODE_BACKENDS:
            return (
                f'--attention-backend in {sorted(PLAIN_DECODE_BACKENDS)} for "none" in '
                f'"shapes", got {sorted(backends)}'
            )
    for flag, on in (
        ("--enable-dp-attention", server_args.enable_dp_attention),
        ("--enable-multi-layer-eagle", server_args.enable_multi_layer_eagle),
        ("--enable-two-batch-overlap", server_args.enable_two_batch_overlap),
        ("--enable-pdmux", server_args.enable_pdmux),
    ):
        if on:
            return f"no {flag}"
    return None


@functools.lru_cache(maxsize=8)
def _cached_policy(path: str) -> Optional[ShapePolicyConfig]:
    # The hook validated the file at start-up; later readers only need its shapes.
    return read_shape_policy(path)


def shape_policy_of(server_args) -> Optional[ShapePolicyConfig]:
    """The shape policy a resolved ServerArgs runs, or None."""
    if not getattr(server_args, "speculative_adaptive", False):
        return None
    path = getattr(server_args, "speculative_adaptive_config", None)
    return _cached_policy(path) if path is not None else None


def flags_shape(server_args) -> Shape:
    return Shape(
        server_args.speculative_eagle_topk or 1,
        server_args.speculative_num_steps or 1,
        server_args.speculative_num_draft_tokens or 1,
    )


# ----------------------------------------------------------------------------- reservations


@functools.lru_cache(maxsize=64)
def _alloc_len(shape: Shape) -> int:
    from sglang.srt.speculative.paged_tree_layout import alloc_len_per_decode

    return alloc_len_per_decode(shape.topk, shape.num_steps, shape.num_draft_tokens)


def reserved_shapes(server_args) -> tuple[Shape, ...]:
    """The shapes the next decode step may take: the policy's speculating shapes, else the
    flags' own."""
    config = shape_policy_of(server_args)
    if config is None:
        return (flags_shape(server_args),)
    return tuple(s for s in config.policy.shapes if s.speculates)


def reserved_alloc_len(server_args) -> int:
    """KV positions a spec v2 step may write past seq_len, for any shape the step may take.
    Read before every decode step (get_alloc_len_per_decode)."""
    return _largest_alloc_len(reserved_shapes(server_args))


@functools.lru_cache(maxsize=64)
def _largest_alloc_len(shapes: tuple[Shape, ...]) -> int:
    return max(_alloc_len(s) for s in shapes)


def reserved_num_draft_tokens(server_args) -> int:
    return max(s.num_draft_tokens for s in reserved_shapes(server_args))


def carried_topk(server_args) -> int:
    """Width of the draft's carried top-k: the largest topk any step may read."""
    return max(s.topk for s in reserved_shapes(server_args))


# ----------------------------------------------------------------------------- runtime states


@dataclass
class ShapeRuntimeState:
    """What a step of `shape` runs with: upstream's per-steps state plus the topk-dependent
    parts (the chain table is keyed by num_steps alone, so each shape keeps its own)."""

    shape: Shape
    runtime: "SpecRuntimeState"
    chain_drafts: object


class ShapeWorker(Protocol):
    """What ShapeController needs of a spec v2 worker (EAGLEWorkerV2 through the functions
    below)."""

    def build_shape_runtime_state(self, shape: Shape) -> ShapeRuntimeState: ...

    def apply_shape_runtime_state(self, state: ShapeRuntimeState) -> None: ...


def build_shape_runtime_state(worker, shape: Shape) -> ShapeRuntimeState:
    """Backends and CUDA graphs of `shape` for an EAGLEWorkerV2: upstream's
    build_adaptive_runtime_state with the topk overridden too."""
    from sglang.srt.speculative.chain_draft import ChainDraftTable

    if not shape.speculates:
        return build_plain_decode_state(worker)

    dw, sa = worker.draft_worker, worker.server_args
    saved = (worker.topk, dw.topk, sa.speculative_eagle_topk, dw.chain_drafts)
    worker.topk = dw.topk = sa.speculative_eagle_topk = shape.topk
    dw.chain_drafts = ChainDraftTable.for_server_args(sa, dw.device)
    try:
        runtime = worker.build_adaptive_runtime_state(
            shape.num_steps, shape.num_draft_tokens
        )
        return ShapeRuntimeState(shape, runtime, dw.chain_drafts)
    finally:
        worker.topk, dw.topk, sa.speculative_eagle_topk, dw.chain_drafts = saved


def build_plain_decode_state(worker) -> ShapeRuntimeState:
    """`none`'s runtime (plain_decode_steps): a target attention backend of its own and CUDA
    graphs captured in DECODE mode, one token a request with its hidden state kept, and the
    kernel of DECODE positions built (build_decode_position_kernel). A `none` step runs no
    draft: the draft's fields stay those of the shape that ran before."""
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
    from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState
    from sglang.srt.speculative.plain_decode_steps import build_decode_position_kernel

    runner = worker.target_worker.model_runner
    backup_init = runner.init_new_workspace
    try:
        backend = runner._get_attention_backend(init_new_workspace=True)
    finally:
        runner.init_new_workspace = backup_init
    graph_runner = None
    if not worker.server_args.disable_cuda_graph:
        graph_runner = CudaGraphRunner(runner, attn_backend=backend, plain_decode=True)
    build_decode_position_kernel(runner.device)
    runtime = SpecRuntimeState(
        speculative_num_steps=NONE.num_steps,
        speculative_num_draft_tokens=NONE.num_draft_tokens,
        draft_attn_backend=None,
        cuda_graph_runner=None,
        target_attn_backend=backend,
        target_graph_runner=graph_runner,
        draft_extend_attn_backend=None,
        cuda_graph_runner_for_draft_extend=None,
    )
    return ShapeRuntimeState(NONE, runtime, None)


def current_runtime_state(worker, shape: Shape) -> ShapeRuntimeState:
    """The state the worker was built with (the flags' shape), to register first."""
    from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

    dw = worker.draft_worker
    runner = worker.target_worker.model_runner
    return ShapeRuntimeState(
        shape,
        SpecRuntimeState(
            speculative_num_steps=shape.num_steps,
            speculative_num_draft_tokens=shape.num_draft_tokens,
            draft_attn_backend=dw.draft_attn_backend,
            cuda_graph_runner=dw.cuda_graph_runner,
            target_attn_backend=runner.attn_backend,
            target_graph_runner=runner.graph_runner,
            draft_extend_attn_backend=dw.draft_extend_attn_backend,
            cuda_graph_runner_for_draft_extend=dw.cuda_graph_runner_for_draft_extend,
        ),
        dw.chain_drafts,
    )


def apply_shape_runtime_state(worker, state: ShapeRuntimeState) -> None:
    """Point an EAGLEWorkerV2 at `state`. Unlike upstream's apply_runtime_state this also
    switches between shapes of equal num_steps (tree 16,3,32 and chain 1,3,4). `none` swaps
    the target's backend and graphs only: its steps run no draft, and the shape after it
    applies all of its own."""
    shape, rs = state.shape, state.runtime
    if not shape.speculates:
        runner = worker.target_worker.model_runner
        runner.attn_backend = rs.target_attn_backend
        runner.graph_runner = rs.target_graph_runner
        return
    dw, sa = worker.draft_worker, worker.server_args
    for obj in (worker, dw):
        obj.topk = shape.topk
        obj.speculative_num_steps = shape.num_steps
        obj.speculative_num_draft_tokens = shape.num_draft_tokens
    dw.chain_drafts = state.chain_drafts
    dw.draft_attn_backend = rs.draft_attn_backend
    dw.draft_runner.draft_attn_backend = rs.draft_attn_backend
    dw.cuda_graph_runner = rs.cuda_graph_runner
    dw.draft_extend_attn_backend = rs.draft_extend_attn_backend
    dw.cuda_graph_runner_for_draft_extend = rs.cuda_graph_runner_for_draft_extend
    runner = worker.target_worker.model_runner
    runner.attn_backend = rs.target_attn_backend
    runner.graph_runner = rs.target_graph_runner
    # Readers of server_args see the running shape, as with upstream's adaptive steps; the
    # scheduler's reservations read the policy's set instead (reserved_alloc_len).
    sa.speculative_eagle_topk = shape.topk
    sa.speculative_num_steps = shape.num_steps
    sa.speculative_num_draft_tokens = shape.num_draft_tokens


# ----------------------------------------------------------------------------- the controller


class StepClock(Protocol):
    """Marks placed in the device's stream order, and the seconds between two of them once
    the device has passed both (None before)."""

    def mark(self) -> object: ...

    def seconds(self, start: object, end: object) -> Optional[float]: ...


class DeviceStepClock:
    """Timing events on the current stream (the one a decode step's kernels run on).

    A step is timed on the device, from its first launch to its last: the wall clock on the
    host cannot tell steps apart under the overlap scheduler, which launches step n + 1 while
    step n runs and then waits for step n - 1's result, so a launch-to-launch interval mostly
    measures the step before, and a shape switch charges one shape's time to the other.
    """

    def __init__(self):
        import torch

        self._device = torch.get_device_module()

    def mark(self) -> object:
        event = self._device.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> Optional[float]:
        if not end.query():
            return None
        return start.elapsed_time(end) / 1e3


@dataclass
class _Launch:
    shape: Shape
    bs: int
    start: Optional[object] = None  # StepClock marks; None when costs are not measured
    end: Optional[object] = None
    step: int = 0  # the controller's count of decode steps at this launch
    # With step_time PERIOD: the end mark of the decode step launched just before, when it
    # ran this shape and no other forward came between (None otherwise: the span is used).
    previous_end: Optional[object] = None
    # The first step of the shape after a switch: it pays for the switch as well.
    after_switch: bool = False
    # The batch size differs from the decode step's before: requests joined or left.
    resized: bool = False
    # The requests' mean context in KV tokens (None: not known).
    context: Optional[float] = None


class ShapeTrace:
    """The config's "trace" file: one JSON object per line, for each decode result the
    number of the step that launched it, its shape and batch size, measured step seconds
    (null when not measured), mean accept length and the policy's scores (tokens per second
    per request) of every shape at that batch size afterwards; for each switch, the step,
    the shapes and the batch size. A line also lists, as "compiles" ([kernel[constexprs],
    milliseconds] each), the Triton kernel variants this process compiled or loaded since
    the line before: a step that took hundreds of milliseconds names what it waited for.
    Under the overlap scheduler a result line is written after the next step launched, so
    the compiles of that launch are on the line written before its own result's.

    A result line also has "t", the host's monotonic clock when the result was read: in a run
    of steps of one shape, the interval between two results is the step's period as the
    decode loop runs it (host work included), where "seconds" is the device's span of the
    step's launches only. The first step after a switch has "after_switch": true; its seconds
    are not the shape's price (ShapeController.on_verify_complete). "context" is the
    requests' mean KV tokens as the step launched, where the worker gave it."""

    def __init__(
        self,
        stream: TextIO,
        compiles: Optional["JitCompileLog"] = None,
        wall_clock: Callable[[], float] = time.monotonic,
    ):
        self._stream = stream
        self._compiles = compiles
        self._wall_clock = wall_clock

    @classmethod
    def open(cls, path: str, tp_rank: int = 0) -> "ShapeTrace":
        from sglang.srt.utils.jit_compile_log import JitCompileLog

        # Line-buffered: a server that is killed keeps what it traced.
        suffix = f".rank{tp_rank}" if tp_rank else ""
        return cls(open(path + suffix, "a", buffering=1), JitCompileLog().install())

    def result(
        self,
        launch: "_Launch",
        seconds: Optional[float],
        accept_length: float,
        scores: Mapping[str, float],
    ) -> None:
        fields = dict(
            step=launch.step,
            shape=launch.shape.label,
            bs=launch.bs,
            seconds=seconds,
            accept=round(accept_length, 3),
            scores={label: round(v, 2) for label, v in scores.items()},
            t=round(self._wall_clock(), 6),
        )
        if launch.context is not None:
            fields["context"] = round(launch.context, 1)
        if launch.after_switch:
            fields["after_switch"] = True
        self._write(**fields)

    def switch(self, step: int, old: Shape, new: Shape, bs: int) -> None:
        self._write(step=step, switch=[old.label, new.label], bs=bs)

    def _write(self, **fields) -> None:
        compiles = self._compiles.drain() if self._compiles is not None else []
        if compiles:
            fields["compiles"] = [
                [c.label(), round(c.seconds * 1000, 1)] for c in compiles
            ]
        self._stream.write(json.dumps(fields) + "\n")


class ShapeController:
    """Chooses and applies a shape before each decode step; feeds the policy the accept
    lengths and step times that come back.

    With the overlap scheduler the result of step n is processed while step n + 1 runs:
    launches queue up and each result is matched with the oldest launch (results come back
    in launch order). A step's time is measured between device marks placed before its first
    launch and after its last (StepClock); by the time its result is processed the device
    has passed both.
    """

    def __init__(
        self,
        worker: ShapeWorker,
        config: ShapePolicyConfig,
        initial: Shape,
        clock: Optional[StepClock] = None,
        metrics: Optional["ShapeMetrics"] = None,
        trace: Optional[ShapeTrace] = None,
    ):
        self.worker = worker
        self.config = config
        shapes = tuple(s for s in config.policy.shapes if s.speculates)
        # Without given costs the table starts empty: the prior, in the units of the first
        # measured step, until steps of each shape and batch size are measured.
        costs = StepCostTable(
            config.step_costs or {},
            config.policy.ema_alpha,
            confirm_cheaper=config.step_time == SPAN,
        )
        self.policy = ShapePolicy(config.policy, costs, initial)
        # Given costs stay as given (deterministic across ranks); otherwise steps are timed.
        self._clock = None
        if config.step_costs is None:
            self._clock = clock if clock is not None else DeviceStepClock()
        self._speculating = shapes
        self._shapes = config.policy.shapes
        self._states: dict[Shape, ShapeRuntimeState] = {}
        self._active = initial
        self._metrics = metrics
        self._trace = trace
        self._pending: Deque[_Launch] = collections.deque()
        self._decode_steps = 0
        # The end mark and shape of the last decode step, while a PERIOD can start there.
        self._last_end: Optional[tuple[Shape, object]] = None
        # Whether the next decode step is the first since a forward of another kind.
        self._first_after_other = False
        # Decode steps launched untimed since the last timed one (config.time_every).
        self._untimed = 0
        # The batch size of the decode step launched last (0 before the first).
        self._last_bs = 0

    @property
    def active(self) -> Shape:
        return self._active

    def register(self, state: ShapeRuntimeState) -> None:
        self._states[state.shape] = state

    def init_states(self) -> None:
        """Build a runtime state for every shape not registered yet."""
        for shape in self._shapes:
            if shape not in self._states:
                self._states[shape] = self.worker.build_shape_runtime_state(shape)

    @property
    def catch_up_runner(self):
        """The widest speculating shape's draft-extend CUDA graph runner (or None): the draft
        catches up on rows owed by `none` steps through it (plain_decode_steps.catch_up).
        """
        widest = max(self._speculating, key=lambda s: s.num_draft_tokens)
        return self._states[widest].runtime.cuda_graph_runner_for_draft_extend

    def before_decode(
        self,
        bs: int,
        plain_allowed: bool = True,
        seq_lens_sum: Optional[int] = None,
    ) -> Shape:
        """The shape of the decode step about to launch at batch size bs, applied.
        plain_allowed False: the batch must speculate (plain_decode_allowed), so `none` gives
        way to the best speculating shape. seq_lens_sum: the batch's KV tokens (the host's,
        a bound where bounded_host_lens issued one), which price a step at its context.
        """
        self._decode_steps += 1
        context = seq_lens_sum / bs if seq_lens_sum and bs else None
        every = self.config.force_switch_every
        if every:
            shape = self._shapes[(self._decode_steps - 1) // every % len(self._shapes)]
        else:
            probes = self.policy.counters.probes
            shape = self.policy.choose(bs, context)
            if self._metrics is not None and self.policy.counters.probes > probes:
                self._metrics.probed()
        if not shape.speculates and not plain_allowed:
            shape = max(self._speculating, key=lambda s: (self.policy.score(s, bs), s))
        switched = shape != self._active
        if switched:
            self.worker.apply_shape_runtime_state(self._states[shape])
            logger.info(
                "Speculation shape %s -> %s at bs %d (scores %.1f -> %.1f tok/s/req)",
                self._active.label,
                shape.label,
                bs,
                self.policy.score(self._active, bs),
                self.policy.score(shape, bs),
            )
            if self._metrics is not None:
                self._metrics.switched()
            if self._trace is not None:
                self._trace.switch(self._decode_steps, self._active, shape, bs)
            self._active = shape
        if self._metrics is not None:
            self._metrics.stepped(shape)
        timed = self._clock is not None and self._times(shape, bs)
        self._untimed = 0 if timed else self._untimed + 1
        start = self._clock.mark() if timed else None
        previous_end = None
        if timed and self._last_end is not None and self._last_end[0] == shape:
            previous_end = self._last_end[1]
        self._pending.append(
            _Launch(
                shape,
                bs,
                start,
                previous_end=previous_end,
                step=self._decode_steps,
                after_switch=switched,
                resized=self._last_bs not in (0, bs),
                context=context,
            )
        )
        self._last_bs = bs
        return shape

    def _times(self, shape: Shape, bs: int) -> bool:
        """Whether a step of `shape` at bs launched now is timed: every step of a probe and
        every step until the shape's price there is confirmed, then one in
        config.time_every."""
        due = self._untimed + 1 >= self.config.time_every
        return due or self.policy.probing or not self.policy.costs.confirmed(shape, bs)

    def after_decode(self) -> None:
        """The decode step before_decode announced has launched all its work."""
        if self._clock is not None and self._pending:
            launch = self._pending[-1]
            # With PERIOD a timed step is charged from the end of the step before it, which
            # is marked where the next step, at this shape and batch size, will be timed.
            leads = (
                self.config.step_time == PERIOD
                and not self._first_after_other
                and self._times(launch.shape, launch.bs)
            )
            end = None
            if launch.start is not None or leads:
                end = self._clock.mark()
            if launch.start is not None:
                launch.end = end
            self._last_end = (launch.shape, end) if leads else None
        self._first_after_other = False

    def after_other_forward(self) -> None:
        """A forward that is not a decode step (a prefill, an extend) has launched: the next
        decode step's period would hold it, and the one after that its result processing.
        """
        self._last_end = None
        self._first_after_other = True

    def on_verify_complete(self, num_correct_drafts_per_req: list[int]) -> None:
        if not self._pending:
            return
        launch = self._pending.popleft()
        if launch.bs != len(num_correct_drafts_per_req):
            # Not the launch this result belongs to (a launch without a result, e.g. a step
            # that retracted): the queue is out of step; start over.
            self._pending.clear()
            return
        accept_lengths = [n + 1 for n in num_correct_drafts_per_req]
        self.policy.observe_accept(launch.shape, accept_lengths)
        seconds = None
        if launch.start is not None and launch.end is not None:
            seconds = self._clock.seconds(launch.start, launch.end)
            if seconds is not None and launch.previous_end is not None:
                period = self._clock.seconds(launch.previous_end, launch.end)
                if period is not None:
                    seconds = max(seconds, period)
            # The first step after a switch is dearer than the shape's warm steps (its
            # buffers and graphs come back into the caches the other shape used; after
            # `none` the draft catches up), often by a tenth and at times several times
            # over: hysteresis pays for switches. As a price it would keep the shape out
            # at this batch size and at every size priced from it, where nothing runs it
            # again.
            if seconds is not None and self._prices(launch):
                self.policy.observe_step_time(
                    launch.shape, launch.bs, seconds, launch.context
                )
        if self._trace is not None:
            scores = {s.label: self.policy.score(s, launch.bs) for s in self._shapes}
            mean = sum(accept_lengths) / len(accept_lengths)
            self._trace.result(launch, seconds, mean, scores)

    def _prices(self, launch: _Launch) -> bool:
        """Whether a measured step's seconds are its shape's price at its batch size.

        Not the first step after a switch (above). Nor, where the shape has a confirmed price
        near that size, a step whose batch just changed size: the scheduler filtered or
        extended the batch before it, and a batch draining at the end of a load, one size a
        step, would otherwise price the shape at every size it passes by its dearest steps.
        A first step's provisional price does not count as one: the next step there, resized
        or not, must be able to replace it (a draining batch's last step would otherwise be
        the shape's price at that size for good). A batch that changes size at every step
        still prices each size range.
        """
        if launch.after_switch:
            return False
        return not (
            launch.resized and self.policy.costs.confirmed_near(launch.shape, launch.bs)
        )


def make_shape_controller(worker, server_args) -> Optional[ShapeController]:
    """The controller of an EAGLEWorkerV2 whose flags configure a shape policy (None
    otherwise), with the state the worker was just built with registered as the first.
    """
    config = shape_policy_of(server_args)
    if config is None:
        return None
    initial = flags_shape(server_args)
    metrics = None
    if server_args.enable_metrics:
        metrics = ShapeMetrics(
            {
                "model_name": server_args.served_model_name or "",
                "tp_rank": str(getattr(worker, "tp_rank", 0)),
            }
        )
    trace = None
    if config.trace is not None:
        trace = ShapeTrace.open(config.trace, getattr(worker, "tp_rank", 0))
    controller = ShapeController(
        worker,
        config,
        initial,
        metrics=metrics,
        trace=trace,
    )
    controller.register(current_runtime_state(worker, initial))
    return controller


def make_plain_decode_steps(server_args, req_to_token_pool, draft_worker):
    """The `none` steps of a worker whose shape policy has `none` in its set, their ring
    allocated and their kernels compiled now, at start-up; or None."""
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
    from sglang.srt.speculative.plain_decode_kernels import compile_kernels
    from sglang.srt.speculative.plain_decode_steps import (
        PlainDecodeSteps,
        allocate_ring,
    )

    config = shape_policy_of(server_args)
    if config is None or NONE not in config.policy.shapes:
        return None
    # A ring row holds what a verify hands its draft extend: upstream's width and dtype for
    # the draft extend's hidden states (an EAGLE3 target's captured layers side by side).
    ring = allocate_ring(
        # One ring row per req_to_token row: slots run 1..size (row 0 pads CUDA-graph batches).
        num_slots=req_to_token_pool.req_to_token.shape[0],
        width=reserved_num_draft_tokens(server_args),
        hidden_size=EagleDraftExtendInput.hidden_size_for(draft_worker),
        dtype=EagleDraftExtendInput.dtype_for(draft_worker),
        device=req_to_token_pool.req_to_token.device,
    )
    if ring.lag.is_cuda:  # elsewhere a `none` step runs the kernels' torch references
        compile_kernels(
            req_to_token_pool.req_to_token, ring.hidden, ring.tokens, ring.lag
        )
    return PlainDecodeSteps(ring)


# ----------------------------------------------------------------------------- metrics


class ShapeMetrics:
    """sglang:spec_shape_steps_total{shape}, sglang:spec_shape_switches_total (every change
    of the running shape, probes' included) and sglang:spec_shape_probes_total, labelled as the
    scheduler's own metrics (SchedulerMetricsCollector)."""

    def __init__(self, labels: Mapping[str, str]):
        # After sglang set PROMETHEUS_MULTIPROC_DIR, as its collectors import it.
        from prometheus_client import Counter

        self._labels = dict(labels)
        self._steps = Counter(
            name="sglang:spec_shape_steps_total",
            documentation="Decode steps run per speculation shape (topk,steps,draft tokens).",
            labelnames=[*self._labels, "shape"],
        )
        self._switches = Counter(
            name="sglang:spec_shape_switches_total",
            documentation="Switches of the speculation shape between decode steps.",
            labelnames=list(self._labels),
        )
        self._probes = Counter(
            name="sglang:spec_shape_probes_total",
            documentation="Probes: a few steps of an idle shape, to refresh its acceptance.",
            labelnames=list(self._labels),
        )
        # The steps counter's child per shape: labels() builds its key and looks the child up
        # on every call, and stepped() runs every decode step.
        self._steps_of: dict[Shape, object] = {}

    def stepped(self, shape: Shape) -> None:
        child = self._steps_of.get(shape)
        if child is None:
            child = self._steps.labels(**self._labels, shape=shape.label)
            self._steps_of[shape] = child
        child.inc()

    def switched(self) -> None:
        self._switches.labels(**self._labels).inc()

    def probed(self) -> None:
        self._probes.labels(**self._labels).inc()
