"""How many positions of a finished request its per-token captures cover.

With --enable-return-routed-experts or --enable-return-indexer-topk, a finished request gets one
capture row per position it fed to the model, read from the host cache by its KV slots:
positions [start_len, seqlen - 1) of BaseTopkCapturer.get_topk. The last returned token has no
row: it was sampled, never fed. So seqlen must be the length of the sequence returned to the
user: the prompt plus the output through its stop (Req.output_ids_through_stop).

Req.seqlen is the prompt plus all of output_ids. Spec v2 commits a verify's accepted tokens at
once and checks the stop after them (Req.check_finished(new_accepted_len)): a request that
reaches max_new_tokens, or a stop token, inside an accepted run keeps the tokens past it in
output_ids, and finished_len marks where the returned output ends (streaming_session calls this
the overshoot). Spec v1 trims output_ids in verify, non-speculative decoding never overshoots.
Read with Req.seqlen, spec v2 returned one extra row per overshooting token: the captures of
tokens the user never got, a longer array than without speculation.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence


class FinishedRequest(Protocol):
    origin_input_ids: Sequence[int]
    output_ids: Sequence[int]
    # Returned output tokens once finished (the stop included); None: all of output_ids.
    finished_len: Optional[int]


def returned_seqlen(
    num_prompt_tokens: int, num_output_tokens: int, finished_len: Optional[int]
) -> int:
    """The prompt plus the output tokens returned: output_ids cut at finished_len."""
    if finished_len is None:
        return num_prompt_tokens + num_output_tokens
    if finished_len < 0:
        raise ValueError(f"{finished_len=} must be non-negative")
    return num_prompt_tokens + min(num_output_tokens, finished_len)


def capture_seqlen(req: FinishedRequest) -> int:
    """The seqlen to read a finished request's captures with (get_topk returns positions up to
    seqlen - 1): the sequence it returns, not what spec v2 decoded past the stop."""
    return returned_seqlen(
        len(req.origin_input_ids), len(req.output_ids), req.finished_len
    )
