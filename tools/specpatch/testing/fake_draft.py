"""Draft workers with fake model runners, for exercising the real draft_forward code.

The worker objects are sglang's own EagleDraftWorker / MultiLayerEagleDraftWorker classes with
only the attributes draft_forward reads (their __init__ would load a model and capture graphs).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


class TableDraftRunner:
    """next_token_logits = logits_table[input_id]; records every step's inputs and KV slots."""

    kv_canary = None  # as ModelRunner with the KV canary off

    def __init__(self, vocab_size: int, seed: int = 0, device: str = "cpu"):
        g = torch.Generator().manual_seed(seed)
        # [input vocab, output vocab]
        self.logits_table = torch.randn(vocab_size, vocab_size, generator=g).to(device)
        self.calls: list[tuple[list[int], list[int]]] = []

    def forward(self, forward_batch, skip_attn_backend_init=False):
        input_ids = forward_batch.input_ids
        self.calls.append((input_ids.tolist(), forward_batch.out_cache_loc.tolist()))
        return SimpleNamespace(
            logits_output=SimpleNamespace(
                next_token_logits=self.logits_table[input_ids],
                hidden_states=forward_batch.spec_info.hidden_states + 1,
            )
        )


class DenseDraftRunner:
    """Costs about what one EAGLE decoder layer plus the lm_head cost per draft step (bf16 GEMMs
    over the same weight bytes), so draft-phase timings carry a realistic model share.
    """

    kv_canary = None  # as ModelRunner with the KV canary off

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        vocab_size: int,
        device: str = "cuda",
        seed: int = 0,
    ):
        g = torch.Generator(device=device).manual_seed(seed)

        def weight(*shape):
            return (
                torch.randn(*shape, generator=g, device=device) / shape[-1] ** 0.5
            ).to(torch.bfloat16)

        self.embed = weight(vocab_size, hidden)
        self.qkv_o = [weight(hidden, hidden) for _ in range(4)]
        self.gate_up = weight(hidden, 2 * intermediate)
        self.down = weight(intermediate, hidden)
        self.lm_head = weight(vocab_size, hidden)

    def forward(self, forward_batch, skip_attn_backend_init=False):
        x = self.embed[forward_batch.input_ids] + forward_batch.spec_info.hidden_states
        for w in self.qkv_o:
            x = x + x @ w
        gate, up = (x @ self.gate_up).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ self.down
        logits = (x @ self.lm_head.t()).float()
        return SimpleNamespace(
            logits_output=SimpleNamespace(next_token_logits=logits, hidden_states=x)
        )


def make_draft_worker(
    worker_cls,
    runner,
    *,
    num_steps: int,
    max_bs: int,
    chain: bool = True,
    device: str = "cpu",
):
    from sglang.srt.speculative.chain_draft import ChainDraftTable

    worker = object.__new__(worker_cls)
    worker.topk = 1
    worker.speculative_num_steps = num_steps
    worker.speculative_num_draft_tokens = num_steps + 1
    worker.hot_token_id = None
    worker.draft_runner = runner
    worker.draft_attn_backend = SimpleNamespace(attn_backends=[object()] * num_steps)
    worker.chain_drafts = ChainDraftTable(topk=1, max_bs=max_bs, device=device)
    if chain:
        worker.chain_drafts.prepare(num_steps, num_steps + 1)
    return worker


def make_forward_batch(
    bs: int,
    num_steps: int,
    *,
    vocab_size: int,
    hidden: int,
    seed: int = 1,
    first_token_width: int = 1,
    device: str = "cpu",
    dtype=torch.float32,
):
    """The ForwardBatch fields draft_forward reads, after the previous round's draft-extend."""
    g = torch.Generator().manual_seed(seed)
    spec_info = SimpleNamespace(
        topk_p=torch.rand(bs, first_token_width, generator=g).to(device),
        topk_index=torch.randint(
            0, vocab_size, (bs, first_token_width), generator=g
        ).to(device),
        hidden_states=torch.randn(bs, hidden, generator=g).to(
            device=device, dtype=dtype
        ),
    )
    return SimpleNamespace(
        spec_info=spec_info,
        batch_size=bs,
        out_cache_loc=(torch.arange(bs * num_steps, dtype=torch.int64) + 1000).to(
            device
        ),
        positions=torch.arange(bs, dtype=torch.int64).to(device),
        input_ids=None,
        attn_backend=None,
    )
