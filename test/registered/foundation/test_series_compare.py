"""specpatch same-tree (specpatch/compare.py): two series that make the same tree pass, any
byte of difference is named (the proof a re-cut of the series needs)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from specpatch import build as builder
from specpatch import compare, upstream
from specpatch.series import read_series

REPO = Path(__file__).resolve().parents[3]


def test_differences_name_each_file_the_trees_do_not_share():
    old = {"a.py": "1", "b.py": "2", "gone.py": "3"}
    new = {"a.py": "1", "b.py": "changed", "added.py": "4"}
    assert compare.differences(old, new) == [
        "only in the new tree: added.py",
        "differs: b.py",
        "only in the old tree: gone.py",
    ]
    assert compare.differences(old, dict(old)) == []


def test_tree_digests_skip_quilt_state(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("x = 1\n")
    (tmp_path / ".pc").mkdir()
    (tmp_path / ".pc" / "applied-patches").write_text("0001\n")
    digests = compare.tree_digests(tmp_path)
    assert list(digests) == ["pkg/m.py"]


@pytest.fixture(scope="module")
def upstream_wheel():
    return upstream.fetch_wheel("cp311", REPO / ".cache" / "upstream").path


def test_a_series_split_in_two_makes_the_same_tree(tmp_path, upstream_wheel):
    """The last patch that edits several files, cut in two (its first file, then the rest
    right after it): the re-cut kind of change."""
    layout = builder.Layout(REPO)
    copy = tmp_path / "repo"
    shutil.copytree(layout.patches, copy / "patches")

    def by_file(patch):
        header, _, body = patch.path.read_text().partition("\n--- a/")
        files = ("--- a/" + body).split("\n--- a/")
        return header, [files[0]] + ["--- a/" + f for f in files[1:]]

    cut = next(
        p for p in reversed(read_series(copy / "patches")) if len(by_file(p)[1]) > 1
    )
    header, files = by_file(cut)
    cut.path.write_text(header + "\n" + files[0].rstrip("\n") + "\n")
    extra = copy / "patches" / "9999-rest.patch"
    extra.write_text(
        "Description: the rest\nCapability: test\nForwarded: no\nLast-Update: 2026-11-25\n"
        + "\n".join(f.rstrip("\n") for f in files[1:])
        + "\n"
    )
    series = copy / "patches" / "series"
    series.write_text(
        series.read_text().replace(cut.name + "\n", cut.name + "\n9999-rest.patch\n")
    )

    new = compare.patched_tree_digests(builder.Layout(copy), upstream_wheel)
    old = compare.patched_tree_digests(layout, upstream_wheel)
    assert compare.differences(old, new) == []


def test_dropping_a_patch_is_named_file_by_file(tmp_path, upstream_wheel):
    layout = builder.Layout(REPO)
    copy = tmp_path / "repo"
    shutil.copytree(layout.patches, copy / "patches")
    last = read_series(copy / "patches")[-1]
    series = copy / "patches" / "series"
    series.write_text(
        "".join(
            line
            for line in series.read_text().splitlines(keepends=True)
            if line.strip() != last.name
        )
    )
    copy_layout = builder.Layout(copy, upstream_cache=layout.cache)
    builder.write_manifest(copy_layout)  # the series no longer edits the dropped files
    old = compare.patched_tree_digests(layout, upstream_wheel)
    new = compare.patched_tree_digests(copy_layout, upstream_wheel)
    touched = {f.removeprefix(builder.TREE_PREFIX) for f in last.touched_files()}
    assert compare.differences(old, new) == [f"differs: {f}" for f in sorted(touched)]
