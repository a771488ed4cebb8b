#!/usr/bin/env bash
# Repack .gpu-bundle/ (made by ../shared/gpu/stage.sh) as .gpu-bundle-xz/: the same wheels,
# stored uncompressed inside xz streams, about 35 MiB instead of 56. That leaves room in a
# device call's 64 MiB for FlashInfer's JIT headers and compiled modules (.flashinfer/).
#   bash tools/pack-gpu-bundle.sh          # after stage.sh; carry .gpu-bundle-xz, not .gpu-bundle
# The dependency wheels change rarely and compress slowly (minutes on two cores): they go into
# deps.tar.xz once per set of wheel names; the sglang wheel is repacked every time.
# tools/gpu-tests.sh unpacks them on the GPU host when .gpu-bundle/ did not travel.
set -euo pipefail
cd "$(dirname "$0")/.."
src=.gpu-bundle out=.gpu-bundle-xz
[ -f "$src/env.sh" ] || { echo "pack-gpu-bundle: run ../shared/gpu/stage.sh first" >&2; exit 2; }
exclude=$(git rev-parse --git-path info/exclude)
grep -qx "/$out/" "$exclude" 2>/dev/null || echo "/$out/" >> "$exclude"
mkdir -p "$out"

# Rewrite wheels with stored (uncompressed) members, so that xz sees the raw bytes.
stored() { # stored SRC_WHEEL DEST_DIR
  local tmp; tmp=$(mktemp -d)
  (cd "$tmp" && unzip -q "$1" && zip -q -0 -r -X "$2/$(basename "$1")" .)
  rm -rf "$tmp"
}

key=$(cd "$src" && ls whl | grep -v '^sglang-' | sha256sum | cut -c1-16)
if [ "$(cat "$out/deps.key" 2>/dev/null)" != "$key" ]; then
  tmp=$(mktemp -d); mkdir -p "$tmp/whl"
  for w in "$src"/whl/*.whl; do
    case "$(basename "$w")" in sglang-*) ;; *) stored "$(realpath "$w")" "$tmp/whl" ;; esac
  done
  cp -r "$src/shim" "$src/env.sh" "$tmp/"
  tar -C "$tmp" -cf - . | xz -9 -T0 > "$out/deps.tar.xz"
  echo "$key" > "$out/deps.key"
  rm -rf "$tmp"
fi
tmp=$(mktemp -d); mkdir -p "$tmp/whl"
stored "$(realpath "$src"/whl/sglang-*.whl)" "$tmp/whl"
tar -C "$tmp" -cf - whl | xz -6 -T0 > "$out/sglang.tar.xz"
rm -rf "$tmp"
du -sh "$out"/*.tar.xz
