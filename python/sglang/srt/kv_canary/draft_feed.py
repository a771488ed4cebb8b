"""Which token a draft pool's KV at position p belongs to: what the draft extend feeds.

The canary expects the K/V of token_at[row, p + offset] at position p of a pool. A draft model
is fed by its worker's draft extend, and sglang's EAGLE-family draft extends feed the target's
ids rotated left by one (input_ids[1:] + the token the target just sampled): the draft KV at p
holds token p + 1. STANDALONE runs the same draft extend (its workers subclass the EAGLE ones)
although its draft is an ordinary LM, so a token offset guessed from the algorithm's name would
flag every healthy draft read. The offset is taken from the worker class that
SpeculativeAlgorithm.create_worker picks instead, and a worker whose draft extend the canary
does not know gets no draft canary rather than a guess.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DraftFeed:
    """How a draft extend lays tokens into its draft's KV."""

    # The draft KV at position p holds the K/V of token p + token_shift.
    token_shift: int
    # Multi-layer EAGLE (MTP): draft layer i is fed ids rotated i more times than layer 0.
    shift_per_layer: bool = False

    def token_offset(self, layer: Optional[int]) -> int:
        """The offset of the pool of draft layer `layer` (None: the single draft runner)."""
        per_layer = (layer or 0) if self.shift_per_layer else 0
        return self.token_shift + per_layer


ROTATED_ONCE = DraftFeed(token_shift=1)
ROTATED_PER_LAYER = DraftFeed(token_shift=1, shift_per_layer=True)


@functools.lru_cache(maxsize=None)
def _draft_extends() -> tuple[tuple[type, DraftFeed], ...]:
    """The worker classes whose draft extend builds its input ids as noted; a subclass that
    keeps the draft extend (STANDALONE's workers) feeds its draft the same way."""
    from sglang.srt.speculative.eagle_worker import EAGLEWorker
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
    from sglang.srt.speculative.multi_layer_eagle_worker import MultiLayerEagleWorker
    from sglang.srt.speculative.multi_layer_eagle_worker_v2 import (
        MultiLayerEagleWorkerV2,
    )

    return (
        # forward_draft_extend -> EagleDraftInput.prepare_for_extend: input_ids[1:] + bonus
        (EAGLEWorker, ROTATED_ONCE),
        # EagleDraftWorker._draft_extend_for_prefill: input_ids[1:] + next_token_ids[i]
        (EAGLEWorkerV2, ROTATED_ONCE),
        # forward_draft_extend: layer i's ids are rotated once more than layer i - 1's
        (MultiLayerEagleWorker, ROTATED_PER_LAYER),
        # _draft_extend_for_prefill: rotate_input_ids_triton once per layer
        (MultiLayerEagleWorkerV2, ROTATED_PER_LAYER),
    )


def draft_feed_of(worker_cls: type) -> Optional[DraftFeed]:
    """How worker_cls's draft extend feeds its draft, or None when the canary does not know."""
    for implementer, feed in _draft_extends():
        if issubclass(worker_cls, implementer):
            return feed
    return None


def speculative_worker_class(server_args) -> Optional[type]:
    """The worker class sglang runs for server_args (None without speculative decoding)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algorithm = SpeculativeAlgorithm.from_string(
        getattr(server_args, "speculative_algorithm", None)
    )
    if algorithm.is_none():
        return None
    return algorithm.create_worker(server_args)


def draft_token_offset(server_args, layer: Optional[int] = None) -> Optional[int]:
    """The token offset of a draft pool under server_args, or None when the draft extend of the
    worker sglang runs is unknown to the canary (its draft pool then goes unchecked)."""
    worker_cls = speculative_worker_class(server_args)
    feed = draft_feed_of(worker_cls) if worker_cls is not None else None
    return None if feed is None else feed.token_offset(layer)
