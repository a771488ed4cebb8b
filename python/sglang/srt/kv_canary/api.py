"""What upstream call sites use: the factory, and one-line helpers that accept None.

    check_canary_settings(server_args.kv_canary, ...)          # ServerArgs, before any GPU work
    self.kv_canary = install_kv_canary(self, server_args)     # ModelRunner, after its pools
    with outside_graph(self.kv_canary, forward_batch):         # host side of one forward
        pre_ops(self.kv_canary, forward_batch)                 # in the forward / graph capture

Every helper is a no-op when the canary is off (the factory returned None), so a call site
costs one attribute read and one call when off: no buffers, no kernels.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from typing import Callable, ContextManager, Iterable, Iterator, Mapping, Optional

import torch

from sglang.srt.kv_canary.config import CanaryConfig, parse_canary_config
from sglang.srt.kv_canary.draft_feed import draft_token_offset, speculative_worker_class
from sglang.srt.kv_canary.faults import ENV_FAULT, FaultInjector, parse_fault_config
from sglang.srt.kv_canary.manager import CanaryManager
from sglang.srt.kv_canary.tables import (
    IDENTITY_CONTENT,
    IDENTITY_REQUEST,
    record_of,
    shared_record,
)

logger = logging.getLogger("sglang.srt.kv_canary")

# Call sites that only hold a KV pool or the allocator find the canary here (empty when off).
_canary_of_pool: "weakref.WeakKeyDictionary[object, CanaryManager]" = (
    weakref.WeakKeyDictionary()
)
_canary_of_allocator: "weakref.WeakKeyDictionary[object, CanaryManager]" = (
    weakref.WeakKeyDictionary()
)


def install_kv_canary(
    model_runner,
    server_args=None,
    *,
    config: Optional[CanaryConfig] = None,
    token_offset: Optional[int] = None,
    group_name: Optional[str] = None,
) -> Optional[CanaryManager]:
    """The runner's canary, or None when off (nothing allocated).

    Call after the runner's req_to_token and KV pools exist and before its CUDA graphs are
    captured. A draft runner (model_runner.is_draft_worker) gets the token offset its worker's
    draft extend implies (draft_feed: 1 for EAGLE, EAGLE3 and STANDALONE) and one single
    forward per inner draft step (speculative_num_steps - 1, at least 1); a multi-layer EAGLE
    layer runner (model_runner.draft_model_idx = i) gets offset 1 + i and one single forward.
    A draft runner whose worker's draft extend the canary does not know is left unchecked
    (None, with a warning): a guessed offset would report every healthy read.
    """
    if config is None:
        # --kv-canary / --kv-canary-sample-every when given, else the environment.
        config = parse_canary_config(
            getattr(server_args, "kv_canary", None),
            getattr(server_args, "kv_canary_sample_every", None),
        )
    if not config.enabled:
        return None

    is_draft = bool(getattr(model_runner, "is_draft_worker", False))
    # Multi-layer EAGLE (MTP): one runner per draft layer, each running once per round; layer i
    # is fed ids rotated i + 1 times.
    layer = getattr(model_runner, "draft_model_idx", None) if is_draft else None
    name = group_name or (
        "target"
        if not is_draft
        else "draft" if layer is None else f"draft layer {layer}"
    )
    if token_offset is None:
        token_offset = draft_token_offset(server_args, layer) if is_draft else 0
        if token_offset is None:
            worker_cls = speculative_worker_class(server_args)
            worker = (
                worker_cls.__name__
                if worker_cls is not None
                else "no speculative worker"
            )
            logger.warning(
                f"KV canary off for {name}: its worker ({worker}) has a draft extend the canary "
                "does not know (kv_canary/draft_feed.py), so which token its KV holds is unknown"
            )
            return None
    num_steps = int(getattr(server_args, "speculative_num_steps", None) or 1)
    num_single_forwards = max(1, num_steps - 1) if is_draft and layer is None else 1
    # The prefix cache shares slots between requests, so fingerprints carry content identity
    # (position, token) rather than the writer's request hash.
    shares_kv = not bool(getattr(server_args, "disable_radix_cache", False))
    identity = IDENTITY_CONTENT if shares_kv else IDENTITY_REQUEST

    pool = model_runner.token_to_kv_pool
    record = shared_record(model_runner.req_to_token_pool, identity)
    group = record.register_group(
        pool,
        name,
        is_draft=is_draft,
        token_offset=token_offset,
        num_slots=_num_slots(pool),
    )
    fault = parse_fault_config()
    manager = CanaryManager(
        config=config,
        record=record,
        group=group,
        num_single_forwards=num_single_forwards,
        impl=_impl_for(record.device),
        fault_injector=(
            FaultInjector(fault) if fault is not None and not is_draft else None
        ),
    )
    _canary_of_pool[pool] = manager
    allocator = getattr(model_runner, "token_to_kv_pool_allocator", None)
    if allocator is not None and allocator not in _canary_of_allocator:
        # Any manager will do: a free poisons the slots in every group.
        _canary_of_allocator[allocator] = manager
    logger.info(
        f"KV canary on for {name}: mode={config.mode.value} identity={identity} "
        f"token_offset={token_offset} single_forwards={num_single_forwards} "
        f"sample_every={config.sample_every} sample_fraction={config.sample_fraction}"
        + (
            f" fault={fault.kind.value}@{fault.trigger_step}"
            if manager.fault_injector
            else ""
        )
    )
    return manager


def check_canary_settings(
    mode: Optional[str],
    sample_every: Optional[int],
    env: Optional[Mapping[str, str]] = None,
) -> CanaryConfig:
    """Every canary setting, flags and environment, checked in ServerArgs.__post_init__: a bad
    one is a ValueError naming its flag or variable before any GPU allocation, not at the
    install after the pools exist. Fault injection is ignored, with a warning, while off.
    """
    env = os.environ if env is None else env
    config = parse_canary_config(mode, sample_every, env=env)
    if config.enabled:
        parse_fault_config(env)
    elif env.get(ENV_FAULT, "").strip():
        logger.warning(
            f"{ENV_FAULT} is set but the KV canary is off: no fault is injected"
        )
    return config


def _num_slots(pool) -> int:
    # sglang pools hold size + page_size rows: the padded slot 0 takes dummy writes.
    return int(pool.size) + int(getattr(pool, "page_size", 1) or 1)


def _impl_for(device: torch.device):
    from sglang.srt.kv_canary import kernels, reference

    return kernels if kernels.is_usable_on(device) else reference


# ----------------------------------------------------------------------------- call sites


def outside_graph(
    manager: Optional[CanaryManager], forward_batch, indices: Iterable[int] = (0,)
) -> ContextManager:
    """with_ops_outside_graph, or nothing when off."""
    if manager is None:
        return contextlib.nullcontext()
    return manager.with_ops_outside_graph(indices, forward_batch)


def runner_bracket(manager: Optional[CanaryManager], forward_batch) -> ContextManager:
    """ModelRunner.forward's own bracket: every forward of a target runner; of a draft runner,
    its spec v2 draft extend (draft_extend_bracket). The draft steps are bracketed by the
    speculative worker, which knows the step."""
    if manager is None:
        return contextlib.nullcontext()
    if not manager.is_draft:
        return manager.with_ops_outside_graph((0,), forward_batch)
    return draft_extend_bracket(manager, forward_batch)


def draft_extend_bracket(
    manager: Optional[CanaryManager], forward_batch
) -> ContextManager:
    """Both brackets (one forward, single forward 0) around a draft runner's spec v2 draft
    extend (or a DP rank's idle one), eager (ModelRunner.forward) or replayed (the
    draft-extend graph runner). They sit with the forward, not in the worker's draft-extend
    code, whose lines later patches edit. Nothing when off, for another forward, or inside a
    bracket the worker opened (its draft steps, its prefill's draft extend)."""
    if manager is None or not manager.is_draft or manager.in_bracket:
        return contextlib.nullcontext()
    if forward_batch.forward_mode.name not in ("DRAFT_EXTEND_V2", "IDLE"):
        return contextlib.nullcontext()
    return _both_brackets(manager, forward_batch)


def active_step(manager: Optional[CanaryManager], index: int) -> ContextManager:
    """with_active_single_forward_manager, or nothing when off."""
    if manager is None:
        return contextlib.nullcontext()
    return manager.with_active_single_forward_manager(index)


def in_draft_step(draft_step: Callable) -> Callable:
    """Decorates an EAGLE worker's draft step, (worker, forward_batch, out_cache_loc, i, ...):
    it runs with single forward i active, so its forward's pre-ops check inner draft step i.
    A decorator rather than a `with` inside keeps the method's lines as they are."""

    @functools.wraps(draft_step)
    def run(worker, forward_batch, out_cache_loc, i, *args, **kwargs):
        with active_step(worker.draft_runner.kv_canary, i):
            return draft_step(worker, forward_batch, out_cache_loc, i, *args, **kwargs)

    return run


def draft_extend_brackets(
    manager: Optional[CanaryManager], forward_batch
) -> ContextManager:
    """Both brackets for a draft extend (one forward, on single forward 0)."""
    if manager is None:
        return contextlib.nullcontext()
    return _both_brackets(manager, forward_batch)


@contextlib.contextmanager
def _both_brackets(manager: CanaryManager, forward_batch) -> Iterator[None]:
    with (
        manager.with_ops_outside_graph([0], forward_batch),
        manager.with_active_single_forward_manager(0),
    ):
        yield


def capturing(manager: Optional[CanaryManager]) -> ContextManager:
    if manager is None:
        return contextlib.nullcontext()
    return manager.capturing()


def pre_ops(
    manager: Optional[CanaryManager], forward_batch, step: Optional[int] = None
) -> None:
    """Verify + write for this forward; `step` activates that single forward around it (for a
    graph runner that calls model.forward directly, e.g. the draft-extend capture)."""
    if manager is None:
        return
    if step is None:
        manager.pre_ops_maybe_inside_graph(forward_batch)
        return
    with manager.with_active_single_forward_manager(step):
        manager.pre_ops_maybe_inside_graph(forward_batch)


def on_kv_move(kv_pool, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """Next to kv_pool.move_kv_cache(tgt_loc, src_loc): the fingerprints move with the K/V."""
    manager = _canary_of_pool.get(kv_pool)
    if manager is not None:
        manager.move_fingerprints(tgt_loc, src_loc)


def on_free(allocator, slots: torch.Tensor) -> None:
    """In the allocator's free(): the slots are poisoned (in every pool) at the next bracket."""
    manager = _canary_of_allocator.get(allocator)
    if manager is not None:
        manager.note_freed(slots)


def on_row_free(req_to_token_pool, row: int) -> None:
    """In ReqToTokenPool.free: the request's ownership of `row` ends, so a request that gets
    the row next (the same one too, back from retraction) reads its prefix as borrowed.
    """
    record = record_of(req_to_token_pool)
    if record is not None:
        record.note_row_released(row)
