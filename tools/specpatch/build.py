"""Build `sglang-<upstream>+spec.<digest>` from the upstream wheel, the overlay and the quilt series.

All work happens in a scratch directory; the only write outside it is the final rename into
`dist/`, so any refusal (wrong upstream, altered file, rejected hunk) leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specpatch import series as quilt_series
from specpatch import upstream, wheel

STAMP = "sglang/_specpatch.json"  # inside the package, read by `specpatch status`
TREE_PREFIX = "python/"  # the SGLang repo keeps the package under python/


@dataclass(frozen=True)
class Layout:
    """Where the repo keeps each build input and output."""

    repo: Path
    upstream_cache: Path | None = None  # default: <repo>/.cache/upstream

    @property
    def patches(self) -> Path:
        return self.repo / "patches"

    @property
    def overlay(self) -> Path:
        return self.repo / "python"

    @property
    def dist(self) -> Path:
        return self.repo / "dist"

    @property
    def cache(self) -> Path:
        return self.upstream_cache or self.repo / ".cache" / "upstream"


def overlay_files(overlay: Path) -> list[Path]:
    return sorted(
        p
        for p in overlay.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc")
    )


def build_digest(layout: Layout, patches: list[quilt_series.Patch]) -> str:
    h = hashlib.sha256(quilt_series.series_digest(patches).encode())
    for path in overlay_files(layout.overlay):
        h.update(
            path.relative_to(layout.overlay).as_posix().encode()
            + b"\0"
            + path.read_bytes()
        )
    return h.hexdigest()


def check_manifest_covers_series(manifest: dict[str, str], touched: list[str]) -> None:
    uncovered = sorted(set(touched) - set(manifest))
    stale = sorted(set(manifest) - set(touched))
    if uncovered or stale:
        raise quilt_series.SeriesError(
            "patches/upstream.sha256 does not match the files the series edits "
            f"(not in manifest: {uncovered}; in manifest but edited by no patch: {stale}); "
            "run `specpatch manifest`"
        )


def _copy_overlay(overlay: Path, tree: Path) -> list[str]:
    added = []
    for src in overlay_files(overlay):
        rel = Path(TREE_PREFIX) / src.relative_to(overlay)
        dst = tree / rel
        if dst.exists():
            raise quilt_series.SeriesError(
                f"overlay file {rel} exists upstream: the overlay only adds modules, edits go in patches/"
            )
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        added.append(rel.as_posix())
    return added


def prepare_tree(
    layout: Layout, upstream_wheel: Path, tree: Path
) -> list[quilt_series.Patch]:
    """Verify upstream and unpack it under tree/python/. Returns the series to apply."""
    patches = quilt_series.read_series(layout.patches)
    manifest = upstream.read_manifest(layout.patches)
    check_manifest_covers_series(manifest, quilt_series.touched_files(patches))
    with zipfile.ZipFile(upstream_wheel) as zf:
        upstream.check_version(zf)
        upstream.check_files(zf, manifest, TREE_PREFIX)
    wheel.unpack(upstream_wheel, tree / TREE_PREFIX)
    return patches


def build(layout: Layout, python_tag: str, upstream_wheel: Path | None = None) -> Path:
    if upstream_wheel is None:
        upstream_wheel = upstream.fetch_wheel(python_tag, layout.cache).path
    elif upstream.python_tag_of(upstream_wheel) != python_tag:
        raise upstream.UpstreamMismatch(
            f"{upstream_wheel.name} is not a {python_tag} wheel"
        )

    with tempfile.TemporaryDirectory(prefix="specpatch-") as scratch:
        tree = Path(scratch) / "tree"
        patches = prepare_tree(layout, upstream_wheel, tree)
        overlay = _copy_overlay(layout.overlay, tree)
        quilt_series.apply(tree, layout.patches)

        digest = build_digest(layout, patches)
        version = f"{upstream.UPSTREAM_VERSION}+spec.{digest[:8]}"
        stamp = {
            "upstream": f"{upstream.UPSTREAM_NAME}=={upstream.UPSTREAM_VERSION}",
            "version": version,
            "build_digest": digest,
            "series_sha256": quilt_series.series_digest(patches),
            "patches": [
                {"name": p.name, "sha256": upstream.sha256_bytes(p.path.read_bytes())}
                for p in patches
            ],
            "overlay": overlay,
        }
        root = tree / TREE_PREFIX
        (root / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
        dist_info = wheel.set_version(
            root, upstream.UPSTREAM_NAME, upstream.UPSTREAM_VERSION, version
        )

        name = upstream_wheel.name.replace(
            f"-{upstream.UPSTREAM_VERSION}-", f"-{version}-", 1
        )
        staged = Path(scratch) / name
        wheel.pack(root, dist_info, staged)
        layout.dist.mkdir(exist_ok=True)
        out = layout.dist / name
        shutil.move(staged, out.with_suffix(".partial"))
        os.replace(out.with_suffix(".partial"), out)
    return out


def write_manifest(layout: Layout, python_tag: str = "cp311") -> dict[str, str]:
    """Record the sha256 of every upstream file the series edits (after checking the version)."""
    wheel_path = upstream.fetch_wheel(python_tag, layout.cache).path
    touched = quilt_series.touched_files(quilt_series.read_series(layout.patches))
    with zipfile.ZipFile(wheel_path) as zf:
        upstream.check_version(zf)
        digests = {
            path: upstream.sha256_bytes(zf.read(path.removeprefix(TREE_PREFIX)))
            for path in touched
        }
    upstream.write_manifest(layout.patches, digests)
    return digests
