"""Triton kernels on CPU tensors under the interpreter. Not collected directly: the interpreter
must be switched on before triton JITs anything, so test_kernels_interpreter.py runs this file
in a fresh process with TRITON_INTERPRET=1 in its environment."""

from __future__ import annotations

import os

import kernel_cases
import pytest
import torch
from canary_sim import SimEngine

from sglang.srt.kv_canary import kernels
from sglang.srt.kv_canary.faults import ENV_FAULT, ENV_FAULT_STEP
from sglang.srt.kv_canary.report import STATS, KVCanaryViolationError

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="run by test_kernels_interpreter.py with TRITON_INTERPRET=1",
)

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "case", kernel_cases.CASES, ids=[c.name for c in kernel_cases.CASES]
)
def test_kernel_matches_reference(case):
    assert kernel_cases.compare(case, kernels, CPU) is None


@pytest.mark.parametrize(
    "case", kernel_cases.STAGE_CASES, ids=[c.name for c in kernel_cases.STAGE_CASES]
)
def test_stage_kernel_matches_reference(case):
    assert kernel_cases.compare_stage(case, kernels, CPU) is None


def test_the_manager_picks_the_kernels_here():
    engine = SimEngine(seed=0)
    assert engine.target.impl is kernels and engine.draft.impl is kernels


@pytest.mark.parametrize("flavour", ["chain", "tree"])
def test_simulated_run_is_clean_with_kernels(flavour):
    kwargs = (
        dict(num_steps=3)
        if flavour == "chain"
        else dict(num_steps=3, topk=2, num_draft_tokens=5, radix=True)
    )
    engine = SimEngine(seed=3, slots=300, **kwargs)
    engine.run_random(60)
    assert (
        STATS.as_dict()["violations_total"] == 0
        and STATS.as_dict()["checks_total"] > 100
    )


@pytest.mark.parametrize(
    "kind", ["corrupt_slot", "misroute_req_to_token", "free_in_use"]
)
def test_injected_faults_are_detected_with_kernels(monkeypatch, kind):
    monkeypatch.setenv(ENV_FAULT, kind)
    monkeypatch.setenv(ENV_FAULT_STEP, "8")
    engine = SimEngine(seed=4, slots=300)
    with pytest.raises(KVCanaryViolationError) as err:
        engine.run_random(200)
    injected = engine.target.fault_injector.injected
    assert (err.value.violations[0].req_row, err.value.violations[0].position) == (
        injected.victim_row,
        injected.victim_position,
    )
