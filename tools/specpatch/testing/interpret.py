"""Run a pytest file under triton's CPU interpreter and collect each test's outcome.

TRITON_INTERPRET must be set before triton compiles anything, and the rest of a test session runs
without it, so the file runs in a fresh process; its junit report comes back as
{test name: "passed" | "failed: ..." | "skipped: ..."}. torch.compile is switched off in that
process: the interpreter runs triton kernels, and the torch.compile'd helpers next to them are
plain torch, which eager mode runs the same way without a C++ toolchain.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

INTERPRETER_ENV = {
    "TRITON_INTERPRET": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "PYTHONUNBUFFERED": "1",
}


# numpy >= 2.5 refuses what older numpy only warns about (a one-element array as a loop bound):
# fail the same way everywhere, unless a suite runs an upstream kernel that does it.
STRICT_NUMPY = ["-W", "error:Conversion of an array with ndim:DeprecationWarning"]


def run_under_interpreter(
    test_file: Path,
    report: Path,
    *,
    cwd: Path,
    timeout: int = 900,
    strict_numpy: bool = True,
) -> tuple[dict[str, str], str]:
    """Outcome per test name, and the tail of the run's output (for failure messages)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            str(test_file),
            f"--junitxml={report}",
            *(STRICT_NUMPY if strict_numpy else []),
        ],
        cwd=cwd,
        env={**os.environ, **INTERPRETER_ENV},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    tail = f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    if not report.exists():
        raise RuntimeError(
            f"interpreter run of {test_file.name} wrote no report ({tail})"
        )
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = (
            case.find("failure")
            if case.find("failure") is not None
            else case.find("error")
        )
        skipped = case.find("skipped")
        outcomes[case.get("name")] = (
            "failed: " + (bad.get("message") or "")[:2000]
            if bad is not None
            else (
                "skipped: " + (skipped.get("message") or "")
                if skipped is not None
                else "passed"
            )
        )
    return outcomes, tail


def interpreter_suite(test_file: Path, names: list[str], strict_numpy: bool = True):
    """(fixture, test) for a test module that reports each test of `test_file`, run once under
    the interpreter, as its own test. Assign both at module level:

        interpreter_run, test_under_interpreter = interpreter_suite(HERE / "cases.py", NAMES)
    """
    import pytest

    @pytest.fixture(scope="module")
    def interpreter_run(tmp_path_factory):
        report = tmp_path_factory.mktemp("interp") / "junit.xml"
        try:
            return run_under_interpreter(
                test_file, report, cwd=test_file.parents[3], strict_numpy=strict_numpy
            )
        except RuntimeError as err:
            pytest.fail(str(err))

    @pytest.mark.parametrize("name", names)
    def test_under_interpreter(interpreter_run, name):
        outcomes, tail = interpreter_run
        assert (
            name in outcomes
        ), f"{name} did not run in the interpreter process:\n{tail}"
        assert outcomes[name] == "passed", f"{name}: {outcomes[name]}\n{tail}"

    return interpreter_run, test_under_interpreter
