"""Whether two patch series make the same tree: the proof that re-cutting the series (splitting,
merging or reordering patches) changes no byte of what the build ships.

Each series is applied with zero fuzz to its own copy of pristine upstream; the trees are then
compared file by file (sha256 of every file under python/).
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
import tempfile
from pathlib import Path

from specpatch import build as builder
from specpatch import series as quilt_series


def tree_digests(root: Path) -> dict[str, str]:
    """sha256 of every file under root, by path relative to it (quilt's state excluded)."""
    digests = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not path.is_symlink() and rel.parts[0] != ".pc":
            digests[rel.as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def patched_tree_digests(
    layout: builder.Layout, upstream_wheel: Path
) -> dict[str, str]:
    """Digests of upstream with layout's series applied (no overlay: the series alone)."""
    with tempfile.TemporaryDirectory(prefix="specpatch-compare-") as scratch:
        tree = Path(scratch)
        builder.prepare_tree(layout, upstream_wheel, tree)
        quilt_series.apply(tree, layout.patches)
        return tree_digests(tree / builder.TREE_PREFIX)


def series_at_revision(repo: Path, revision: str, dest: Path) -> builder.Layout:
    """A layout whose patches/ is the series committed at `revision` of the git repo."""
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", revision, "patches"],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        raise quilt_series.SeriesError(
            f"git archive {revision} patches: {archive.stderr.decode().strip()}"
        )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return builder.Layout(dest)


def differences(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """One line per file the two trees do not share byte for byte."""
    lines = []
    for path in sorted(old.keys() | new.keys()):
        if path not in new:
            lines.append(f"only in the old tree: {path}")
        elif path not in old:
            lines.append(f"only in the new tree: {path}")
        elif old[path] != new[path]:
            lines.append(f"differs: {path}")
    return lines
