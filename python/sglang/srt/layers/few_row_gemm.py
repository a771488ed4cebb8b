"""A linear layer's GEMM tiled for few rows: y [M, N] = x [M, K] @ weight [N, K]^T.

A target's verify runs every linear layer over bs x num_draft_tokens rows (128 at bs 4 of tree
16,3,32), a decode step over bs. Up to a few hundred rows both read every weight once and are
bound by that read, so a verify's GEMMs need not take longer than a decode step's. cuBLAS's
tiles for 128 rows (112x128 and 96x128 in the 7.24B profile, against 128x8 and 64x8 at 4 rows)
leave a 4096-column layer a few dozen CTAs to stream its weights on a GPU of 132 SMs. This
kernel covers every row in one tile (BLOCK_M >= M) and gets a CTA per SM or more in one of two
ways: narrow column tiles (BLOCK_N 16-64), or wider ones (64-128) with the reduction split
across CTAs (split-K). Every CTA reads the whole row tile of x for its columns, so the narrow
tiles read x from L2 M / BLOCK_N times as often as their weights: at 128 rows, two to eight
times; the split keeps that at one or less. A split CTA stores its fp32 partial sums, and the
last of a tile's splits to finish adds them up in split order and stores the tile: one launch,
and the same sums in the same order on every call.

Whether it beats cuBLAS depends on the GPU, the layer and the row count:
benchmark/spec/bench_verify_gemm.py measures that, and a server runs this kernel only for the
layers and row counts its measurement names (few_row_gemm_table.py, opt-in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Tiling:
    """One launch configuration: the tile (rows x columns x reduction step), its warps and
    pipeline stages, and the number of CTAs each output tile's reduction is split across.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1

    @property
    def label(self) -> str:
        split = f" k/{self.split_k}" if self.split_k > 1 else ""
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k}"
            f" w{self.num_warps} s{self.num_stages}{split}"
        )


def tilings_for(rows: int) -> list[Tiling]:
    """The tilings bench_verify_gemm.py tries at `rows` rows: one row tile covering them all
    (tl.dot's smallest is 16), up to 128, then 128-row tiles; narrow column tiles, so that a
    4096-column layer has 64-256 CTAs. From 32 rows, where 16-column tiles read x from L2
    more than their weights, also 64- and 128-column tiles with the reduction split 4 or 8
    ways, and 128-column tiles unsplit for the widest layers (gate_up, the LM head: 200 or
    more CTAs already), where a split's partial sums would add more traffic than it saves.
    Nine or thirteen, since each is a compile per layer width on a fresh host."""
    block_m = min(max(16, triton.next_power_of_2(rows)), 128)
    plain = [Tiling(block_m, n, k) for n in (16, 32, 64) for k in (64, 128)]
    wide = [Tiling(block_m, n, 128, num_warps=8, num_stages=3) for n in (16, 32, 64)]
    if block_m < 32:
        return plain + wide
    wide_columns = [
        Tiling(block_m, n, 64, num_warps=8, num_stages=4, split_k=s)
        for n, s in ((64, 4), (128, 1), (128, 4), (128, 8))
    ]
    return plain + wide + wide_columns


@triton.jit
def _few_row_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    partial_ptr,
    arrivals_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_ym,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    # K, the layer's input width, is a constant: one compile per layer shape, as a GEMM
    # library picks its kernel per shape, and a reduction loop the compiler can pipeline.
    # Programs that share an output tile are neighbours (split fastest, then m): where the
    # rows need more than one row tile, the second reads the weights the first just brought
    # into L2.
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    split = pid % SPLIT_K
    tile = pid // SPLIT_K
    pid_m = tile % num_m_tiles
    pid_n = tile // num_m_tiles
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N

    # Each split reduces over its own run of whole BLOCK_K steps, the same number in every
    # split (a constant trip count, which the compiler pipelines); steps past K are masked
    # off, so the last split's run may be short or empty.
    STEPS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    SPLIT_STEPS: tl.constexpr = (STEPS + SPLIT_K - 1) // SPLIT_K
    k_begin = split * (SPLIT_STEPS * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(SPLIT_STEPS):
        ks = k_begin + step * BLOCK_K + tl.arange(0, BLOCK_K)
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

    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    y_ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_ok)
    else:
        # partial_ptr: [tiles, SPLIT_K, BLOCK_M, BLOCK_N] fp32; arrivals_ptr: [tiles] int32,
        # zero between calls.
        TILE_ELEMS: tl.constexpr = BLOCK_M * BLOCK_N
        in_tile = (
            tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        )
        tile_partials = partial_ptr + tile.to(tl.int64) * (SPLIT_K * TILE_ELEMS)
        tl.store(tile_partials + split * TILE_ELEMS + in_tile, acc)
        # Every thread's partial is stored before the arrival is counted (the barrier), and
        # the count's release publishes them to the CTA that reads them back after its
        # acquire; .cg reads them from L2, where the other CTAs' stores are.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(
                    tile_partials + s * TILE_ELEMS + in_tile, cache_modifier=".cg"
                )
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_ok)
            # Ready for the next call, a CUDA graph's next replay included.
            tl.atomic_xchg(arrivals_ptr + tile, 0, sem="relaxed", scope="gpu")


@dataclass
class SplitWorkspace:
    """What split tilings' launches share on one device: calls in stream order, each leaving
    the arrival counts at zero for the next. A CUDA graph captured with one keeps its
    addresses, so a workspace is allocated once at the largest size its calls need."""

    # [>= tiles * split_k * block_m * block_n] fp32: the splits' partial sums
    partials: torch.Tensor
    # [>= tiles] int32: splits of each output tile that have stored theirs
    arrivals: torch.Tensor

    @classmethod
    def allocate(
        cls, device: "torch.device | str", partial_elems: int, tiles: int
    ) -> "SplitWorkspace":
        return cls(
            partials=torch.empty(
                max(partial_elems, 1), dtype=torch.float32, device=device
            ),
            arrivals=torch.zeros(max(tiles, 1), dtype=torch.int32, device=device),
        )

    def holds(self, needs: tuple[int, int]) -> bool:
        partial_elems, tiles = needs
        return self.partials.numel() >= partial_elems and self.arrivals.numel() >= tiles


def split_needs(rows: int, out_features: int, tiling: Tiling) -> tuple[int, int]:
    """(partial sums, arrival counts) a call of `tiling` over rows x out_features needs of
    its workspace; (0, 0) for an unsplit tiling, which stores its tiles directly."""
    if tiling.split_k == 1:
        return 0, 0
    tiles = triton.cdiv(rows, tiling.block_m) * triton.cdiv(
        out_features, tiling.block_n
    )
    return tiles * tiling.split_k * tiling.block_m * tiling.block_n, tiles


def few_row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    tiling: Tiling,
    workspace: SplitWorkspace,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype, accumulated in fp32. Both inputs
    must be contiguous along K (a linear layer's input and weight are); `workspace` must
    hold split_needs(M, N, tiling)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1
    m, k = x.shape
    n = weight.shape[0]
    assert workspace.holds(split_needs(m, n, tiling)), "workspace too small"
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(m, tiling.block_m) * triton.cdiv(n, tiling.block_n)
    _few_row_gemm_kernel[(tiles * tiling.split_k,)](
        x,
        weight,
        out,
        workspace.partials,
        workspace.arrivals,
        m,
        n,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        K=k,
        BLOCK_M=tiling.block_m,
        BLOCK_N=tiling.block_n,
        BLOCK_K=tiling.block_k,
        SPLIT_K=tiling.split_k,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )
    return out


def reference_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What few_row_linear computes, in plain torch: fp32 products and sums, rounded once."""
    return (x.float() @ weight.float().T).to(x.dtype)
