"""The KV canary inside a running server: EAGLE spec v2 (chain and tree) on the synthetic pair,
and STANDALONE and EAGLE3 drafts, whose draft-pool token offset comes from their worker's
draft extend (kv_canary/draft_feed.py).

The scheduler runs in a child process, so the tests read its log (captured at the file
descriptor level) and set the canary's environment before the Engine starts.
"""

from __future__ import annotations

import os
import random
import re
from contextlib import contextmanager

import pytest

from specpatch.testing import engine as eng
from specpatch.testing import synth

pytestmark = pytest.mark.gpu

VIOLATION = "KV canary violation"


@contextmanager
def canary_env(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.mark.parametrize("deferred", ["0", "1"], ids=["sync-drain", "deferred-drain"])
@pytest.mark.parametrize(
    "spec", [eng.SpecConfig(1, 3, 4), eng.SpecConfig(16, 3, 32)], ids=lambda s: s.label
)
def test_raise_mode_sees_no_violation_in_2000_requests_with_retraction(
    toy_pair, capfd, spec, deferred, record_metric
):
    target, draft = toy_pair
    vocab = synth.load_meta(target)["spec"]["vocab"]
    prompts = eng.random_prompts(2000, vocab, seed=11, min_len=8, max_len=80)
    expected = synth.table_continuations(target, prompts, 48)
    # A chain reserves so little KV per request that admission control alone avoids running out;
    # the scheduler's test switch retracts on purpose then.
    forced = {"SGLANG_TEST_RETRACT": "1"} if spec.topk == 1 else {}
    with canary_env(
        SGLANG_KV_CANARY="raise", SGLANG_KV_CANARY_DEFERRED_DRAIN=deferred, **forced
    ):
        kwargs = eng.engine_kwargs(
            target,
            draft,
            spec,
            max_running_requests=64,
            max_total_tokens=6000,
            log_level="info",
        )
        with eng.engine(**kwargs) as e:
            assert e.server_args.disable_overlap_schedule is False
            run = eng.generate(e, prompts, 48)
    text = "".join(capfd.readouterr())
    installed = text.count("KV canary on for")
    retractions = text.count("KV cache pool is full. Retract requests.") + text.count(
        "Testing retraction."
    )
    record_metric("canary_installs", installed)
    record_metric("retraction_events", retractions)
    record_metric("violations", text.count(VIOLATION))
    assert (
        installed >= 2
    ), "the canary was not installed on the target and draft runners"
    assert retractions > 0, "no retraction happened"
    assert VIOLATION not in text, [
        line for line in text.splitlines() if VIOLATION in line
    ][:5]
    assert run.output_ids == expected


@pytest.mark.parametrize("deferred", ["0", "1"], ids=["sync-drain", "deferred-drain"])
@pytest.mark.parametrize(
    "fault", ["corrupt_slot", "misroute_req_to_token", "free_in_use"]
)
@pytest.mark.parametrize("spec", [eng.SpecConfig(16, 3, 32)], ids=lambda s: s.label)
def test_each_injected_fault_is_detected(
    toy_pair, capfd, fault, spec, deferred, record_metric
):
    target, draft = toy_pair
    vocab = synth.load_meta(target)["spec"]["vocab"]
    prompts = eng.random_prompts(16, vocab, seed=5, min_len=16, max_len=48)
    with canary_env(
        SGLANG_KV_CANARY="log",
        SGLANG_KV_CANARY_FAULT=fault,
        SGLANG_KV_CANARY_FAULT_STEP=20,
        SGLANG_KV_CANARY_DEFERRED_DRAIN=deferred,
    ):
        # Eager: the fault path is the same, and the start-up is a fraction of a captured one.
        with eng.engine(
            **eng.engine_kwargs(target, draft, spec, log_level="info", cuda_graph=False)
        ) as e:
            eng.generate(e, prompts, 64)
    text = "".join(capfd.readouterr())
    lines = [line for line in text.splitlines() if VIOLATION in line]
    record_metric("violation_lines", len(lines))
    record_metric("first_violation", lines[0][-300:] if lines else None)
    assert re.search(r"inject", text, re.IGNORECASE), "the fault was never injected"
    assert lines, f"fault {fault} was injected but not detected"


def test_http_server_serves_canary_stats(toy_pair):
    """`launch_server --kv-canary log`: GET /kv_canary_stats reports checks and no violations."""
    import requests

    target, draft = toy_pair
    vocab = synth.load_meta(target)["spec"]["vocab"]
    prompts = eng.random_prompts(8, vocab, seed=2)
    kwargs = eng.engine_kwargs(
        target, draft, eng.SpecConfig(16, 3, 32), kv_canary="log"
    )
    with eng.server(**kwargs) as base:
        resp = requests.post(
            f"{base}/generate",
            json={
                "input_ids": prompts,
                "sampling_params": {
                    "temperature": 0,
                    "max_new_tokens": 32,
                    "ignore_eos": True,
                },
            },
            timeout=120,
        )
        resp.raise_for_status()
        [stats] = requests.get(f"{base}/kv_canary_stats", timeout=10).json()[
            "schedulers"
        ]
    assert stats["checks_total"] > 0 and stats["forwards_checked"] > 0
    assert stats["violations_total"] == 0
    assert set(stats["checks_by_group"]) >= {"target", "draft step 0"}


# The pair each algorithm drafts with: an ordinary Llama LM for STANDALONE (the Llama target's
# head rows moved, specpatch.testing.synth_standalone), an EAGLE3 head on a dense Qwen3 target.
PAIR_FIXTURES = {"STANDALONE": "standalone_pair", "EAGLE3": "qwen3_eagle3_pair"}
DRAFT_OFFSET_1 = re.compile(
    r"KV canary on for draft: mode=\w+ identity=\w+ token_offset=1 "
)


@pytest.mark.parametrize(
    "spec", [eng.SpecConfig(1, 3, 4), eng.SpecConfig(4, 3, 8)], ids=lambda s: s.label
)
@pytest.mark.parametrize("algorithm", sorted(PAIR_FIXTURES))
def test_raise_mode_sees_no_violation_in_600_requests_with_retraction_for_standalone_and_eagle3(
    request, capfd, algorithm, spec, record_metric
):
    """Raise mode would stop the server at the first violation: a wrong draft offset (STANDALONE
    used to get 0) reports every draft read of a healthy server."""
    target, draft = request.getfixturevalue(PAIR_FIXTURES[algorithm])
    vocab = synth.load_meta(target)["spec"]["vocab"]
    prompts = eng.random_prompts(600, vocab, seed=13, min_len=8, max_len=80)
    expected = synth.table_continuations(target, prompts, 48)
    # Retract on purpose too: a small KV pool alone may not run out with a chain.
    with canary_env(SGLANG_KV_CANARY="raise", SGLANG_TEST_RETRACT="1"):
        kwargs = eng.engine_kwargs(
            target,
            draft,
            spec,
            speculative_algorithm=algorithm,
            max_running_requests=64,
            max_total_tokens=6000,
            log_level="info",
        )
        with eng.engine(**kwargs) as e:
            assert e.server_args.disable_overlap_schedule is False
            run = eng.generate(e, prompts, 48)
    text = "".join(capfd.readouterr())
    retractions = text.count("KV cache pool is full. Retract requests.") + text.count(
        "Testing retraction."
    )
    record_metric("retraction_events", retractions)
    record_metric("violations", text.count(VIOLATION))
    record_metric("accept_length", round(run.accept_length, 3))
    assert (
        "KV canary on for target" in text
    ), "the canary was not installed on the target runner"
    assert DRAFT_OFFSET_1.search(
        text
    ), "the draft runner's canary was not installed with token offset 1"
    assert retractions > 0, "no retraction happened"
    assert VIOLATION not in text, [
        line for line in text.splitlines() if VIOLATION in line
    ][:5]
    assert run.output_ids == expected


def _prompts_sharing_their_first_tokens(
    vocab: int, *, groups: int, per_group: int, seed: int
) -> list[list[int]]:
    """Groups of prompts that share their first 1, 2 or 3 tokens and nothing after."""
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        head = [rng.randrange(vocab) for _ in range(1 + g % 3)]
        prompts += [
            head + [rng.randrange(vocab) for _ in range(rng.randint(8, 40))]
            for _ in range(per_group)
        ]
    return prompts


@pytest.mark.parametrize("algorithm", sorted(PAIR_FIXTURES))
def test_raise_mode_sees_no_violation_when_prompts_share_their_first_tokens(
    request, capfd, algorithm, record_metric
):
    """Prompts of one prefill that share a first token write position 0 each, and
    cache_unfinished_req points all but one at the first one's slot. STANDALONE's draft KV at
    p holds token p + 1 (EAGLE's draft extend), so with single-token radix keys the others'
    draft read another prompt's second token there (prefix_cache_keys: bigram keys). A second wave
    on the same heads is admitted on top of the cached prefixes."""
    target, draft = request.getfixturevalue(PAIR_FIXTURES[algorithm])
    vocab = synth.load_meta(target)["spec"]["vocab"]
    first = _prompts_sharing_their_first_tokens(vocab, groups=9, per_group=4, seed=21)
    # Each first-wave prompt's first half, then a token other than the one it had there.
    second = [p[: len(p) // 2] + [(p[len(p) // 2] + 1) % vocab] for p in first]
    waves = [first, second]
    with canary_env(SGLANG_KV_CANARY="raise"):
        kwargs = eng.engine_kwargs(
            target,
            draft,
            eng.SpecConfig(4, 3, 8),
            speculative_algorithm=algorithm,
            log_level="info",
        )
        with eng.engine(**kwargs) as e:
            runs = [eng.generate(e, wave, 32) for wave in waves]
    text = "".join(capfd.readouterr())
    record_metric("violations", text.count(VIOLATION))
    assert VIOLATION not in text, [
        line for line in text.splitlines() if VIOLATION in line
    ][:5]
    assert re.search(r"#cached-token: [1-9]", text), "no prefill reused a cached prefix"
    for i, (run, wave) in enumerate(zip(runs, waves)):
        eng.assert_identical(
            run, synth.table_continuations(target, wave, 32), f"wave {i}"
        )


@pytest.mark.parametrize(
    "fault", ["corrupt_slot", "misroute_req_to_token", "free_in_use"]
)
@pytest.mark.parametrize("algorithm", sorted(PAIR_FIXTURES))
def test_each_injected_fault_is_detected_for_standalone_and_eagle3(
    request, capfd, algorithm, fault, record_metric
):
    target, draft = request.getfixturevalue(PAIR_FIXTURES[algorithm])
    vocab = synth.load_meta(target)["spec"]["vocab"]
    prompts = eng.random_prompts(16, vocab, seed=5, min_len=16, max_len=48)
    with canary_env(
        SGLANG_KV_CANARY="log",
        SGLANG_KV_CANARY_FAULT=fault,
        SGLANG_KV_CANARY_FAULT_STEP=20,
    ):
        # Eager: the fault path is the same, and the start-up is a fraction of a captured one.
        kwargs = eng.engine_kwargs(
            target,
            draft,
            eng.SpecConfig(4, 3, 8),
            speculative_algorithm=algorithm,
            log_level="info",
            cuda_graph=False,
        )
        with eng.engine(**kwargs) as e:
            eng.generate(e, prompts, 64)
    lines = "".join(capfd.readouterr()).splitlines()
    injected = [i for i, line in enumerate(lines) if "KV canary fault injected" in line]
    found = [i for i, line in enumerate(lines) if VIOLATION in line]
    record_metric("violation_lines", len(found))
    record_metric("first_violation", lines[found[0]][-300:] if found else None)
    assert injected, "the fault was never injected"
    assert found, f"fault {fault} was injected but not detected"
    # Nothing before the fault: a healthy server's draft reads are clean.
    assert found[0] > injected[0], lines[found[0]]
    victim = re.search(r"row (\d+) pos (\d+) slot", lines[injected[0]])
    assert any(
        f"row={victim[1]} pos={victim[2]} " in lines[i] for i in found
    ), "the victim was never reported"
