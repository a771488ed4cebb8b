"""Unpack a wheel into a tree and pack a tree back into a wheel with a correct RECORD."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import zipfile
from pathlib import Path

# Fixed timestamps make the patched wheel byte-reproducible from the same inputs.
_ZIP_DATE = (2026, 1, 1, 0, 0, 0)


def unpack(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(dest)
        # Keep executable bits (compiled extensions, scripts) that extractall drops.
        for info in zf.infolist():
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                (dest / info.filename).chmod(mode)


def _record_hash(data: bytes) -> str:
    digest = (
        base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    )
    return f"sha256={digest}"


def set_version(root: Path, name: str, old_version: str, new_version: str) -> Path:
    """Rename the .dist-info dir and rewrite METADATA's Version; returns the new dist-info dir."""
    old = root / f"{name}-{old_version}.dist-info"
    new = root / f"{name}-{new_version}.dist-info"
    old.rename(new)
    metadata = new / "METADATA"
    lines = metadata.read_text().split("\n")
    lines = [
        f"Version: {new_version}" if ln.startswith("Version: ") else ln for ln in lines
    ]
    metadata.write_text("\n".join(lines))
    return new


def pack(root: Path, dist_info: Path, out: Path) -> None:
    """Zip `root` into `out`, writing RECORD last (it lists every other file with its hash)."""
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and p.parent.name != "__pycache__"
    )
    record = dist_info / "RECORD"
    rows = []
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for path in files:
            if path == record:
                continue
            arcname = path.relative_to(root).as_posix()
            data = path.read_bytes()
            info = zipfile.ZipInfo(arcname, date_time=_ZIP_DATE)
            info.external_attr = (path.stat().st_mode & 0o777 | 0o100000) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
            rows.append((arcname, _record_hash(data), str(len(data))))
        rows.append((record.relative_to(root).as_posix(), "", ""))
        # csv, not joins: upstream has file names with commas (MoE tuning configs).
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        info = zipfile.ZipInfo(record.relative_to(root).as_posix(), date_time=_ZIP_DATE)
        info.external_attr = 0o100644 << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        zf.writestr(info, text.getvalue())
