"""Which patch of the series added each line, and which patches rewrite an earlier patch's lines.

A patch that removes (or re-indents) a line another patch added is a fix-up of that patch and
belongs folded into it: otherwise neither reads alone, and dropping the earlier one breaks the
later. The series is replayed on the upstream files, hunk by hunk, keeping each line's origin
("upstream" or the patch that added it); every removed line whose origin is a patch is reported.

The hunks' line numbers are exact: refresh-check proves every patch is what `quilt refresh` writes
against the tree the patches before it produce, so a context mismatch here is an error, not fuzz.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from specpatch.series import Patch, SeriesError

UPSTREAM = "upstream"
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass(frozen=True)
class Rewrite:
    """`patch` removes a line of `file` that `origin` (an earlier patch) added."""

    patch: str
    origin: str
    file: str
    line: str


@dataclass(frozen=True)
class Hunk:
    file: str
    old_start: int  # 1-based line in the file before this patch
    old_len: int  # 0: a pure insertion after line old_start
    body: list[str]  # the hunk's lines, each starting with " ", "-" or "+"


def parse_hunks(patch_text: str) -> list[Hunk]:
    """The hunks of a unified diff in file order, header and "\\ No newline" lines dropped."""
    hunks: list[Hunk] = []
    lines = patch_text.splitlines()
    current_file = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("+++ "):
            current_file = line[4:].split("\t")[0].strip().removeprefix("b/")
            i += 1
            continue
        match = HUNK.match(line)
        if not match or current_file is None:
            i += 1
            continue
        old_len = int(match.group(2) or 1)
        new_len = int(match.group(4) or 1)
        body: list[str] = []
        i += 1
        while old_len > 0 or new_len > 0:
            row = lines[i] if i < len(lines) else ""
            i += 1
            if row.startswith("\\"):
                continue
            row = row or " "  # an empty context line may lose its leading space
            body.append(row)
            old_len -= row[0] in " -"
            new_len -= row[0] in " +"
        hunks.append(
            Hunk(current_file, int(match.group(1)), int(match.group(2) or 1), body)
        )
    return hunks


def find_rewrites(
    patches: list[Patch], upstream_text: Callable[[str], str]
) -> list[Rewrite]:
    """Every line a patch removes that an earlier patch added, in series order.

    upstream_text(path) is the upstream file the series edits (path as in the patches,
    e.g. python/sglang/srt/server_args.py)."""
    # file -> [(text, origin)], the file as the patches so far leave it
    files: dict[str, list[tuple[str, str]]] = {}
    rewrites: list[Rewrite] = []
    for patch in patches:
        shift: dict[str, int] = (
            {}
        )  # lines added minus removed by this patch's earlier hunks
        for hunk in parse_hunks(patch.path.read_text()):
            lines = files.setdefault(
                hunk.file,
                [(text, UPSTREAM) for text in upstream_text(hunk.file).splitlines()],
            )
            first = hunk.old_start if hunk.old_len == 0 else hunk.old_start - 1
            at = first + shift.get(hunk.file, 0)
            replaced: list[tuple[str, str]] = []
            cursor = at
            for row in hunk.body:
                kind, text = row[0], row[1:]
                if kind == "+":
                    replaced.append((text, patch.name))
                    continue
                if cursor >= len(lines) or lines[cursor][0] != text:
                    raise SeriesError(
                        f"{patch.name}: hunk at {hunk.file}:{hunk.old_start} does not match "
                        f"the tree the earlier patches produce (run specpatch refresh-check)"
                    )
                if kind == " ":
                    replaced.append(lines[cursor])
                elif lines[cursor][1] != UPSTREAM:
                    rewrites.append(
                        Rewrite(patch.name, lines[cursor][1], hunk.file, text.strip())
                    )
                cursor += 1
            lines[at:cursor] = replaced
            shift[hunk.file] = shift.get(hunk.file, 0) + len(replaced) - (cursor - at)
    return rewrites
