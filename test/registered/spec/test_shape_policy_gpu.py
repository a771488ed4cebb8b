"""The speculation shape policy on the GPU (docs/shape-policy.md): token identity with no
speculation while the shape switches every few decode steps, retraction under switching, and
the policy's own choice, on the synthetic pair."""

from __future__ import annotations

import json
import re

import pytest
import requests

from specpatch.testing import engine as eng
from specpatch.testing import synth
from specpatch.testing.marks import FA3_SKIP, TREE_BACKENDS, TWO_GPUS

pytestmark = pytest.mark.gpu

MAX_NEW_TOKENS = 64
BATCH_SIZES = (1, 8, 48)
WIDE = eng.SpecConfig(16, 3, 32)  # the flags' shape: the first one run
# 1,1,2 verifies one draft token that the draft extend already predicted: no draft forward.
SHAPES = ["16,3,32", "4,3,8", "1,3,4", "1,1,2"]
SWITCH = re.compile(r"Speculation shape (\S+) -> (\S+) at bs (\d+)")


@pytest.fixture(scope="module")
def prompts(toy_pair):
    vocab = synth.load_meta(toy_pair[0])["spec"]["vocab"]
    return eng.random_prompts(max(BATCH_SIZES), vocab, seed=3)


def policy_kwargs(tmp_path, target, draft, shapes=SHAPES, **config_and_engine):
    config = {"shapes": shapes}
    for key in ("force_switch_every", "patience", "margin", "step_time", "trace"):
        if key in config_and_engine:
            config[key] = config_and_engine.pop(key)
    path = tmp_path / "shape-policy.json"
    path.write_text(json.dumps(config))
    return eng.engine_kwargs(
        target,
        draft,
        WIDE,
        speculative_adaptive=True,
        speculative_adaptive_config=str(path),
        log_level="info",
        **config_and_engine,
    )


def switches(text: str) -> list[tuple[str, str, int]]:
    return [(a, b, int(bs)) for a, b, bs in SWITCH.findall(text)]


@pytest.mark.parametrize("backend", TREE_BACKENDS)
@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graph", "eager"])
def test_forced_switches_keep_token_identity(
    toy_pair, prompts, tmp_path, capfd, record_metric, backend, cuda_graph
):
    """Every 3 decode steps the next shape of 16,3,32 -> 4,3,8 -> 1,3,4 -> 1,1,2: the carried
    top-k, the reserved KV and each shape's graphs must make every switch invisible in the
    output."""
    if not cuda_graph and backend != "triton":
        pytest.skip("eager switching is covered on triton; graphs on every backend")
    target, draft = toy_pair
    expected = synth.table_continuations(target, prompts, MAX_NEW_TOKENS)
    kwargs = policy_kwargs(
        tmp_path,
        target,
        draft,
        force_switch_every=3,
        attention_backend=backend,
        cuda_graph=cuda_graph,
    )
    with eng.engine(**kwargs) as e:
        assert e.server_args.disable_overlap_schedule is False, "fell back to spec v1"
        assert e.server_args.speculative_adaptive is True
        accept = eng.identical_by_batch_size(e, prompts, expected, BATCH_SIZES, backend)
    seen = switches("".join(capfd.readouterr()))
    record_metric("accept_length_by_bs", accept)
    record_metric("switches", len(seen))
    assert {(a, b) for a, b, _ in seen} == set(zip(SHAPES, SHAPES[1:] + SHAPES[:1]))
    assert all(1.0 < a <= 4.0 for a in accept.values()), accept


@pytest.mark.parametrize("backend", ["triton", pytest.param("fa3", marks=FA3_SKIP)])
@pytest.mark.parametrize(
    "shapes,every",
    [
        (["16,3,32", "none", "1,3,4"], 3),
        # A `none` run longer than the draft's ring (32 rows): it catches up inside the run.
        (["none", "16,3,32"], 40),
    ],
    ids=["short-runs", "run-past-the-ring"],
)
def test_forced_switches_through_none_keep_token_identity(
    toy_pair, prompts, tmp_path, capfd, record_metric, backend, shapes, every
):
    """Steps without speculation (plain_decode_steps) between speculating ones: the target's
    DECODE graphs, the draft rows owed and caught up, must leave the output the target's.
    """
    target, draft = toy_pair
    expected = synth.table_continuations(target, prompts, MAX_NEW_TOKENS)
    kwargs = policy_kwargs(
        tmp_path,
        target,
        draft,
        shapes=shapes,
        force_switch_every=every,
        attention_backend=backend,
    )
    with eng.engine(**kwargs) as e:
        accept = eng.identical_by_batch_size(e, prompts, expected, BATCH_SIZES, backend)
    seen = switches("".join(capfd.readouterr()))
    record_metric("accept_length_by_bs", accept)
    assert any(b == "none" for _, b, _ in seen), "no step ran without speculation"
    assert any(a == "none" for a, _, _ in seen), "speculation never resumed"


# The kernels a `none` step launches around its DECODE graph (plain_decode_kernels).
NONE_STEP_KERNELS = {"_decode_inputs_kernel", "_push_rows_kernel"}


def compiles_while_serving(
    toy_pair, prompts, tmp_path, shapes: list[str], kernels: set[str]
) -> tuple[int, list[tuple]]:
    """Serve greedy batches at bs 1, 8 and 48 (sizes the graphs were captured at) under
    forced switches among `shapes`, with the policy's trace: the `none` steps taken, and
    (step, variant) of each of `kernels` compiled or loaded after the trace's first line
    (which carries what start-up compiled)."""
    target, draft = toy_pair
    trace = tmp_path / "trace.jsonl"
    kwargs = policy_kwargs(
        tmp_path,
        target,
        draft,
        shapes=shapes,
        force_switch_every=3,
        trace=str(trace),
    )
    with eng.engine(**kwargs) as e:
        for bs in BATCH_SIZES:
            eng.generate(e, prompts[:bs], MAX_NEW_TOKENS)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    none_steps = sum(line.get("shape") == "none" for line in lines)
    late = [
        (line.get("step"), label)
        for line in lines[1:]
        for label, _ in line.get("compiles", ())
        if label.split("[")[0] in kernels
    ]
    return none_steps, late


def test_none_steps_compile_none_of_their_kernels_while_serving(
    toy_pair, prompts, tmp_path, record_metric
):
    """The server compiles (or loads) the kernels of its `none` steps at start-up: no line
    of the policy's trace after the first lists one, at any batch size. Greedy only: a
    sampled batch's int32 token ids are covered by test_plain_decode_kernels'
    specialisation keys, and on a cold GPU host spec v2's sampling kernels take minutes to
    compile (test_tree_v2_sampling_completes...)."""
    none_steps, late = compiles_while_serving(
        toy_pair, prompts, tmp_path, ["16,3,32", "none", "1,3,4"], NONE_STEP_KERNELS
    )
    record_metric("none_steps", none_steps)
    assert none_steps > 0, "no step ran without speculation"
    assert late == [], f"compiled while serving: {late}"


def test_draft_replays_compile_no_kv_index_kernel_while_serving(
    toy_pair, prompts, tmp_path
):
    """Each shape's draft-decode graphs were captured with their buffers' int32 seq_lens;
    a replay at a batch that fills a captured size exactly used to hand the KV-index kernel
    the batch's int64 ones instead, a compile per power-of-two bucket and shape in the
    middle of serving (the triton-eager-kernels-compiled-once patch)."""
    _, late = compiles_while_serving(
        toy_pair,
        prompts,
        tmp_path,
        ["16,3,32", "4,3,8", "1,3,4"],
        {"generate_draft_decode_kv_indices"},
    )
    assert late == [], f"compiled while serving: {late}"


@pytest.mark.parametrize(
    "shapes", [SHAPES, SHAPES + ["none"]], ids=["speculating", "with-none"]
)
def test_retraction_under_switching_keeps_identity_and_leaks_nothing(
    toy_pair, tmp_path, capfd, record_metric, shapes
):
    """With "none" in the set, requests are retracted and re-prefilled while they owe the
    draft rows (plain_decode_steps): a re-prefill must start them owing nothing."""
    target, draft = toy_pair
    vocab = synth.load_meta(target)["spec"]["vocab"]
    many = eng.random_prompts(256, vocab, seed=7, min_len=16, max_len=96)
    expected = synth.table_continuations(target, many, 128)
    kwargs = policy_kwargs(
        tmp_path,
        target,
        draft,
        shapes=shapes,
        force_switch_every=2,
        max_running_requests=256,
        max_total_tokens=12000,
    )
    with eng.engine(**kwargs) as e:
        run = eng.generate(e, many, 128)
    eng.assert_identical(run, expected, "retraction under switching")
    text = "".join(capfd.readouterr())
    retractions = text.count("KV cache pool is full. Retract requests.")
    record_metric("retraction_events", retractions)
    record_metric("switches", len(switches(text)))
    assert retractions > 0, "the pool was large enough: nothing retracted"
    assert switches(text), "no shape switch happened"
    eng.assert_no_leak_reported(text)


@pytest.mark.parametrize("step_time", ["span", "period"])
def test_the_policy_chooses_by_batch_size_and_keeps_identity(
    toy_pair, prompts, tmp_path, capfd, record_metric, step_time
):
    """Unforced: whatever the policy picks, outputs stay identical; the picks are recorded.
    With "period" each step's time starts at the end of the step before (device events
    across steps, reset by the prefills in between)."""
    target, draft = toy_pair
    expected = synth.table_continuations(target, prompts, 256)
    kwargs = policy_kwargs(tmp_path, target, draft, patience=2, step_time=step_time)
    with eng.engine(**kwargs) as e:
        for bs in (1, 48, 1):
            run = eng.generate(e, prompts[:bs], 256)
            eng.assert_identical(run, expected[:bs], f"bs {bs}")
    seen = switches("".join(capfd.readouterr()))
    record_metric("switches", [f"{a}->{b}@{bs}" for a, b, bs in seen][:20])


def test_server_exports_shape_metrics(toy_pair, prompts, tmp_path, record_metric):
    target, draft = toy_pair
    kwargs = policy_kwargs(tmp_path, target, draft, force_switch_every=2)
    kwargs.update(enable_metrics=True)
    kwargs.pop("log_level", None)
    with eng.server(**kwargs) as base:
        requests.post(
            f"{base}/generate",
            json={
                "input_ids": prompts[:4],
                "sampling_params": {"max_new_tokens": 96, "temperature": 0},
            },
            timeout=120,
        ).raise_for_status()
        metrics = requests.get(f"{base}/metrics", timeout=10).text
    steps = re.findall(r'sglang:spec_shape_steps_total\{[^}]*shape="([^"]+)"', metrics)
    record_metric("shapes_exported", sorted(set(steps)))
    assert set(steps) == set(SHAPES)
    assert re.search(r"sglang:spec_shape_switches_total\{[^}]*\} [1-9]", metrics)


@TWO_GPUS
def test_tp2_with_given_step_costs_chooses_alike_on_both_ranks(
    toy_pair, prompts, tmp_path, capfd, record_metric
):
    """Given step costs make every rank's choice the same; a rank on another shape would
    hang in the collectives, so finishing identical is the check."""
    target, draft = toy_pair
    expected = synth.table_continuations(target, prompts, MAX_NEW_TOKENS)
    path = tmp_path / "shape-policy.json"
    path.write_text(
        json.dumps(
            {
                "shapes": SHAPES[:3],
                "patience": 2,
                # Crossovers within the run's batch sizes: the wide tree at bs 1, the chain at 48.
                "step_costs": {
                    "16,3,32": {"1": 0.004, "8": 0.006, "48": 0.020},
                    "4,3,8": {"1": 0.0045, "8": 0.005, "48": 0.009},
                    "1,3,4": {"1": 0.005, "8": 0.0052, "48": 0.0065},
                },
            }
        )
    )
    kwargs = eng.engine_kwargs(
        target,
        draft,
        WIDE,
        tp_size=2,
        speculative_adaptive=True,
        speculative_adaptive_config=str(path),
        log_level="info",
    )
    with eng.engine(**kwargs) as e:
        for bs in BATCH_SIZES:
            run = eng.generate(e, prompts[:bs], MAX_NEW_TOKENS)
            eng.assert_identical(run, expected[:bs], f"tp2 bs {bs}")
    seen = switches("".join(capfd.readouterr()))
    record_metric("switches", [f"{a}->{b}@{bs}" for a, b, bs in seen][:20])
    assert seen, "the given costs should have switched shapes between bs 1 and 48"
