"""GPU smoke tests of the patched sglang on the synthetic pair: EAGLE chains and trees through
the Engine and through `python -m sglang.launch_server` over HTTP, the mission command
(`--speculative-eagle-topk 16 --page-size 1` on default flags) included."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import requests

from specpatch.testing import engine as eng
from specpatch.testing import synth
from specpatch.testing.marks import FLASHINFER_SKIP

pytestmark = pytest.mark.gpu

README = Path(__file__).resolve().parents[3] / "README.md"

NUM_PROMPTS, MAX_NEW_TOKENS = 32, 128
CHAIN = eng.SpecConfig(topk=1, num_steps=3, num_draft_tokens=4)


@pytest.fixture(scope="module")
def prompts(toy_pair):
    vocab = synth.load_meta(toy_pair[0])["spec"]["vocab"]
    return eng.random_prompts(NUM_PROMPTS, vocab, seed=1)


@pytest.fixture(scope="module")
def no_spec_run(toy_pair, prompts):
    target, _ = toy_pair
    with eng.engine(**eng.engine_kwargs(target, None, None)) as e:
        eng.generate(e, prompts[:4], 8)  # warm-up
        return eng.generate(e, prompts, MAX_NEW_TOKENS)


def test_no_spec_follows_the_bigram_table(
    toy_pair, prompts, no_spec_run, record_metric
):
    expected = synth.table_continuations(toy_pair[0], prompts, MAX_NEW_TOKENS)
    assert no_spec_run.output_ids == expected
    record_metric("no_spec_tok_per_s", round(no_spec_run.tok_per_s, 1))


def test_eagle_topk1_is_token_identical_to_no_spec(
    toy_pair, prompts, no_spec_run, record_metric
):
    target, draft = toy_pair
    with eng.engine(**eng.engine_kwargs(target, draft, CHAIN)) as e:
        eng.generate(e, prompts[:4], 8)
        run = eng.generate(e, prompts, MAX_NEW_TOKENS)
    identical = sum(a == b for a, b in zip(run.output_ids, no_spec_run.output_ids))
    agreement = synth.load_meta(draft)["agreement"]
    expected_accept = synth.expected_chain_accept_length(agreement, CHAIN.num_steps)
    record_metric("identical", f"{identical}/{NUM_PROMPTS}")
    record_metric("accept_length", round(run.accept_length, 3))
    record_metric("expected_accept_length", round(expected_accept, 3))
    record_metric("spec_tok_per_s", round(run.tok_per_s, 1))
    record_metric("no_spec_tok_per_s", round(no_spec_run.tok_per_s, 1))
    assert identical == NUM_PROMPTS, [
        eng.first_divergence(a, b)
        for a, b in zip(run.output_ids, no_spec_run.output_ids)
    ]
    assert abs(run.accept_length - expected_accept) <= 0.15 * expected_accept


@pytest.mark.parametrize(
    "spec,backend",
    [
        (eng.SpecConfig(4, 3, 8, overlap=False), "triton"),
        (eng.SpecConfig(1, 3, 4, overlap=False), "triton"),
        pytest.param(
            eng.SpecConfig(16, 3, 32, overlap=False),
            "flashinfer",
            marks=FLASHINFER_SKIP,
        ),
    ],
    ids=lambda value: getattr(value, "label", value),
)
def test_eagle_spec_v1_is_token_identical_to_no_spec(
    toy_pair, prompts, no_spec_run, spec, backend, record_metric
):
    """Spec v1 (where the hook sends trees it cannot run on v2) through the v1 verify path;
    on flashinfer the tree verify's plan is the host-planned one spec v2 uses too."""
    target, draft = toy_pair
    with eng.engine(
        **eng.engine_kwargs(target, draft, spec, attention_backend=backend)
    ) as e:
        eng.generate(e, prompts[:4], 8)
        run = eng.generate(e, prompts, MAX_NEW_TOKENS)
    identical = sum(a == b for a, b in zip(run.output_ids, no_spec_run.output_ids))
    record_metric("identical", f"{identical}/{NUM_PROMPTS}")
    record_metric("accept_length", round(run.accept_length, 3))
    record_metric("spec_tok_per_s", round(run.tok_per_s, 1))
    assert identical == NUM_PROMPTS
    assert 1.0 < run.accept_length <= spec.num_steps + 1


def generate_over_http(
    base: str, input_ids: list[list[int]], max_new_tokens: int
) -> list[dict]:
    """Greedy /generate of a batch of token-id prompts."""
    resp = requests.post(
        f"{base}/generate",
        json={
            "input_ids": input_ids,
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": max_new_tokens,
                "ignore_eos": True,
            },
        },
        timeout=120,
    )
    resp.raise_for_status()
    return resp.json()


@pytest.mark.parametrize(
    "spec", [CHAIN, eng.SpecConfig(16, 3, 32)], ids=lambda spec: spec.label
)
def test_http_server_with_eagle(toy_pair, prompts, spec, record_metric):
    """`launch_server ... --speculative-eagle-topk {1, 16} --page-size 1`, both on spec v2."""
    target, draft = toy_pair
    with eng.server(
        **eng.engine_kwargs(target, draft, spec, enable_metrics=True)
    ) as base:
        info = requests.get(f"{base}/server_info", timeout=10).json()
        assert info["disable_overlap_schedule"] is False, "fell back to spec v1"
        assert info["speculative_eagle_topk"] == spec.topk
        batch = prompts[:8]
        outs = generate_over_http(base, batch, 64)
        assert [o["output_ids"] for o in outs] == synth.table_continuations(
            target, batch, 64
        )
        assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
        metrics = requests.get(f"{base}/metrics", timeout=10).text
        assert "sglang:spec_accept_length" in metrics
        accept = [
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("sglang:spec_accept_length")
        ]
        record_metric("http_spec_accept_length_gauge", accept)


def readme_curl(base: str) -> list[str]:
    """The README's demo request ("Serving the demo pair"), sent to `base` instead of
    localhost:30000."""
    line = next(
        ln.strip()
        for ln in README.read_text().splitlines()
        if ln.strip().startswith("curl localhost:30000/generate")
    )
    return shlex.split(line.replace("localhost:30000", base.removeprefix("http://")))


@FLASHINFER_SKIP
def test_mission_command_runs_spec_v2_trees_on_default_flags(
    toy_pair, prompts, record_metric
):
    """`launch_server --speculative-algorithm EAGLE --speculative-eagle-topk 16 --page-size 1`
    as users write it: no steps, no draft-token count, no attention backend. Besides the model
    paths it passes what the synthetic pair and the GPU bundle need: no tokenizer files, a KV
    pool sized for a tiny model, the bundle's sampling and grammar backends. sglang picks
    flashinfer for it; on Hopper the tree gets triton instead (default_tree_attention_backend).
    """
    from sglang.srt.utils import is_hopper_with_cuda_12_3

    target, draft = toy_pair
    flags = dict(
        model_path=str(target),
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=str(draft),
        speculative_eagle_topk=16,
        page_size=1,
        skip_tokenizer_init=True,
        max_total_tokens=1 << 18,
        sampling_backend="pytorch",
        grammar_backend="none",
    )
    with eng.server(**flags) as base:
        info = requests.get(f"{base}/server_info", timeout=10).json()
        assert info["disable_overlap_schedule"] is False, "fell back to spec v1"
        shape = (
            info["speculative_eagle_topk"],
            info["speculative_num_steps"],
            info["speculative_num_draft_tokens"],
        )
        assert shape == (16, 3, 32)
        record_metric("attention_backend", info["attention_backend"])
        assert info["attention_backend"] == (
            "triton" if is_hopper_with_cuda_12_3() else "flashinfer"
        )
        batch = prompts[:8]
        outs = generate_over_http(base, batch, 64)
        # The README's curl, as a newcomer pastes it (the server answers 400 without the
        # JSON content type).
        assert shutil.which(
            "curl"
        ), "the GPU host has no curl to run the README's request"
        reply = subprocess.run(
            readme_curl(base), capture_output=True, text=True, timeout=60
        )
    assert reply.returncode == 0, reply.stderr
    readme_out = json.loads(reply.stdout)
    assert (
        readme_out["output_ids"]
        == synth.table_continuations(target, [[1, 2, 3]], 16)[0]
    ), reply.stdout
    assert [o["output_ids"] for o in outs] == synth.table_continuations(
        target, batch, 64
    )
    accept = [
        o["meta_info"]["completion_tokens"] / o["meta_info"]["spec_verify_ct"]
        for o in outs
    ]
    record_metric("accept_length", round(sum(accept) / len(accept), 3))
    assert min(accept) > 1.0
