"""Cases for triton_extend_rows, run under triton's CPU interpreter by test_triton_extend_rows.py
(and on CUDA by its GPU test): the extend kernels read k and v as strided views of a fused qkv
projection exactly as they read contiguous copies."""

from __future__ import annotations

import pytest
import split_prefix_cases as spc
import torch

from sglang.srt.layers.attention import triton_split_prefix as sp
from sglang.srt.layers.attention.triton_extend_rows import extend_rows

CASES = [c for c in spc.CASES if c.name != "bs2_scaled_kv"]


def fused_views(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as a decoder layer hands them over: column slices of one [tokens, q + k + v]
    projection, viewed as [tokens, heads, head_dim] (token stride: the projection's width).
    """
    q, k, v = x["q_extend"], x["k_extend"], x["v_extend"]
    tokens = q.shape[0]
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q_width, kv_width = q[0].numel(), k[0].numel()
    k_view = qkv[:, q_width : q_width + kv_width].view(tokens, *k.shape[1:])
    v_view = qkv[:, q_width + kv_width :].view(tokens, *v.shape[1:])
    assert extend_rows(k_view) is k_view and (tokens == 1 or not k_view.is_contiguous())
    return k_view, v_view


def upstream(x: dict, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(x["q_extend"], float("nan"))
    return spc.upstream_extend(x, out, k_extend=k, v_extend=v)


def split_prefix(x: dict, k: torch.Tensor, v: torch.Tensor, case) -> torch.Tensor:
    out = torch.full_like(x["q_extend"], float("nan"))
    sp.split_prefix_extend_attention(
        spc.plan_for(case), **{**x, "k_extend": k, "v_extend": v, "o_extend": out}
    )
    return out


def check(case, device: str) -> None:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = spc.make_inputs(case, device, dtype)
    k_view, v_view = fused_views(x)
    k, v = x["k_extend"], x["v_extend"]
    # Only the addressing differs: the same arithmetic in the same order, bit for bit.
    assert torch.equal(upstream(x, k_view, v_view), upstream(x, k, v))
    assert torch.equal(
        split_prefix(x, k_view, v_view, case), split_prefix(x, k, v, case)
    )


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_strided_rows_read_as_contiguous(case):
    check(case, "cpu")
