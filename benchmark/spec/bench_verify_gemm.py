"""A target's linear layers at the row counts a verify gives them, by GEMM library.

A decode step runs each linear layer over bs rows, a verify over bs x num_draft_tokens (tree
16,3,32 at bs 4: 128). Up to a few hundred rows both read every weight once and that read
bounds them, yet the 7.24B target's GEMMs took 5680 us over 128 rows against 4926 over 4
(docs/benchmarks.md, "Profiles of the decode step"): 15 % of the step that keeps #23's tree
target at bs 4 out of reach. This times each layer shape of a preset's target at each row
count as torch runs it (`F.linear`, its default BLAS choice: what sglang's unquantized linear
layers run), with cuBLAS and cuBLASLt forced, and with few_row_gemm.py's Triton kernel (the
best of its tilings),
and prints microseconds, the weights' read bandwidth, and one target forward's GEMMs at each
row count over the first row count's:

    python benchmark/spec/bench_verify_gemm.py --preset llama8b --rows 4,16,32,64,128,256,512 \
        --out gemm.json

The --out rows are what SGLANG_FEW_ROW_GEMM reads (sglang.srt.layers.few_row_gemm_table): a
server on the same GPU then runs the kernel or cuBLASLt, the faster, for each layer and row
count where it measured faster than torch.

Each call reads a different copy of the weights (copies adding up to several L2s), as a
forward reads each layer's once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sglang.srt.layers import few_row_gemm  # noqa: E402
from specpatch.testing.synth import PRESETS, TargetSpec  # noqa: E402

# "torch": F.linear as sglang calls it; "cublas", "cublaslt": the same with
# torch.backends.cuda.preferred_blas_library forcing that library; "triton": few_row_gemm.
BACKENDS = ("torch", "cublas", "cublaslt", "triton")
# Bytes of weight copies each timed loop cycles through: several times an H100's or H200's
# 50-60 MB L2, so a call finds none of its weights there.
ROTATION_BYTES = 512 << 20


@dataclass(frozen=True)
class LayerShape:
    """One linear layer of the target: `out_features` x `in_features` weights, `per_forward`
    of them in one forward (one per layer, or the LM head's one)."""

    name: str
    out_features: int
    in_features: int
    per_forward: int

    @property
    def weight_bytes(self) -> int:
        return self.out_features * self.in_features * 2  # bf16


def layer_shapes(spec: TargetSpec) -> list[LayerShape]:
    """The GEMMs of one forward of a Llama-shaped target: fused qkv, o, fused gate_up and down
    in every layer, and the LM head (a verify computes logits for every row it checks).
    """
    head_dim = spec.hidden // spec.num_heads
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * head_dim
    layers = spec.num_layers
    return [
        LayerShape("qkv_proj", qkv, spec.hidden, layers),
        LayerShape("o_proj", spec.hidden, spec.num_heads * head_dim, layers),
        LayerShape("gate_up_proj", 2 * spec.intermediate, spec.hidden, layers),
        LayerShape("down_proj", spec.hidden, spec.intermediate, layers),
        LayerShape("lm_head", spec.vocab, spec.hidden, 1),
    ]


def forward_totals(rows: list[dict], shapes: list[LayerShape]) -> dict[tuple, float]:
    """(backend, row count) -> microseconds of one forward's GEMMs: each shape's time at that
    row count times its count per forward, for the cells where every shape was timed."""
    per_forward = {s.name: s.per_forward for s in shapes}
    cells: dict[tuple, dict[str, float]] = {}
    for r in rows:
        cells.setdefault((r["backend"], r["rows"]), {})[r["layer"]] = r["us"]
    return {
        key: sum(us * per_forward[name] for name, us in by_layer.items())
        for key, by_layer in cells.items()
        if by_layer.keys() == per_forward.keys()
    }


def total_lines(
    totals: dict[tuple, float], row_counts: list[int], shapes: list[LayerShape]
) -> list[str]:
    """One line per backend: a forward's GEMMs at each row count, its weights' bandwidth, and
    the time over the first row count's (1.00 where a verify costs what a decode does).
    """
    weights = sum(s.weight_bytes * s.per_forward for s in shapes)
    lines = []
    for backend in BACKENDS:
        base = totals.get((backend, row_counts[0]))
        cells = []
        for m in row_counts:
            us = totals.get((backend, m))
            if us is None:
                continue
            ratio = f", {us / base:.2f}x" if base else ""
            cells.append(f"{m} rows {us:.0f} us ({weights / us / 1e6:.2f} TB/s{ratio})")
        if cells:
            lines.append(f"  {backend}: " + "; ".join(cells))
    return lines


def best_over_libraries(totals: dict[tuple, float], row_counts: list[int]) -> list[str]:
    """Per row count, each other backend's forward over torch's (below 1: faster than what
    sglang runs today)."""
    lines = []
    for m in row_counts:
        base = totals.get(("torch", m))
        if not base:
            continue
        cells = [
            f"{b} {totals[(b, m)] / base:.3f}" for b in BACKENDS[1:] if (b, m) in totals
        ]
        if cells:
            lines.append(f"  {m} rows: " + ", ".join(cells))
    return lines


# ---------------------------------------------------------------------------- on the GPU


def time_us(call: Callable[[int], object], copies: int, iters: int) -> float:
    """Mean microseconds of call(i) (i cycling over the weight copies), after a warm-up."""
    for i in range(copies):
        call(i)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        call(i % copies)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def time_us_with_library(
    backend: str, call: Callable[[int], object], copies: int, iters: int
) -> float:
    """time_us of call with torch's BLAS library forced to `backend` ("torch": as it is)."""
    previous = torch.backends.cuda.preferred_blas_library()
    if backend != "torch":
        torch.backends.cuda.preferred_blas_library(backend)
    try:
        return time_us(call, copies, iters)
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def time_best_tiling(x, weights: list, want, copies: int, iters: int):
    """(microseconds, tiling) of few_row_gemm's fastest tiling on x and the weight copies, or
    None if none computes `want`; a tiling that computes wrong is printed, and is no
    candidate."""
    best: Optional[tuple[float, few_row_gemm.Tiling]] = None
    tilings = few_row_gemm.tilings_for(x.shape[0])
    out_features = weights[0].shape[0]
    needs = [few_row_gemm.split_needs(x.shape[0], out_features, t) for t in tilings]
    workspace = few_row_gemm.SplitWorkspace.allocate(
        x.device, max(n[0] for n in needs), max(n[1] for n in needs)
    )
    for tiling in tilings:
        got = few_row_gemm.few_row_linear(x, weights[0], tiling, workspace)
        if not torch.allclose(got.float(), want.float(), atol=5e-2, rtol=1e-2):
            err = (got.float() - want.float()).abs().max().item()
            print(
                f"  few_row_gemm {tiling.label}: WRONG (off by {err:.3g})", flush=True
            )
            continue
        us = time_us(
            lambda i: few_row_gemm.few_row_linear(x, weights[i], tiling, workspace),
            copies,
            iters,
        )
        if best is None or us < best[0]:
            best = (us, tiling)
    return best


def result_row(
    shape: LayerShape,
    rows: int,
    backend: str,
    us: float,
    tiling: Optional[few_row_gemm.Tiling] = None,
) -> dict:
    """One timed cell as --out writes it: what SGLANG_FEW_ROW_GEMM's table reads (the layer's
    shape, the rows, each backend's microseconds, the kernel's tiling) and the bandwidth.
    """
    row = {
        "layer": shape.name,
        "out_features": shape.out_features,
        "in_features": shape.in_features,
        "rows": rows,
        "backend": backend,
        "us": us,
        "tb_per_s": shape.weight_bytes / us / 1e6,
    }
    if tiling is not None:
        row |= {"tiling": tiling.label, "tiling_config": dataclasses.asdict(tiling)}
    return row


def measure(
    shapes: Iterable[LayerShape],
    row_counts: list[int],
    backends: list[str],
    iters: int,
) -> list[dict]:
    rows = []
    for shape in shapes:
        copies = max(2, math.ceil(ROTATION_BYTES / shape.weight_bytes))
        weights = [
            torch.randn(
                shape.out_features,
                shape.in_features,
                device="cuda",
                dtype=torch.bfloat16,
            )
            * 0.02
            for _ in range(copies)
        ]
        for m in row_counts:
            x = torch.randn(m, shape.in_features, device="cuda", dtype=torch.bfloat16)
            want = few_row_gemm.reference_linear(x, weights[0])
            for backend in backends:
                tiling = None
                if backend == "triton":
                    best = time_best_tiling(x, weights, want, copies, iters)
                    if best is None:
                        continue
                    us, tiling = best
                else:
                    us = time_us_with_library(
                        backend, lambda i: F.linear(x, weights[i]), copies, iters
                    )
                row = result_row(shape, m, backend, us, tiling)
                rows.append(row)
                print(
                    f"{shape.name:>13} {m:>4} rows {backend:>8}: {row['us']:8.1f} us "
                    f"{row['tb_per_s']:5.2f} TB/s {row.get('tiling', '')}",
                    flush=True,
                )
        del weights
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama8b", choices=sorted(PRESETS))
    parser.add_argument("--rows", default="4,16,32,64,128,256,512")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", help="rows as JSON")
    args = parser.parse_args()
    row_counts = [int(x) for x in args.rows.split(",")]
    backends = args.backends.split(",")
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        parser.error(f"--backends: unknown {sorted(unknown)}; known {list(BACKENDS)}")
    shapes = layer_shapes(PRESETS[args.preset])
    rows = measure(shapes, row_counts, backends, args.iters)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    totals = forward_totals(rows, shapes)
    print(f"one forward's GEMMs ({args.preset}), by row count:")
    print("\n".join(total_lines(totals, row_counts, shapes)))
    print("each backend over torch's, one forward:")
    print("\n".join(best_over_libraries(totals, row_counts)))


if __name__ == "__main__":
    main()
