"""GPU-host staging: what the offline GPU bundle leaves out, packed here and installed there
(fa3_stage: FA3's library in parts; flashinfer_stage: FlashInfer's JIT headers, compiled modules
back). Run as `python3 -m specpatch.gpu_host.<module>` from tools/gpu-env.sh and gpu-tests.sh.
"""
