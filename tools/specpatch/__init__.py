"""The patch set's tooling.

Top level: the build (`specpatch` command, `python -m specpatch`): upstream (the pinned release
and its manifest), series (quilt), wheel (RECORD), build, cli.
testing/: what the tests and benchmarks run on: synthetic models, engine helpers, fakes.
gpu_host/: staging what the GPU bundle lacks (FA3, FlashInfer's JIT headers) to the GPU host.
"""
