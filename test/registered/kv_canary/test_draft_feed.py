"""The draft pool's token offset comes from the worker sglang runs, and matches what that
worker's draft extend feeds its draft: upstream's own draft-extend code, run on CPU up to the
point where the draft's input ids are built."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from canary_sim import FakePool, FakeReqToTokenPool, spec_server_args

from sglang.srt.kv_canary import api
from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode
from sglang.srt.kv_canary.draft_feed import (
    ROTATED_ONCE,
    ROTATED_PER_LAYER,
    draft_feed_of,
    draft_token_offset,
    speculative_worker_class,
)

PROMPTS = [[11, 12, 13, 14], [21, 22, 23]]
NEXT_TOKENS = [15, 24]  # what the target sampled after each prompt


class _Fed(Exception):
    """Raised by a probe batch at the draft extend's first step after its input ids are built."""

    def __init__(self, input_ids: torch.Tensor):
        super().__init__("input ids built")
        self.input_ids = input_ids.clone()


class _ScheduleBatchProbe:
    """What spec v1's forward_draft_extend reads of a ScheduleBatch before the forward."""

    def __init__(self):
        self.forward_mode = SimpleNamespace(is_idle=lambda: False)
        self.input_ids = torch.tensor(sum(PROMPTS, []))
        self.extend_lens = [len(p) for p in PROMPTS]
        self.seq_lens = torch.tensor(self.extend_lens)

    def get_model_worker_batch(self, **kwargs):
        raise _Fed(self.input_ids)


class _ModelWorkerBatchProbe:
    """What spec v2's _draft_extend_for_prefill reads of a ModelWorkerBatch before the forward."""

    def __init__(self):
        self.forward_mode = SimpleNamespace(is_idle=lambda: False)
        self.input_ids = torch.tensor(sum(PROMPTS, []))
        self.extend_seq_lens = [len(p) for p in PROMPTS]

    @property
    def seq_lens(self):  # read first when the draft's input is assembled
        raise _Fed(self.input_ids)


def _feed_shift(fed: torch.Tensor) -> int:
    """How far each prompt's fed ids are rotated: prompt + next token, read from offset k."""
    shifts = set()
    start = 0
    for prompt, next_token in zip(PROMPTS, NEXT_TOKENS):
        fed_ids = fed[start : start + len(prompt)].tolist()
        start += len(prompt)
        sequence = prompt + [next_token]
        (shift,) = [
            k for k in range(len(sequence)) if sequence[k : k + len(prompt)] == fed_ids
        ]
        shifts.add(shift)
    (shift,) = shifts
    return shift


def _standalone_v1_feed() -> int:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.standalone_worker import StandaloneWorker

    worker = SimpleNamespace(speculative_algorithm=SpeculativeAlgorithm.STANDALONE)
    with pytest.raises(_Fed) as fed:
        StandaloneWorker.forward_draft_extend(
            worker,
            _ScheduleBatchProbe(),
            torch.zeros(7, 8),
            torch.tensor(NEXT_TOKENS),
            None,
        )
    return _feed_shift(fed.value.input_ids)


def _standalone_v2_feed() -> int:
    from sglang.srt.speculative.standalone_worker_v2 import StandaloneDraftWorker

    with pytest.raises(_Fed) as fed:
        StandaloneDraftWorker._draft_extend_for_prefill(
            SimpleNamespace(),
            _ModelWorkerBatchProbe(),
            torch.zeros(7, 8),
            torch.tensor(NEXT_TOKENS),
        )
    return _feed_shift(fed.value.input_ids)


@pytest.mark.parametrize(
    "overlap,upstream_feed",
    [(False, _standalone_v1_feed), (True, _standalone_v2_feed)],
    ids=["spec-v1", "spec-v2"],
)
def test_standalone_offset_is_what_its_draft_extend_feeds(overlap, upstream_feed):
    """STANDALONE's draft is an ordinary LM, but its draft extend rotates the ids as EAGLE's does."""
    args = spec_server_args("STANDALONE", overlap=overlap)
    assert draft_token_offset(args) == upstream_feed() == 1


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE"])
@pytest.mark.parametrize("overlap", [False, True], ids=["spec-v1", "spec-v2"])
def test_eagle_family_drafts_are_fed_one_token_ahead(algorithm, overlap):
    args = spec_server_args(algorithm, overlap=overlap)
    assert draft_feed_of(speculative_worker_class(args)) == ROTATED_ONCE
    assert draft_token_offset(args) == 1


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("overlap", [False, True], ids=["spec-v1", "spec-v2"])
def test_multi_layer_eagle_layers_are_fed_one_more_token_ahead_each(algorithm, overlap):
    args = spec_server_args(algorithm, overlap=overlap, multi_layer=True)
    assert draft_feed_of(speculative_worker_class(args)) == ROTATED_PER_LAYER
    assert [draft_token_offset(args, layer) for layer in range(3)] == [1, 2, 3]


@pytest.mark.parametrize("algorithm", ["NGRAM", "DFLASH", "FROZEN_KV_MTP"])
def test_workers_with_another_draft_extend_have_no_known_offset(algorithm):
    args = spec_server_args(algorithm, overlap=False)
    assert speculative_worker_class(args) is not None
    assert draft_token_offset(args) is None


def test_a_subclass_inherits_its_base_workers_feed():
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    class PluginWorker(EAGLEWorkerV2):
        pass

    assert draft_feed_of(PluginWorker) == ROTATED_ONCE
    assert draft_feed_of(type("Unrelated", (), {})) is None


def _draft_runner(**extra) -> SimpleNamespace:
    r2t_pool = FakeReqToTokenPool(rows=3, context=8, device=torch.device("cpu"))
    return SimpleNamespace(
        token_to_kv_pool=FakePool(10),
        req_to_token_pool=r2t_pool,
        is_draft_worker=True,
        **extra,
    )


def test_install_gives_a_standalone_draft_pool_offset_1():
    args = spec_server_args("STANDALONE", num_steps=1)
    manager = api.install_kv_canary(
        _draft_runner(), args, config=CanaryConfig(CanaryMode.LOG)
    )
    assert manager.group.token_offset == 1 and manager.is_draft


def test_install_leaves_a_draft_with_an_unknown_feed_unchecked(caplog):
    args = spec_server_args("FROZEN_KV_MTP", overlap=False)
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        assert (
            api.install_kv_canary(
                _draft_runner(), args, config=CanaryConfig(CanaryMode.RAISE)
            )
            is None
        )
    [message] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert message.startswith(
        "KV canary off for draft: its worker (FrozenKVMTPWorker) has a draft extend"
    )
    # the target runner of the same server is still checked
    target = SimpleNamespace(**{**vars(_draft_runner()), "is_draft_worker": False})
    assert (
        api.install_kv_canary(
            target, args, config=CanaryConfig(CanaryMode.RAISE)
        ).group.token_offset
        == 0
    )
