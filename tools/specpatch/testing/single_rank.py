"""A one-rank gloo world, so sglang's modules that ask their process groups (model layers,
ForwardBatch.init_new) run in a CPU test process."""

from __future__ import annotations

import socket


def init_model_parallel_on_cpu() -> None:
    """Initialise sglang's distributed environment and model-parallel groups once (TP 1)."""
    from sglang.srt.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ps.init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )
    ps.initialize_model_parallel(backend="gloo")
