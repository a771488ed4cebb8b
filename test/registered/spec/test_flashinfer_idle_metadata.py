"""FlashInfer metadata for a DP rank's speculative IDLE batch (the
flashinfer-idle-speculative-metadata patch).

The idle rank's draft, verify and draft extend batches carry an idle spec input without KV
indices: the real init_forward_metadata must not plan from them (nothing reads an IDLE plan);
IDLE batches without a spec input keep the plain decode plan."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.attention.flashinfer_backend import (
    DecodeMetadata,
    FlashInferAttnBackend,
)
from sglang.srt.layers.attention.flashinfer_tree_cascade import TreeCascade
from sglang.srt.model_executor.forward_batch_info import ForwardMode


class RecordingUpdater:
    def __init__(self):
        self.calls = []

    def update(self, *args, **kwargs):
        self.calls.append(kwargs)


def bare_backend() -> FlashInferAttnBackend:
    """The attributes init_forward_metadata reads, on the CPU (__init__ needs a model runner)."""
    backend = object.__new__(FlashInferAttnBackend)
    backend.__dict__.update(
        decode_wrappers=["decode wrapper"],
        indices_updater_decode=RecordingUpdater(),
        decode_split_tile_size=None,
        forward_metadata=None,
        tree_cascade=TreeCascade(serves=False),
    )
    return backend


def idle_batch(spec_info) -> SimpleNamespace:
    return SimpleNamespace(
        forward_mode=ForwardMode.IDLE,
        spec_info=spec_info,
        req_pool_indices=torch.zeros(2),
        seq_lens=torch.ones(2),
        seq_lens_cpu=torch.ones(2),
        seq_lens_sum=2,
        encoder_lens=None,
    )


@pytest.mark.parametrize(
    "spec_info",
    [
        SimpleNamespace(
            draft_token_num=8
        ),  # an idle EagleVerifyInput: no kv_indptr at all
        SimpleNamespace(kv_indptr=None, kv_indices=None),  # an idle EagleDraftInput
    ],
    ids=["verify", "draft"],
)
def test_idle_spec_batch_is_not_planned(spec_info):
    backend = bare_backend()
    backend.init_forward_metadata(idle_batch(spec_info))
    assert backend.indices_updater_decode.calls == []
    assert isinstance(backend.forward_metadata, DecodeMetadata)
    assert backend.forward_metadata.decode_wrappers == ["decode wrapper"]


def test_idle_batch_without_spec_input_keeps_the_decode_plan():
    backend = bare_backend()
    backend.init_forward_metadata(idle_batch(None))
    [call] = backend.indices_updater_decode.calls
    assert call["spec_info"] is None and call["decode_wrappers"] == ["decode wrapper"]
    assert isinstance(backend.forward_metadata, DecodeMetadata)
