"""A linear layer's GEMM tiled for few rows: y [M, N] = x [M, K] @ weight [N, K]^T.

A target's verify runs every linear layer over bs x num_draft_tokens rows (128 at bs 4 of tree
16,3,32), a decode step over bs. Up to a few hundred rows both read every weight once and are
bound by that read, so a verify's GEMMs need not take longer than a decode step's. cuBLAS's
tiles for 128 rows (112x128 and 96x128 in the 7.24B profile, against 128x8 and 64x8 at 4 rows)
leave a 4096-column layer a few dozen CTAs to stream its weights on a GPU of 132 SMs. This
kernel covers every row in one tile (BLOCK_M >= M) and cuts the columns narrow (BLOCK_N
16-64), so there is a CTA per SM or more and each weight is read once. An experiment for
bench_verify_gemm.py, not yet wired into a server: whether it beats cuBLAS at those row counts
is what that benchmark measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Tiling:
    """One launch configuration: the tile (rows x columns x reduction step) and its warps and
    pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4

    @property
    def label(self) -> str:
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k}"
            f" w{self.num_warps} s{self.num_stages}"
        )


def tilings_for(rows: int) -> list[Tiling]:
    """The tilings bench_verify_gemm.py tries at `rows` rows: one row tile covering them all
    (tl.dot's smallest is 16), up to 128, then 128-row tiles; narrow column tiles, so that a
    4096-column layer has 64-256 CTAs. Nine, since each is a compile per layer width on a
    fresh host."""
    block_m = min(max(16, triton.next_power_of_2(rows)), 128)
    plain = [Tiling(block_m, n, k) for n in (16, 32, 64) for k in (64, 128)]
    wide = [Tiling(block_m, n, 128, num_warps=8, num_stages=3) for n in (16, 32, 64)]
    return plain + wide


@triton.jit
def _few_row_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_ym,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # K, the layer's input width, is a constant: one compile per layer shape, as a GEMM
    # library picks its kernel per shape, and a reduction loop the compiler can pipeline.
    # Programs that share a column tile are neighbours (m fastest): where the rows need more
    # than one row tile, the second reads the weights the first just brought into L2.
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % num_m_tiles
    pid_n = pid // num_m_tiles
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[:, None] * stride_wn + ks[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def few_row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    tiling: Tiling,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype, accumulated in fp32. Both inputs
    must be contiguous along K (a linear layer's input and weight are)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, tiling.block_m) * triton.cdiv(n, tiling.block_n),)
    _few_row_gemm_kernel[grid](
        x,
        weight,
        out,
        m,
        n,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        K=k,
        BLOCK_M=tiling.block_m,
        BLOCK_N=tiling.block_n,
        BLOCK_K=tiling.block_k,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )
    return out


def reference_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What few_row_linear computes, in plain torch: fp32 products and sums, rounded once."""
    return (x.float() @ weight.float().T).to(x.dtype)
