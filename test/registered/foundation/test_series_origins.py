"""specpatch.origins: which patch added each line, and which patches rewrite an earlier patch's.

The series rewrites none of its own lines: a fix-up belongs folded into the patch it fixes, so
any rewrite fails here.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from specpatch import origins, upstream
from specpatch.series import Patch, SeriesError, read_series

REPO = Path(__file__).resolve().parents[3]
CACHE = REPO / ".cache" / "upstream"

UPSTREAM_FILE = "a\nb\nc\nd\ne\nf\ng\n"


def write_patch(tmp_path: Path, name: str, hunks: str) -> Patch:
    path = tmp_path / name
    path.write_text(
        "Description: x\n---\n--- a/python/m.py\n+++ b/python/m.py\n" + hunks
    )
    return Patch(name, path)


def rewrites_of(*patches: Patch) -> list[tuple[str, str, str]]:
    found = origins.find_rewrites(list(patches), lambda path: UPSTREAM_FILE)
    return [(r.patch, r.origin, r.line) for r in found]


def test_removing_an_earlier_patchs_line_is_reported(tmp_path):
    first = write_patch(tmp_path, "0001", "@@ -2,2 +2,3 @@\n b\n+added\n c\n")
    second = write_patch(
        tmp_path, "0002", "@@ -2,3 +2,3 @@\n b\n-added\n+changed\n c\n"
    )
    assert rewrites_of(first, second) == [("0002", "0001", "added")]


def test_editing_upstream_lines_and_adding_next_to_a_patch_are_not(tmp_path):
    first = write_patch(tmp_path, "0001", "@@ -2,2 +2,3 @@\n b\n+added\n c\n")
    # second: keeps 0001's line as context, replaces upstream's "e", inserts at the end
    second = write_patch(
        tmp_path,
        "0002",
        "@@ -2,5 +2,5 @@\n b\n added\n c\n d\n-e\n+E\n" "@@ -8,0 +8,1 @@\n+tail\n",
    )
    assert rewrites_of(first, second) == []


def test_later_hunks_of_a_patch_land_where_its_earlier_hunks_moved_them(tmp_path):
    first = write_patch(
        tmp_path, "0001", "@@ -1,1 +1,3 @@\n a\n+x\n+y\n@@ -6,1 +8,2 @@\n f\n+z\n"
    )
    second = write_patch(tmp_path, "0002", "@@ -8,3 +8,2 @@\n f\n-z\n g\n")
    assert rewrites_of(first, second) == [("0002", "0001", "z")]


def test_a_hunk_that_does_not_match_the_tree_is_an_error(tmp_path):
    bad = write_patch(tmp_path, "0001", "@@ -2,2 +2,2 @@\n b\n-not-c\n+c2\n")
    with pytest.raises(SeriesError, match="does not match"):
        rewrites_of(bad)


def test_no_patch_rewrites_an_earlier_patchs_lines():
    wheel = upstream.fetch_wheel("cp311", CACHE).path
    with zipfile.ZipFile(wheel) as zf:
        found = origins.find_rewrites(
            read_series(REPO / "patches"),
            lambda path: zf.read(path.removeprefix("python/")).decode(),
        )
    assert not found, [
        f"{r.patch} rewrites {r.origin}'s line in {r.file}: {r.line!r}" for r in found
    ]


def test_a_pure_insertion_goes_after_the_line_its_hunk_names(tmp_path):
    # "@@ -7,0 +8,1 @@": one line inserted after upstream line 7 ("g"), no context.
    first = write_patch(tmp_path, "0001", "@@ -7,0 +8,1 @@\n+tail\n")
    second = write_patch(tmp_path, "0002", "@@ -7,2 +7,1 @@\n g\n-tail\n")
    assert rewrites_of(first, second) == [("0002", "0001", "tail")]
