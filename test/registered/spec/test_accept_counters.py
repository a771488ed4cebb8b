"""The accept counters in the draft-extend CUDA-graph buffers: both fields exist, padding keeps
each field's meaning, and staging copies each field the batch carries on its own."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.speculative.accept_counters import (
    pad_accept_counters,
    stage_accept_counters,
)


@pytest.mark.parametrize(
    "runner_module,buffers_class",
    [
        (
            "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner",
            "EagleDraftExtendInputBuffers",
        ),
        (
            "sglang.srt.speculative.multi_layer_eagle_draft_extend_cuda_graph_runner",
            "MultiLayerEagleDraftExtendInputBuffers",
        ),
    ],
)
def test_graph_buffers_carry_both_counters(runner_module, buffers_class):
    import importlib

    cls = getattr(importlib.import_module(runner_module), buffers_class)
    fields = {f.name for f in dataclasses.fields(cls)}
    assert {"num_correct_drafts", "num_accept_tokens"} <= fields


def test_padding_is_a_full_chain_in_both_meanings():
    drafts, tokens = torch.zeros(6, dtype=torch.int32), torch.zeros(
        6, dtype=torch.int32
    )
    pad_accept_counters(drafts, tokens, num_tokens_per_req=4)
    assert drafts.tolist() == [3] * 6 and tokens.tolist() == [4] * 6
    assert torch.equal(tokens, drafts + 1)


@pytest.mark.parametrize("bs,max_bs", [(1, 1), (1, 8), (5, 8), (8, 8)])
def test_staging_copies_both_counters(bs, max_bs):
    drafts_buf, tokens_buf = torch.full((max_bs,), -7, dtype=torch.int32), torch.full(
        (max_bs,), -7, dtype=torch.int32
    )
    drafts = torch.randint(0, 4, (bs,), dtype=torch.int32)
    spec_info = SimpleNamespace(num_correct_drafts=drafts, num_accept_tokens=drafts + 1)
    stage_accept_counters(drafts_buf, tokens_buf, spec_info, bs)
    assert drafts_buf[:bs].tolist() == drafts.tolist()
    assert tokens_buf[:bs].tolist() == (drafts + 1).tolist()
    assert (
        drafts_buf[bs:].tolist() == tokens_buf[bs:].tolist() == [-7] * (max_bs - bs)
    )  # padding untouched


@pytest.mark.parametrize("present", ["num_correct_drafts", "num_accept_tokens"])
def test_staging_copies_each_counter_on_its_own(present):
    drafts_buf, tokens_buf = torch.zeros(4, dtype=torch.int32), torch.zeros(
        4, dtype=torch.int32
    )
    values = torch.tensor([2, 1, 3], dtype=torch.int32)
    spec_info = SimpleNamespace(num_correct_drafts=None, num_accept_tokens=None)
    setattr(spec_info, present, values)
    stage_accept_counters(drafts_buf, tokens_buf, spec_info, 3)
    staged, other = (
        (drafts_buf, tokens_buf)
        if present == "num_correct_drafts"
        else (tokens_buf, drafts_buf)
    )
    assert staged[:3].tolist() == [2, 1, 3]
    assert other.tolist() == [0, 0, 0, 0]
