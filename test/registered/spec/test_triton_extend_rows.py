"""layers/attention/triton_extend_rows.py: the extend's k and v reach triton's extend kernels
as the strided views a fused qkv projection gives, without copies, and read the same."""

from __future__ import annotations

from pathlib import Path

import extend_rows_cases
import pytest
import torch

from sglang.srt.layers.attention import triton_extend_rows as er
from specpatch.testing.interpret import interpreter_suite

HERE = Path(__file__).resolve().parent
NAMES = [
    f"test_strided_rows_read_as_contiguous[{c.name}]" for c in extend_rows_cases.CASES
]

# Upstream's extend kernel and the split-prefix kernel bound loops by device values, which
# the interpreter reads as one-element arrays: numpy >= 2.5 refuses that.
interpreter_run, test_under_interpreter = interpreter_suite(
    HERE / "extend_rows_cases.py", NAMES, strict_numpy=False
)


def test_views_of_a_fused_projection_pass_through_uncopied():
    qkv = torch.randn(5, (8 + 2 + 2) * 16)
    k = qkv[:, 8 * 16 : 10 * 16].view(5, 2, 16)
    assert not k.is_contiguous()
    assert er.extend_rows(k) is k
    contiguous = torch.randn(5, 2, 16)
    assert er.extend_rows(contiguous) is contiguous


def test_in_place_unless_the_env_says_0(monkeypatch):
    assert er.enabled_by_env({})
    assert not er.enabled_by_env({"SGLANG_TRITON_EXTEND_ROWS_IN_PLACE": "0"})
    monkeypatch.setattr(er, "_ENABLED", False)
    k = torch.randn(5, 12 * 16)[:, 128:160].view(5, 2, 16)
    rows = er.extend_rows(k)
    assert rows is not k and rows.is_contiguous()


def test_a_strided_head_dim_is_copied():
    k = torch.randn(5, 16, 2).transpose(1, 2)  # [5, 2, 16], head dim stride 2
    rows = er.extend_rows(k)
    assert rows is not k and rows.is_contiguous() and torch.equal(rows, k)


def test_offsets_past_int32_are_copied():
    """A long prefill of a wide projection: a row stride of 12288 over 200k tokens passes
    int32, where the contiguous copy's (1024 per token) does not."""
    k = torch.empty_strided((200_000, 8, 128), (12288, 128, 1), device="meta")
    assert er.extend_rows(k) is not k and er.extend_rows(k).is_contiguous()
    short = torch.empty_strided((1000, 8, 128), (12288, 128, 1), device="meta")
    assert er.extend_rows(short) is short


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", extend_rows_cases.CASES, ids=[c.name for c in extend_rows_cases.CASES]
)
def test_strided_rows_read_as_contiguous_on_cuda(case):
    """On CUDA upstream's kernel also takes the short query tile where it applies, and
    the split-prefix kernel runs as the server would run it at bs 1-4."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    extend_rows_cases.check(case, "cuda")
