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


def test_code_names_patches_by_what_they_do_not_by_number():
    """A re-cut renumbers the series: `the spec-v2-paged-trees patch` stays true where its
    number would not."""
    import re

    by_number = re.compile(r"\bpatch(es)? 0\d{3}\b")
    found = [
        f"{path.relative_to(ROOT)}:{i}"
        for top in FORMATTED_DIRS
        for path in sorted((ROOT / top).rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if by_number.search(line)
    ]
    assert not found, found
