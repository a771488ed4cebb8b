"""speculative/bounded_host_lens.py: where a spec v2 decode step may take bounds for its host
sequence lengths instead of waiting for the launched verify, and that the bounds hold."""

from __future__ import annotations

import json
import logging
import random
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.speculative import bounded_host_lens as bhl
from specpatch.testing import engine as eng
from specpatch.testing.marks import FA3_SKIP, FLASHINFER_SKIP


def server(**overrides):
    args = dict(
        attention_backend="triton",
        prefill_attention_backend=None,
        decode_attention_backend=None,
        speculative_draft_attention_backend=None,
        disable_cuda_graph=False,
        disable_cuda_graph_padding=False,
        page_size=1,
        enable_two_batch_overlap=False,
        enable_dp_attention=False,
        pp_size=1,
        cuda_graph_bs=None,
        cuda_graph_max_bs=64,
        speculative_adaptive=False,
    )
    args.update(overrides)
    return SimpleNamespace(**args)


class FakeBatch:
    """What batch_allows_bounds and set_host_seq_lens read of a ScheduleBatch."""

    def __init__(self, committed, device_lens, **overrides):
        self.reqs = [
            SimpleNamespace(kv_committed_len=n, multimodal_inputs=None)
            for n in committed
        ]
        self.seq_lens = torch.tensor(device_lens, dtype=torch.int64)
        self.return_logprob = False
        self.has_grammar = False
        self.sampling_info = SimpleNamespace(
            penalizer_orchestrator=SimpleNamespace(is_required=False)
        )
        self.req_to_token_pool = SimpleNamespace()
        self.spec_info = SimpleNamespace(verify_done=None)
        self.waited = 0
        for key, value in overrides.items():
            setattr(self, key, value)

    def batch_size(self):
        return len(self.reqs)

    def maybe_wait_verify_done(self):
        self.waited += 1


@pytest.fixture
def enabled(monkeypatch):
    monkeypatch.setattr(bhl, "_ENABLED", True)
    monkeypatch.setattr(bhl, "_bounds_issued", False)


def test_on_unless_the_env_says_0(monkeypatch):
    assert bhl.enabled_by_env({})
    assert bhl.enabled_by_env({bhl.ENV: "1"})
    assert not bhl.enabled_by_env({bhl.ENV: "0"})
    assert not bhl.requested_by_env({})
    assert bhl.requested_by_env({bhl.ENV: "1"})
    monkeypatch.setattr(bhl, "_ENABLED", False)
    assert not bhl.batch_allows_bounds(FakeBatch([5], [5]), server())


@pytest.mark.parametrize(
    "overrides,why",
    [
        ({"attention_backend": "torch_native"}, "torch_native"),
        ({"prefill_attention_backend": "torch_native"}, "torch_native"),
        ({"decode_attention_backend": "torch_native"}, "torch_native"),
        ({"speculative_draft_attention_backend": "torch_native"}, "torch_native"),
        ({"attention_backend": "flashinfer", "speculative_eagle_topk": 1}, "chains"),
        ({"disable_cuda_graph": True}, "no CUDA graphs"),
        ({"disable_cuda_graph_padding": True}, "padding"),
        ({"page_size": 16}, "page size 16"),
        ({"enable_two_batch_overlap": True}, "two-batch overlap"),
        ({"enable_dp_attention": True}, "DP attention"),
        ({"pp_size": 2}, "pipeline"),
        (
            {"speculative_adaptive": True, "speculative_adaptive_config": None},
            "--speculative-adaptive without a shape policy",
        ),
    ],
)
def test_servers_that_read_exact_host_lengths_keep_them(overrides, why):
    assert why in bhl.server_refusal(server(**overrides))


def test_fa3_and_flashinfer_trees_take_bounds_by_default_flashinfer_chains_when_asked(
    monkeypatch,
):
    """FA3, sglang's default for EAGLE chains on Hopper, takes bounds as triton does unless the
    switch says 0; FlashInfer takes them for trees by default and for chains only with the
    switch set to 1 (bounded_host_lens.TREES_ONLY_BACKENDS says why)."""
    monkeypatch.delenv(bhl.ENV, raising=False)
    assert bhl.server_refusal(server(attention_backend="fa3")) is None
    assert bhl.server_refusal(server(decode_attention_backend="fa3")) is None
    tree, chain = {"speculative_eagle_topk": 16}, {"speculative_eagle_topk": 1}
    assert bhl.server_refusal(server(attention_backend="flashinfer", **tree)) is None
    assert (
        bhl.server_refusal(
            server(
                attention_backend="fa3",
                speculative_draft_attention_backend="flashinfer",
                **tree,
            )
        )
        is None
    )
    for args in (
        {"attention_backend": "flashinfer", **chain},
        {"attention_backend": "flashinfer"},  # no topk given: a chain
        {"attention_backend": "fa3", "decode_attention_backend": "flashinfer", **chain},
    ):
        why = bhl.server_refusal(server(**args))
        assert why and f"{bhl.ENV}=1" in why and "flashinfer" in why, args
    assert bhl.server_refusal(server(attention_backend="fa3", **chain)) is None
    monkeypatch.setenv(bhl.ENV, "1")
    assert bhl.server_refusal(server(attention_backend="flashinfer", **chain)) is None
    assert "torch_native" in bhl.server_refusal(
        server(attention_backend="torch_native", **tree)
    )
    assert "page size 16" in bhl.server_refusal(
        server(attention_backend="fa3", page_size=16, **chain)
    )


@pytest.mark.parametrize("backend", ["triton", "fa3", "flashinfer"])
def test_trees_take_bounds_at_every_page_size_chains_at_page_size_1(
    monkeypatch, backend
):
    """Spec v2 lays a tree round out flat at every page size and each backend reads it by
    token slot or through pages of one token, so a paged tree takes bounds as at page size 1;
    a paged chain reads FA3's page table of real pages and keeps exact lengths."""
    monkeypatch.delenv(bhl.ENV, raising=False)
    tree, chain = {"speculative_eagle_topk": 16}, {"speculative_eagle_topk": 1}
    spec = dict(speculative_algorithm="EAGLE", disable_overlap_schedule=False)
    for page_size in (1, 4, 16, 64):
        paged_tree = server(attention_backend=backend, page_size=page_size, **tree)
        assert bhl.server_refusal(paged_tree) is None, page_size
        assert bhl.may_issue_bounds(
            server(attention_backend=backend, page_size=page_size, **tree, **spec)
        )
    monkeypatch.setenv(bhl.ENV, "1")  # flashinfer chains asked for bounds
    assert bhl.server_refusal(server(attention_backend=backend, **chain)) is None
    assert bhl.server_refusal(
        server(attention_backend=backend, page_size=16, **chain)
    ) == ("page size 16 with a chain")


@pytest.mark.parametrize(
    "shapes,backend,page_size,takes_bounds",
    [
        (["16,3,32", "1,3,4"], "flashinfer", 1, True),  # a tree in the set
        (["1,3,4", "1,1,2", "none"], "flashinfer", 1, False),  # chains only
        (["16,3,32", "4,3,8"], "fa3", 16, True),  # paged trees only
        (["16,3,32", "1,3,4"], "fa3", 16, False),  # a paged chain in the set
    ],
)
def test_a_shape_policy_answers_alike_for_every_running_shape(
    monkeypatch, enabled, tmp_path, shapes, backend, page_size, takes_bounds
):
    """The scheduler prepares a step, bounds included, before the worker picks its shape,
    and each shape's backends are built while the flags name that shape: whether bounds may
    be issued must not follow the running shape, or a step prepared under the tree runs on
    the chain's FlashInfer backends built for exact lengths (an illegal memory access).
    """
    monkeypatch.delenv(bhl.ENV, raising=False)
    config = tmp_path / "shape-policy.json"
    config.write_text(json.dumps({"shapes": shapes}))
    answers = set()
    for running_topk in (16, 4, 1):
        args = server(
            attention_backend=backend,
            page_size=page_size,
            speculative_algorithm="EAGLE",
            disable_overlap_schedule=False,
            speculative_adaptive=True,
            speculative_adaptive_config=str(config),
            speculative_eagle_topk=running_topk,
        )
        answers.add((bhl.server_refusal(args) is None, bhl.may_issue_bounds(args)))
    assert answers == {(takes_bounds, takes_bounds)}


def test_may_issue_bounds_only_for_spec_v2(monkeypatch, enabled):
    spec = dict(speculative_algorithm="EAGLE", disable_overlap_schedule=False)
    assert bhl.may_issue_bounds(server(**spec))
    assert not bhl.may_issue_bounds(server(**{**spec, "speculative_algorithm": None}))
    assert not bhl.may_issue_bounds(
        server(**{**spec, "disable_overlap_schedule": True})
    )
    assert not bhl.may_issue_bounds(server(**spec, page_size=16))
    monkeypatch.setattr(bhl, "_ENABLED", False)
    assert not bhl.may_issue_bounds(server(**spec))


def test_triton_with_graphs_may_take_bounds(tmp_path):
    assert bhl.server_refusal(server()) is None
    policy = tmp_path / "policy.json"
    policy.write_text('{"shapes": ["16,3,32", "1,3,4"]}')
    assert (
        bhl.server_refusal(
            server(speculative_adaptive=True, speculative_adaptive_config=str(policy))
        )
        is None
    )
    assert (
        bhl.server_refusal(server(speculative_draft_attention_backend="triton")) is None
    )
    assert bhl.graph_batch_limit(server()) == 64
    assert bhl.graph_batch_limit(server(cuda_graph_bs=[1, 2, 4, 24])) == 24


@pytest.mark.parametrize(
    "overrides",
    [
        {"return_logprob": True},
        {"has_grammar": True},
        {
            "sampling_info": SimpleNamespace(
                penalizer_orchestrator=SimpleNamespace(is_required=True)
            )
        },
        {"req_to_token_pool": SimpleNamespace(mamba_pool=object())},
    ],
    ids=["logprobs", "grammar", "penalizers", "mamba"],
)
def test_steps_that_read_exact_host_lengths_keep_them(enabled, overrides):
    assert bhl.batch_allows_bounds(FakeBatch([5, 9], [4, 8]), server())
    assert not bhl.batch_allows_bounds(FakeBatch([5, 9], [4, 8], **overrides), server())


def test_multimodal_inputs_and_batches_past_the_graphs_keep_exact_lengths(enabled):
    batch = FakeBatch([5, 9], [4, 8])
    batch.reqs[1].multimodal_inputs = object()
    assert not bhl.batch_allows_bounds(batch, server())
    assert not bhl.batch_allows_bounds(FakeBatch([5] * 65, [4] * 65), server())
    assert bhl.batch_allows_bounds(FakeBatch([5] * 64, [4] * 64), server())


@pytest.mark.parametrize(
    "env,refusal_level", [({}, logging.INFO), ({bhl.ENV: "1"}, logging.WARNING)]
)
def test_the_log_says_once_whether_the_switch_takes_effect(
    enabled, caplog, monkeypatch, env, refusal_level
):
    monkeypatch.setattr(bhl, "_logged", set())
    monkeypatch.delenv(bhl.ENV, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    caplog.set_level(logging.INFO, logger=bhl.logger.name)
    for _ in range(3):
        bhl.set_host_seq_lens(FakeBatch([5], [4]), 4, server(page_size=16))
    for _ in range(3):
        bhl.set_host_seq_lens(FakeBatch([5], [4]), 4, server())
    # A refusal is a warning only for a user who asked for bounds.
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (refusal_level, f"{bhl.KEEPS_EXACT_LENS}: page size 16 with a chain"),
        (logging.INFO, bhl.BOUNDS_IN_USE),
    ]


def test_bounds_do_not_wait_and_cover_the_device_lengths(enabled):
    # Committed lengths after this step's pre-claim; the launched step committed 1 and 4.
    batch = FakeBatch([12, 30], [11, 31])
    bhl.set_host_seq_lens(batch, max_step_tokens=4, server_args=server())
    assert batch.waited == 0
    assert batch.seq_lens_cpu.tolist() == [16, 34] and batch.seq_lens_sum == 50
    assert (batch.seq_lens_cpu >= batch.seq_lens).all()


def test_without_bounds_the_host_waits_and_copies_exactly(monkeypatch):
    monkeypatch.setattr(bhl, "_ENABLED", False)
    batch = FakeBatch([12, 30], [11, 31])
    bhl.set_host_seq_lens(batch, max_step_tokens=4, server_args=server())
    assert batch.waited == 1
    assert batch.seq_lens_cpu.tolist() == [11, 31] and batch.seq_lens_sum == 42


def test_bounds_order_the_stream_after_the_verify_on_the_device(enabled, monkeypatch):
    waits = []
    stream = SimpleNamespace(wait_event=waits.append)
    device = SimpleNamespace(current_stream=lambda: stream)
    monkeypatch.setattr(bhl.torch, "get_device_module", lambda: device)
    event = object()
    batch = FakeBatch([3], [2], spec_info=SimpleNamespace(verify_done=event))
    bhl.set_host_seq_lens(batch, max_step_tokens=2, server_args=server())
    assert waits == [event] and batch.waited == 0


@pytest.mark.parametrize("seed", range(5))
def test_bounds_hold_over_a_run_of_the_overlap_schedulers_bookkeeping(seed):
    """The scheduler's bookkeeping as spec v2 keeps it: prepare_for_decode pre-claims one slot
    per step, the result of a step is processed one iteration later (+ accept - 1), and a
    step commits 1 .. max_step_tokens tokens. The bound at each prepare covers the length
    entering that step, by at most 2 + max_step_tokens - 1."""
    rng = random.Random(seed)
    max_step_tokens = 4
    committed, seq_len = 37, 37  # just after prefill
    unprocessed = None  # accept length of the launched step, not processed yet
    for _ in range(200):
        committed += 1  # prepare: pre-claim this step's bonus slot
        bound = int(bhl.seq_len_bounds([committed], max_step_tokens)[0])
        assert seq_len <= bound <= seq_len + max_step_tokens + 1
        accept = rng.randint(
            1, max_step_tokens
        )  # launch: the step will commit this many
        if unprocessed is not None:
            committed += unprocessed - 1  # process the previous step's result
        seq_len += accept
        unprocessed = accept


def test_the_eager_draft_extend_reads_prefix_lengths_from_the_device(
    enabled, monkeypatch
):
    device = torch.tensor([11, 31])
    # Switch on but no bounds issued yet (or ever, on a refused server): no sync.
    assert bhl.exact_prefix_lens(device, [11, 31]) == [11, 31]
    bhl.set_host_seq_lens(FakeBatch([12, 30], [11, 31]), 4, server())
    assert bhl._bounds_issued
    assert bhl.exact_prefix_lens(device, [16, 34]) == [11, 31]


# ----------------------------------------------------------------------------- on a GPU

# Triton and fa3 take bounds by default; flashinfer only with the switch set to 1.
BACKENDS = [
    "triton",
    pytest.param("flashinfer", marks=FLASHINFER_SKIP),
    pytest.param("fa3", marks=FA3_SKIP),
]


CHAIN_AND_WIDE_TREE = pytest.mark.parametrize(
    "spec",
    [eng.SpecConfig(1, 3, 4), eng.SpecConfig(16, 3, 32)],
    ids=lambda s: s.label,
)


def ask_for_bounds(monkeypatch, backend: str, topk: int) -> None:
    """The switch as a user of `backend` gets bounds: unset (the default), or 1 for a chain on
    a backend that takes bounds for trees only (the engine's processes read it at start-up).
    """
    if backend in bhl.TREES_ONLY_BACKENDS and topk <= 1:
        monkeypatch.setenv(bhl.ENV, "1")
    else:
        monkeypatch.delenv(bhl.ENV, raising=False)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@CHAIN_AND_WIDE_TREE
def test_servers_with_bounded_host_lengths_stay_token_identical(
    small_pair, spec, backend, monkeypatch, record_metric, capfd
):
    """Spec v2 with CUDA graphs and host lengths as bounds, batches that shrink as requests
    finish: identical to the table. Triton reads the bounds as sizes, FlashInfer plans from
    them with the kernels' lengths rewritten on the device (docs/flashinfer-overlap.md), FA3
    copies page-table rows as wide as them."""
    ask_for_bounds(monkeypatch, backend, spec.topk)
    target, draft = small_pair
    accept = eng.spec_v2_identical_by_batch_size(
        target,
        draft,
        spec,
        (1, 4, 24),
        seed=11,
        log_level="info",
        attention_backend=backend,
    )
    record_metric("accept_length_by_bs", accept)
    assert all(a > 1.0 for a in accept.values()), accept
    assert bhl.BOUNDS_IN_USE in "".join(capfd.readouterr()), "bounds never applied"


# A context short enough that every request of the test below runs into it.
CONTEXT_LENGTH, PROMPT_LEN = 160, 124


@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend,lengths",
    [
        ("triton", "bounds"),
        pytest.param("flashinfer", "bounds", marks=FLASHINFER_SKIP),
        pytest.param("flashinfer", "exact", marks=FLASHINFER_SKIP),
        pytest.param("fa3", "bounds", marks=FA3_SKIP),
        pytest.param("fa3", "exact", marks=FA3_SKIP),
    ],
)
@CHAIN_AND_WIDE_TREE
def test_spec_v2_runs_to_the_context_length(
    small_pair, spec, backend, lengths, monkeypatch, capfd
):
    """Eight requests that generate until the context length stops them, at the graphs'
    largest batch. A step there reads up to its tokens past the context length, from
    req_to_token's extra columns, which FA3's page tables must be as wide as; and a bound
    passes every real length by up to a step's tokens, where FA3's copies of page-table rows
    must stop at a row's width (fa3_tree_metadata.page_table_columns). Exact lengths tell the
    bounds apart from what any spec v2 run meets there: FlashInfer's tree draft decode wrote
    past its slot buffer (flashinfer_host_plans.draft_decode_kv_slots).
    """
    from specpatch.testing import synth

    if lengths == "exact":
        monkeypatch.setenv(bhl.ENV, "0")
    else:
        ask_for_bounds(monkeypatch, backend, spec.topk)
    target, draft = small_pair
    vocab = synth.load_meta(target)["spec"]["vocab"]
    prompts = eng.random_prompts(
        8, vocab, min_len=PROMPT_LEN, max_len=PROMPT_LEN, seed=23
    )
    kwargs = eng.engine_kwargs(
        target,
        draft,
        spec,
        max_running_requests=8,
        cuda_graph_bs=[1, 2, 4, 8],
        context_length=CONTEXT_LENGTH,
        allow_auto_truncate=True,
        attention_backend=backend,
        log_level="info",
        # Upstream's piecewise-graph warm-up runs one request as long as its largest bucket
        # (8192 tokens), past a 160-token context: an illegal memory access on FA3 and
        # FlashInfer at start-up, with or without speculation (sgl-project/sglang#21112).
        disable_piecewise_cuda_graph=True,
    )
    with eng.engine(**kwargs) as e:
        run = eng.generate(e, prompts, CONTEXT_LENGTH - PROMPT_LEN)
    generated = [len(out) for out in run.output_ids]
    # The scheduler stops a request 2 tokens short of the context length.
    assert (
        min(generated) >= CONTEXT_LENGTH - PROMPT_LEN - 2 - spec.num_draft_tokens
    ), generated
    expected = [
        synth.table_continuations(target, [prompt], n)[0]
        for prompt, n in zip(prompts, generated)
    ]
    eng.assert_identical(run, expected, f"context length {CONTEXT_LENGTH}")
    bounds_applied = bhl.BOUNDS_IN_USE in "".join(capfd.readouterr())
    assert bounds_applied == (lengths == "bounds"), (lengths, bounds_applied)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.timeout(420)
def test_bounded_host_lengths_under_retraction_keep_identity_and_leak_nothing(
    toy_pair, backend, capfd, monkeypatch, record_metric
):
    """256 concurrent requests on a KV pool that holds a fraction of them: retraction,
    filter and merge all run on batches whose host lengths are bounds."""
    ask_for_bounds(monkeypatch, backend, topk=4)
    target, draft = toy_pair
    eng.retraction_stress(
        target,
        draft,
        eng.SpecConfig(4, 3, 8),
        log_level="info",
        attention_backend=backend,
    )
    text = "".join(capfd.readouterr())
    assert bhl.BOUNDS_IN_USE in text, "bounds never applied"
    retractions = text.count(eng.RETRACT_LOG_LINE)
    record_metric("retraction_events", retractions)
    assert retractions > 0, "the pool was large enough: the stress test did not retract"
    eng.assert_no_leak_reported(text)


@pytest.mark.gpu
@FLASHINFER_SKIP
@pytest.mark.parametrize(
    "bounds,tensor_cores",
    [("0", None), ("0", "true"), ("1", None)],
    ids=["exact", "exact-tensor-cores", "bounds"],
)
def test_flashinfer_unsplit_plans_stay_token_identical(
    small_pair, bounds, tensor_cores, monkeypatch, record_metric
):
    """SGLANG_FLASHINFER_SPEC_UNSPLIT_PLAN=1 (flashinfer_host_plans): each fixed-width graph
    planned once without split-KV, with exact host lengths and with bounds. The small pair's
    GQA group of 2 decodes off tensor cores unless told otherwise or given bounds; on them the
    draft decode is planned at capture only (draft_decode_planned_at_capture_only)."""
    monkeypatch.setenv("SGLANG_FLASHINFER_SPEC_UNSPLIT_PLAN", "1")
    monkeypatch.setenv(bhl.ENV, bounds)
    if tensor_cores is not None:
        monkeypatch.setenv("SGLANG_FLASHINFER_USE_TENSOR_CORE", tensor_cores)
    target, draft = small_pair
    accept = eng.spec_v2_identical_by_batch_size(
        target,
        draft,
        eng.SpecConfig(16, 3, 32),
        (1, 4, 24),
        seed=17,
        attention_backend="flashinfer",
    )
    record_metric("accept_length_by_bs", accept)
    assert all(a > 1.0 for a in accept.values()), accept
