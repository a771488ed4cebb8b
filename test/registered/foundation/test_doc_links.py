"""Relative links in README.md and docs/*.md point at files that exist (and at headings that exist,
for `file.md#anchor`), so moving or removing a file cannot leave a dangling link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> list[str]:
    """Lines outside fenced and indented code blocks, with inline code removed."""
    lines, fenced, in_code, previous_blank = [], False, False, True
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        blank = not line.strip()
        if not blank:
            in_code = line.startswith("    ") and (previous_blank or in_code)
        previous_blank = blank
        if fenced or in_code or blank:
            continue
        lines.append(INLINE_CODE.sub("", line))
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose_lines(md.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _relative_links(md: Path) -> list[str]:
    targets = []
    for line in _prose_lines(md.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            targets.append(target)
    return targets


def test_the_docs_have_relative_links():
    assert any(_relative_links(md) for md in DOCS)


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(md: Path):
    broken = []
    for target in _relative_links(md):
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{md.relative_to(REPO)}: " + "; ".join(broken)


def test_slug_matches_github():
    assert _slug("Per-bracket staging, build ca0e33ee (2026-11-23, H100)") == (
        "per-bracket-staging-build-ca0e33ee-2026-11-23-h100"
    )
    assert _slug("Spec v2 vs v1 trees on FA3") == "spec-v2-vs-v1-trees-on-fa3"
    assert (
        _slug("Chains, trees and no speculation") == "chains-trees-and-no-speculation"
    )
