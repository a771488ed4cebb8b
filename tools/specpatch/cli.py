"""`specpatch` command line: build, status, manifest, tree, refresh-check, origins,
same-tree."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from specpatch import build as builder
from specpatch import compare, origins
from specpatch import series as quilt_series
from specpatch import upstream

REPO = Path(__file__).resolve().parents[2]


def installed_stamp() -> dict | None:
    """The stamp of the sglang importable here, read without importing sglang (which is slow)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sglang is not installed in this environment")
    stamp = Path(list(spec.submodule_search_locations)[0]) / Path(builder.STAMP).name
    return json.loads(stamp.read_text()) if stamp.is_file() else None


def cmd_build(args: argparse.Namespace) -> int:
    layout = builder.Layout(REPO)
    out = builder.build(
        layout,
        args.python_tag,
        Path(args.upstream_wheel) if args.upstream_wheel else None,
    )
    print(out)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    stamp = installed_stamp()
    if stamp is None:
        print(
            "installed sglang carries no specpatch stamp (pristine upstream or another build)"
        )
        return 1
    print(
        f"installed sglang {stamp['version']} (upstream {stamp['upstream']}), {len(stamp['patches'])} patches:"
    )
    for patch in stamp["patches"]:
        print(f"  {patch['name']}")
    current = quilt_series.series_digest(quilt_series.read_series(REPO / "patches"))
    digest = builder.build_digest(
        builder.Layout(REPO), quilt_series.read_series(REPO / "patches")
    )
    same_series = current == stamp["series_sha256"]
    same_build = digest == stamp["build_digest"]
    print(
        f"series matches this checkout: {'yes' if same_series else 'no'}; "
        f"overlay+series match: {'yes' if same_build else 'no (rebuild)'}"
    )
    return 0 if same_build else 2


def cmd_manifest(args: argparse.Namespace) -> int:
    digests = builder.write_manifest(builder.Layout(REPO))
    print(f"wrote patches/{upstream.MANIFEST_NAME}: {len(digests)} files")
    return 0


def cmd_tree(args: argparse.Namespace) -> int:
    """Materialize upstream + series under build/tree for editing with quilt."""
    layout = builder.Layout(REPO)
    tree = Path(args.dir).resolve()
    if tree.exists():
        if not args.force:
            raise SystemExit(f"{tree} exists (pass --force to recreate it)")
        shutil.rmtree(tree)
    wheel_path = upstream.fetch_wheel(args.python_tag, layout.cache).path
    builder.prepare_tree(layout, wheel_path, tree)
    (tree / "patches").symlink_to(layout.patches)
    quilt_series.push_all_keeping_state(tree, layout.patches)
    print(
        f"{tree}: upstream + series applied. Edit with quilt, e.g.\n"
        f"  cd {tree} && export QUILT_PATCHES=patches QUILT_REFRESH_ARGS='{quilt_series.QUILT_ENV['QUILT_REFRESH_ARGS']}'\n"
        f"  quilt new NNNN-name.patch && quilt add python/sglang/... && $EDITOR ... && quilt refresh\n"
        f"then add the patch header and run `specpatch manifest` and `specpatch refresh-check`."
    )
    return 0


def cmd_refresh_check(args: argparse.Namespace) -> int:
    layout = builder.Layout(REPO)
    wheel_path = upstream.fetch_wheel(args.python_tag, layout.cache).path
    with tempfile.TemporaryDirectory(prefix="specpatch-refresh-") as scratch:
        tree = Path(scratch)
        builder.prepare_tree(layout, wheel_path, tree)
        changed = quilt_series.refresh_diff(tree, layout.patches)
    for name, diff in changed.items():
        print(f"--- {name} changes on refresh:\n{diff}")
    print(
        f"refresh-check: {len(changed)} patch(es) not reproducible"
        if changed
        else "refresh-check: series is reproducible"
    )
    return 1 if changed else 0


def cmd_origins(args: argparse.Namespace) -> int:
    layout = builder.Layout(REPO)
    wheel_path = upstream.fetch_wheel(args.python_tag, layout.cache).path
    with zipfile.ZipFile(wheel_path) as zf:
        rewrites = origins.find_rewrites(
            quilt_series.read_series(layout.patches),
            lambda path: zf.read(path.removeprefix("python/")).decode(),
        )
    for r in rewrites:
        print(f"{r.patch} rewrites a line of {r.origin} in {r.file}: {r.line!r}")
    pairs = sorted({(r.patch, r.origin) for r in rewrites})
    print(
        f"origins: {len(rewrites)} line(s) rewritten, by "
        + ", ".join(f"{p} of {o}" for p, o in pairs)
        if rewrites
        else "origins: no patch rewrites an earlier patch's lines"
    )
    return 1 if rewrites else 0


def cmd_same_tree(args: argparse.Namespace) -> int:
    """The checkout's series and the one committed at a revision make byte-identical trees."""
    layout = builder.Layout(REPO)
    wheel_path = upstream.fetch_wheel(args.python_tag, layout.cache).path
    with tempfile.TemporaryDirectory(prefix="specpatch-old-series-") as scratch:
        old_layout = compare.series_at_revision(REPO, args.revision, Path(scratch))
        old = compare.patched_tree_digests(old_layout, wheel_path)
    new = compare.patched_tree_digests(layout, wheel_path)
    lines = compare.differences(old, new)
    for line in lines:
        print(line)
    print(
        f"same-tree: {len(lines)} file(s) differ from the series at {args.revision}"
        if lines
        else f"same-tree: identical to the series at {args.revision} ({len(new)} files)"
    )
    return 1 if lines else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specpatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="build the patched wheel into dist/")
    p.add_argument(
        "--python-tag", default=f"cp{sys.version_info.major}{sys.version_info.minor}"
    )
    p.add_argument(
        "--upstream-wheel", help="use this upstream wheel instead of downloading it"
    )
    p.set_defaults(func=cmd_build)
    p = sub.add_parser("status", help="which patches the installed sglang carries")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser(
        "manifest", help="rewrite patches/upstream.sha256 from the series"
    )
    p.set_defaults(func=cmd_manifest)
    p = sub.add_parser(
        "tree", help="materialize upstream + series for editing with quilt"
    )
    p.add_argument("--dir", default=str(REPO / "build" / "tree"))
    p.add_argument("--force", action="store_true")
    p.add_argument("--python-tag", default="cp311")
    p.set_defaults(func=cmd_tree)
    p = sub.add_parser(
        "refresh-check", help="fail if `quilt refresh` would change any patch"
    )
    p.add_argument("--python-tag", default="cp311")
    p.set_defaults(func=cmd_refresh_check)
    p = sub.add_parser(
        "origins", help="fail if a patch rewrites lines an earlier patch added"
    )
    p.add_argument("--python-tag", default="cp311")
    p.set_defaults(func=cmd_origins)
    p = sub.add_parser(
        "same-tree",
        help="fail unless the series makes the same tree as the one at a git revision",
    )
    p.add_argument("revision", help="e.g. main, or the commit before a re-cut")
    p.add_argument("--python-tag", default="cp311")
    p.set_defaults(func=cmd_same_tree)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (upstream.UpstreamMismatch, quilt_series.SeriesError) as exc:
        print(f"specpatch {args.command}: refused: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
