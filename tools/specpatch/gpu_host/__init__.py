"""GPU-host staging: what the offline GPU bundle leaves out, packed here and installed there
(fa3_stage: FA3's library in parts; flashinfer_stage: FlashInfer's JIT headers, compiled modules
back; triton_cache: Triton's compiled kernels back; jit_cache: sglang's nvcc-built modules
back; cpu_sets: each GPU's cores). Run as `python3 -m specpatch.gpu_host.<module>` from
tools/gpu-env.sh, gpu-tests.sh and gpu-lanes.sh.
"""

# One file that comes back from a device call (through $OUT) is at most 16 MiB.
MAX_RETURNED_BYTES = 16 << 20
