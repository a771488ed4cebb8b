"""plain_decode_kernels' triton kernels against their plain-torch references
(plain_decode_kernel_cases.py): on CPU through triton's interpreter, and on CUDA."""

from __future__ import annotations

from pathlib import Path

import plain_decode_kernel_cases as cases
import pytest
import torch
from triton.backends import BaseBackend
from triton.runtime.jit import create_function_from_signature

from sglang.srt.speculative import plain_decode_kernels as kernels
from sglang.srt.speculative.plain_decode_kernels import (
    compile_kernels,
    decode_inputs_triton,
    push_rows_triton,
)
from sglang.srt.speculative.plain_decode_steps import DraftRowRing
from specpatch.testing.interpret import interpreter_suite
from specpatch.testing.sm90_compile import launches_compile_for_sm90

HERE = Path(__file__).resolve().parent
IDS = [c.name for c in cases.CASES]
NAMES = [
    f"test_{kernel}_kernel_matches_reference[{name}]"
    for kernel in ("decode_inputs", "push_rows")
    for name in IDS
]


interpreter_run, test_under_interpreter = interpreter_suite(
    HERE / "plain_decode_kernel_cases.py", NAMES
)


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases.CASES, ids=IDS)
def test_decode_inputs_kernel_matches_reference_on_cuda(case):
    cases.check_decode_inputs(case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases.CASES, ids=IDS)
def test_push_rows_kernel_matches_reference_on_cuda(case):
    cases.check_push_rows(case, "cuda")


@pytest.mark.parametrize("case", cases.CASES, ids=IDS)
def test_kernels_compile_for_sm90(case):
    """Triton's compiler, which the interpreter does not run, takes each case's types."""
    req_to_token, slots, seq_lens, bonus = cases._batch(case, "cpu")
    hidden = torch.zeros(case.bs, case.hidden_size, dtype=case.hidden_dtype)
    ring = cases._rings(case, cases.num_slots_of(case), torch.Generator())
    with launches_compile_for_sm90() as compiled:
        decode_inputs_triton(req_to_token, slots, seq_lens, bonus)
        push_rows_triton(*ring, slots, hidden, torch.zeros_like(slots))
    assert compiled == ["_decode_inputs_kernel", "_push_rows_kernel"]


def launch_keys(monkeypatch) -> list[tuple]:
    """Each launch of the two kernels from now on, as (kernel, Triton's specialisation key),
    in launch order; nothing runs."""
    keys = []
    for name in ("_decode_inputs_kernel", "_push_rows_kernel"):
        kernel = getattr(kernels, name)
        binder = create_function_from_signature(
            kernel.signature, kernel.params, BaseBackend
        )

        def launch(*args, name=name, binder=binder, **kwargs):
            keys.append((name, tuple(binder(*args, **kwargs)[1])))

        monkeypatch.setattr(kernels, name, _Launcher(launch))
    return keys


class _Launcher:
    """kernel[grid](...) that hands the launch to `launch` instead."""

    def __init__(self, launch):
        self._launch = launch

    def __getitem__(self, grid):
        return self._launch


# sglang's sampler: int32 token ids for a sampled batch, int64 (argmax) for a greedy one.
@pytest.mark.parametrize(
    "token_dtype", [torch.int32, torch.int64], ids=["sampled", "greedy"]
)
def test_start_up_compiles_every_variant_a_none_step_launches(monkeypatch, token_dtype):
    """compile_kernels, run at start-up, launches each kernel with the specialisation keys a
    `none` step's launches have, whatever the batch size (1, a multiple of 16, the rest),
    the slices' alignment and the sampler's token dtype: the server's first `none` steps
    compile nothing (each compile held the batch about 50 ms)."""
    ring = DraftRowRing.allocate(9, 4, 96, torch.bfloat16, torch.device("cpu"))
    req_to_token = torch.zeros(9, 128, dtype=torch.int32)
    keys = launch_keys(monkeypatch)
    compile_kernels(req_to_token, ring.hidden, ring.tokens, ring.lag)
    compiled = set(keys)
    assert {name for name, _ in compiled} == {
        "_decode_inputs_kernel",
        "_push_rows_kernel",
    }
    keys.clear()
    for bs in (1, 3, 8, 16):
        slots = torch.arange(1, bs + 1)
        seq_lens = torch.arange(bs) + 7
        # The batch's hidden states and tokens as slices of wider tensors (row 1 on): not
        # 16-byte aligned where a row is not.
        hidden = torch.zeros(bs + 1, 96, dtype=torch.bfloat16)[1:]
        tokens = torch.zeros(bs + 1, dtype=token_dtype)[1:]
        decode_inputs_triton(req_to_token, slots, seq_lens, tokens)
        push_rows_triton(ring.hidden, ring.tokens, ring.lag, slots, hidden, tokens)
    assert len(keys) == 8
    assert set(keys) <= compiled, "a none step launches a variant start-up did not"
