"""The KV canary inside a running server: EAGLE spec v2 (chain and tree) on the synthetic pair.

The scheduler runs in a child process, so the tests read its log (captured at the file
descriptor level) and set the canary's environment before the Engine starts.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager

import pytest

from specpatch import engine as eng
from specpatch import synth

pytestmark = pytest.mark.gpu

VIOLATION = "KV canary violation"


@contextmanager
def canary_env(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.mark.parametrize("deferred", ["0", "1"], ids=["sync-drain", "deferred-drain"])
@pytest.mark.parametrize("spec", [eng.SpecConfig(1, 3, 4), eng.SpecConfig(16, 3, 32)], ids=lambda s: s.label)
def test_raise_mode_sees_no_violation_in_2000_requests_with_retraction(toy_pair, capfd, spec, deferred,
                                                                       record_metric):
    target, draft = toy_pair
    vocab = synth.load_meta(target)["spec"]["vocab"]
    prompts = eng.random_prompts(2000, vocab, seed=11, min_len=8, max_len=80)
    expected = synth.table_continuations(target, prompts, 48)
    # A chain reserves so little KV per request that admission control alone avoids running out;
    # the scheduler's test switch retracts on purpose then.
    forced = {"SGLANG_TEST_RETRACT": "1"} if spec.topk == 1 else {}
    with canary_env(SGLANG_KV_CANARY="raise", SGLANG_KV_CANARY_DEFERRED_DRAIN=deferred, **forced):
        kwargs = eng.engine_kwargs(target, draft, spec, max_running_requests=64, max_total_tokens=6000,
                                   log_level="info")
        with eng.engine(**kwargs) as e:
            assert e.server_args.disable_overlap_schedule is False
            run = eng.generate(e, prompts, 48)
    text = "".join(capfd.readouterr())
    installed = text.count("KV canary on for")
    retractions = text.count("KV cache pool is full. Retract requests.") + text.count("Testing retraction.")
    record_metric("canary_installs", installed)
    record_metric("retraction_events", retractions)
    record_metric("violations", text.count(VIOLATION))
    assert installed >= 2, "the canary was not installed on the target and draft runners"
    assert retractions > 0, "no retraction happened"
    assert VIOLATION not in text, [line for line in text.splitlines() if VIOLATION in line][:5]
    assert run.output_ids == expected


@pytest.mark.parametrize("deferred", ["0", "1"], ids=["sync-drain", "deferred-drain"])
@pytest.mark.parametrize("fault", ["corrupt_slot", "misroute_req_to_token", "free_in_use"])
@pytest.mark.parametrize("spec", [eng.SpecConfig(16, 3, 32)], ids=lambda s: s.label)
def test_each_injected_fault_is_detected(toy_pair, capfd, fault, spec, deferred, record_metric):
    target, draft = toy_pair
    vocab = synth.load_meta(target)["spec"]["vocab"]
    prompts = eng.random_prompts(16, vocab, seed=5, min_len=16, max_len=48)
    with canary_env(SGLANG_KV_CANARY="log", SGLANG_KV_CANARY_FAULT=fault, SGLANG_KV_CANARY_FAULT_STEP=20,
                    SGLANG_KV_CANARY_DEFERRED_DRAIN=deferred):
        # Eager: the fault path is the same, and the start-up is a fraction of a captured one.
        with eng.engine(**eng.engine_kwargs(target, draft, spec, log_level="info", cuda_graph=False)) as e:
            eng.generate(e, prompts, 64)
    text = "".join(capfd.readouterr())
    lines = [line for line in text.splitlines() if VIOLATION in line]
    record_metric("violation_lines", len(lines))
    record_metric("first_violation", lines[0][-300:] if lines else None)
    assert re.search(r"inject", text, re.IGNORECASE), "the fault was never injected"
    assert lines, f"fault {fault} was injected but not detected"


def test_http_server_serves_canary_stats(toy_pair):
    """`launch_server --kv-canary log`: GET /kv_canary_stats reports checks and no violations."""
    import requests

    target, draft = toy_pair
    vocab = synth.load_meta(target)["spec"]["vocab"]
    prompts = eng.random_prompts(8, vocab, seed=2)
    kwargs = eng.engine_kwargs(target, draft, eng.SpecConfig(16, 3, 32), kv_canary="log")
    with eng.server(**kwargs) as base:
        resp = requests.post(f"{base}/generate", json={
            "input_ids": prompts,
            "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True},
        }, timeout=120)
        resp.raise_for_status()
        [stats] = requests.get(f"{base}/kv_canary_stats", timeout=10).json()["schedulers"]
    assert stats["checks_total"] > 0 and stats["forwards_checked"] > 0
    assert stats["violations_total"] == 0
    assert set(stats["checks_by_group"]) >= {"target", "draft step 0"}
