"""Test support, for tests and benchmarks: synthetic model pairs (synth, synth_eagle3,
synth_standalone), engine and server helpers (engine), fake draft workers (fake_draft), model
parallel state on CPU (single_rank), the CUDA driver stub (cudastub) and triton's CPU
interpreter runs (interpret). Not used by the build.
"""
