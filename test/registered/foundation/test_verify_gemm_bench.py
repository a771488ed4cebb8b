"""benchmark/spec/bench_verify_gemm.py and its Triton kernel (sglang.srt.layers.few_row_gemm): the kernel
against its plain-torch reference (few_row_gemm_cases.py) through triton's interpreter and on
CUDA, every tiling compiled for sm_90, and the benchmark's layer table and summaries."""

from __future__ import annotations

import sys
from pathlib import Path

import few_row_gemm_cases as cases
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "spec"))
import bench_verify_gemm as bench  # noqa: E402

from sglang.srt.layers import few_row_gemm  # noqa: E402
from specpatch.testing.interpret import interpreter_suite  # noqa: E402
from specpatch.testing.sm90_compile import launches_compile_for_sm90  # noqa: E402
from specpatch.testing.synth import PRESETS  # noqa: E402

HERE = Path(__file__).resolve().parent
IDS = [c.name for c in cases.CASES]

interpreter_run, test_under_interpreter = interpreter_suite(
    HERE / "few_row_gemm_cases.py",
    [f"test_kernel_matches_reference[{name}]" for name in IDS],
)


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases.CASES, ids=IDS)
def test_kernel_matches_reference_on_cuda(case):
    cases.check(case, "cuda", torch.bfloat16)


@pytest.mark.gpu
def test_kernel_matches_reference_on_a_7b_layer_on_cuda():
    # The 7.24B target's down_proj (14336 -> 4096) over tree 16,3,32's rows at bs 4: on the
    # GPU a tile's splits run at once, so its last arrival is whichever split finishes last.
    cases.check(
        cases.Case("llama8b-down-128", 128, 4096, 14336), "cuda", torch.bfloat16
    )


@pytest.mark.gpu
def test_a_split_tiling_replays_in_a_cuda_graph():
    # What a verify graph does with it: captured once, replayed on new inputs in place; each
    # replay finds the arrival counts the last one left at zero.
    tiling = few_row_gemm.Tiling(128, 128, 64, num_warps=8, num_stages=4, split_k=8)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    workspace = few_row_gemm.SplitWorkspace.allocate(
        "cuda", *few_row_gemm.split_needs(128, 4096, tiling)
    )
    out = torch.empty(128, 4096, device="cuda", dtype=torch.bfloat16)
    few_row_gemm.few_row_linear(x, w, tiling, workspace, out)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        few_row_gemm.few_row_linear(x, w, tiling, workspace, out)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=g))
        graph.replay()
        want = few_row_gemm.reference_linear(x, w).float()
        err = (out.float() - want).abs().max().item()
        assert err <= want.abs().max().item() * 2**-7  # one bf16 rounding
        assert int(workspace.arrivals.count_nonzero()) == 0


# Shared memory an H100 CTA may have (227 KB).
H100_SHARED_BYTES = 232448


@pytest.mark.parametrize("rows", [1, 32, 128, 512])
def test_every_tiling_compiles_for_sm90_with_its_loads_pipelined(rows):
    """Triton's compiler, which the interpreter does not run, takes each tiling with the
    types and alignments a bf16 layer of the 7.24B target passes (4096 wide), pipelines the
    loads of x and the weights through num_stages buffers each (what hides a CTA's memory
    latency, with one or two CTAs an SM), and fits an H100's shared memory."""
    x = torch.zeros(rows, 4096, dtype=torch.bfloat16)
    weight = torch.zeros(96, 4096, dtype=torch.bfloat16)
    tilings = few_row_gemm.tilings_for(rows)
    workspace = few_row_gemm.SplitWorkspace.allocate("cpu", 1 << 20, 1 << 10)
    binaries = []
    with launches_compile_for_sm90(binaries) as compiled:
        for tiling in tilings:
            few_row_gemm.few_row_linear(x, weight, tiling, workspace)
    assert compiled == ["_few_row_gemm_kernel"] * len(tilings)
    for tiling, binary in zip(tilings, binaries):
        async_loads = binary.asm["ttgir"].count("async_copy_global_to_local")
        assert async_loads == 2 * tiling.num_stages, tiling.label
        assert binary.metadata.shared <= H100_SHARED_BYTES, tiling.label


@pytest.mark.parametrize(
    "rows,block_m", [(1, 16), (16, 16), (17, 32), (128, 128), (512, 128)]
)
def test_one_row_tile_covers_up_to_128_rows(rows, block_m):
    tilings = few_row_gemm.tilings_for(rows)
    assert tilings and {t.block_m for t in tilings} == {block_m}
    # narrow column tiles, or wider ones split: a 4096-column layer gets at least 64 CTAs
    # per row tile; an unsplit 128-column tile is for the widest layers (gate_up's 28672
    # columns: 224 CTAs)
    for t in tilings:
        if t.block_n == 128 and t.split_k == 1:
            assert 28672 // t.block_n >= 200
        else:
            assert 4096 // t.block_n * t.split_k >= 64, t.label


@pytest.mark.parametrize("rows,splits", [(16, set()), (32, {4, 8}), (128, {4, 8})])
def test_the_reduction_is_split_from_32_rows(rows, splits):
    # From 32 rows a 64-column tile reads x from L2 half as often as its weights or more
    # (rows / block_n); the split tilings' wider tiles keep that down.
    tilings = few_row_gemm.tilings_for(rows)
    assert {t.split_k for t in tilings} - {1} == splits
    assert all(t.block_n >= 64 for t in tilings if t.split_k > 1)


def test_the_7b_targets_layers_are_llama_3_8bs():
    shapes = {s.name: s for s in bench.layer_shapes(PRESETS["llama8b"])}

    assert {
        n: (s.out_features, s.in_features, s.per_forward) for n, s in shapes.items()
    } == {
        "qkv_proj": (6144, 4096, 32),  # 32 query heads and 2 x 8 KV heads of 128
        "o_proj": (4096, 4096, 32),
        "gate_up_proj": (28672, 4096, 32),
        "down_proj": (4096, 14336, 32),
        "lm_head": (32000, 4096, 1),
    }
    # about 7B parameters in the GEMMs of one forward, read once each
    weights = sum(s.weight_bytes * s.per_forward for s in shapes.values())
    assert 13.9e9 < weights < 14.3e9


def _rows(backend: str, rows: int, us_per_layer: dict) -> list[dict]:
    return [
        {"layer": name, "rows": rows, "backend": backend, "us": us}
        for name, us in us_per_layer.items()
    ]


SMALL = [
    bench.LayerShape("a", 64, 32, 3),
    bench.LayerShape("head", 128, 32, 1),
]


def test_a_forward_sums_each_layer_times_its_count():
    rows = [
        *_rows("torch", 4, {"a": 10.0, "head": 5.0}),
        *_rows("torch", 128, {"a": 12.0, "head": 6.0}),
        *_rows("triton", 128, {"a": 9.0, "head": 6.0}),
        *_rows("cublaslt", 128, {"a": 11.0}),  # its head not timed: no total
    ]

    assert bench.forward_totals(rows, SMALL) == {
        ("torch", 4): 35.0,
        ("torch", 128): 42.0,
        ("triton", 128): 33.0,
    }


def test_the_summaries_compare_row_counts_and_backends():
    totals = {("torch", 4): 35.0, ("torch", 128): 42.0, ("triton", 128): 33.0}
    weights = sum(s.weight_bytes * s.per_forward for s in SMALL)  # 28672 bytes

    assert bench.total_lines(totals, [4, 128], SMALL) == [
        f"  torch: 4 rows 35 us ({weights / 35e6:.2f} TB/s, 1.00x); "
        f"128 rows 42 us ({weights / 42e6:.2f} TB/s, 1.20x)",
        # no 4-row time to compare with
        f"  triton: 128 rows 33 us ({weights / 33e6:.2f} TB/s)",
    ]
    assert bench.best_over_libraries(totals, [4, 128]) == ["  128 rows: triton 0.786"]


def test_an_unknown_backend_names_the_flag(monkeypatch, capsys):
    monkeypatch.setattr(
        sys, "argv", ["bench_verify_gemm.py", "--backends", "torch,cutlass"]
    )

    with pytest.raises(SystemExit):
        bench.main()
    assert "--backends: unknown ['cutlass']" in capsys.readouterr().err


def test_the_fastest_tiling_that_computes_right_is_kept(monkeypatch, capsys):
    x, weight = torch.ones(4, 8), torch.ones(16, 8)
    want = few_row_gemm.reference_linear(x, weight)
    tilings = few_row_gemm.tilings_for(4)
    wrong, fastest = tilings[0], tilings[1]
    calls = []

    def linear(x, w, tiling, workspace):
        calls.append(tiling)
        return want + 1 if tiling == wrong else want

    def time_us(call, copies, iters):
        call(0)  # the call under time is the tiling's own
        return 1.0 if calls[-1] == fastest else 2.0

    monkeypatch.setattr(few_row_gemm, "few_row_linear", linear)
    monkeypatch.setattr(bench, "time_us", time_us)

    assert bench.time_best_tiling(x, [weight], want, 1, 1) == (1.0, fastest)
    assert f"few_row_gemm {wrong.label}: WRONG (off by 1)" in capsys.readouterr().out


def test_bench_e2e_few_row_gemm_configs_need_the_table(monkeypatch, capsys):
    import bench_e2e

    argv = ["bench_e2e.py", "--configs", "tree,tree-few-row-gemm", "--batch-sizes", "1"]
    monkeypatch.setattr(sys, "argv", argv)

    with pytest.raises(SystemExit):
        bench_e2e.main()
    assert (
        "tree-few-row-gemm runs the GEMMs of --few-row-gemm-table FILE"
        in capsys.readouterr().err
    )


def test_bench_e2e_few_row_gemm_configs_read_the_table_they_are_given(
    monkeypatch, tmp_path
):
    import bench_e2e

    for name in bench_e2e.FEW_ROW_GEMM_CONFIGS:
        config, env = bench_e2e.CONFIGS[name]
        monkeypatch.setitem(bench_e2e.CONFIGS, name, (config, dict(env)))
    monkeypatch.chdir(tmp_path)

    bench_e2e.set_few_row_gemm_table("gemm.json")

    for name in bench_e2e.FEW_ROW_GEMM_CONFIGS:
        env = bench_e2e.CONFIGS[name][1]
        # absolute: the engines may start elsewhere
        assert env["SGLANG_FEW_ROW_GEMM"] == str(tmp_path / "gemm.json")
    # an A/B of a switch, never the policy's "best fixed shape"
    assert "SGLANG_FEW_ROW_GEMM" in bench_e2e.KERNEL_SWITCHES
    assert bench_e2e.CONFIGS["tree-few-row-gemm"][0] == bench_e2e.CONFIGS["tree"][0]
