"""The triton kernels against the reference on CPU, through triton's interpreter.

TRITON_INTERPRET must be set before triton compiles anything, and the rest of the suite runs
without it, so interpreter_cases.py runs once per session in a subprocess; each of its tests
is reported here as its own test."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import kernel_cases

HERE = Path(__file__).resolve().parent
INNER = HERE / "interpreter_cases.py"

INNER_TESTS = (
    [f"test_kernel_matches_reference[{c.name}]" for c in kernel_cases.CASES]
    + ["test_the_manager_picks_the_kernels_here"]
    + [f"test_simulated_run_is_clean_with_kernels[{f}]" for f in ("chain", "tree")]
    + [f"test_injected_faults_are_detected_with_kernels[{k}]" for k in ("corrupt_slot", "misroute_req_to_token", "free_in_use")]
)


@pytest.fixture(scope="module")
def interpreter_run(tmp_path_factory):
    report = tmp_path_factory.mktemp("interp") / "junit.xml"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(INNER),
         f"--junitxml={report}",
         # numpy >= 2.5 refuses what older numpy only warns about; fail the same way everywhere
         "-W", "error:Conversion of an array with ndim:DeprecationWarning"],
        cwd=HERE.parents[2], env=env, capture_output=True, text=True, timeout=900,
    )
    if not report.exists():
        pytest.fail(f"interpreter run wrote no report (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        outcomes[case.get("name")] = (
            "failed: " + (bad.get("message") or "")[:2000] if bad is not None
            else "skipped: " + (skipped.get("message") or "") if skipped is not None else "passed"
        )
    return outcomes, proc.stdout[-4000:]


@pytest.mark.parametrize("name", INNER_TESTS)
def test_under_interpreter(interpreter_run, name):
    outcomes, tail = interpreter_run
    assert name in outcomes, f"{name} did not run in the interpreter process:\n{tail}"
    assert outcomes[name] == "passed", outcomes[name]


def test_every_interpreter_test_is_reported_here(interpreter_run):
    outcomes, _ = interpreter_run
    assert set(outcomes) == set(INNER_TESTS)
