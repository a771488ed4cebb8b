"""fa3_verify_splits: the split count of FA3's cascade tree verify, fixed on request."""

from __future__ import annotations

import pytest

from sglang.srt.layers.attention import fa3_verify_splits


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({}, None),  # unset: FA3's own choice
        ({fa3_verify_splits.ENV: ""}, None),
        ({fa3_verify_splits.ENV: "1"}, 1),
        ({fa3_verify_splits.ENV: " 4 "}, 4),
    ],
)
def test_the_split_count_asked_for(environ, expected):
    assert fa3_verify_splits.fixed_num_splits(environ) == expected


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_split_count_that_is_not_a_count_is_refused_by_name(value):
    with pytest.raises(ValueError, match=f"{fa3_verify_splits.ENV}='{value}'"):
        fa3_verify_splits.fixed_num_splits({fa3_verify_splits.ENV: value})


@pytest.mark.parametrize("backend_default", [0, 1])
def test_unset_the_verify_keeps_the_backends_own_count(monkeypatch, backend_default):
    monkeypatch.setattr(fa3_verify_splits, "_FIXED", None)
    assert fa3_verify_splits.tree_verify_num_splits(backend_default) == backend_default


def test_asked_for_the_verify_takes_that_count(monkeypatch):
    monkeypatch.setattr(fa3_verify_splits, "_FIXED", 1)
    # over FA3's heuristic (0) and deterministic inference's 1 alike
    assert fa3_verify_splits.tree_verify_num_splits(0) == 1
    monkeypatch.setattr(fa3_verify_splits, "_FIXED", 3)
    assert fa3_verify_splits.tree_verify_num_splits(1) == 3
