"""Canary off on CUDA: no device memory, and the call sites launch no kernel and copy nothing.

The same forwards with the canary in raise mode are the control: they must show allocations and
kernels, or the counting below would prove nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from canary_sim import Batch, SimEngine, draft_step_batch
from torch.profiler import ProfilerActivity, profile

from sglang.srt.kv_canary.config import CanaryMode

pytestmark = pytest.mark.gpu


def _device_events(fn) -> list[str]:
    """Names of the kernels and memcpys/memsets fn puts on the GPU."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [
        e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    ]


def _engine_bytes(mode: CanaryMode) -> tuple[SimEngine, int]:
    """A simulated EAGLE engine on CUDA and the device bytes its construction added beyond the
    simulation's own req_to_token table."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = SimEngine(
        mode=mode, device="cuda", topk=4, num_steps=3, num_draft_tokens=8
    )
    torch.cuda.synchronize()
    return (
        engine,
        torch.cuda.memory_allocated() - before - engine.r2t.untyped_storage().nbytes(),
    )


def _on_cuda(batch: Batch) -> Batch:
    moved = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return Batch(
        **{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
    )


def _batches(engine: SimEngine) -> tuple[Batch, Batch]:
    """A target decode batch and an inner-draft-step batch over three admitted requests, built
    (host-to-device copies included) before anything is profiled."""
    reqs = [engine.admit(prompt_len=12) for _ in range(3)]
    return engine.decode_batch(reqs), _on_cuda(draft_step_batch(engine, 0))


def _every_call_site(
    engine: SimEngine, decode: Batch, draft_extend: Batch, draft_step: Batch
) -> None:
    """A target forward, a draft-extend and an inner draft step: every bracket and pre-op."""
    engine.forward(engine.target, decode)
    engine.forward(engine.draft, draft_extend, draft_extend=True)
    engine.run_draft_steps(draft_step, [draft_step])


def test_off_allocates_nothing_on_the_device():
    off, off_bytes = _engine_bytes(CanaryMode.OFF)
    assert off.target is None and off.draft is None
    assert off_bytes == 0
    _, raise_bytes = _engine_bytes(CanaryMode.RAISE)
    assert (
        raise_bytes > 0
    ), "control: raise mode should hold fingerprint buffers on the device"


def test_off_call_sites_put_nothing_on_the_gpu():
    off, _ = _engine_bytes(CanaryMode.OFF)
    decode, draft_step = _batches(off)
    draft_extend = dataclasses.replace(decode, token_to_kv_pool=off.draft_pool)
    assert (
        _device_events(lambda: _every_call_site(off, decode, draft_extend, draft_step))
        == []
    )

    on, _ = _engine_bytes(CanaryMode.RAISE)
    decode, draft_step = _batches(on)
    draft_extend = dataclasses.replace(decode, token_to_kv_pool=on.draft_pool)
    events = _device_events(
        lambda: _every_call_site(on, decode, draft_extend, draft_step)
    )
    assert len(events) > 0, "control: raise mode launches kernels"
