"""The per-step choice of a speculation shape for the running batch (docs/shape-policy.md).

A fixed draft shape that wins at batch size 1 loses at large batch: verify costs bs *
num_draft_tokens target tokens, nearly free while the target is bound by reading its weights
and proportional once it is bound by compute. Before each decode step this policy picks, from
a user-given set of shapes, the one with the most expected tokens per second at the running
batch size:

    score(shape, bs) = accept_length(shape) / step_seconds(shape, bs)

accept_length is an EMA per shape of the tokens a request commits in a step (over the
shape's own request-steps, so a step weighs as many draws as it has requests; 1 for no
speculation); step_seconds a table per shape over batch sizes (measured at
start-up, refreshed by the steps that run). Keeping the two apart lets a shape measured at one
batch size be chosen at another. A switch needs the challenger to beat the running shape by a
margin for `patience` decisions in a row, or by a decisive margin once; a shape idle for
`probe_interval` steps runs for `probe_steps` steps when its stale score is within the margin
of the best, so its acceptance follows the traffic, and a shape priced only by a guess from a
distant batch size runs a few steps once the batch settles, to measure its price there. A
price remembers the requests' mean context it was measured at (a step reads more KV as they
grow) and is carried to the batch's context by what a token of context costs a step at that
batch size, once the steps run say (context_slope); one taken far from the batch's context is
measured again before it decides anything.

Decisions only: which runtime state (graphs, backends) a shape uses is the worker's business.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

from sglang.srt.speculative.context_slope import ContextSlope

CONFIG_FLAG = "--speculative-adaptive-config"


class Shape(NamedTuple):
    """A draft shape: topk, num_steps, num_draft_tokens; NONE verifies the bonus token only.
    A tuple: the policy looks shapes up in dicts dozens of times a decode step, and a
    tuple's hash and comparisons run in C, a dataclass's in Python."""

    topk: int
    num_steps: int
    num_draft_tokens: int

    @property
    def speculates(self) -> bool:
        return self.num_steps > 0

    @property
    def label(self) -> str:
        if not self.speculates:
            return "none"
        return f"{self.topk},{self.num_steps},{self.num_draft_tokens}"

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """ "16,3,32" -> Shape(16, 3, 32); "none" -> NONE."""
        if text.strip().lower() == "none":
            return NONE
        parts = text.split(",")
        try:
            topk, num_steps, num_draft_tokens = (int(p) for p in parts)
        except ValueError:
            raise ValueError(
                f"{CONFIG_FLAG}: shape {text!r} is not TOPK,STEPS,DRAFT_TOKENS or none"
            ) from None
        return cls(topk, num_steps, num_draft_tokens)


NONE = Shape(topk=1, num_steps=0, num_draft_tokens=1)


@dataclass(frozen=True)
class PolicyConfig:
    shapes: tuple[Shape, ...]
    # A challenger must score above (1 + margin) x the running shape ...
    margin: float = 0.05
    # ... in this many decisions in a row ...
    patience: int = 8
    # ... unless it scores above (1 + decisive_margin) x, which switches at once. Patience is
    # for near ties, where a noisy estimate could flap; a batch that jumps (1 -> 64) or an
    # engine whose first shape is far off would otherwise run a shape that costs several
    # times the best for `patience` steps.
    decisive_margin: float = 0.25
    # A shape idle for this many steps is probed for probe_steps steps.
    probe_interval: int = 512
    probe_steps: int = 8
    # Weight of the newest step in the step-time EMA.
    ema_alpha: float = 0.2
    # Request-steps the accept-length estimate averages over. A step of n requests counts as
    # n draws: one request's accept length ranges over 1 .. num_steps + 1, so a per-step
    # weight would let a batch of one swing the estimate by far more than the margin, and the
    # policy would leave the best shape on a run of short draws. One draw's spread is about
    # 1 token, so over the EMA's 2 x horizon draws the estimate of a chain's 2.5 wanders by
    # 1 / sqrt(2 x horizon) / 2.5: 4 % at 64, the margin's size, and 2 % at 256.
    accept_horizon: int = 256

    @classmethod
    def from_dict(cls, raw: Mapping[str, object], check_shape=None) -> "PolicyConfig":
        """Validate a config's policy keys; check_shape(shape) raises ValueError for a shape
        the server would refuse on its own (the hook's tree / chain rules)."""
        labels = raw.get("shapes")
        if not isinstance(labels, (list, tuple)) or not all(
            isinstance(s, str) for s in labels
        ):
            raise ValueError(f'{CONFIG_FLAG}: "shapes" must be a list of strings')
        shapes = tuple(Shape.parse(s) for s in labels)
        if len(set(shapes)) != len(shapes):
            raise ValueError(f'{CONFIG_FLAG}: "shapes" lists a shape twice: {labels}')
        if sum(s.speculates for s in shapes) < 1 or len(shapes) < 2:
            raise ValueError(
                f'{CONFIG_FLAG}: "shapes" needs at least two shapes, one of them '
                f"speculating, got {labels}"
            )
        if check_shape is not None:
            for shape in shapes:
                if shape.speculates:
                    check_shape(shape)
        defaults = cls(shapes=shapes)
        values = {}
        for key, low in (
            ("margin", 0.0),
            ("decisive_margin", 0.0),
            ("ema_alpha", 0.0),
            ("accept_horizon", 1),
            ("patience", 1),
            ("probe_interval", 1),
            ("probe_steps", 1),
        ):
            value = raw.get(key, getattr(defaults, key))
            kind = float if isinstance(getattr(defaults, key), float) else int
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f'{CONFIG_FLAG}: "{key}" must be a number')
            if kind is int and value != int(value):
                raise ValueError(f'{CONFIG_FLAG}: "{key}" must be an integer')
            if value < low or (key == "ema_alpha" and not 0 < value <= 1):
                raise ValueError(f'{CONFIG_FLAG}: "{key}" out of range: {value}')
            values[key] = kind(value)
        if values["decisive_margin"] < values["margin"]:
            raise ValueError(
                f'{CONFIG_FLAG}: "decisive_margin" ({values["decisive_margin"]}) is below '
                f'"margin" ({values["margin"]})'
            )
        return cls(shapes=shapes, **values)


def prior_step_cost(shape: Shape, bs: int, verify_knee: int = 128) -> float:
    """A step's cost in units of one target decode step, before anything is measured: a verify
    that costs in proportion once bs * num_draft_tokens passes the knee where the target stops
    being bound by reading its weights, the spec loop's fixed price, and a small price per
    draft step. Only its ratios are used (StepCostTable scales it to what was measured).
    """
    verify = 1.0 + bs * shape.num_draft_tokens / verify_knee
    if not shape.speculates:
        return verify
    return verify + 0.5 + 0.1 * shape.num_steps


class StepCostTable:
    """step_seconds(shape, bs) from measured (or given) points.

    Between two points of a shape: linear. Past a shape's points: its nearest point, scaled by
    how the prior grows from there, corrected by how the other shapes measured at both batch
    sizes grew against their prior (on a host-bound target a step barely grows with the batch,
    far less than the prior's verify term says). A shape with no point yet: the prior, scaled
    by how far the measured points are from it (their median). So a shape or batch size not
    measured yet is compared in the units of those that were, and nothing looks cheap merely
    for not having run; the next measured step replaces the guess.

    A step far slower than the table expects is a one-off, not what the shape costs: the first
    step of a shape or of a new batch size compiles kernels, replays a CUDA graph for the first
    time and grows allocators, and took up to a few hundred times a warm step. It is left out
    unless the steps after it are as slow. Only steps at batch sizes the shape has already run
    count towards that streak: a shape's first steps on a growing batch are each the first at
    their size, and three of them in a row are three one-offs, not a new cost. A point far above
    a measured step was set by such a one-off and is replaced: at the step's own batch size, and
    at the shape's other batch sizes where it is ONE_OFF_RATIO times dearer per prior unit (the
    prior's growth over batch sizes is right to well within that), since a one-off that set the
    only point of a batch size is otherwise never run there again to be corrected. A point set
    by the first step the table believes of a shape at a batch size (its first step there, or
    the next where the first was left out) is provisional: a one-off can stay under
    ONE_OFF_RATIO (the first replay of a CUDA graph took 3.4x a warm step), the step after a
    compile is often still slower than the warm ones, and the next step there (at a near
    context) confirms the cheaper of the two instead of moving the point by the EMA, which would
    keep a price probe's few steps dear: either step may have waited on something else, neither
    did less than the shape's work, and a probe's dearer step standing alone would keep the
    shape out until its next probe. Until then the point is an upper bound, not an estimate:
    where the shape's other points price that batch size lower, they do. A shape is often left
    on its first step at a size (the batch grew past it), and a one-off trusted there would
    price the shape dear at that size, and at every size extrapolated from it, for as long as it
    does not run there again, which its price then prevents; a price that is too low instead
    runs the shape, and its steps correct it.

    A step's cost also grows with its requests' contexts (the KV its attention reads): over
    a run of 1024-token replies the chain's step at bs 48 went from 2.9 to 4.5 ms. A point
    remembers the mean context it was measured at, and a step at a context more than
    CONTEXT_NEAR away from it replaces it instead of moving it by the EMA. A price is the
    shape's cost at the context of the points it comes from (context_at); seconds_at
    carries it to another context by what a token of context costs at that batch size
    (ContextSlope, fed by the believed steps), and the policy probes a shape priced that
    far from the running batch's context (ShapePolicy._context_stale).
    """

    # How many times the expected seconds a step may take and still be believed.
    ONE_OFF_RATIO = 4.0
    # Steps of a shape in a row that slow are believed (the cost really changed).
    ONE_OFF_STREAK = 3
    # Batch sizes within this factor of each other are near (measured_near).
    NEAR = 2.0
    # Mean contexts (KV tokens per request) within this factor of each other are near.
    CONTEXT_NEAR = 2.0

    def __init__(
        self,
        points: Mapping[Shape, Mapping[int, float]],
        ema_alpha: float,
        prior: Callable[[Shape, int], float] = prior_step_cost,
        confirm_cheaper: bool = True,
    ):
        self._points: dict[Shape, dict[int, float]] = {}
        self._ema_alpha = ema_alpha
        # Whether a provisional point's second step confirms the cheaper of the two (steps
        # timed as device spans, which no step's work undercuts) or replaces it (periods: a
        # first step after another forward is charged its span, less than a period).
        self._confirm_cheaper = confirm_cheaper
        self._prior = prior
        # Seconds per prior unit of every point, and their median (None: not computed).
        self._units: dict[tuple[Shape, int], float] = {}
        self._seconds_per_unit: Optional[float] = None
        # Slow steps in a row, by shape (ONE_OFF_STREAK).
        self._slow: dict[Shape, int] = {}
        # (shape, bs) pairs given or stepped, believed or not: a step at a pair not in it is
        # the first there.
        self._ran: set[tuple[Shape, int]] = set()
        # Points set by the shape's first step at that batch size.
        self._provisional: dict[Shape, set[int]] = {}
        # The mean context of each point's latest step (absent: given, or not known).
        self._contexts: dict[tuple[Shape, int], float] = {}
        # Each shape's points that are not provisional, sorted by batch size.
        self._confirmed: dict[Shape, dict[int, float]] = {}
        # seconds() since the table last changed: the policy asks for the same few pairs
        # several times a step, on the scheduler's thread.
        self._memo: dict[tuple[Shape, int], float] = {}
        self._context_memo: dict[tuple[Shape, int], Optional[float]] = {}
        # What a token of mean context costs a step, by batch size, and seconds_at()'s
        # (seconds, their context, that cost) by (shape, bs) since the table last changed.
        self.context_slope = ContextSlope()
        self._line_memo: dict[tuple[Shape, int], tuple] = {}
        for shape, by_bs in points.items():
            if not by_bs or min(by_bs.values()) <= 0:
                raise ValueError(f"step costs of {shape.label} must be positive")
            self._points[shape] = {}
            for bs, seconds in sorted(by_bs.items()):
                self._set(shape, bs, seconds)
                self._ran.add((shape, bs))
            self._confirmed[shape] = dict(self._points[shape])

    def seconds(self, shape: Shape, bs: int) -> float:
        seconds = self._memo.get((shape, bs))
        if seconds is None:
            by_bs = self._points.get(shape, {})
            seconds = self._from_points(shape, bs, by_bs)
            confirmed = self._confirmed.get(shape)
            if confirmed and len(confirmed) < len(by_bs):
                seconds = min(seconds, self._from_points(shape, bs, confirmed))
            self._memo[(shape, bs)] = seconds
        return seconds

    def seconds_at(self, shape: Shape, bs: int, context: Optional[float]) -> float:
        """seconds(shape, bs) carried from the context of the points it comes from to
        `context` (the batch's mean KV tokens) by what a token of context costs a step at bs
        (ContextSlope), never below half of it; as is where either context is unknown.
        """
        line = self._line_memo.get((shape, bs))
        if line is None:
            per_token = self.context_slope.per_token(bs)
            # Without a cost per token there is nothing to carry (the usual case until
            # contexts have spread at some batch size).
            then = self.context_at(shape, bs) if per_token > 0 else None
            line = self._line_memo[(shape, bs)] = (
                self.seconds(shape, bs),
                then,
                per_token,
            )
        seconds, then, per_token = line
        if context is None or then is None:
            return seconds
        carried = seconds + per_token * (context - then)
        return carried if carried > 0.5 * seconds else 0.5 * seconds

    def context_at(self, shape: Shape, bs: int) -> Optional[float]:
        """The mean context of the points seconds(shape, bs) comes from: the point's at bs,
        the two around it weighed as the interpolation weighs them, or the nearest one's
        past the ends (None where none is known, e.g. given costs)."""
        key = (shape, bs)
        if key not in self._context_memo:
            known = {
                b: self._contexts[(shape, b)]
                for b in self._points.get(shape, ())
                if (shape, b) in self._contexts
            }
            context = None
            if bs in known:
                context = known[bs]
            elif known:
                sizes = list(known)
                i = bisect.bisect_left(sizes, bs)
                if 0 < i < len(sizes):
                    context = _interpolate(known, bs)
                else:
                    context = known[sizes[i - 1] if i > 0 else sizes[0]]
            self._context_memo[key] = context
        return self._context_memo[key]

    def _from_points(self, shape: Shape, bs: int, by_bs: Mapping[int, float]) -> float:
        """The shape's seconds at bs from by_bs (its points, sorted by batch size)."""
        if bs in by_bs:
            return by_bs[bs]
        sizes = list(by_bs)
        i = bisect.bisect_left(sizes, bs)
        if 0 < i < len(sizes):
            return _interpolate(by_bs, bs)
        if sizes:
            anchor = sizes[i - 1] if i > 0 else sizes[0]
            grown = self._prior(shape, bs) / self._prior(shape, anchor)
            return by_bs[anchor] * grown * self._drift(shape, anchor, bs)
        return self._prior(shape, bs) * (self._unit() or 1.0)

    def _drift(self, shape: Shape, anchor: int, bs: int) -> float:
        """How far the prior's growth from anchor to bs is off, by the other shapes whose
        confirmed points span both sizes: the median of their seconds per prior unit at bs
        over that at anchor (1 when none spans them)."""
        low, high = min(anchor, bs), max(anchor, bs)
        ratios = []
        for other, points in self._confirmed.items():
            if other == shape or not points:
                continue
            sizes = list(points)
            if sizes[0] > low or sizes[-1] < high:
                continue
            unit_at_bs = _interpolate(points, bs) / self._prior(other, bs)
            unit_at_anchor = _interpolate(points, anchor) / self._prior(other, anchor)
            ratios.append(unit_at_bs / unit_at_anchor)
        return statistics.median(ratios) if ratios else 1.0

    def observe(
        self, shape: Shape, bs: int, seconds: float, context: Optional[float] = None
    ) -> None:
        """A measured step, its requests' mean context `context` (KV tokens, None: not
        known): the point at bs moves towards it (is set by the first, and replaced by the
        second, where the two are over ONE_OFF_RATIO apart and the step is believed, and
        where the point was measured at a context not near this one).
        """
        if not seconds > 0:  # a clock that did not advance measured nothing
            return
        slow = bool(self._units) and seconds > self.ONE_OFF_RATIO * self.seconds(
            shape, bs
        )
        first_at_bs = (shape, bs) not in self._ran
        self._ran.add((shape, bs))
        if slow:
            if first_at_bs:
                return
            self._slow[shape] = self._slow.get(shape, 0) + 1
            if self._slow[shape] < self.ONE_OFF_STREAK:
                return
        self._slow.pop(shape, None)
        if context is not None:
            self.context_slope.observe(shape, bs, context, seconds)
        by_bs = self._points.setdefault(shape, {})
        point = by_bs.get(bs)
        # Replace a point set by a first step, one far above this step (a one-off set it), or
        # with a believed slow streak; otherwise the EMA smooths the shape's warm steps.
        measured_at = self._contexts.get((shape, bs))
        provisional = point is not None and bs in self._provisional.get(shape, ())
        context_near = _context_near(measured_at, context)
        replace = (
            point is None
            or slow
            or provisional
            or seconds * self.ONE_OFF_RATIO < point
            or not context_near
        )
        if not replace:
            a = self._ema_alpha
            seconds = (1 - a) * point + a * seconds
        elif self._confirm_cheaper and provisional and context_near and not slow:
            # A provisional point confirmed: the cheaper of its two steps (class docstring).
            seconds = min(point, seconds)
        self._set(shape, bs, seconds)
        if context is not None:
            self._contexts[(shape, bs)] = context
        confirmed = self._confirmed.setdefault(shape, {})
        if first_at_bs or point is None:
            self._provisional.setdefault(shape, set()).add(bs)
            confirmed.pop(bs, None)
        else:
            self._provisional.get(shape, set()).discard(bs)
            new = bs not in confirmed
            confirmed[bs] = seconds
            if new:  # kept in order, as the points are
                self._confirmed[shape] = dict(sorted(confirmed.items()))
        self._drop_one_offs(shape, bs)
        self._memo.clear()
        self._context_memo.clear()
        self._line_memo.clear()

    def _set(self, shape: Shape, bs: int, seconds: float) -> None:
        by_bs = self._points[shape]
        new = bs not in by_bs
        by_bs[bs] = seconds
        if new:  # seconds() bisects the keys in order
            self._points[shape] = dict(sorted(by_bs.items()))
        self._units[(shape, bs)] = seconds / self._prior(shape, bs)
        self._seconds_per_unit = None

    def _drop_one_offs(self, shape: Shape, bs: int) -> None:
        """Forget the shape's points that cost ONE_OFF_RATIO times the point at bs per
        prior unit."""
        ceiling = self.ONE_OFF_RATIO * self._units[(shape, bs)]
        by_bs = self._points[shape]
        for other in [b for b in by_bs if self._units[(shape, b)] > ceiling]:
            del by_bs[other]
            self._confirmed[shape].pop(other, None)
            del self._units[(shape, other)]
            self._seconds_per_unit = None

    def confirmed(self, shape: Shape, bs: int) -> bool:
        """Whether the shape's point at bs is more than its first step's there (or given)."""
        return bs in self._confirmed.get(shape, ())

    def provisional(self, shape: Shape, bs: int) -> bool:
        """Whether the shape's point at bs is a first step's: an upper bound (above)."""
        return bs in self._points.get(shape, ()) and not self.confirmed(shape, bs)

    def confirmed_near(self, shape: Shape, bs: int) -> bool:
        """Whether the shape has a confirmed point within a factor NEAR of bs."""
        return any(_near(bs, point) for point in self._confirmed.get(shape, ()))

    def measured_near(self, shape: Shape, bs: int) -> bool:
        """Whether the shape has a point within a factor NEAR of bs: its price there is more
        than a guess carried from afar."""
        return any(_near(bs, point) for point in self._points.get(shape, ()))

    def _unit(self) -> Optional[float]:
        """Median seconds per prior unit over the points (None before the first)."""
        if self._seconds_per_unit is None and self._units:
            self._seconds_per_unit = statistics.median(self._units.values())
        return self._seconds_per_unit


def _near(a: int, b: int) -> bool:
    """Batch sizes within StepCostTable.NEAR of each other."""
    return a / StepCostTable.NEAR <= b <= a * StepCostTable.NEAR


def _context_near(a: Optional[float], b: Optional[float]) -> bool:
    """Mean contexts within StepCostTable.CONTEXT_NEAR of each other; an unknown one is near
    any other."""
    if a is None or b is None:
        return True
    return a / StepCostTable.CONTEXT_NEAR <= b <= a * StepCostTable.CONTEXT_NEAR


def _interpolate(by_bs: Mapping[int, float], bs: int) -> float:
    """Linear between the points (sorted by batch size) around bs, which they must span."""
    if bs in by_bs:
        return by_bs[bs]
    sizes = list(by_bs)
    i = bisect.bisect_left(sizes, bs)
    lo, hi = sizes[i - 1], sizes[i]
    w = (bs - lo) / (hi - lo)
    return (1 - w) * by_bs[lo] + w * by_bs[hi]


@dataclass
class ShapeCounters:
    """What the metrics export: steps run per shape, the policy's switches (a probe's detour
    and return are not counted), probes started."""

    steps: dict[str, int] = field(default_factory=dict)
    switches: int = 0
    probes: int = 0


# How many request-steps the initial accept-length guess weighs as.
GUESS_DRAWS = 8


class ShapePolicy:
    # A probe of a shape priced by a guess (_unpriced_contender): its length, and how far below
    # the running shape the guess may score.
    PRICE_PROBE_STEPS = 3
    PRICE_PROBE_MARGIN = 0.25
    # How far below the running shape a shape priced at another context may score and be
    # probed (_context_contender): a step's cost grows by half or more over a run's contexts,
    # so a price from the end of the last run can sit that far below a fresh one.
    CONTEXT_PROBE_MARGIN = 0.5
    # A challenger idle for more steps than this is probed (PRICE_PROBE_STEPS) before the
    # policy switches to it on patience: its price is as old as its last run, the running
    # shape's as fresh as its last step, and a host or device that slowed down since makes
    # every idle shape look cheaper than it is now. A decisive challenger (a batch that
    # jumped) is switched to at once. A challenger priced at a context not near the running
    # batch's is probed alike (_context_stale).
    STALE_AFTER = 64

    def __init__(
        self,
        config: PolicyConfig,
        costs: StepCostTable,
        initial: Shape,
        initial_accept_lengths: Optional[Mapping[Shape, float]] = None,
    ):
        if initial not in config.shapes:
            raise ValueError(
                f"{CONFIG_FLAG}: the flags' own shape {initial.label} is not in "
                f"{[s.label for s in config.shapes]}"
            )
        self.config = config
        self.costs = costs
        self.current = initial
        # Before a shape has run: what the caller expects of it (e.g. the chain expectation
        # of its depth), else the optimistic depth + 1, so that every shape gets measured.
        given = dict(initial_accept_lengths or {})
        self.accept_length = {
            s: 1.0 if not s.speculates else given.get(s, s.num_steps + 1.0)
            for s in config.shapes
        }
        # Draws behind each shape's accept length (up to accept_horizon), the initial guess
        # counting as GUESS_DRAWS: until a shape has horizon draws its estimate is their plain
        # mean. One request's draw ranges over 1 .. num_steps + 1, so a guess replaced by the
        # first draw could price a shape at accept length 1 after a single step and never
        # run it again.
        self._accept_draws = {s: GUESS_DRAWS for s in config.shapes}
        self.counters = ShapeCounters()
        self._step = 0
        self._last_run = {s: 0 for s in config.shapes}
        # The mean context of the batch being decided for (None: not known).
        self._context: Optional[float] = None
        # The step of each shape's last probe for a price at another context.
        self._context_probed: dict[Shape, int] = {}
        self._challenger: Optional[Shape] = None
        self._streak = 0
        self._probe_left = 0
        self._probe_return: Optional[Shape] = None
        self._probe_bs = 0  # the batch size a probe began at
        # The batch size the batch has stayed near (StepCostTable.NEAR), and for how many
        # decisions in a row.
        self._settled_bs = 0
        self._settled_for = 0

    def score(self, shape: Shape, bs: int) -> float:
        """Expected tokens a second per request of `shape` at bs, its price carried to the
        batch's context."""
        seconds = self.costs.seconds_at(shape, bs, self._context)
        return self.accept_length[shape] / seconds

    def choose(self, bs: int, context: Optional[float] = None) -> Shape:
        """The shape of the next decode step at batch size bs, whose requests' mean context
        is `context` KV tokens (None: not known)."""
        self._step += 1
        self._context = context
        if _near(self._settled_bs, bs):
            self._settled_for += 1
        else:
            self._settled_bs, self._settled_for = bs, 1
        if self._probe_left > 0:
            self._probe_left -= 1
            if self._probe_left > 0 and _near(self._probe_bs, bs):
                return self._ran(self.current)
            # The probe is over, or the batch left the size it began at (a near tie there
            # says nothing of this one: a probe of the wide tree begun as a batch drained to
            # bs 4 would go on at bs 64 after the next arrivals): back to the shape it left,
            # then decide as usual.
            self._probe_left = 0
            self._switch(self._probe_return, counted=False)
        # Every shape's score, once: nothing the scores read changes before the next result.
        scores = {s: self.score(s, bs) for s in self.config.shapes}
        best = max(scores, key=lambda s: (scores[s], s))
        threshold = (1 + self.config.margin) * scores[self.current]
        if best != self.current and scores[best] > threshold:
            if best == self._challenger:
                self._streak += 1
            else:
                self._challenger, self._streak = best, 1
            if self._streak >= self.config.patience:
                chosen, stale = best, self._stale(best, bs)
            else:
                chosen = self._decisive_challenger(scores)
                # A decisive challenger (the batch jumped) is switched to without a probe,
                # unless its price may be decisive only for having been taken at another
                # context.
                stale = chosen is not None and self._context_stale(chosen, bs)
            if stale:
                self._start_probe(chosen, bs, self.PRICE_PROBE_STEPS)
                return self._ran(self.current)
            if chosen is not None:
                self._switch(chosen)
        else:
            self._challenger, self._streak = None, 0
        probe = self._stale_contender(scores)
        steps = self.config.probe_steps
        if probe is None:
            probe = self._context_contender(bs, scores)
            steps = self.PRICE_PROBE_STEPS
        if probe is None:
            probe = self._unpriced_contender(bs, scores)
        if probe is not None:
            self._start_probe(probe, bs, steps)
        return self._ran(self.current)

    @property
    def probing(self) -> bool:
        """Whether the step just chosen is a probe's (its price is what the probe is for)."""
        return self._probe_left > 0

    def _start_probe(self, shape: Shape, bs: int, steps: int) -> None:
        self.counters.probes += 1
        self._probe_return = self.current
        self._probe_left = steps
        self._probe_bs = bs
        self._switch(shape, counted=False)

    def _stale(self, shape: Shape, bs: int) -> bool:
        """Whether the shape's score rests on a run older than STALE_AFTER steps, or on a
        price at another context (_context_stale). `none`'s price is the target's decode
        step, which drifts with the rest: stale alike."""
        idle_for = self._step - self._last_run[shape]
        return idle_for > self.STALE_AFTER or self._context_stale(shape, bs)

    def _context_stale(self, shape: Shape, bs: int) -> bool:
        """Whether the shape's price at bs was taken at a mean context not near the running
        batch's: it is what a step cost then. Requests' contexts grow through a run, so an
        idle shape's price taken late in one run is dear against the running shape's early in
        the next, and one taken early is cheap later on: in a run of 1024-token replies at
        bs 48 the narrow tree, priced early, kept the chain, priced at the end of the run
        before, out of a whole run that the chain makes a fifth faster."""
        return not _context_near(self.costs.context_at(shape, bs), self._context)

    def observe_accept(self, shape: Shape, accept_lengths: Sequence[int]) -> None:
        """Feed the tokens each request committed in a step of `shape` (drafts + bonus)."""
        if not accept_lengths or not shape.speculates:
            return
        n = len(accept_lengths)
        mean = sum(accept_lengths) / n
        horizon = self.config.accept_horizon
        seen = self._accept_draws[shape]
        # An EMA over draws, each weighing 1 / horizon: the step's n draws weigh
        # 1 - (1 - 1 / horizon) ** n together; while fewer than horizon have been seen, the
        # plain mean of all of them (n / (seen + n)) where that weighs more.
        a = 1 - (1 - 1 / horizon) ** n
        if seen < horizon:
            a = max(a, n / (seen + n))
        self._accept_draws[shape] = min(seen + n, horizon)
        self.accept_length[shape] = (1 - a) * self.accept_length[shape] + a * mean

    def observe_step_time(
        self, shape: Shape, bs: int, seconds: float, context: Optional[float] = None
    ) -> None:
        self.costs.observe(shape, bs, seconds, context)

    def _decisive_challenger(self, scores: Mapping[Shape, float]) -> Optional[Shape]:
        """The best speculating shape where it beats the running one by decisive_margin: a
        switch that does not wait out patience. A switch into `none` always waits: the first
        speculating step after it catches the draft up on every step it skipped (a cost its
        score does not carry), so a `none` run of a step or two, where a shrinking or growing
        batch passes a size `none` scores well at, costs more than it saves."""
        floor = (1 + self.config.decisive_margin) * scores[self.current]
        contenders = [
            s
            for s, score in scores.items()
            if s.speculates and s != self.current and score > floor
        ]
        return max(contenders, key=lambda s: (scores[s], s), default=None)

    def _stale_contender(self, scores: Mapping[Shape, float]) -> Optional[Shape]:
        """An idle shape whose stale score is within decisive_margin of the running one. A
        stale accept length can be off by more than the margin (the shape was left on a few
        short draws, or never ran long): probing only near ties would leave such a shape
        behind for good, while a probe costs probe_steps steps in probe_interval."""
        return self._best_within(
            scores,
            self.config.decisive_margin,
            lambda s: s.speculates
            and self._step - self._last_run[s] > self.config.probe_interval,
        )

    def _context_contender(
        self, bs: int, scores: Mapping[Shape, float]
    ) -> Optional[Shape]:
        """An idle shape priced at bs at a context over CONTEXT_NEAR times the running
        batch's, scoring within CONTEXT_PROBE_MARGIN of the running shape: its price is dear
        against the running shape's, so PRICE_PROBE_STEPS steps price it at this context. A
        shape priced at a shorter context looks cheaper than it is instead: where that makes
        it win, the switch waits for a probe (_stale), and where it does not, nothing is lost.
        So probes come where contexts fall (a new run of requests, short requests joining
        long ones), not at every doubling as contexts grow; as price probes, once the batch
        has stayed near bs for `patience` decisions; and once per shape in STALE_AFTER steps:
        a ramp of new requests finds each shape's points at its larger sizes taken at the
        longer contexts of the load before, one size after another."""
        if self._context is None or self._settled_for < self.config.patience:
            return None
        ceiling = self._context * StepCostTable.CONTEXT_NEAR

        def priced_dear(shape: Shape) -> bool:
            then = self.costs.context_at(shape, bs)
            last = self._context_probed.get(shape)
            return (
                then is not None
                and then > ceiling
                and (last is None or self._step - last > self.STALE_AFTER)
            )

        shape = self._best_within(scores, self.CONTEXT_PROBE_MARGIN, priced_dear)
        if shape is not None:
            self._context_probed[shape] = self._step
        return shape

    def _unpriced_contender(
        self, bs: int, scores: Mapping[Shape, float]
    ) -> Optional[Shape]:
        """A shape whose price at this batch size is a guess carried from afar (no point within
        StepCostTable.NEAR of bs) and scores within PRICE_PROBE_MARGIN of the running one,
        once the batch has stayed near bs for `patience` decisions; `none` included, its price
        being all there is to learn of it. A price grown from a distant batch size, or
        `none`'s from the prior, can be off by more than the margin where the shape is in
        fact the best, and nothing would run it there to correct that. The probe runs
        PRICE_PROBE_STEPS steps: a shape's first step at a new size may be a one-off, the next
        set its price."""
        if self._settled_for < self.config.patience:
            return None
        return self._best_within(
            scores,
            self.PRICE_PROBE_MARGIN,
            lambda s: not self.costs.measured_near(s, bs),
        )

    def _best_within(
        self,
        scores: Mapping[Shape, float],
        margin: float,
        eligible: Callable[[Shape], bool],
    ) -> Optional[Shape]:
        """The best-scoring shape other than the running one that is eligible and scores at
        least the running one's score / (1 + margin) (scores: every shape's at this batch
        size)."""
        floor = scores[self.current] / (1 + margin)
        contenders = [
            s
            for s, score in scores.items()
            if s != self.current and score >= floor and eligible(s)
        ]
        return max(contenders, key=lambda s: (scores[s], s), default=None)

    def _switch(self, shape: Shape, counted: bool = True) -> None:
        if shape != self.current:
            self.counters.switches += counted
            self.current = shape
        self._challenger, self._streak = None, 0

    def _ran(self, shape: Shape) -> Shape:
        self._last_run[shape] = self._step
        self.counters.steps[shape.label] = self.counters.steps.get(shape.label, 0) + 1
        return shape
