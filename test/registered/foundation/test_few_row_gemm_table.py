"""sglang.srt.layers.few_row_gemm_table: which GEMMs SGLANG_FEW_ROW_GEMM sends to the few-row
kernel or to cuBLASLt (those bench_verify_gemm measured faster than torch), the start-up
refusal of a bad file, and the linear layer's call site."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "spec"))
import bench_verify_gemm as bench  # noqa: E402

from sglang.srt.layers import few_row_gemm, few_row_gemm_table  # noqa: E402
from sglang.srt.layers.few_row_gemm_table import CUBLASLT, LayerRows  # noqa: E402

QKV = bench.LayerShape("qkv_proj", 6144, 4096, 32)
DOWN = bench.LayerShape("down_proj", 4096, 14336, 32)
SPLIT = few_row_gemm.Tiling(128, 128, 64, num_warps=8, num_stages=4, split_k=8)
NARROW = few_row_gemm.Tiling(32, 32, 128)


def bench_rows() -> list[dict]:
    """bench_verify_gemm --out rows: for qkv at 128 rows the kernel 10 % faster than torch
    and cuBLASLt 7 %, at 32 rows the kernel 2 % faster (inside the margin); for down_proj at
    128 rows the kernel slower and cuBLASLt 13 % faster."""
    return [
        bench.result_row(QKV, 128, "torch", 30.0),
        bench.result_row(QKV, 128, "cublaslt", 28.0),
        bench.result_row(QKV, 128, "triton", 27.0, SPLIT),
        bench.result_row(QKV, 32, "torch", 25.0),
        bench.result_row(QKV, 32, "triton", 24.5, NARROW),
        bench.result_row(DOWN, 128, "torch", 60.0),
        bench.result_row(DOWN, 128, "triton", 61.0, SPLIT),
        bench.result_row(DOWN, 128, "cublaslt", 52.0),
    ]


def test_the_table_holds_what_measured_faster_than_torch_by_the_margin():
    table = few_row_gemm_table.table_from_rows(bench_rows())

    # Each GEMM takes the faster of the two: the kernel for qkv, cuBLASLt for down_proj.
    assert table.choices == {
        LayerRows(6144, 4096, 128): SPLIT,
        LayerRows(4096, 14336, 128): CUBLASLT,
    }
    # With no margin the 2 % gain at 32 rows counts too.
    loose = few_row_gemm_table.table_from_rows(bench_rows(), margin=0.0)
    assert loose.choices == {
        LayerRows(6144, 4096, 128): SPLIT,
        LayerRows(6144, 4096, 32): NARROW,
        LayerRows(4096, 14336, 128): CUBLASLT,
    }


def test_a_cublaslt_row_inside_the_margin_is_not_taken():
    rows = [
        bench.result_row(DOWN, 64, "torch", 50.0),
        bench.result_row(DOWN, 64, "cublaslt", 49.0),
    ]

    assert few_row_gemm_table.table_from_rows(rows).choices == {}


def test_a_row_without_its_torch_time_is_not_taken():
    rows = [bench.result_row(QKV, 64, "triton", 1.0, NARROW)]

    assert few_row_gemm_table.table_from_rows(rows).choices == {}


def test_the_workspace_is_sized_for_the_largest_split_call_once():
    table = few_row_gemm_table.table_from_rows(bench_rows(), margin=0.0)

    ws = table.workspace(torch.device("cpu"))
    # qkv at 128 rows: 48 column tiles of 128, split 8 ways, 128 x 128 fp32 partials each
    # (down_proj's cuBLASLt entry needs none)
    assert ws.partials.numel() == 48 * 8 * 128 * 128
    assert ws.arrivals.numel() == 48 and int(ws.arrivals.count_nonzero()) == 0
    assert table.workspace(torch.device("cpu")) is ws


def test_a_file_that_is_not_the_benchmarks_rows_names_the_variable(tmp_path):
    bad = tmp_path / "gemm.json"
    bad.write_text(json.dumps([{"layer": "qkv_proj", "us": 1.0}]))

    with pytest.raises(ValueError, match=f"SGLANG_FEW_ROW_GEMM={bad}: not the rows"):
        few_row_gemm_table.load_table(str(bad))
    with pytest.raises(ValueError, match="SGLANG_FEW_ROW_GEMM=/nonexistent.json"):
        few_row_gemm_table.load_table("/nonexistent.json")


@pytest.fixture
def table_file(tmp_path, monkeypatch):
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps(bench_rows()))
    monkeypatch.setattr(few_row_gemm_table, "_PATH", str(path))
    monkeypatch.setattr(few_row_gemm_table, "_table", [])
    return path


def test_only_the_tables_gemms_leave_torchs_default(table_file, monkeypatch):
    calls = []

    def linear(x, weight, tiling, workspace):
        calls.append((tuple(x.shape), tuple(weight.shape), tiling))
        return torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype)

    def lt_linear(x, weight):
        calls.append((tuple(x.shape), tuple(weight.shape), CUBLASLT))
        return torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype)

    monkeypatch.setattr(few_row_gemm_table, "few_row_linear", linear)
    monkeypatch.setattr(few_row_gemm_table, "cublaslt_linear", lt_linear)
    qkv = torch.zeros(6144, 4096, dtype=torch.bfloat16)
    down = torch.zeros(4096, 14336, dtype=torch.bfloat16)
    x = torch.zeros(128, 4096, dtype=torch.bfloat16)
    x_down = torch.zeros(128, 14336, dtype=torch.bfloat16)

    assert few_row_gemm_table.linear_if_measured_faster(x, qkv) is not None
    assert few_row_gemm_table.linear_if_measured_faster(x_down, down) is not None
    assert calls == [
        ((128, 4096), (6144, 4096), SPLIT),
        ((128, 14336), (4096, 14336), CUBLASLT),
    ]
    # Rows the table does not name, a layer it does not name, another dtype, a 3-d input:
    # torch's GEMM (None).
    assert few_row_gemm_table.linear_if_measured_faster(x[:96], qkv) is None
    assert few_row_gemm_table.linear_if_measured_faster(x_down[:96], down) is None
    o_proj = torch.zeros(4096, 4096, dtype=torch.bfloat16)
    assert few_row_gemm_table.linear_if_measured_faster(x, o_proj) is None
    assert few_row_gemm_table.linear_if_measured_faster(x.float(), qkv) is None
    assert few_row_gemm_table.linear_if_measured_faster(x[None], qkv) is None
    assert len(calls) == 2


def test_cublaslt_is_preferred_for_its_gemm_only(monkeypatch):
    seen = []

    def linear(x, weight):
        seen.append(torch.backends.cuda.preferred_blas_library())
        return x @ weight.T

    monkeypatch.setattr(few_row_gemm_table.F, "linear", linear)
    before = torch.backends.cuda.preferred_blas_library()
    x, w = torch.randn(4, 8), torch.randn(3, 8)

    assert torch.equal(few_row_gemm_table.cublaslt_linear(x, w), x @ w.T)
    assert seen == [torch._C._BlasBackend.Cublaslt]
    assert torch.backends.cuda.preferred_blas_library() == before

    # A GEMM that raises leaves the preference as it found it.
    def fails(x, weight):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(few_row_gemm_table.F, "linear", fails)
    with pytest.raises(RuntimeError, match="NOT_SUPPORTED"):
        few_row_gemm_table.cublaslt_linear(x, w)
    assert torch.backends.cuda.preferred_blas_library() == before


def test_without_the_variable_nothing_is_read(monkeypatch):
    monkeypatch.setattr(few_row_gemm_table, "_PATH", None)
    monkeypatch.setattr(few_row_gemm_table, "_table", [])

    x, w = torch.zeros(128, 4096), torch.zeros(6144, 4096)
    assert few_row_gemm_table.linear_if_measured_faster(x, w) is None
    few_row_gemm_table.check_env()
    assert few_row_gemm_table._table == []


def test_server_args_refuse_a_bad_table_before_the_gpu(tmp_path, monkeypatch):
    from sglang.srt.server_args import ServerArgs
    from specpatch.testing import synth

    synth.make_pair(tmp_path, "toy", 0.7)
    bad = tmp_path / "gemm.json"
    bad.write_text("not json")
    monkeypatch.setattr(few_row_gemm_table, "_PATH", str(bad))
    monkeypatch.setattr(few_row_gemm_table, "_table", [])

    with pytest.raises(ValueError, match=f"SGLANG_FEW_ROW_GEMM={bad}: not the rows"):
        ServerArgs(
            model_path=str(tmp_path / "target"),
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=str(tmp_path / "draft"),
            speculative_eagle_topk=16,
            skip_tokenizer_init=True,
            device="cuda",
            attention_backend="triton",
        )


def test_the_unquantized_linear_layer_asks_the_table_first(table_file, monkeypatch):
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    taken = torch.full((128, 6144), 7.0, dtype=torch.bfloat16)
    monkeypatch.setattr(
        few_row_gemm_table, "few_row_linear", lambda x, w, tiling, ws: taken
    )
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(
        torch.zeros(6144, 4096, dtype=torch.bfloat16), requires_grad=False
    )
    method = UnquantizedLinearMethod()

    assert method.apply(layer, torch.zeros(128, 4096, dtype=torch.bfloat16)) is taken
    # 96 rows are not in the table: torch's GEMM of zeros.
    out = method.apply(layer, torch.ones(96, 4096, dtype=torch.bfloat16))
    assert out.shape == (96, 6144) and int(out.count_nonzero()) == 0
    # A bias keeps torch's GEMM (F.linear adds it).
    bias = torch.ones(6144, dtype=torch.bfloat16)
    out = method.apply(layer, torch.zeros(128, 4096, dtype=torch.bfloat16), bias)
    assert torch.equal(out, bias.expand(128, -1))


@pytest.mark.gpu
def test_a_table_gemm_on_cuda_matches_the_reference(table_file):
    # What the server runs for the 7.24B target's qkv_proj over tree 16,3,32's rows at bs 4.
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02

    got = few_row_gemm_table.linear_if_measured_faster(x, w).float()
    want = few_row_gemm.reference_linear(x, w).float()
    assert (got - want).abs().max().item() <= want.abs().max().item() * 2**-7


@pytest.mark.gpu
def test_a_cublaslt_gemm_replayed_in_a_cuda_graph_matches_the_reference(table_file):
    # down_proj over 128 rows, as the target-verify graph captures it.
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(128, 14336, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (
        torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16, generator=g)
        * 0.02
    )
    before = torch.backends.cuda.preferred_blas_library()

    few_row_gemm_table.linear_if_measured_faster(x, w)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = few_row_gemm_table.linear_if_measured_faster(x, w)
    x.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=g))
    graph.replay()
    torch.cuda.synchronize()

    want = few_row_gemm.reference_linear(x, w).float()
    assert (out.float() - want).abs().max().item() <= want.abs().max().item() * 2**-7
    assert torch.backends.cuda.preferred_blas_library() == before
