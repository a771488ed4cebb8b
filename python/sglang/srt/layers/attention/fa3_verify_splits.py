"""How many KV splits FA3's tree verify runs with: FA3's own choice, or a fixed count.

FA3 has no tree-masked kernel, so sglang verifies a tree (topk > 1) on FA3 as a cascade
(flashattention_backend.forward_extend, `use_cascade_attn`): a pass over each request's
prefix, a pass over the draft tokens each row may see, and a merge. Both passes leave the
split count to FA3 (num_splits 0). Under a CUDA graph, FA3 reads a verify whose page-table
rows are as wide as the context, and for a varlen call it sizes its splits as if one sequence
were that long (flash_api's get_num_splits: seqlen_k from the table's width, a batch of one),
so the captured prefix pass may split and combine where bs x KV-heads programs already fill
the GPU. Whether that is where FA3's tree verify loses to triton's is not measured yet:
SGLANG_FA3_TREE_VERIFY_NUM_SPLITS=N (a whole number >= 1) fixes both passes' split count for
that A/B (benchmark/spec/bench_verify_attention.py --fa3 per layer; bench_e2e's
tree-verify-one-split@fa3 end to end); unset, sglang's choice stands.
"""

from __future__ import annotations

import os
from typing import Optional

ENV = "SGLANG_FA3_TREE_VERIFY_NUM_SPLITS"


def fixed_num_splits(environ=os.environ) -> Optional[int]:
    """The split count asked for, or None for FA3's (and sglang's) own choice."""
    value = environ.get(ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"{ENV}={value!r}: want a whole number of KV splits >= 1, or unset for FA3's "
            "own choice"
        )
    return int(value)


_FIXED = fixed_num_splits()


def tree_verify_num_splits(default: int) -> int:
    """num_splits for both passes of FA3's cascade tree verify; `default` is what the backend
    passes everywhere else (0: FA3's heuristic; 1 under deterministic inference)."""
    return default if _FIXED is None else _FIXED
