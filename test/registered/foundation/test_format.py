"""Our Python is formatted as upstream sglang formats its own: black, and isort with the black
profile, at the versions of upstream's pre-commit (settings in pyproject.toml). Patches are
not checked here: they edit upstream files, which keep upstream's formatting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FORMATTED_DIRS = ["python", "tools", "test", "benchmark"]


@pytest.mark.parametrize(
    "tool,check_args",
    [("black", ["--check"]), ("isort", ["--check-only"])],
)
def test_code_is_formatted(tool, check_args):
    result = subprocess.run(
        [sys.executable, "-m", tool, *check_args, *FORMATTED_DIRS],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, (
        f"run `.venv/bin/{tool} {' '.join(FORMATTED_DIRS)}` (tools/setup.sh installs it):\n"
        + result.stdout[-4000:]
        + result.stderr[-4000:]
    )
