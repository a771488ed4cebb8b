"""The build: patched wheel from upstream + overlay + series, and every way it must refuse."""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specpatch import build as builder
from specpatch import series as quilt_series
from specpatch import upstream

REPO = Path(__file__).resolve().parents[3]
CACHE = REPO / ".cache" / "upstream"


@pytest.fixture(scope="module")
def upstream_wheel() -> Path:
    return upstream.fetch_wheel("cp311", CACHE).path


@pytest.fixture
def scratch_repo(tmp_path: Path) -> builder.Layout:
    """A copy of the build inputs (patches, overlay), so tests can break them."""
    shutil.copytree(REPO / "patches", tmp_path / "patches")
    shutil.copytree(
        REPO / "python",
        tmp_path / "python",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return builder.Layout(tmp_path, upstream_cache=CACHE)


def rewrite_wheel(src: Path, dst: Path, edit: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            zout.writestr(item, edit.get(item.filename, zin.read(item.filename)))
    return dst


def assert_nothing_written(layout: builder.Layout) -> None:
    assert not layout.dist.exists() or not any(layout.dist.iterdir())


def test_build_produces_stamped_wheel_with_valid_record(scratch_repo, upstream_wheel):
    out = builder.build(scratch_repo, "cp311", upstream_wheel)
    assert out.parent == scratch_repo.dist
    assert (
        out.name.startswith("sglang-0.5.12.post1+spec.") and "-cp311-cp311-" in out.name
    )
    version = out.name.split("-")[1]
    with zipfile.ZipFile(out) as zf:
        names = set(zf.namelist())
        dist_info = f"sglang-{version}.dist-info"
        assert (
            f"{dist_info}/METADATA" in names
            and "sglang-0.5.12.post1.dist-info/METADATA" not in names
        )
        assert f"Version: {version}\n" in zf.read(f"{dist_info}/METADATA").decode()
        record = list(csv.reader(zf.read(f"{dist_info}/RECORD").decode().splitlines()))
        listed = {row[0] for row in record}
        assert listed == names
        for path, digest, size in record:
            if path.endswith("RECORD"):
                continue
            data = zf.read(path)
            expected = (
                base64.urlsafe_b64encode(hashlib.sha256(data).digest())
                .rstrip(b"=")
                .decode()
            )
            assert digest == f"sha256={expected}" and int(size) == len(data), path
        stamp = json.loads(zf.read(builder.STAMP))
        series = quilt_series.read_series(scratch_repo.patches)
        assert [p["name"] for p in stamp["patches"]] == [p.name for p in series]
        assert stamp["version"] == version
        for overlay_file in builder.overlay_files(scratch_repo.overlay):
            rel = overlay_file.relative_to(scratch_repo.overlay).as_posix()
            assert zf.read(rel) == overlay_file.read_bytes()
        # A patched call site is really in the wheel.
        assert b"self.chain_drafts.lookup(" in zf.read(
            "sglang/srt/speculative/eagle_worker_v2.py"
        )


def test_build_is_reproducible(scratch_repo, upstream_wheel):
    first = builder.build(scratch_repo, "cp311", upstream_wheel).read_bytes()
    second = builder.build(scratch_repo, "cp311", upstream_wheel).read_bytes()
    assert first == second


def test_altered_upstream_file_is_refused_and_nothing_written(
    scratch_repo, upstream_wheel, tmp_path
):
    manifest = upstream.read_manifest(scratch_repo.patches)
    victim = sorted(manifest)[0]
    inner = victim.removeprefix(builder.TREE_PREFIX)
    with zipfile.ZipFile(upstream_wheel) as zf:
        altered = zf.read(inner) + b"\n# local edit\n"
    fake = rewrite_wheel(
        upstream_wheel, tmp_path / upstream_wheel.name, {inner: altered}
    )
    with pytest.raises(upstream.UpstreamMismatch, match=victim):
        builder.build(scratch_repo, "cp311", fake)
    assert_nothing_written(scratch_repo)

    # The CLI says the same on stderr with a distinct exit code.
    cli = subprocess.run(
        [sys.executable, "-m", "specpatch", "build", "--upstream-wheel", str(fake)],
        cwd=REPO / "tools",
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 3
    assert "refused" in cli.stderr and victim in cli.stderr


def test_wrong_upstream_version_is_refused(scratch_repo, upstream_wheel, tmp_path):
    with zipfile.ZipFile(upstream_wheel) as zin:
        renamed = {
            i.filename.replace(
                "sglang-0.5.12.post1.dist-info", "sglang-0.5.13.dist-info"
            ): zin.read(i.filename)
            for i in zin.infolist()
        }
    fake = tmp_path / "sglang-0.5.13-cp311-cp311-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(fake, "w") as zout:
        for name, data in renamed.items():
            zout.writestr(name, data)
    with pytest.raises(upstream.UpstreamMismatch, match="not sglang 0.5.12.post1"):
        builder.build(scratch_repo, "cp311", fake)
    assert_nothing_written(scratch_repo)


def test_rejected_hunk_names_patch_file_and_hunk(scratch_repo, upstream_wheel):
    patch = quilt_series.read_series(scratch_repo.patches)[0]
    text = patch.path.read_text()
    # Corrupt a context line of the first hunk so it cannot apply without fuzz.
    lines = text.splitlines(keepends=True)
    first_hunk = next(i for i, ln in enumerate(lines) if ln.startswith("@@"))
    context = next(
        i
        for i in range(first_hunk + 1, len(lines))
        if lines[i].startswith(" ") and lines[i].strip()
    )
    lines[context] = " " + lines[context][1:].replace(
        lines[context].strip(), "not_upstream_code()", 1
    )
    patch.path.write_text("".join(lines))
    target = patch.touched_files()[0]
    with pytest.raises(quilt_series.SeriesError) as err:
        builder.build(scratch_repo, "cp311", upstream_wheel)
    message = str(err.value)
    assert patch.name in message and target in message and "Hunk #1 FAILED" in message
    assert_nothing_written(scratch_repo)


def test_overlay_may_not_shadow_upstream(scratch_repo, upstream_wheel):
    shadow = scratch_repo.overlay / "sglang" / "srt" / "server_args.py"
    shadow.write_text("# would replace upstream\n")
    with pytest.raises(quilt_series.SeriesError, match="exists upstream"):
        builder.build(scratch_repo, "cp311", upstream_wheel)
    assert_nothing_written(scratch_repo)


def test_manifest_must_cover_series(scratch_repo, upstream_wheel):
    manifest = upstream.read_manifest(scratch_repo.patches)
    dropped = sorted(manifest)[0]
    del manifest[dropped]
    upstream.write_manifest(scratch_repo.patches, manifest)
    with pytest.raises(quilt_series.SeriesError, match="specpatch manifest"):
        builder.build(scratch_repo, "cp311", upstream_wheel)


def test_every_patch_has_a_header():
    for patch in quilt_series.read_series(
        REPO / "patches"
    ):  # raises on a missing field
        header = patch.header()
        assert header.startswith("Description: "), patch.name
        assert "Capability:" in header


def test_patch_headers_are_wrapped_at_80_columns():
    """The header is what `quilt header` and a reviewer read in a terminal."""
    for patch in quilt_series.read_series(REPO / "patches"):
        long = [ln for ln in patch.header().splitlines() if len(ln) > 80]
        assert not long, f"{patch.name}: {long}"


def test_missing_header_field_is_refused(scratch_repo):
    patch = quilt_series.read_series(scratch_repo.patches)[0]
    patch.path.write_text(patch.path.read_text().replace("Forwarded:", "Fwd:", 1))
    with pytest.raises(quilt_series.SeriesError, match="Forwarded"):
        quilt_series.read_series(scratch_repo.patches)


def test_series_is_reproducible_under_quilt_refresh(upstream_wheel, tmp_path):
    layout = builder.Layout(REPO, upstream_cache=CACHE)
    builder.prepare_tree(layout, upstream_wheel, tmp_path)
    assert quilt_series.refresh_diff(tmp_path, layout.patches) == {}


def test_refresh_check_detects_a_hand_edited_patch(
    scratch_repo, upstream_wheel, tmp_path
):
    patch = quilt_series.read_series(scratch_repo.patches)[0]
    # A hand edit quilt would normalise: drop the function name after a hunk header.
    text = patch.path.read_text()
    hunk = next(
        ln
        for ln in text.splitlines()
        if ln.startswith("@@") and ln.count("@@") == 2 and not ln.endswith("@@")
    )
    patch.path.write_text(text.replace(hunk, hunk[: hunk.rindex("@@") + 2], 1))
    builder.prepare_tree(scratch_repo, upstream_wheel, tmp_path)
    changed = quilt_series.refresh_diff(tmp_path, scratch_repo.patches)
    assert list(changed) == [patch.name]


def test_quiltrc_for_developers_matches_build_settings():
    rc = {}
    for line in (REPO / "patches" / "quiltrc").read_text().splitlines():
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            rc[key] = value.strip('"')
    for key, value in quilt_series.QUILT_ENV.items():
        if key.startswith("QUILT_"):
            assert rc.get(key) == value, key
