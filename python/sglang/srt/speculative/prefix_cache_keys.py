"""Which keys the radix cache must match on so that a shared prefix is valid in the draft KV too.

EAGLE-family draft extends feed the draft the target's ids rotated left by one (input_ids[1:]
+ the token the target sampled), so the draft KV at position p holds the K/V of token p + 1.
A prefix the radix cache hands to a request, at admission or when cache_unfinished_req swaps
the request's own slots for equal ones already in the tree, is then right for the draft only
if the token after it matches too: the radix cache's bigram keys (CacheInitParams.is_eagle)
give exactly that, one cached position fewer for the same tokens.

STANDALONE's workers subclass the EAGLE ones and keep that draft extend, although their draft
is an ordinary LM, but upstream keys their cache on single tokens. Two prompts that share only
a first token then share position 0: the request whose slot is dropped for the other's reads
the other request's second token in the draft KV at position 0 from then on. The target KV is
right, so outputs are unchanged; the draft attends to a wrong key, which costs acceptance, and
the KV canary reports the draft read.
"""

from __future__ import annotations

from typing import Union

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo


def prefix_cache_uses_bigram_keys(
    spec_algorithm: Union[SpeculativeAlgorithm, CustomSpecAlgo],
) -> bool:
    """CacheInitParams.is_eagle for the scheduler's prefix cache: whether the draft KV at
    position p holds token p + 1.

    Upstream's is_eagle() (EAGLE, EAGLE3, FROZEN_KV_MTP), and STANDALONE, which runs the same
    draft extend. NGRAM has no draft KV; DFLASH and plugin algorithms keep upstream's answer.
    """
    return spec_algorithm.is_eagle() or spec_algorithm.is_standalone()
