"""Host time of FlashInfer's spec v2 plans, measured on the CPU.

Times the Python that runs on the host between two CUDA-graph replays of a spec v2 decode step
on flashinfer (page size 1): the tree verify's and draft extend's prefill plans
(flashinfer_host_plans.plan_fixed_width, FlashInfer's BatchPrefillWithPagedKVCacheWrapper.plan
inside it) and the draft decode's index pointers and fast_decode_plan. No GPU: FlashInfer's
compiled planner (the module's `plan`) and the triton launches are replaced by stubs that return
at once, so the numbers are the Python around them; device tensors are CPU tensors.

    python benchmark/spec/host_plan_cpu.py --batch-sizes 1,4,16,48 --width 32 --topk 16
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import timeit
from types import SimpleNamespace

import torch


@contextlib.contextmanager
def cpu_flashinfer():
    """Lets FlashInfer's wrappers live on the CPU: no pinned memory, a stub planner module."""
    import flashinfer.decode as fi_decode
    import flashinfer.prefill as fi_prefill

    module = SimpleNamespace(plan=lambda *args: [0] * 16)
    real_empty = torch.empty
    saved = (
        fi_prefill.get_batch_prefill_module,
        (
            fi_decode.get_batch_decode_module
            if hasattr(fi_decode, "get_batch_decode_module")
            else None
        ),
        torch.cuda.device,
    )

    def empty(*args, pin_memory=False, **kwargs):
        return real_empty(*args, **kwargs)

    torch.empty = empty
    fi_prefill.get_batch_prefill_module = lambda *args: module
    torch.cuda.device = lambda device: contextlib.nullcontext()
    try:
        yield module
    finally:
        torch.empty = real_empty
        fi_prefill.get_batch_prefill_module = saved[0]
        torch.cuda.device = saved[2]


def graph_prefill_wrapper(bs: int, kv_slots: int, mask_bytes: int):
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper

    return BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(1 << 20, dtype=torch.uint8),
        "NHD",
        backend="fa2",
        use_cuda_graph=True,
        qo_indptr_buf=torch.zeros(bs + 1, dtype=torch.int32),
        paged_kv_indptr_buf=torch.zeros(bs + 1, dtype=torch.int32),
        paged_kv_indices_buf=torch.zeros(kv_slots, dtype=torch.int32),
        paged_kv_last_page_len_buf=torch.ones(bs, dtype=torch.int32),
        custom_mask_buf=torch.zeros(mask_bytes, dtype=torch.uint8),
        mask_indptr_buf=torch.zeros(bs + 1, dtype=torch.int32),
    )


def us_per_call(fn, number: int) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def time_batch(
    plans, bs: int, width: int, topk: int, steps: int, seq_len: int, number: int
):
    from flashinfer.page import get_seq_lens

    gen = torch.Generator().manual_seed(bs)
    seq_lens = torch.randint(seq_len - 40, seq_len + 40, (bs,), generator=gen)
    kv_lens = seq_lens + width
    kv_slots = int(kv_lens.sum()) + 64
    mask_bits = width * kv_slots
    heads = plans.HeadConfig(32, 8, 128, torch.bfloat16, torch.bfloat16)
    req_to_token = torch.arange(bs * 1024, dtype=torch.int32).view(bs, 1024)
    req_pool_indices = torch.arange(bs)
    custom_mask = torch.ones(mask_bits, dtype=torch.bool)
    indptr_buf = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indices_buf = torch.zeros(kv_slots, dtype=torch.int32)
    rows = {}
    with cpu_flashinfer():
        wrapper = graph_prefill_wrapper(bs, kv_slots, mask_bits // 8 + bs)
        indptrs = plans.fixed_width_indptrs(kv_lens, width)
        kv_indices = kv_indices_buf[: int(indptrs.kv_indptr[-1])]
        ones = torch.ones(bs, dtype=torch.int32)

        def upstream_plan():
            wrapper.begin_forward(
                indptrs.qo_indptr,
                indptrs.kv_indptr,
                kv_indices,
                ones,
                heads.num_qo_heads,
                heads.num_kv_heads,
                heads.head_dim,
                1,
                q_data_type=heads.q_data_type,
                kv_data_type=heads.kv_data_type,
                non_blocking=True,
            )

        def plan(mask):
            plans.plan_fixed_width(
                wrapper,
                heads,
                width=width,
                req_pool_indices=req_pool_indices,
                kv_lens=kv_lens,
                kv_lens_cpu=kv_lens,
                req_to_token=req_to_token,
                kv_indptr_buf=indptr_buf,
                kv_indices_buf=kv_indices_buf,
                custom_mask=mask,
            )

        rows["fixed_width_indptrs"] = us_per_call(
            lambda: plans.fixed_width_indptrs(
                plans.fixed_width_kv_lens(kv_lens, width), width
            ),
            number,
        )
        rows["get_seq_lens"] = us_per_call(
            lambda: get_seq_lens(indptrs.kv_indptr, ones, 1), number
        )
        rows["wrapper.plan (python)"] = us_per_call(upstream_plan, number)
        if hasattr(plans, "plan_paged_prefill"):
            rows["plan_paged_prefill"] = us_per_call(
                lambda: plans.plan_paged_prefill(
                    wrapper, heads, indptrs, width, kv_indices
                ),
                number,
            )
        rows["plan_fixed_width verify"] = us_per_call(lambda: plan(custom_mask), number)
        rows["plan_fixed_width extend"] = us_per_call(lambda: plan(None), number)
        rows["draft_decode_indptrs"] = us_per_call(
            lambda: plans.draft_decode_indptrs(seq_lens, topk, steps), number
        )
    return rows


def load_plans(path: str | None):
    """The installed flashinfer_host_plans, or another version of it (e.g. main's) by path."""
    import importlib.util

    if path is None:
        from sglang.srt.layers.attention import flashinfer_host_plans

        return flashinfer_host_plans
    spec = importlib.util.spec_from_file_location("host_plans_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def patch_launches(plans):
    """Triton launches and FlashInfer's mask packing return at once (their host cost is a
    launch on the GPU, not measured here)."""
    import importlib

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    plans.create_flashinfer_kv_indices_triton = NoLaunch()
    packbits = importlib.import_module("flashinfer.quantization.packbits")
    packbits.get_quantization_module = lambda: SimpleNamespace(
        segment_packbits=lambda *args: None
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,4,16,48")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--topk", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=300)
    parser.add_argument("--number", type=int, default=200)
    parser.add_argument(
        "--host-plans",
        default=None,
        help="path of a flashinfer_host_plans.py to time instead of the installed one",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    plans = load_plans(args.host_plans)
    patch_launches(plans)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    table = {
        bs: time_batch(
            plans, bs, args.width, args.topk, args.steps, args.seq_len, args.number
        )
        for bs in sizes
    }
    names = list(next(iter(table.values())))
    print("host us per call | " + " | ".join(f"bs {bs}" for bs in sizes))
    for name in names:
        print(f"{name} | " + " | ".join(f"{table[bs][name]:.1f}" for bs in sizes))


if __name__ == "__main__":
    main()
