"""The quilt series: reading it, applying it with zero fuzz, and proving a refresh is a no-op."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Matches `quilt refresh` to how the patches are stored, so a refresh of an unchanged tree is byte-identical.
QUILT_ENV = {
    "QUILT_REFRESH_ARGS": "-p ab --no-timestamps --no-index --sort",
    "QUILT_DIFF_ARGS": "-p ab --no-timestamps --no-index --sort",
    "QUILT_PUSH_ARGS": "--fuzz=0",
    "QUILT_DIFF_OPTS": "-p",
    "QUILT_NO_DIFF_TIMESTAMPS": "1",
    "QUILT_NO_DIFF_INDEX": "1",
    "LC_ALL": "C",
}
REQUIRED_HEADERS = ("Description:", "Capability:", "Forwarded:", "Last-Update:")


class SeriesError(RuntimeError):
    """The series does not apply, or is malformed."""


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path

    def touched_files(self) -> list[str]:
        """Paths (in the SGLang tree, e.g. python/sglang/srt/...) this patch edits."""
        files = []
        for line in self.path.read_text().splitlines():
            if line.startswith("+++ "):
                target = line[4:].split("\t")[0].strip()
                if target == "/dev/null":
                    raise SeriesError(f"{self.name} deletes a file: not supported")
                files.append(target.removeprefix("b/"))
            elif line.startswith("--- /dev/null"):
                raise SeriesError(
                    f"{self.name} creates a file: new modules belong in the overlay (python/)"
                )
        return files

    def header(self) -> str:
        text = self.path.read_text()
        return text.split("\n---", 1)[0].split("\nIndex:", 1)[0]


def read_series(patches_dir: Path) -> list[Patch]:
    series = patches_dir / "series"
    names = [
        ln.split()[0]
        for ln in series.read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    patches = [Patch(name, patches_dir / name) for name in names]
    for patch in patches:
        if not patch.path.is_file():
            raise SeriesError(
                f"series names {patch.name}, which is not in {patches_dir}"
            )
        missing = [h for h in REQUIRED_HEADERS if h not in patch.header()]
        if missing:
            raise SeriesError(f"{patch.name}: header lacks {', '.join(missing)}")
    return patches


def series_digest(patches: list[Patch]) -> str:
    h = hashlib.sha256()
    for patch in patches:
        h.update(patch.name.encode() + b"\0" + patch.path.read_bytes() + b"\0")
    return h.hexdigest()


def touched_files(patches: list[Patch]) -> list[str]:
    return sorted({f for patch in patches for f in patch.touched_files()})


def _quilt(tree: Path, patches_dir: Path, *args: str) -> subprocess.CompletedProcess:
    if shutil.which("quilt") is None:
        raise SeriesError("quilt is not installed (apt-get install quilt)")
    env = {
        **os.environ,
        **QUILT_ENV,
        "QUILT_PATCHES": str(patches_dir),
        "QUILT_PC": ".pc",
    }
    return subprocess.run(
        ["quilt", "--quiltrc", "-", *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )


def _describe_failure(output: str) -> str:
    """Turn quilt/patch chatter into 'patch P: file F: hunk #N FAILED at L' lines."""
    lines, patch, file = [], "?", "?"
    for line in output.splitlines():
        if m := re.match(r"Applying patch (?:patches/)?(\S+)", line):
            patch = m.group(1)
        elif m := re.match(r"patching file (\S+)", line):
            file = m.group(1)
        elif m := re.match(r"(Hunk #\d+ (?:FAILED|succeeded) at \d+.*)", line):
            if "FAILED" in line or "fuzz" in line:
                lines.append(f"patch {patch}: {file}: {m.group(1)}")
        elif "can't find file" in line or "No such file" in line:
            lines.append(f"patch {patch}: {line.strip()}")
    return "\n  ".join(lines) if lines else output.strip()


def apply(tree: Path, patches_dir: Path) -> None:
    """Apply the whole series to `tree` with zero fuzz, leaving no quilt state or backup files behind."""
    if not read_series(patches_dir):
        return
    result = _quilt(tree, patches_dir, "push", "-a", "--fuzz=0")
    if result.returncode != 0:
        raise SeriesError(
            "the series does not apply with zero fuzz:\n  "
            + _describe_failure(result.stdout + result.stderr)
        )
    shutil.rmtree(tree / ".pc", ignore_errors=True)
    for leftover in list(tree.rglob("*.orig")) + list(tree.rglob("*.rej")):
        leftover.unlink()


def push_all_keeping_state(tree: Path, patches_dir: Path) -> None:
    """For the developer tree: apply the series and keep .pc so quilt can refresh/pop later."""
    result = _quilt(tree, patches_dir, "push", "-a", "--fuzz=0")
    if result.returncode not in (0, 2):  # 2: nothing to push
        raise SeriesError(
            "the series does not apply with zero fuzz:\n  "
            + _describe_failure(result.stdout + result.stderr)
        )


def refresh_diff(tree: Path, patches_dir: Path) -> dict[str, str]:
    """Push and refresh each patch of a copy of the series on `tree` (an unpacked upstream);
    return {patch name: unified diff old->new} for every patch whose bytes a refresh changes.
    """
    import difflib

    changed: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "patches"
        shutil.copytree(patches_dir, copy)
        for patch in read_series(copy):
            result = _quilt(tree, copy, "push", "--fuzz=0")
            if result.returncode != 0:
                raise SeriesError(
                    "the series does not apply with zero fuzz:\n  "
                    + _describe_failure(result.stdout + result.stderr)
                )
            result = _quilt(tree, copy, "refresh")
            if result.returncode != 0:
                raise SeriesError(
                    f"quilt refresh {patch.name} failed: {result.stderr.strip()}"
                )
            before = (patches_dir / patch.name).read_text().splitlines(keepends=True)
            after = patch.path.read_text().splitlines(keepends=True)
            if before != after:
                changed[patch.name] = "".join(
                    difflib.unified_diff(before, after, "committed", "refreshed")
                )
    return changed
