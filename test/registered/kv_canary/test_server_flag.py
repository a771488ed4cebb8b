"""--kv-canary / --kv-canary-sample-every: parsed by ServerArgs, refused before any GPU work when
bad, and preferred over the SGLANG_KV_CANARY* environment by install_kv_canary."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.kv_canary import CanaryMode, api
from specpatch import synth


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    synth.make_pair(root, "toy", 0.7)
    return root / "target"


def cli_args(target, *flags):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", str(target), "--skip-tokenizer-init", "--device", "cuda",
                            "--attention-backend", "triton", *flags])
    return ServerArgs.from_cli_args(ns)


def test_flags_reach_server_args(target):
    args = cli_args(target, "--kv-canary", "raise", "--kv-canary-sample-every", "4")
    assert (args.kv_canary, args.kv_canary_sample_every) == ("raise", 4)


def test_unset_flags_leave_the_environment_in_charge(target):
    args = cli_args(target)
    assert (args.kv_canary, args.kv_canary_sample_every) == (None, None)


def test_bad_sample_rate_is_a_config_error(target):
    with pytest.raises(ValueError, match="sample"):
        cli_args(target, "--kv-canary", "log", "--kv-canary-sample-every", "0")


def test_bad_mode_is_refused_by_the_parser(target):
    with pytest.raises(SystemExit):
        cli_args(target, "--kv-canary", "loud")


def test_the_flag_wins_over_the_environment(monkeypatch):
    from canary_sim import FakePool, FakeReqToTokenPool

    monkeypatch.setenv("SGLANG_KV_CANARY", "off")
    r2t_pool = FakeReqToTokenPool(rows=2, context=8, device=torch.device("cpu"))
    runner = SimpleNamespace(token_to_kv_pool=FakePool(16), req_to_token_pool=r2t_pool, is_draft_worker=False)
    flags = SimpleNamespace(kv_canary="raise", kv_canary_sample_every=3, speculative_num_steps=None)
    manager = api.install_kv_canary(runner, flags)
    assert manager is not None
    assert (manager.config.mode, manager.config.sample_every) == (CanaryMode.RAISE, 3)

    monkeypatch.setenv("SGLANG_KV_CANARY", "raise")
    assert api.install_kv_canary(runner, SimpleNamespace(kv_canary="off", kv_canary_sample_every=None)) is None
