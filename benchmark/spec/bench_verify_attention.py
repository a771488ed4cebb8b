"""Triton extend attention at speculative verify shapes, one process, side by side: upstream's
prefill query tile; a tile as long as the extend (sglang.srt.layers.attention.triton_short_extend);
and that plus the split prefix at small batch (triton_split_prefix), what the series runs by
default.

    python benchmark/spec/bench_verify_attention.py --batch-sizes 1,16,64 --draft-tokens 2,4,32

Each row: microseconds per call for one layer (heads/kv heads/head dim of a Llama-3-8B-shaped
target by default) and the ratios upstream / short and upstream / split; `split other` is the
split prefix with its partial kernel on the warp count the plan does not pick (4 <-> 8), and
`short / split` says whether splitting pays against the short tile alone. The outputs are
compared too: each changes the work, not the attention.

With --fa3 (FA3 staged: specpatch.gpu_host.fa3_stage), each row also times FA3's tree verify as
sglang's FlashAttention backend runs it (fa3_cascade.py: a prefix pass, an expand pass and a
merge) and variants of it: the prefix pass alone, the prefix pass with the draft rows attended
and merged in one triton launch (fa3_tree_expand.py, what the series runs by default), one
split (num_splits 1), GQA packing forced (pack_gqa), and the prefix pass's tile schedule made once (scheduler_metadata, as sglang does
for decode only), and a prefix page table far wider than the prefixes (as when the table's
rows are sized from bounds); `fa3 / split` compares sglang's cascade with the series' triton verify.

With --flashinfer, FlashInfer's masked verify as sglang's backend ran it, its unmasked prefix
pass alone, and the cascade the series runs (flashinfer_tree_cascade.py): the prefix pass and
the same triton merge. The mask is a chain (rows see up to draft-tokens draft tokens) unless
--tree-steps N gives each request a random tree's paths of at most N steps, as a verify of
topk > 1 sees them.
"""

from __future__ import annotations

import argparse
import json

import fa3_cascade
import flashinfer_verify
import torch
import triton.testing

from sglang.srt.layers.attention import triton_short_extend, triton_split_prefix
from sglang.srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd


def verify_batch(bs, prefix_len, draft_tokens, heads, kv_heads, dim, dev="cuda"):
    """A verify of bs requests with prefix_len tokens each in scattered KV slots and a chain
    (causal) mask over draft_tokens rows; what extend_attention_fwd takes."""
    dt = torch.bfloat16
    pool = bs * prefix_len + 1024
    n = bs * draft_tokens
    mask_rows = [
        torch.cat(
            [
                torch.ones(draft_tokens, prefix_len, dtype=torch.bool, device=dev),
                torch.ones(draft_tokens, draft_tokens, device=dev).tril().bool(),
            ],
            dim=1,
        ).flatten()
    ] * bs
    return dict(
        q_extend=torch.randn(n, heads, dim, device=dev, dtype=dt),
        k_extend=torch.randn(n, kv_heads, dim, device=dev, dtype=dt),
        v_extend=torch.randn(n, kv_heads, dim, device=dev, dtype=dt),
        o_extend=torch.empty(n, heads, dim, device=dev, dtype=dt),
        k_buffer=torch.randn(pool, kv_heads, dim, device=dev, dtype=dt),
        v_buffer=torch.randn(pool, kv_heads, dim, device=dev, dtype=dt),
        qo_indptr=torch.arange(0, n + 1, draft_tokens, device=dev, dtype=torch.int32),
        kv_indptr=torch.arange(
            0, bs * prefix_len + 1, prefix_len, device=dev, dtype=torch.int32
        ),
        kv_indices=torch.randperm(pool, device=dev)[: bs * prefix_len],
        custom_mask=torch.cat(mask_rows),
        is_causal=True,
        mask_indptr=torch.arange(
            0,
            bs * draft_tokens * (prefix_len + draft_tokens) + 1,
            draft_tokens * (prefix_len + draft_tokens),
            device=dev,
            dtype=torch.int64,
        ),
        max_len_extend=draft_tokens,
        k_scale=1.0,
        v_scale=1.0,
    )


def random_tree(draft_tokens: int, steps: int, seed: int = 0) -> list[int]:
    """parents[j] of an EAGLE-like tree of draft_tokens nodes (-1 for the root, node 0), each
    node at most `steps` below the root, parents before their children: what a topk > 1
    verify's rows see is a node's ancestors and itself, at most steps + 1 draft tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    parents, depth = [-1], [0]
    for _ in range(1, draft_tokens):
        open_nodes = [i for i, d in enumerate(depth) if d < steps]
        parent = open_nodes[int(torch.randint(len(open_nodes), (1,), generator=gen))]
        parents.append(parent)
        depth.append(depth[parent] + 1)
    return parents


def with_tree_mask(batch: dict, parents: list[int]) -> dict:
    """The batch's extend blocks replaced by a tree's: draft token j sees itself and its
    ancestors (parents[j], -1 for the root)."""
    draft = len(parents)
    visible = torch.zeros(draft, draft, dtype=torch.bool)
    for j in range(draft):
        node = j
        while node >= 0:
            visible[j, node] = True
            node = parents[node]
    bs = batch["qo_indptr"].shape[0] - 1
    masks = batch["custom_mask"].view(bs, draft, -1).clone()
    masks[:, :, -draft:] = visible.to(masks.device)
    return dict(batch, custom_mask=masks.flatten(), is_causal=False)


PLANNED_WARPS = triton_split_prefix.partial_warps


def other_warps(tile_rows: int) -> int:
    return 12 - PLANNED_WARPS(tile_rows)


def time_us(
    args: dict, short_tile: bool, split_prefix: bool, warps=PLANNED_WARPS
) -> tuple[float, torch.Tensor]:
    triton_short_extend._ENABLED = short_tile
    triton_split_prefix._ENABLED = split_prefix
    triton_split_prefix.partial_warps = warps
    fn = lambda: extend_attention_fwd(**args)  # noqa: E731
    fn()
    # Replayed from a CUDA graph, as the server's verify is: a plain loop would time the
    # host's launches (two for the split prefix), not the GPU's work.
    us = triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3
    return us, args["o_extend"].clone()


# A prefix page table as wide as a long context's, for rows whose lengths are much shorter:
# sglang's FA3 CUDA graphs capture the verify with page-table rows of the context length.
WIDE_PREFIX_TABLE = 8192


def time_graphed_us(fn) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3


def fa3_row(args: dict, expected: torch.Tensor) -> dict:
    """Microseconds per layer of FA3's cascade and its variants on the batch `args`, each
    checked against the triton verify's output `expected`."""
    inputs = fa3_cascade.cascade_inputs(args)
    variants = {
        "fa3_us": {},
        "fa3_num_splits_1_us": {"num_splits": 1},
        "fa3_pack_gqa_us": {"pack_gqa": True},
        "fa3_scheduler_metadata_us": {
            "scheduler_metadata": fa3_cascade.prefix_scheduler_metadata(inputs)
        },
    }
    row = {}
    for name, kwargs in variants.items():
        out = fa3_cascade.run_cascade(inputs, **kwargs)
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
        row[name] = time_graphed_us(lambda: fa3_cascade.run_cascade(inputs, **kwargs))
    out = fa3_cascade.run_cascade(inputs, triton_expand=True)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    row["fa3_triton_expand_us"] = time_graphed_us(
        lambda: fa3_cascade.run_cascade(inputs, triton_expand=True)
    )
    row["fa3_prefix_pass_us"] = time_graphed_us(
        lambda: fa3_cascade.run_cascade(inputs, prefix_only=True)
    )
    wide = fa3_cascade.with_wide_prefix_table(inputs, WIDE_PREFIX_TABLE)
    torch.testing.assert_close(
        fa3_cascade.run_cascade(wide), expected, atol=2e-2, rtol=2e-2
    )
    row["fa3_wide_table_us"] = time_graphed_us(lambda: fa3_cascade.run_cascade(wide))
    row["fa3_wide_table_num_splits_1_us"] = time_graphed_us(
        lambda: fa3_cascade.run_cascade(wide, num_splits=1)
    )
    return row


def flashinfer_row(args: dict, expected: torch.Tensor) -> dict:
    """Microseconds per layer of FlashInfer's masked verify, its unmasked prefix pass and the
    cascade, the two full ones checked against the triton verify's output `expected`."""
    inputs = fa3_cascade.cascade_inputs(args)
    verify = flashinfer_verify.flashinfer_verify(inputs, args["custom_mask"])
    row = {}
    checked = [
        ("flashinfer_us", verify.masked_pass),
        ("flashinfer_cascade_us", verify.cascade),
        ("flashinfer_graph_cascade_us", verify.graph_cascade),
    ]
    checked += [
        (f"flashinfer_rows{n}_cascade_us", fn)
        for n, fn in verify.rows_split_cascade.items()
    ]
    for name, fn in checked:
        torch.testing.assert_close(fn(), expected, atol=2e-2, rtol=2e-2)
        row[name] = time_graphed_us(fn)
    row["flashinfer_prefix_pass_us"] = time_graphed_us(verify.prefix_pass)
    row["flashinfer_graph_prefix_pass_us"] = time_graphed_us(verify.graph_prefix_pass)
    for n, fn in verify.rows_split_prefix_pass.items():
        row[f"flashinfer_rows{n}_prefix_pass_us"] = time_graphed_us(fn)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-sizes", default="1,16,48,64")
    p.add_argument("--draft-tokens", default="2,4,8,32")
    p.add_argument("--prefix-lens", default="128,256,1024,4096")
    p.add_argument("--heads", default="32,8,128", help="query heads, kv heads, dim")
    p.add_argument("--fa3", action="store_true", help="also FA3's cascade verify")
    p.add_argument(
        "--flashinfer", action="store_true", help="also FlashInfer's masked verify"
    )
    p.add_argument(
        "--tree-steps",
        type=int,
        default=0,
        help="draft rows see a random tree's paths of at most this many steps (0: a chain)",
    )
    p.add_argument("--out")
    a = p.parse_args()
    heads, kv_heads, dim = (int(x) for x in a.heads.split(","))
    rows = []
    print(
        f"{'bs':>4} {'prefix':>6} {'draft':>5} {'upstream us':>12} {'short us':>9} "
        f"{'split us':>9} {'split other':>11} {'short':>6} {'split':>6} {'short / split':>13}"
    )
    for prefix_len in (int(x) for x in a.prefix_lens.split(",")):
        for bs in (int(x) for x in a.batch_sizes.split(",")):
            for draft_tokens in (int(x) for x in a.draft_tokens.split(",")):
                args = verify_batch(bs, prefix_len, draft_tokens, heads, kv_heads, dim)
                if a.tree_steps:
                    parents = random_tree(draft_tokens, a.tree_steps)
                    args = with_tree_mask(args, parents)
                upstream, out_upstream = time_us(args, False, False)
                short, out_short = time_us(args, True, False)
                split, out_split = time_us(args, True, True)
                split_other, out_other = time_us(args, True, True, other_warps)
                for out in (out_short, out_split, out_other):
                    torch.testing.assert_close(out, out_upstream, atol=2e-2, rtol=2e-2)
                rows.append(
                    dict(
                        bs=bs,
                        prefix_len=prefix_len,
                        draft_tokens=draft_tokens,
                        upstream_us=upstream,
                        short_us=short,
                        split_us=split,
                        split_other_warps_us=split_other,
                    )
                )
                if a.fa3:
                    rows[-1].update(fa3_row(args, out_upstream))
                if a.flashinfer:
                    rows[-1].update(flashinfer_row(args, out_upstream))
                print(
                    f"{bs:>4} {prefix_len:>6} {draft_tokens:>5} {upstream:>12.1f} "
                    f"{short:>9.1f} {split:>9.1f} {split_other:>11.1f} "
                    f"{upstream / short:>5.2f}x {upstream / split:>5.2f}x "
                    f"{short / split:>12.2f}x",
                    flush=True,
                )
                if a.fa3:
                    r = rows[-1]
                    print(
                        f"      fa3 cascade {r['fa3_us']:.1f} us (prefix pass "
                        f"{r['fa3_prefix_pass_us']:.1f}; with the triton expand "
                        f"{r['fa3_triton_expand_us']:.1f}), num_splits 1 "
                        f"{r['fa3_num_splits_1_us']:.1f}, pack_gqa {r['fa3_pack_gqa_us']:.1f}, "
                        f"scheduler metadata {r['fa3_scheduler_metadata_us']:.1f}, "
                        f"{WIDE_PREFIX_TABLE}-wide table {r['fa3_wide_table_us']:.1f} "
                        f"(num_splits 1 {r['fa3_wide_table_num_splits_1_us']:.1f}); "
                        f"fa3 / split {r['fa3_us'] / split:.2f}x, fa3 with the triton "
                        f"expand / split {r['fa3_triton_expand_us'] / split:.2f}x",
                        flush=True,
                    )
                if a.flashinfer:
                    r = rows[-1]
                    print(
                        f"      flashinfer masked {r['flashinfer_us']:.1f} us (prefix pass "
                        f"{r['flashinfer_prefix_pass_us']:.1f}; cascade with the triton "
                        f"expand {r['flashinfer_cascade_us']:.1f}); flashinfer / split "
                        f"{r['flashinfer_us'] / split:.2f}x, cascade / masked "
                        f"{r['flashinfer_cascade_us'] / r['flashinfer_us']:.2f}x",
                        flush=True,
                    )
                    rows_split = ", ".join(
                        f"{n} pieces {r[f'flashinfer_rows{n}_cascade_us']:.1f} (prefix "
                        f"pass {r[f'flashinfer_rows{n}_prefix_pass_us']:.1f})"
                        for n in (2, 4, 8)
                        if f"flashinfer_rows{n}_cascade_us" in r
                    )
                    print(
                        f"      flashinfer graphed cascade {r['flashinfer_graph_cascade_us']:.1f}"
                        f" us (prefix pass {r['flashinfer_graph_prefix_pass_us']:.1f}); rows "
                        f"split, unsplit KV: {rows_split}",
                        flush=True,
                    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
