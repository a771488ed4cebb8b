"""Which linear layers run another GEMM than torch's default: opt-in, from a measurement.

A spec v2 verify runs each of the target's linear layers over bs x num_draft_tokens rows, and
cuBLAS's tiles for a hundred rows read the same weights slower than its tiles for a decode's
few (few_row_gemm.py). Two GEMMs can do better there: few_row_gemm's Triton kernel, and
cuBLASLt, whose heuristics pick other tiles than cuBLAS's for some shapes (the 7.24B target's
down_proj from 32 rows). Which wins depends on the GPU, the layer's shape and the row
count, so a server runs either only where a measurement on its GPU says so:

    python benchmark/spec/bench_verify_gemm.py --preset P --rows 32,128 --out gemm.json
    SGLANG_FEW_ROW_GEMM=gemm.json python -m sglang.launch_server ...

A layer of `out_features` x `in_features` weights over M rows then runs the faster of the two
(the kernel at its fastest tiling) at exactly that (out_features, in_features, M) where it
took at most 1 - MARGIN of torch's time; every other GEMM is torch's, as without the
variable. Row counts are exact because the verify's are (bs x num_draft_tokens at each
captured batch size) and a tiling's speed changes with the rows; a layer shape is matched
whole, so a table measured at one tensor-parallel size applies to that size only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

import torch
import torch.nn.functional as F

from sglang.srt.layers.few_row_gemm import (
    SplitWorkspace,
    Tiling,
    few_row_linear,
    split_needs,
)

ENV = "SGLANG_FEW_ROW_GEMM"
# How much faster than torch a tiling or cuBLASLt must have measured to replace it: timing noise of
# bench_verify_gemm's loops is about 1 %.
MARGIN = 0.03
# A table entry that runs torch's GEMM through cuBLASLt instead of cuBLAS.
CUBLASLT = "cublaslt"
GemmChoice = Union[Tiling, Literal["cublaslt"]]


@dataclass(frozen=True)
class LayerRows:
    """One GEMM a forward runs: a layer's weights and the rows it multiplies them by."""

    out_features: int
    in_features: int
    rows: int


@dataclass
class FewRowGemmTable:
    """The GEMMs that do not run torch's default: each a few_row_gemm tiling or CUBLASLT."""

    choices: dict[LayerRows, GemmChoice]
    # One per device, sized for the table's largest split call at its first use.
    _workspaces: dict[torch.device, SplitWorkspace] = field(default_factory=dict)

    def workspace(self, device: torch.device) -> SplitWorkspace:
        ws = self._workspaces.get(device)
        if ws is None:
            needs = [
                split_needs(key.rows, key.out_features, choice)
                for key, choice in self.choices.items()
                if isinstance(choice, Tiling)
            ]
            ws = SplitWorkspace.allocate(
                device,
                max((n[0] for n in needs), default=0),
                max((n[1] for n in needs), default=0),
            )
            self._workspaces[device] = ws
        return ws


def table_from_rows(rows: list[dict], margin: float = MARGIN) -> FewRowGemmTable:
    """The table of bench_verify_gemm's rows: each (layer shape, row count) whose faster of
    its "triton" and "cublaslt" rows took at most 1 - margin of its "torch" row's
    microseconds."""
    torch_us: dict[LayerRows, float] = {}
    candidates: dict[LayerRows, list[tuple[float, GemmChoice]]] = {}
    for row in rows:
        key = LayerRows(row["out_features"], row["in_features"], row["rows"])
        if row["backend"] == "torch":
            torch_us[key] = row["us"]
        elif row["backend"] == "triton":
            tiling = Tiling(**row["tiling_config"])
            candidates.setdefault(key, []).append((row["us"], tiling))
        elif row["backend"] == CUBLASLT:
            candidates.setdefault(key, []).append((row["us"], CUBLASLT))
    choices = {}
    for key, measured in candidates.items():
        us, choice = min(measured, key=lambda m: m[0])
        if key in torch_us and us <= (1 - margin) * torch_us[key]:
            choices[key] = choice
    return FewRowGemmTable(choices)


def load_table(path: str) -> FewRowGemmTable:
    """The table of a bench_verify_gemm --out file; a ValueError naming the variable where
    the file is not one."""
    try:
        rows = json.loads(Path(path).read_text())
        return table_from_rows(rows)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{ENV}={path}: not the rows of `bench_verify_gemm.py --out` "
            f"({type(e).__name__}: {e})"
        ) from None


_PATH = os.environ.get(ENV) or None
_table: list[Optional[FewRowGemmTable]] = []


def active_table() -> Optional[FewRowGemmTable]:
    """The table SGLANG_FEW_ROW_GEMM names (read once), or None where it is unset."""
    if _PATH is None:
        return None
    if not _table:
        _table.append(load_table(_PATH))
    return _table[0]


def check_env() -> None:
    """At start-up, before any GPU allocation: a bad SGLANG_FEW_ROW_GEMM file is refused
    there, not at the first forward."""
    active_table()


def cublaslt_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T with torch's GEMM sent to cuBLASLt for this call only. The preference is
    process-wide state, set and restored around the one GEMM on the thread that launches
    the forward; a CUDA graph captured here keeps cuBLASLt's kernel."""
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(CUBLASLT)
    try:
        return F.linear(x, weight)
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def linear_if_measured_faster(
    x: torch.Tensor, weight: torch.Tensor
) -> Optional[torch.Tensor]:
    """x @ weight.T through the GEMM the table names for this layer at x's row count, else
    None (the caller runs torch's GEMM)."""
    if _PATH is None:
        return None
    if x.dim() != 2 or x.dtype != weight.dtype or torch.compiler.is_compiling():
        # torch.compile'd pieces (the prefill's piecewise graphs) keep torch's GEMM.
        return None
    table = active_table()
    choice = table.choices.get(LayerRows(weight.shape[0], weight.shape[1], x.shape[0]))
    if choice is None:
        return None
    if choice == CUBLASLT:
        return cublaslt_linear(x, weight)
    if x.stride(1) != 1 or weight.stride(1) != 1:
        return None
    return few_row_linear(x, weight, choice, table.workspace(x.device))
