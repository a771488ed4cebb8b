"""Spec v2: the positions of the draft extend that follows verify, made on the device.

After verify, every request re-runs the draft over its whole verify block: the same number of
rows for every request (num_draft_tokens, the tree's width), at positions prefix_len[b] ..
prefix_len[b] + width - 1, where prefix_len is the request's KV length before verify. The
generic extend setup (ForwardBatch.init_new) builds positions from host lists: two host-to-device
copies and a position kernel on every decode step, in a loop that is bound by host work at
small batch sizes. A fixed width needs none of that: one broadcast add on the device.

The draft-extend CUDA graph needs only the positions (it fills the per-request extend lengths
itself); the eager path keeps the generic setup, which its attention backend plans from.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def _row_offsets(width: int, device: torch.device) -> torch.Tensor:
    # [width] int64: 0 .. width - 1, made once per width and device, not once per step.
    return torch.arange(width, dtype=torch.int64, device=device)


def fixed_width_positions(prefix_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[bs * width] int64: request b's rows sit at positions prefix_lens[b] + 0 .. width - 1,
    requests one after another (the extend's row order). prefix_lens: [bs], any int dtype.
    """
    offsets = _row_offsets(width, prefix_lens.device)
    return (prefix_lens.to(torch.int64).unsqueeze(1) + offsets).view(-1)


def positions_suffice(model_runner) -> bool:
    """Whether a forward of this model needs nothing from the extend setup but positions:
    models with mrope positions, n-gram embeddings or LoRA read the per-request extend lists.
    """
    return not (
        model_runner.model_is_mrope
        or model_runner.use_ngram_embedding
        or model_runner.server_args.enable_lora
    )
