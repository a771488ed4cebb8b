"""The shape policy's `none`: decode steps without speculation in a spec v2 server
(docs/shape-policy.md, "none as a plain decode with a batched draft catch-up").

A `none` step is the target's own decode: one token a request, through a CUDA graph captured in
DECODE mode beside the verify graphs, sampled as plain decoding samples. What it leaves the
draft owing is one row per request, the pair (the target's hidden state at position p, the
token sampled there), exactly the row a verify that accepted no draft hands its draft extend.
Owed rows wait in a ring per request slot (DraftRowRing). Before the next speculating step, or
before a ring could overflow, the draft catches up: one draft extend over each request's owed
rows, as after a verify that accepted that many tokens, through the draft-extend CUDA graph of
the widest shape (catch_up). Rows past a request's owed count land on positions the next
draft and verify write again before anything reads them, the invariant that already covers a
verify's rejected rows; a request that owes nothing keeps its carried draft input.

Host lengths stay what spec v2 made them (exact, or bounds on triton and FA3, which read them
only as sizes or page-table widths): a `none` step commits one token, so its successor's
bounds hold.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.next_draft_input import select_next_draft_input
from sglang.srt.speculative.plain_decode_kernels import decode_inputs, push_rows

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ModelWorkerBatch
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.eagle_info import EagleDraftInput

logger = logging.getLogger(__name__)

# Attention backends whose DECODE metadata may see spec v2's host lengths (bounds included).
PLAIN_DECODE_BACKENDS = frozenset({"triton", "fa3"})


# ----------------------------------------------------------------------------- owed rows


@dataclass
class DraftRowRing:
    """Draft rows owed per request slot, on the device (written in stream order)."""

    # [num_slots, width, hidden]: the target's hidden state at each owed position
    hidden: torch.Tensor
    # [num_slots, width] int64: the token the target sampled there (the row's draft input)
    tokens: torch.Tensor
    # [num_slots] int64: rows owed
    lag: torch.Tensor

    @classmethod
    def allocate(
        cls,
        num_slots: int,
        width: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> "DraftRowRing":
        return cls(
            hidden=torch.zeros(
                num_slots, width, hidden_size, dtype=dtype, device=device
            ),
            tokens=torch.zeros(num_slots, width, dtype=torch.int64, device=device),
            lag=torch.zeros(num_slots, dtype=torch.int64, device=device),
        )

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def push(
        self, req_pool_indices: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """One owed row per request: hidden [bs, hidden], tokens [bs]. The caller catches
        up before a ring holds `width` rows (PlainDecodeSteps.must_catch_up)."""
        push_rows(self.hidden, self.tokens, self.lag, req_pool_indices, hidden, tokens)

    def owed(
        self, req_pool_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden [bs * width, hidden], tokens [bs * width], lag [bs]) of these requests, in
        the verify-block layout a draft extend reads: request b's rows at b * width."""
        hidden = self.hidden[req_pool_indices].flatten(0, 1)
        tokens = self.tokens[req_pool_indices].flatten()
        return hidden, tokens, self.lag[req_pool_indices]

    def clear(self, req_pool_indices: torch.Tensor) -> None:
        self.lag[req_pool_indices] = 0


def allocate_ring(
    num_slots: int,
    width: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: "torch.device | str",
) -> DraftRowRing:
    """The ring of a server whose policy has `none`, with its size in the log; a shortfall of
    memory is an error that names what sizes it."""
    # The hidden rows, and the int64 tokens and lag beside them.
    total = (
        num_slots * width * hidden_size * dtype.itemsize + num_slots * (width + 1) * 8
    )
    sizes = (
        f"{num_slots} request slots x {width} rows (the widest shape's draft tokens) x "
        f"{hidden_size} {dtype} hidden = {total / 2**30:.2f} GiB"
    )
    try:
        ring = DraftRowRing.allocate(num_slots, width, hidden_size, dtype, device)
    except torch.OutOfMemoryError:
        raise RuntimeError(
            f'Not enough memory for the draft rows that "none" steps leave owing: {sizes}. '
            "Lower --max-running-requests (request slots) or --mem-fraction-static, or "
            'take "none" out of the shape policy\'s "shapes".'
        ) from None
    logger.info(f'Shape policy: "none"\'s owed draft rows: {sizes}')
    return ring


class PlainDecodeSteps:
    """A spec v2 worker's `none` steps and the draft's catch-up after them.

    steps_since_catch_up counts the `none` steps since the last catch-up: an upper bound of
    every request's owed rows (a request that joined later owes fewer), known on the host
    without reading the device. The ring comes allocated (at start-up: allocate_ring), so that
    a shortfall of memory stops the server before it serves rather than in the middle of a
    batch.
    """

    def __init__(self, ring: DraftRowRing):
        self.ring = ring
        self.steps_since_catch_up = 0

    @property
    def width(self) -> int:
        return self.ring.width

    @property
    def must_catch_up(self) -> bool:
        """Whether another `none` step could overflow a ring."""
        return self.steps_since_catch_up >= self.width

    @property
    def owes_rows(self) -> bool:
        return self.steps_since_catch_up > 0

    def forget(self, req_pool_indices: torch.Tensor) -> None:
        """Requests whose draft KV a prefill has just written owe nothing."""
        self.ring.clear(req_pool_indices)

    def decoded(
        self,
        req_pool_indices: torch.Tensor,
        hidden: torch.Tensor,
        next_token_ids: torch.Tensor,
    ) -> None:
        """Record a `none` step's owed rows: hidden [bs, hidden], next_token_ids [bs]."""
        self.ring.push(req_pool_indices, hidden, next_token_ids)
        self.steps_since_catch_up += 1

    def caught_up(self, req_pool_indices: torch.Tensor) -> None:
        self.ring.clear(req_pool_indices)
        self.steps_since_catch_up = 0


# ----------------------------------------------------------------------------- a `none` step


def plain_decode_allowed(batch: "ModelWorkerBatch") -> bool:
    """Whether this decode batch may take a `none` step: grammar and logprob batches keep
    speculating, since their spec v2 handling (masks, logprobs by accepted path) lives in the
    verify."""
    return not (batch.return_logprob or batch.has_grammar)


def plain_decode_batch(
    batch: "ModelWorkerBatch", req_to_token: torch.Tensor
) -> "ModelWorkerBatch":
    """The target's DECODE batch for a spec v2 decode step: each request's carried bonus token
    at position seq_len (spec v2's committed length), into the slot spec v2 allocated there.
    A copy: the spec v2 batch stays as it was."""
    draft_input: "EagleDraftInput" = batch.spec_info
    inputs = decode_inputs(
        req_to_token, batch.req_pool_indices, batch.seq_lens, draft_input.bonus_tokens
    )
    bs = len(batch.seq_lens)
    return dataclasses.replace(
        batch,
        forward_mode=ForwardMode.DECODE,
        input_ids=inputs.input_ids,
        seq_lens=inputs.seq_lens,
        orig_seq_lens=inputs.seq_lens,
        seq_lens_cpu=batch.seq_lens_cpu + 1,
        seq_lens_sum=batch.seq_lens_sum + bs,
        out_cache_loc=inputs.out_cache_loc,
        spec_info=None,
        capture_hidden_mode=CaptureHiddenMode.LAST,
    )


def build_decode_position_kernel(device: "torch.device | str") -> None:
    """Have sglang build its kernel for DECODE positions now, at start-up: ForwardBatch gives
    a DECODE batch its positions through a CUDA kernel nvcc builds on first use
    (forward_batch_info.clamp_position), and a spec v2 server's only DECODE batches are `none`
    steps, so the first of them would wait for that build (seconds) in the middle of serving,
    with every running request."""
    from sglang.srt.model_executor import forward_batch_info

    # Built per dtype: ScheduleBatch keeps seq_lens in int64, and plain_decode_batch keeps it.
    forward_batch_info.clamp_position(torch.ones(1, dtype=torch.int64, device=device))


def plain_decode_result(
    decoded: "GenerationBatchResult",
    batch: "ModelWorkerBatch",
    new_seq_lens: torch.Tensor,
    verify_done: Optional[torch.cuda.Event],
) -> "GenerationBatchResult":
    """What the spec v2 result path reads of a step that committed one token a request and
    proposed no draft: speculative_num_draft_tokens 1 (how the scheduler tells it from a
    speculating step), accept length 1, no correct drafts. The carried draft input passes on
    unchanged but for its bonus token and lengths (new_seq_lens: [bs], the DECODE batch's),
    until a catch-up replaces it."""
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    carried: "EagleDraftInput" = batch.spec_info
    bs = len(batch.seq_lens)
    next_token_ids = decoded.next_token_ids
    next_draft_input = EagleDraftInput(
        topk_p=carried.topk_p,
        topk_index=carried.topk_index,
        hidden_states=carried.hidden_states,
        bonus_tokens=next_token_ids.to(carried.bonus_tokens.dtype),
        new_seq_lens=new_seq_lens,
        verify_done=verify_done,
    )
    decoded.speculative_num_draft_tokens = 1
    decoded.next_draft_input = next_draft_input
    decoded.accept_lens = torch.ones(
        bs, dtype=torch.int32, device=batch.seq_lens.device
    )
    decoded.correct_drafts = torch.zeros_like(decoded.accept_lens)
    return decoded


def run_plain_decode_step(worker, batch: "ModelWorkerBatch") -> "GenerationBatchResult":
    """A `none` step of an EAGLEWorkerV2: the target's decode through the runner the shape
    controller applied (DECODE mode), its owed draft rows recorded, the spec v2 result.
    """
    plain = plain_decode_batch(batch, worker.req_to_token_pool.req_to_token)
    decoded = worker.target_worker.forward_batch_generation(plain)
    worker.plain_decode_steps.decoded(
        batch.req_pool_indices,
        decoded.logits_output.hidden_states,
        decoded.next_token_ids,
    )
    verify_done = torch.get_device_module(batch.seq_lens.device).Event()
    verify_done.record()
    return plain_decode_result(decoded, batch, plain.seq_lens, verify_done)


def speculated(result: "GenerationBatchResult") -> bool:
    """Whether a spec v2 decode result came from a speculating step (not `none`)."""
    return result.speculative_num_draft_tokens != 1


# ----------------------------------------------------------------------------- the catch-up


def catch_up_before(worker, batch: "ModelWorkerBatch", speculating: bool) -> None:
    """Catch the draft up where it owes rows and this step speculates, or where another `none`
    step could overflow a ring (run inside the worker's draft contexts)."""
    steps: PlainDecodeSteps = worker.plain_decode_steps
    if steps.owes_rows and (speculating or steps.must_catch_up):
        catch_up(
            worker.draft_worker, steps, batch, worker.shape_controller.catch_up_runner
        )


def catch_up(
    draft_worker,
    steps: PlainDecodeSteps,
    batch: "ModelWorkerBatch",
    draft_extend_runner,
) -> None:
    """Run the draft over each request's owed rows and refresh the carried draft input of
    those that owed any (batch.spec_info, in place); clears the rings.

    draft_extend_runner: the widest shape's draft-extend CUDA graph runner (its width is the
    ring's), or None to run eagerly.
    """
    carried: "EagleDraftInput" = batch.spec_info
    width = steps.width
    hidden, tokens, lag = steps.ring.owed(batch.req_pool_indices)
    # The host's copy of the owed counts: one wait for the device per catch-up (one per
    # `width` steps at most), for exact host lengths on the eager path and on backends that
    # plan from them.
    lag_cpu = lag.cpu()
    # A request that owes nothing still gets a row selected (its first, then dropped): the
    # in-graph selection reads row b * width + accepted - 1.
    accepted = lag.clamp(min=1).to(torch.int32)
    draft_input = type(carried)(
        hidden_states=hidden,
        num_tokens_per_req=width,
        num_tokens_for_logprob_per_req=width,
    )
    forward_batch = draft_input.prepare_for_extend_to_fill_draft_kvcache(
        catch_up_batch(
            batch, lag, lag_cpu, width, draft_worker.req_to_token_pool.req_to_token
        ),
        tokens,
        width,
        draft_worker.draft_runner,
        draft_extend_runner,
        lists_unread_on_replay=True,
    )
    forward_batch.spec_info.num_accept_tokens = accepted
    forward_batch.spec_info.num_correct_drafts = accepted - 1
    if draft_extend_runner is not None and draft_extend_runner.can_run(forward_batch):
        out = draft_extend_runner.replay(forward_batch)
        topk_p, topk_index, next_hidden = out.topk_p, out.topk_index, out.hidden_states
    else:
        logits = draft_worker.draft_runner.forward(
            forward_batch, skip_attn_backend_init=True
        ).logits_output
        nxt = select_next_draft_input(
            logits.next_token_logits,
            logits.hidden_states,
            accepted,
            width,
            draft_worker.carried_topk,
        )
        topk_p, topk_index, next_hidden = nxt.topk_p, nxt.topk_index, nxt.hidden_states
    merge_caught_up(carried, lag, topk_p, topk_index, next_hidden)
    steps.caught_up(batch.req_pool_indices)


def catch_up_batch(
    batch: "ModelWorkerBatch",
    lag: torch.Tensor,
    lag_cpu: torch.Tensor,
    width: int,
    req_to_token: torch.Tensor,
) -> "ModelWorkerBatch":
    """A copy of a spec v2 decode batch for the catch-up's draft extend: lengths that start
    each request's owed rows, seq_len - lag, on the device and on the host (where seq_len may
    be a bound, which stays one), and the KV slots of the `width` rows from there.
    lag: [bs] on the device, lag_cpu: the same on the host."""
    seq_lens = batch.seq_lens - lag.to(batch.seq_lens.dtype)
    seq_lens_cpu = batch.seq_lens_cpu - lag_cpu.to(batch.seq_lens_cpu.dtype)
    positions = seq_lens[:, None] + torch.arange(width, device=seq_lens.device)
    out_cache_loc = req_to_token[batch.req_pool_indices[:, None], positions]
    return dataclasses.replace(
        batch,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens_cpu,
        seq_lens_sum=int(seq_lens_cpu.sum()),
        out_cache_loc=out_cache_loc.flatten().to(torch.int64),
    )


def merge_caught_up(
    carried: "EagleDraftInput",
    lag: torch.Tensor,
    topk_p: torch.Tensor,
    topk_index: torch.Tensor,
    hidden_states: Optional[torch.Tensor],
) -> None:
    """Requests that owed rows take the catch-up's next draft input; the others keep theirs.
    topk_p / topk_index: [bs, carried topk]; hidden_states: [bs, hidden] or None."""
    owed = (lag > 0)[:, None]
    carried.topk_p = torch.where(owed, topk_p, carried.topk_p)
    carried.topk_index = torch.where(owed, topk_index, carried.topk_index)
    if hidden_states is not None and carried.hidden_states is not None:
        carried.hidden_states = torch.where(owed, hidden_states, carried.hidden_states)
