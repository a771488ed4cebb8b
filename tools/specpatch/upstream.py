"""The pinned upstream: which sglang wheel the series is built on, and proof that it is that wheel.

Upstream code is a build input, never committed. What we commit instead is a manifest
(`patches/upstream.sha256`) of every upstream file the series edits; a build refuses an
upstream whose version or any of those files differs, before writing anything.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

UPSTREAM_NAME = "sglang"
UPSTREAM_VERSION = "0.5.12.post1"
# The GPU host runs cp312; this machine and CI run cp311. Upstream ships one wheel per tag.
PLATFORM_TAGS = (
    "manylinux_2_34_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
)
MANIFEST_NAME = "upstream.sha256"


class UpstreamMismatch(RuntimeError):
    """Upstream is not the release the series was written against."""


@dataclass(frozen=True)
class UpstreamWheel:
    path: Path
    python_tag: str  # e.g. "cp311"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_wheel(python_tag: str, cache_dir: Path) -> UpstreamWheel:
    """Download (once) the upstream wheel for `python_tag` into `cache_dir`."""
    pattern = f"{UPSTREAM_NAME}-{UPSTREAM_VERSION}-{python_tag}-{python_tag}-*.whl"
    found = sorted(cache_dir.glob(pattern))
    if not found:
        cache_dir.mkdir(parents=True, exist_ok=True)
        py_version = f"{python_tag[2]}.{python_tag[3:]}"
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--implementation",
            "cp",
            "--python-version",
            py_version,
            "--dest",
            str(cache_dir),
            f"{UPSTREAM_NAME}=={UPSTREAM_VERSION}",
        ]
        for plat in PLATFORM_TAGS:
            cmd += ["--platform", plat]
        subprocess.run(cmd, check=True)
        found = sorted(cache_dir.glob(pattern))
    if not found:
        raise UpstreamMismatch(
            f"no {UPSTREAM_NAME} {UPSTREAM_VERSION} wheel for {python_tag} in {cache_dir}"
        )
    return UpstreamWheel(path=found[-1], python_tag=python_tag)


def python_tag_of(wheel: Path) -> str:
    # name-version-pytag-abitag-platform.whl
    parts = wheel.name[: -len(".whl")].split("-")
    if len(parts) != 5:
        raise UpstreamMismatch(f"{wheel.name} is not a wheel file name")
    return parts[2]


def read_manifest(patches_dir: Path) -> dict[str, str]:
    """`patches/upstream.sha256`: '<sha256>  <path in the SGLang tree>' per line."""
    manifest: dict[str, str] = {}
    for line in (patches_dir / MANIFEST_NAME).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            digest, path = line.split(maxsplit=1)
            manifest[path.strip()] = digest
    return manifest


def write_manifest(patches_dir: Path, digests: dict[str, str]) -> None:
    lines = [
        f"# sha256 of every upstream file the series edits ({UPSTREAM_NAME} {UPSTREAM_VERSION})"
    ]
    lines += [f"{digests[path]}  {path}" for path in sorted(digests)]
    (patches_dir / MANIFEST_NAME).write_text("\n".join(lines) + "\n")


def check_version(zf: zipfile.ZipFile) -> None:
    metadata = f"{UPSTREAM_NAME}-{UPSTREAM_VERSION}.dist-info/METADATA"
    if metadata not in zf.namelist():
        found = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        raise UpstreamMismatch(
            f"upstream is not {UPSTREAM_NAME} {UPSTREAM_VERSION}: found {found or 'no METADATA'}"
        )


def check_files(
    zf: zipfile.ZipFile, manifest: dict[str, str], tree_prefix: str
) -> None:
    """Every file the series edits must be byte-identical to the one the series was written for."""
    names = set(zf.namelist())
    problems = []
    for tree_path, expected in sorted(manifest.items()):
        wheel_path = tree_path.removeprefix(tree_prefix)
        if wheel_path not in names:
            problems.append(f"{tree_path}: missing from upstream")
            continue
        found = sha256_bytes(zf.read(wheel_path))
        if found != expected:
            problems.append(
                f"{tree_path}: sha256 {found[:12]}… differs from the manifest's {expected[:12]}…"
            )
    if problems:
        raise UpstreamMismatch(
            "upstream files the series edits are not the pinned ones:\n  "
            + "\n  ".join(problems)
        )
