# Source on the GPU host, from the checkout root: sglang and what the bundle lacks, importable.
#   source tools/gpu-env.sh
# The bundle travels as .gpu-bundle/ or, repacked smaller, as .gpu-bundle-xz/
# (tools/pack-gpu-bundle.sh); .whl/ holds wheels the bundle lacks (tools/stage-extra-wheels.sh),
# .flashinfer/ FlashInfer's JIT headers and compiled modules (specpatch.gpu_host.flashinfer_stage),
# .fa3/ or /tmp/fa3 FA3's library in parts (specpatch.gpu_host.fa3_stage), .triton-cache/
# Triton's kernels compiled by an earlier call (specpatch.gpu_host.triton_cache), .jit-cache/
# sglang's nvcc-built modules (specpatch.gpu_host.jit_cache).
# sglang's own CUDA kernels that nvcc builds on first use (sglang.jit_kernel, through tvm-ffi):
# one cache path for every process of the call, the bundle's first import included.
export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/tmp/tvm-ffi-cache}
if [ ! -f .gpu-bundle/env.sh ] && [ -f .gpu-bundle-xz/deps.tar.xz ]; then
  mkdir -p .gpu-bundle && for a in .gpu-bundle-xz/*.tar.xz; do tar -xJf "$a" -C .gpu-bundle; done
fi
python3 -c "import sglang" 2>/dev/null && [ -n "${PYTHONPATH:-}" ] || source .gpu-bundle/env.sh
# The modules of .jit-cache/ when carried (specpatch.gpu_host.jit_cache): once the bundle is
# installed, whose headers they were built against; install then pins those headers' times,
# which the install above made newer than every carried module (ninja would rebuild each).
if [ -f .jit-cache/tvm-ffi-cache.tar.xz ]; then
  PYTHONPATH=tools:${PYTHONPATH:-} python3 -m specpatch.gpu_host.jit_cache install .jit-cache
fi
# The bundle's IPython stand-in lacks what matplotlib asks a loaded IPython (bench_e2e --png):
# from version 8.24 on it leaves notebook hooks alone.
ipython_shim=.gpu-bundle/shim/IPython/__init__.py
if [ -f "$ipython_shim" ] && ! grep -q version_info "$ipython_shim"; then
  echo "version_info = (8, 24)" >>"$ipython_shim"
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gpu-site .whl/*.whl 2>&1 | grep -v WARNING
  # pip --target leaves out a wheel's scripts (py-spy is one): they go to /tmp/gpu-site/bin.
  python3 - .whl/*.whl <<'PY'
import os, sys, zipfile
os.makedirs("/tmp/gpu-site/bin", exist_ok=True)
for wheel in sys.argv[1:]:
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if ".data/scripts/" in name and not name.endswith("/"):
                dest = os.path.join("/tmp/gpu-site/bin", os.path.basename(name))
                with open(dest, "wb") as f:
                    f.write(zf.read(name))
                os.chmod(dest, 0o755)
PY
  export PATH=/tmp/gpu-site/bin:$PATH
fi
if [ -f .flashinfer/manifest.json ]; then
  PYTHONPATH=tools:$PYTHONPATH python3 -m specpatch.gpu_host.flashinfer_stage install .flashinfer || return 1
fi
# FA3 parts carried in this call join /tmp/fa3: a slim pack's one part rides beside the bundle.
if [ -f .fa3/manifest.json ]; then
  PYTHONPATH=tools:$PYTHONPATH python3 -m specpatch.gpu_host.fa3_stage receive .fa3 /tmp/fa3
fi
if [ -f /tmp/fa3/manifest.json ]; then
  PYTHONPATH=tools:$PYTHONPATH python3 -m specpatch.gpu_host.fa3_stage install /tmp/fa3 || return 1
fi
# One Triton cache path on every host, so that what a call collects and the next one installs
# is the same cache (a call's first engine otherwise compiles every kernel before it starts).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
if [ -f .triton-cache/triton-cache.tar.xz ]; then
  PYTHONPATH=tools:$PYTHONPATH python3 -m specpatch.gpu_host.triton_cache install .triton-cache
fi
export SPECPATCH_MODEL_CACHE=${SPECPATCH_MODEL_CACHE:-/tmp/specpatch-models}
