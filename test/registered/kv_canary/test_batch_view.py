"""What the canary reads out of a ForwardBatch in each forward mode."""

from __future__ import annotations

import pytest
import torch
from canary_sim import Batch, Mode

from sglang.srt.kv_canary import batch_view


def _batch(mode, positions, rows, extend_lens=None, n_tokens=None):
    n = len(positions) if n_tokens is None else n_tokens
    return Batch(
        forward_mode=mode,
        batch_size=len(rows),
        req_pool_indices=torch.tensor(rows),
        positions=torch.tensor(positions),
        input_ids=torch.zeros(n, dtype=torch.int64),
        out_cache_loc=torch.arange(n),
        token_to_kv_pool=None,
        extend_seq_lens=(
            None
            if extend_lens is None
            else torch.tensor(extend_lens, dtype=torch.int32)
        ),
    )


@pytest.mark.parametrize(
    "mode,positions,rows,extend_lens,prefix",
    [
        # extend: rows carry different numbers of tokens; the prefix is where each starts
        (Mode.EXTEND, [4, 5, 6, 0, 1], [3, 5], [3, 2], [4, 0]),
        # decode: one token per row, at seq_len - 1
        (Mode.DECODE, [9, 2], [3, 5], None, [9, 2]),
        # target verify / draft extend v2: a block per row starting at the committed length
        (Mode.TARGET_VERIFY, [7, 8, 8, 9, 3, 4, 4, 5], [3, 5], None, [7, 3]),
        (Mode.DRAFT_EXTEND_V2, [7, 8, 9, 3, 4, 5], [3, 5], [3, 3], [7, 3]),
    ],
)
def test_prefix_lens_are_each_rows_first_position(
    mode, positions, rows, extend_lens, prefix
):
    batch = _batch(mode, positions, rows, extend_lens)
    view = batch_view.view_of(batch)
    assert batch_view.read_prefix_lens(batch, view).tolist() == prefix


def test_variable_extend_maps_tokens_to_rows():
    batch = _batch(Mode.MIXED, [4, 5, 6, 0, 9], [3, 5, 6], [3, 1, 1])
    rows, per_row = batch_view.token_batch_rows(batch, batch_view.view_of(batch), 5)
    assert rows.tolist() == [0, 0, 0, 1, 2] and per_row == 0


def test_uniform_layout_and_uneven_split_error():
    batch = _batch(Mode.TARGET_VERIFY, list(range(8)), [3, 5])
    assert batch_view.token_batch_rows(batch, batch_view.view_of(batch), 8) == (None, 4)
    with pytest.raises(ValueError, match="do not split evenly"):
        batch_view.token_batch_rows(batch, batch_view.view_of(batch), 7)


def test_which_forwards_record_tokens():
    def records(mode, is_draft):
        return batch_view.records_tokens(
            batch_view.view_of(_batch(mode, [0], [1])), is_draft
        )

    assert records(Mode.EXTEND, False) and records(
        Mode.EXTEND, True
    )  # prompt, draft prefill
    assert records(Mode.DECODE, False) and not records(
        Mode.DECODE, True
    )  # draft steps speculate
    assert not records(Mode.TARGET_VERIFY, False)  # tree nodes share positions
    assert records(Mode.DRAFT_EXTEND_V2, True)  # accepted tokens get recorded here


def test_skipped_and_unknown_modes():
    assert batch_view.view_of(_batch(Mode.IDLE, [], [])).skipped
    assert batch_view.view_of(_batch(Mode.PREBUILT, [3], [1])).skipped
    odd = _batch(Mode.DECODE, [1], [1])
    odd.forward_mode = type("M", (), {"name": "TELEPORT"})()
    with pytest.raises(ValueError, match="TELEPORT"):
        batch_view.view_of(odd)


def test_every_upstream_forward_mode_is_known():
    pytest.importorskip("sglang.srt.model_executor.forward_batch_info")
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    assert {m.name for m in ForwardMode} <= batch_view.KNOWN_MODES
    assert {
        m.name for m in Mode
    } == batch_view.KNOWN_MODES  # the tests' stand-in matches
