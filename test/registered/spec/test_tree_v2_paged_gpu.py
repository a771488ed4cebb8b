"""Spec v2 tree drafting with --page-size > 1 on triton, flashinfer and fa3
(docs/paged-trees.md), on the GPU.

The synthetic target's greedy continuation is its bigram table, so "identical to the table" is
token identity with no-spec (see test_tree_v2_gpu). Every test id starts with its attention
backend and names its page size, so -k selects by backend and page size; each of these groups
starts at most three engines (one per test):
    -k "paged_tree_v2 and triton and page4"      -k "paged_tree_v2 and triton and page16"
    -k "paged_tree_v2 and triton and page64"     -k "paged_retraction and triton"
    -k "paged_radix and triton"                  -k "paged_tree_v2 and flashinfer"
    -k "paged_retraction and flashinfer"         -k "paged_tree_v2 and fa3"
    -k "paged_retraction and fa3"                -k "paged_radix and fa3"
    -k "paged_canary"
(one page size on flashinfer: -k "paged_tree_v2 and flashinfer and page16").
"""

from __future__ import annotations

import pytest
from test_tree_v2_gpu import (
    FA3_SKIP,
    FLASHINFER_SKIP,
    check_identity_across_batch_sizes,
)

from specpatch.testing import engine as eng
from specpatch.testing import synth

pytestmark = pytest.mark.gpu

MAX_NEW_TOKENS = 64

# backend x page size x (topk, steps, draft tokens) x CUDA graphs. triton: every page size with
# topk 4, 8 and 16 among its three, each page size eager once. flashinfer plans pages of one
# token, so it reads the flat layout as triton does: one shape per page size, the widest tree
# graphed. fa3 reads a page table, of pages of one token on spec v2 trees: one shape per page
# size, graphed where users run it and eager once. The prefixes of the random prompts (8..64 tokens) end mid-page and at page
# boundaries, and 64 new tokens cross pages at every size.
PAGED_SHAPES = [
    ("triton", 4, eng.SpecConfig(4, 3, 8), True),
    ("triton", 4, eng.SpecConfig(8, 3, 16), False),
    ("triton", 4, eng.SpecConfig(16, 3, 32), True),
    ("triton", 16, eng.SpecConfig(4, 3, 8), False),
    ("triton", 16, eng.SpecConfig(8, 5, 32), True),
    ("triton", 16, eng.SpecConfig(16, 3, 64), True),
    ("triton", 64, eng.SpecConfig(4, 5, 16), True),
    ("triton", 64, eng.SpecConfig(8, 3, 16), True),
    ("triton", 64, eng.SpecConfig(16, 3, 32), False),
    ("flashinfer", 4, eng.SpecConfig(8, 3, 16), False),
    ("flashinfer", 16, eng.SpecConfig(16, 3, 32), True),
    ("flashinfer", 64, eng.SpecConfig(4, 3, 8), True),
    ("fa3", 4, eng.SpecConfig(8, 3, 16), True),
    ("fa3", 16, eng.SpecConfig(16, 3, 32), True),
    ("fa3", 64, eng.SpecConfig(4, 3, 8), False),
]


def _shape_id(
    backend: str, page_size: int, spec: eng.SpecConfig, cuda_graph: bool
) -> str:
    mode = "graph" if cuda_graph else "eager"
    return f"{backend}-page{page_size}-{spec.label}-{mode}"


def _backend_case(*values, case_id: str):
    """One parameter set whose first value is its attention backend: flashinfer's cases skip
    where its JIT kernels cannot run, fa3's where sgl_kernel has no FA3 library."""
    marks = {"flashinfer": [FLASHINFER_SKIP], "fa3": [FA3_SKIP]}.get(values[0], [])
    return pytest.param(*values, id=case_id, marks=marks)


@pytest.fixture(scope="module")
def prompts(toy_pair):
    vocab = synth.load_meta(toy_pair[0])["spec"]["vocab"]
    return eng.random_prompts(48, vocab, seed=3)


@pytest.mark.parametrize(
    "backend,page_size,spec,cuda_graph",
    [_backend_case(*shape, case_id=_shape_id(*shape)) for shape in PAGED_SHAPES],
)
def test_paged_tree_v2_is_token_identical_to_no_spec(
    toy_pair, prompts, backend, page_size, spec, cuda_graph, record_metric
):
    check_identity_across_batch_sizes(
        toy_pair,
        prompts,
        spec,
        cuda_graph,
        record_metric,
        page_size=page_size,
        attention_backend=backend,
    )


RETRACTION_CASES = [
    ("triton", eng.SpecConfig(4, 3, 8)),
    ("triton", eng.SpecConfig(16, 3, 32)),
    ("flashinfer", eng.SpecConfig(4, 3, 8)),
    ("fa3", eng.SpecConfig(16, 3, 32)),
]


@pytest.mark.parametrize(
    "backend,spec",
    [
        _backend_case(backend, spec, case_id=f"{backend}-page16-{spec.label}")
        for backend, spec in RETRACTION_CASES
    ],
)
def test_paged_retraction_keeps_identity_and_leaks_nothing(
    toy_pair, capfd, record_metric, backend, spec
):
    """256 concurrent requests on a KV pool that holds a fraction of them, page 16: retraction
    frees a request's pages mid-tree, and the idle leak check (on by default, raising) counts
    every page when the pool drains."""
    target, draft = toy_pair
    vocab = synth.load_meta(target)["spec"]["vocab"]
    many = eng.random_prompts(256, vocab, seed=7, min_len=16, max_len=96)
    expected = synth.table_continuations(target, many, 128)
    kwargs = eng.engine_kwargs(
        target,
        draft,
        spec,
        max_running_requests=256,
        max_total_tokens=12000,
        page_size=16,
        attention_backend=backend,
    )
    with eng.engine(**kwargs) as e:
        assert e.server_args.disable_overlap_schedule is False, "fell back to spec v1"
        run = eng.generate(e, many, 128)
        # Idle again: the scheduler's leak check has run on the drained pool.
        eng.generate(e, many[:1], 4)
    eng.assert_identical(run, expected, "paged retract stress")
    log = capfd.readouterr()
    text = log.out + log.err
    retractions = text.count("KV cache pool is full. Retract requests.")
    record_metric("retraction_events", retractions)
    record_metric("accept_length", round(run.accept_length, 3))
    assert retractions > 0, "the pool was large enough: the stress test did not retract"
    eng.assert_no_leak_reported(text)


RADIX_CASES = [("triton", 16), ("triton", 64), ("fa3", 16)]


@pytest.mark.parametrize(
    "backend,page_size",
    [
        _backend_case(backend, page_size, case_id=f"{backend}-page{page_size}")
        for backend, page_size in RADIX_CASES
    ],
)
def test_paged_radix_reuse_of_prefixes_longer_than_a_page(
    toy_pair, capfd, record_metric, backend, page_size
):
    """Requests sharing a prefix of several pages: the second round reads it from the radix
    cache (page-aligned), drafts a tree right after it, and stays identical."""
    target, draft = toy_pair
    vocab = synth.load_meta(target)["spec"]["vocab"]
    shared_len = 3 * page_size + 5  # ends mid-page
    [shared] = eng.random_prompts(
        1, vocab, seed=11, min_len=shared_len, max_len=shared_len
    )
    tails = eng.random_prompts(16, vocab, seed=12, min_len=1, max_len=2 * page_size)
    prompts = [shared + tail for tail in tails]
    expected = synth.table_continuations(target, prompts, MAX_NEW_TOKENS)
    kwargs = eng.engine_kwargs(
        target,
        draft,
        eng.SpecConfig(8, 3, 16),
        page_size=page_size,
        attention_backend=backend,
    )
    with eng.engine(**kwargs) as e:
        assert e.server_args.disable_overlap_schedule is False, "fell back to spec v1"
        first = eng.generate(e, prompts[:1], MAX_NEW_TOKENS)
        again = eng.generate(e, prompts, MAX_NEW_TOKENS)
    eng.assert_identical(first, expected[:1], "first request")
    eng.assert_identical(again, expected, "prefix-sharing requests")
    cached = [m.get("cached_tokens", 0) for m in again.meta]
    record_metric("cached_tokens", cached)
    aligned_prefix = len(shared) // page_size * page_size
    assert all(c >= aligned_prefix for c in cached), (aligned_prefix, cached)
    text = "".join(capfd.readouterr())
    eng.assert_no_leak_reported(text)


CANARY_BACKENDS = ["triton", "flashinfer", "fa3"]


@pytest.mark.parametrize(
    "backend",
    [_backend_case(b, case_id=f"{b}-page16") for b in CANARY_BACKENDS],
)
def test_paged_canary_raise_mode_sees_no_violation_under_retraction(
    toy_pair, capfd, monkeypatch, record_metric, backend
):
    """The KV canary in raise mode on a paged tree (page 16, tree 16,3,32) with retraction: every
    slot a target or draft forward reads holds what the request wrote there, across pages.
    """
    target, draft = toy_pair
    vocab = synth.load_meta(target)["spec"]["vocab"]
    many = eng.random_prompts(600, vocab, seed=13, min_len=8, max_len=80)
    expected = synth.table_continuations(target, many, 48)
    # The scheduler child inherits the environment at spawn.
    monkeypatch.setenv("SGLANG_KV_CANARY", "raise")
    kwargs = eng.engine_kwargs(
        target,
        draft,
        eng.SpecConfig(16, 3, 32),
        max_running_requests=64,
        max_total_tokens=6000,
        page_size=16,
        attention_backend=backend,
        log_level="info",
    )
    with eng.engine(**kwargs) as e:
        assert e.server_args.disable_overlap_schedule is False, "fell back to spec v1"
        run = eng.generate(e, many, 48)
    text = "".join(capfd.readouterr())
    violations = [line for line in text.splitlines() if "KV canary violation" in line]
    retractions = text.count("KV cache pool is full. Retract requests.")
    record_metric("canary_installs", text.count("KV canary on for"))
    record_metric("retraction_events", retractions)
    record_metric("violations", len(violations))
    assert text.count("KV canary on for") >= 2, "the canary is not on target and draft"
    assert retractions > 0, "the pool was large enough: the test did not retract"
    assert not violations, violations[:5]
    eng.assert_identical(run, expected, "paged canary")
