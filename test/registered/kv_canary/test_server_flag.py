"""--kv-canary / --kv-canary-sample-every: parsed by ServerArgs, refused before any GPU work when
bad, and preferred over the SGLANG_KV_CANARY* environment by install_kv_canary."""

from __future__ import annotations

import argparse
import logging
import re
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.kv_canary import CanaryMode, api, config
from sglang.srt.kv_canary.faults import ENV_FAULT, ENV_FAULT_STEP
from specpatch.testing import synth


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    synth.make_pair(root, "toy", 0.7)
    return root / "target"


def cli_args(target, *flags):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(
        [
            "--model-path",
            str(target),
            "--skip-tokenizer-init",
            "--device",
            "cuda",
            "--attention-backend",
            "triton",
            *flags,
        ]
    )
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


@pytest.mark.parametrize(
    "spelling,mode",
    [("LOG", "log"), ("Raise", "raise"), ("none", "none"), ("NONE", "none")],
)
def test_the_flag_takes_any_case_and_none(target, spelling, mode):
    args = cli_args(target, "--kv-canary", spelling)
    assert args.kv_canary == mode
    assert (
        config.parse_canary_config(args.kv_canary, env={}).mode
        is config.MODE_SPELLINGS[mode]
    )


@pytest.mark.parametrize("spelling", ["LOG", "Raise", "none", "NONE", "off"])
def test_the_environment_takes_what_the_flag_takes(target, monkeypatch, spelling):
    monkeypatch.setenv(config.ENV_MODE, spelling)
    cli_args(target)  # accepted at config time
    assert config.parse_canary_config().mode is config.MODE_SPELLINGS[spelling.lower()]


def test_the_flag_offers_every_spelling_the_environment_accepts():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    [action] = [a for a in parser._actions if "--kv-canary" in a.option_strings]
    assert list(action.choices) == list(config.MODE_SPELLINGS)


def test_a_bad_mode_in_the_environment_is_a_config_error(target, monkeypatch):
    monkeypatch.setenv(config.ENV_MODE, "loud")
    with pytest.raises(
        ValueError,
        match=r"SGLANG_KV_CANARY='loud': expected one of off\|none\|log\|raise",
    ):
        cli_args(target)


@pytest.mark.parametrize(
    "fault_env,match",
    [
        (
            {ENV_FAULT: "flip_bits"},
            r"SGLANG_KV_CANARY_FAULT='flip_bits': expected one of corrupt_slot",
        ),
        (
            {ENV_FAULT: "corrupt_slot", ENV_FAULT_STEP: "0"},
            r"SGLANG_KV_CANARY_FAULT_STEP='0'",
        ),
        (
            {ENV_FAULT: "free_in_use", ENV_FAULT_STEP: "soon"},
            r"SGLANG_KV_CANARY_FAULT_STEP='soon'",
        ),
    ],
)
@pytest.mark.parametrize("via", ["flag", "env"])
def test_bad_fault_injection_is_a_config_error(
    target, monkeypatch, fault_env, match, via
):
    """Checked in ServerArgs, not when the runner installs the canary after GPU allocation."""
    for name, value in fault_env.items():
        monkeypatch.setenv(name, value)
    if via == "env":
        monkeypatch.setenv(config.ENV_MODE, "raise")
    flags = ("--kv-canary", "log") if via == "flag" else ()
    with pytest.raises(ValueError, match=match):
        cli_args(target, *flags)


def test_fault_injection_while_off_is_a_warning(target, monkeypatch, caplog):
    monkeypatch.delenv(config.ENV_MODE, raising=False)
    monkeypatch.setenv(
        ENV_FAULT, "flip_bits"
    )  # not even checked: nothing will be injected
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        cli_args(target)
    assert [r.getMessage() for r in caplog.records if ENV_FAULT in r.getMessage()] == [
        "SGLANG_KV_CANARY_FAULT is set but the KV canary is off: no fault is injected"
    ]


def test_the_flag_wins_over_the_environment(monkeypatch):
    from canary_sim import FakePool, FakeReqToTokenPool

    monkeypatch.setenv("SGLANG_KV_CANARY", "off")
    r2t_pool = FakeReqToTokenPool(rows=2, context=8, device=torch.device("cpu"))
    runner = SimpleNamespace(
        token_to_kv_pool=FakePool(16), req_to_token_pool=r2t_pool, is_draft_worker=False
    )
    flags = SimpleNamespace(
        kv_canary="raise", kv_canary_sample_every=3, speculative_num_steps=None
    )
    manager = api.install_kv_canary(runner, flags)
    assert manager is not None
    assert (manager.config.mode, manager.config.sample_every) == (CanaryMode.RAISE, 3)

    monkeypatch.setenv("SGLANG_KV_CANARY", "raise")
    assert (
        api.install_kv_canary(
            runner, SimpleNamespace(kv_canary="off", kv_canary_sample_every=None)
        )
        is None
    )
