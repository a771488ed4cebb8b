"""The new tokens' K and V rows as triton's extend attention kernels read them: in place.

A decoder layer projects q, k and v in one GEMM and splits its output, so the k and v that reach
`TritonAttnBackend.forward_extend` are views with a row stride of the fused projection's width.
Upstream passed `k.contiguous()` and `v.contiguous()` to the extend kernel: two copy kernels per
layer per extend. For a prefill they are a small part of the work; for a speculative verify or
draft extend (a few rows per request) each is a launch of almost no data, and a 32-layer target
runs 64 of them per verify, a fixed cost on the GPU in every speculating step.

Every extend kernel the backend launches (upstream's `_fwd_kernel`, with its short tile, and
the split-prefix kernel) takes a token stride and a head stride for k and v and reads the head
dimension as contiguous. So only a tensor whose head dimension is not contiguous needs the copy,
or one so long that its strided offsets pass what 32-bit index arithmetic holds (a contiguous
copy's are smaller by the projection's width over k's).

On by default; SGLANG_TRITON_EXTEND_ROWS_IN_PLACE=0 copies as upstream did (for an A/B).
"""

from __future__ import annotations

import os

import torch


def enabled_by_env(environ=os.environ) -> bool:
    """In place unless SGLANG_TRITON_EXTEND_ROWS_IN_PLACE is "0"."""
    return environ.get("SGLANG_TRITON_EXTEND_ROWS_IN_PLACE", "1") != "0"


_ENABLED = enabled_by_env()
# Offsets the kernels may compute in int32.
MAX_OFFSET = 2**31 - 1


def extend_rows(x: torch.Tensor) -> torch.Tensor:
    """x ([tokens, heads, head_dim] k or v of the extend) as the extend kernels can read it:
    itself when its head dimension is contiguous (any token and head strides) and its last
    element's offset fits int32, else a contiguous copy."""
    if _ENABLED and x.stride(-1) == 1 and _last_offset(x) <= MAX_OFFSET:
        return x
    return x.contiguous()


def _last_offset(x: torch.Tensor) -> int:
    return sum((n - 1) * s for n, s in zip(x.shape, x.stride()))
