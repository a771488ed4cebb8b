"""How much a decode step's time grows with its requests' mean context, per batch size
(docs/shape-policy.md, "Contexts").

A step's attention reads every request's KV, so a shape's step at one batch size costs more as
the requests' contexts grow: the chain's step at bs 48 on the 1.21B target went from 2.9 to
4.5 ms over a run of 1024-token replies. A price measured at one context compared with one
measured at another (an idle shape's from its last run against the running shape's fresh
one) favours the shape priced at the shorter context by what that difference costs; within a
factor of two of contexts at bs 48 that is up to a fifth of a step, four times the policy's
margin. At one batch size the shapes' growth per token of context was alike (0.161 and 0.144
ms per 100 tokens for the chain and the narrow tree at bs 48), so the growth learned from
whichever shapes run carries every shape's price to the batch's context.

Per (shape, batch size), an exponentially weighted least-squares fit of step seconds on mean
context, over that shape's steps there; a batch size's growth pools its shapes' fits (each
weighed by how many steps it holds and how far its contexts spread), and a batch size
without a fit takes its nearest fitted one's, scaled by the ratio of batch sizes (a step
reads bs times the mean context). Nothing is known, and nothing carried, until a fit has
MIN_STEPS steps over contexts spread by MIN_SPREAD tokens.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Hashable, Optional


@dataclass
class _Fit:
    """Exponentially weighted sums of (context, seconds) over one (shape, bs)'s steps."""

    weight: float = 0.0
    context: float = 0.0
    seconds: float = 0.0
    context_sq: float = 0.0
    context_seconds: float = 0.0

    def add(self, context: float, seconds: float, keep: float) -> None:
        self.weight = keep * self.weight + 1.0
        self.context = keep * self.context + context
        self.seconds = keep * self.seconds + seconds
        self.context_sq = keep * self.context_sq + context * context
        self.context_seconds = keep * self.context_seconds + context * seconds

    def variance(self) -> float:
        """The weighted variance of the contexts (tokens squared)."""
        mean = self.context / self.weight
        return max(self.context_sq / self.weight - mean * mean, 0.0)

    def slope(self) -> float:
        """Seconds per token of mean context (the least-squares line's)."""
        mean_context = self.context / self.weight
        mean_seconds = self.seconds / self.weight
        covariance = self.context_seconds / self.weight - mean_context * mean_seconds
        return covariance / self.variance()


class ContextSlope:
    # Steps a fit remembers: each step's weight halves after this many of its shape's steps
    # at that batch size (a run of replies spans a few hundred).
    HALF_LIFE_STEPS = 128
    # A fit says nothing before it holds this many steps (by weight) ...
    MIN_STEPS = 8.0
    # ... over contexts whose standard deviation is at least this many tokens.
    MIN_SPREAD = 32.0

    def __init__(self):
        self._keep = 0.5 ** (1.0 / self.HALF_LIFE_STEPS)
        self._fits: dict[tuple[Hashable, int], _Fit] = {}
        # Since the last observe(): each batch size's pooled slope (None: not computed), and
        # per_token() by batch size.
        self._pooled: Optional[dict[int, float]] = None
        self._memo: dict[int, float] = {}

    def observe(self, shape: Hashable, bs: int, context: float, seconds: float) -> None:
        """A believed step of `shape` at batch size bs: its requests' mean context (KV tokens)
        and its seconds."""
        self._fits.setdefault((shape, bs), _Fit()).add(context, seconds, self._keep)
        self._pooled = None
        self._memo.clear()

    def per_token(self, bs: int) -> float:
        """Seconds a step at batch size bs grows by per token of mean context (0 where no fit
        says; never below 0)."""
        if bs not in self._memo:
            self._memo[bs] = self._per_token(bs)
        return self._memo[bs]

    def _per_token(self, bs: int) -> float:
        if self._pooled is None:
            self._pooled = self._pooled_by_bs()
        pooled = self._pooled
        if not pooled:
            return 0.0
        sizes = sorted(pooled)
        i = bisect.bisect_left(sizes, bs)
        candidates = sizes[max(i - 1, 0) : i + 1]
        nearest = min(candidates, key=lambda b: (max(b, bs) / min(b, bs), b))
        return max(pooled[nearest] * bs / nearest, 0.0)

    def _pooled_by_bs(self) -> dict[int, float]:
        """Each batch size's pooled slope, over the fits that say something."""
        sums: dict[int, list[float]] = {}
        min_spread_sq = self.MIN_SPREAD**2
        for (_, bs), fit in self._fits.items():
            if fit.weight < self.MIN_STEPS:
                continue
            spread_sq = fit.variance()
            if spread_sq < min_spread_sq:
                continue
            weight = fit.weight * spread_sq
            total = sums.setdefault(bs, [0.0, 0.0])
            total[0] += weight * fit.slope()
            total[1] += weight
        return {bs: num / den for bs, (num, den) in sums.items()}
