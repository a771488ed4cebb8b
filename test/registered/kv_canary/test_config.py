"""Config parsing, sampling, and "off means nothing": no buffers, no kernels, no-op call sites."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.kv_canary import api
from sglang.srt.kv_canary.config import (
    ENV_MODE,
    ENV_SAMPLE_EVERY,
    CanaryConfig,
    CanaryMode,
    VerifySampler,
    parse_canary_config,
)


def test_default_is_off():
    config = parse_canary_config(env={})
    assert (
        config.mode is CanaryMode.OFF
        and not config.enabled
        and config.sample_every == 1
    )


MODES = [
    ("off", CanaryMode.OFF),
    ("log", CanaryMode.LOG),
    (" RAISE ", CanaryMode.RAISE),
    ("", CanaryMode.OFF),
    ("LOG", CanaryMode.LOG),
    ("none", CanaryMode.OFF),  # newer upstream's spelling of off
    ("None", CanaryMode.OFF),
]


@pytest.mark.parametrize("raw,mode", MODES)
def test_mode_from_env(raw, mode):
    assert parse_canary_config(env={ENV_MODE: raw}).mode is mode


@pytest.mark.parametrize("raw,mode", [m for m in MODES if m[0]])
def test_explicit_mode_is_read_as_the_env_is(raw, mode):
    assert parse_canary_config(raw, env={}).mode is mode


def test_explicit_values_win_over_env():
    env = {ENV_MODE: "log", ENV_SAMPLE_EVERY: "7"}
    config = parse_canary_config("raise", 3, env=env)
    assert config.mode is CanaryMode.RAISE and config.sample_every == 3
    assert parse_canary_config(CanaryMode.LOG, env={}).mode is CanaryMode.LOG


@pytest.mark.parametrize(
    "env,name",
    [
        ({ENV_MODE: "loud"}, ENV_MODE),
        ({ENV_SAMPLE_EVERY: "0"}, ENV_SAMPLE_EVERY),
        ({ENV_SAMPLE_EVERY: "-2"}, ENV_SAMPLE_EVERY),
        ({ENV_SAMPLE_EVERY: "often"}, ENV_SAMPLE_EVERY),
        ({ENV_SAMPLE_EVERY: "1.5"}, ENV_SAMPLE_EVERY),
    ],
)
def test_bad_env_values_name_the_variable(env, name):
    with pytest.raises(ValueError, match=name):
        parse_canary_config(env=env)


def test_bad_explicit_values_name_the_flag():
    with pytest.raises(
        ValueError,
        match=re.escape("--kv-canary='sometimes': expected one of off|none|log|raise"),
    ):
        parse_canary_config("sometimes", env={})
    with pytest.raises(ValueError, match="--kv-canary-sample-every=0"):
        parse_canary_config("log", 0, env={})
    with pytest.raises(ValueError, match="--kv-canary-sample-every=True"):
        parse_canary_config("log", True, env={})
    with pytest.raises(ValueError, match="sample_fraction="):
        parse_canary_config("log", sample_fraction=1.5, env={})
    with pytest.raises(ValueError, match="not both"):
        parse_canary_config("log", 2, sample_fraction=0.5, env={})


def test_sample_every_checks_every_nth_forward():
    sampler = VerifySampler(CanaryConfig(CanaryMode.LOG, sample_every=3))
    assert [sampler.tick() for _ in range(9)] == [True, False, False] * 3


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25, 0.1, 0.3])
def test_sample_fraction_is_spread_evenly(fraction):
    sampler = VerifySampler(
        parse_canary_config("log", sample_fraction=fraction, env={})
    )
    picks = [sampler.tick() for _ in range(1000)]
    assert sum(picks) == round(1000 * fraction)
    # no two checks closer than floor(1 / f) - 1 forwards apart
    gaps = [
        b - a
        for a, b in zip(
            [i for i, p in enumerate(picks) if p],
            [i for i, p in enumerate(picks) if p][1:],
        )
    ]
    assert min(gaps, default=int(1 / fraction)) >= int(1 / fraction)


class _Untouchable:
    """A model runner whose pools may not be looked at: off must not allocate anything."""

    def __getattr__(self, name):
        raise AssertionError(f"install_kv_canary read model_runner.{name} while off")


def test_off_install_returns_none_and_touches_nothing():
    off = parse_canary_config(env={})
    assert api.install_kv_canary(_Untouchable(), SimpleNamespace(), config=off) is None


def test_off_reads_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_MODE, raising=False)
    assert api.install_kv_canary(_Untouchable(), SimpleNamespace()) is None


def test_call_site_helpers_are_no_ops_when_off():
    batch = object()
    with api.outside_graph(None, batch), api.active_step(None, 3), api.capturing(None):
        api.pre_ops(None, batch)
    with api.draft_extend_brackets(None, batch):
        pass
    # pools and allocators the canary never saw are ignored
    api.on_kv_move(_Pool(), torch.tensor([1]), torch.tensor([2]))
    api.on_free(_Pool(), torch.tensor([1]))


class _Pool:
    pass


def test_enabled_install_sizes_buffers_from_the_pools():
    from canary_sim import FakePool, FakeReqToTokenPool, spec_server_args

    r2t_pool = FakeReqToTokenPool(rows=5, context=32, device=torch.device("cpu"))
    target = SimpleNamespace(
        token_to_kv_pool=FakePool(100),
        req_to_token_pool=r2t_pool,
        is_draft_worker=False,
    )
    draft = SimpleNamespace(
        token_to_kv_pool=FakePool(100), req_to_token_pool=r2t_pool, is_draft_worker=True
    )
    args = spec_server_args("EAGLE", num_steps=4)
    on = CanaryConfig(CanaryMode.LOG)
    t = api.install_kv_canary(target, args, config=on)
    d = api.install_kv_canary(draft, args, config=on)
    assert t.record is d.record  # one record per req_to_token pool
    assert t.group.slot_fp.shape == (101,) and t.record.token_at.shape == (5, 33)
    assert (t.group.token_offset, d.group.token_offset) == (0, 1)
    assert (len(t.single_forwards), len(d.single_forwards)) == (
        1,
        3,
    )  # num_steps - 1 inner steps
    assert t.record.identity == "request"


def test_draft_of_one_step_still_has_one_single_forward():
    from canary_sim import FakePool, FakeReqToTokenPool, spec_server_args

    r2t_pool = FakeReqToTokenPool(rows=3, context=8, device=torch.device("cpu"))
    draft = SimpleNamespace(
        token_to_kv_pool=FakePool(10), req_to_token_pool=r2t_pool, is_draft_worker=True
    )
    args = spec_server_args("STANDALONE", num_steps=1, radix=True)
    manager = api.install_kv_canary(draft, args, config=CanaryConfig(CanaryMode.LOG))
    assert (
        len(manager.single_forwards) == 1
        and manager.group.token_offset == 1
        and manager.is_draft
    )
    assert (
        manager.record.identity == "content"
    )  # radix cache on: KV is shared across requests


def test_multi_layer_draft_runners_get_their_layer_offset():
    from canary_sim import FakePool, FakeReqToTokenPool, spec_server_args

    r2t_pool = FakeReqToTokenPool(rows=3, context=8, device=torch.device("cpu"))
    args = spec_server_args("EAGLE", num_steps=3, multi_layer=True)
    managers = [
        api.install_kv_canary(
            SimpleNamespace(
                token_to_kv_pool=FakePool(10),
                req_to_token_pool=r2t_pool,
                is_draft_worker=True,
                draft_model_idx=i,
            ),
            args,
            config=CanaryConfig(CanaryMode.LOG),
        )
        for i in range(3)
    ]
    assert [
        (
            m.group.name,
            m.group.token_offset,
            m.group.speculative_tail,
            len(m.single_forwards),
        )
        for m in managers
    ] == [
        ("draft layer 0", 1, 0, 1),
        ("draft layer 1", 2, 1, 1),
        ("draft layer 2", 3, 2, 1),
    ]


def test_runner_bracket_covers_targets_and_draft_extends_the_worker_left_open():
    from canary_sim import Batch, Mode, SimEngine

    engine = SimEngine(seed=0)
    req = engine.admit(5)

    def batch(mode):
        return Batch(
            mode,
            1,
            torch.tensor([req.row]),
            torch.tensor([5]),
            torch.tensor([1]),
            torch.tensor([0]),
            engine.target_pool,
        )

    draft = engine.draft
    with api.runner_bracket(engine.target, batch(Mode.DECODE)):
        assert engine.target.single_forwards[0].is_staged
    # A draft step: the worker brackets it (it knows the step).
    with api.runner_bracket(draft, batch(Mode.DECODE)):
        assert not draft.single_forwards[0].is_staged and not draft.in_bracket
    # A spec v2 draft extend, or a DP rank's idle one: single forward 0, both brackets.
    for mode in (Mode.DRAFT_EXTEND_V2, Mode.IDLE):
        with api.runner_bracket(draft, batch(mode)):
            assert draft.single_forwards[0].is_staged and draft._active == 0
        assert not draft.in_bracket
    # Inside a bracket the worker opened (the prefill's draft extend): nothing more.
    with api.draft_extend_brackets(draft, batch(Mode.EXTEND)):
        with api.runner_bracket(draft, batch(Mode.DRAFT_EXTEND_V2)):
            assert draft._outside == [0]
