"""Multi-layer EAGLE (MTP) on the GPU, on the synthetic Step-3.5 checkpoint
(specpatch.testing.synth_mtp): its target is a bigram table, its three MTP layers draft a chain.

How sglang 0.5.12.post1 runs it, and so the flags here:
- `--speculative-algorithm EAGLE` on a Step3p5ForCausalLM target: ServerArgs turns
  enable_multi_layer_eagle on by itself. No draft path, as Step-3.5-Flash is served: the draft
  worker loads the target's checkpoint as Step3p5MTP, one ModelRunner per step (its own KV pool
  and attention backend: the spec-multi-layer-eagle-per-step-pools patch), step k on checkpoint
  layer 45 + k.
- topk 1, 3 steps, 4 draft tokens: one draft token per MTP layer. Steps may not outnumber
  num_nextn_predict_layers (3), and the multi-layer workers draft chains (trees run spec v1).
- Spec v2: with topk 1 and the overlap scheduler on (the default) this is
  MultiLayerEagleWorkerV2, what users get; --disable-overlap-schedule gives the spec v1
  MultiLayerEagleWorker, which the spec-multi-layer-eagle-per-step-pools patch edits too
  (before it, v1 could not even be imported).
  Spec v1 has no draft-extend CUDA graphs (speculative/multi_layer_v1_draft_extend.py:
  upstream's were spec v2's and never captured, so v1 + CUDA graphs died on its first decode);
  with CUDA graphs on only its target replays graphs.
- `--attention-backend fa3`: sglang's own choice on Hopper for topk 1 (_get_default_attn_backend),
  so what a Step-3.5 user gets there; one triton case runs where FA3 is not staged. That case is
  spec v2 without CUDA graphs: sglang's triton backend builds no sliding-window KV indices for
  draft extend, eager on spec v1 or in spec v2's draft-extend graph, so the MTP layers' extend
  kernel got None (a triton CompilationError at graph capture) and the speculative hook now
  refuses those combinations (check_sliding_window_draft_extend); spec v2's eager draft extend
  is planned as a plain extend, which builds them.
- Piecewise CUDA graphs (the target's prefill, torch.compile'd and captured at start-up for
  every token-count size) are on by default in 0.5.12.post1 for this model in every case here,
  --disable-cuda-graph included (ModelRunner builds them whether or not decode graphs are on;
  only --disable-piecewise-cuda-graph or ServerArgs' model/feature list turns them off). Only the
  case users get (fa3, spec v2, CUDA graphs) keeps them; the others test the draft paths and
  start much faster without them.
- Page size 1 (engine_kwargs); any page size works for chains. Step3p5 is a hybrid
  sliding-window model: target and every draft step get SWA pools; the window (512) outlasts
  these sequences.

No spec follows the bigram table here too (first test), so "identical to the table" is token
identity with no spec. The MTP layers agree with the table on ~90%, ~70% and ~50% of tokens:
the accept length expected from them (~2.85) is far from what all steps running layer 0 would
give (~3.44), or layer 2 (~1.88).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from specpatch.testing import engine as eng
from specpatch.testing import synth
from specpatch.testing.marks import FA3_SKIP

pytestmark = pytest.mark.gpu

CHAIN = eng.SpecConfig(topk=1, num_steps=3, num_draft_tokens=4)
BATCH_SIZES = (1, 8)
MAX_NEW_TOKENS = 128

FA3 = pytest.param("fa3", marks=FA3_SKIP)


def chain_case(backend: str, overlap: bool, cuda_graph: bool):
    """backend, spec v2 (overlap scheduler), CUDA graphs; marks stay on the top-level param,
    the only place pytest reads them."""
    label = (
        f"{backend}-{'v2' if overlap else 'v1'}-{'graph' if cuda_graph else 'eager'}"
    )
    marks = [FA3_SKIP] if backend == "fa3" else []
    return pytest.param(backend, overlap, cuda_graph, marks=marks, id=label)


CHAIN_CASES = [
    chain_case("fa3", True, True),
    chain_case("fa3", True, False),
    chain_case("fa3", False, True),
    chain_case("fa3", False, False),
    # the one triton combination that runs a sliding-window MTP draft (module docstring)
    chain_case("triton", True, False),
]


def piecewise_cuda_graph(backend: str, overlap: bool, cuda_graph: bool) -> bool:
    """Piecewise CUDA graphs for the target's prefill only where users get them by default."""
    return (backend, overlap, cuda_graph) == ("fa3", True, True)


@pytest.fixture(scope="module")
def prompts(step3p5_mtp_model):
    vocab = synth.load_meta(step3p5_mtp_model)["spec"]["vocab"]
    return eng.random_prompts(max(BATCH_SIZES), vocab, seed=5)


def mtp_engine_kwargs(
    model, spec, backend: str, cuda_graph: bool, piecewise: bool = False
) -> dict:
    return eng.engine_kwargs(
        model,
        None,
        spec,
        cuda_graph=cuda_graph,
        max_running_requests=max(BATCH_SIZES),
        max_total_tokens=1 << 16,
        attention_backend=backend,
        # the target's own MTP layers are the draft
        speculative_draft_model_path=None,
        disable_piecewise_cuda_graph=not piecewise,
    )


@pytest.mark.parametrize("backend", [FA3, "triton"])
def test_mtp_target_no_spec_is_its_bigram_table(step3p5_mtp_model, prompts, backend):
    expected = synth.table_continuations(step3p5_mtp_model, prompts, MAX_NEW_TOKENS)
    kwargs = mtp_engine_kwargs(step3p5_mtp_model, None, backend, cuda_graph=True)
    with eng.engine(**kwargs) as e:
        run = eng.generate(e, prompts, MAX_NEW_TOKENS)
    eng.assert_identical(run, expected, "no spec")


@pytest.mark.parametrize("backend,overlap,cuda_graph", CHAIN_CASES)
def test_mtp_chain_is_token_identical_to_no_spec(
    step3p5_mtp_model, prompts, backend, overlap, cuda_graph, record_metric
):
    model = step3p5_mtp_model
    expected = synth.table_continuations(model, prompts, MAX_NEW_TOKENS)
    spec = replace(CHAIN, overlap=overlap)
    piecewise = piecewise_cuda_graph(backend, overlap, cuda_graph)
    kwargs = mtp_engine_kwargs(model, spec, backend, cuda_graph, piecewise)
    with eng.engine(**kwargs) as e:
        assert e.server_args.enable_multi_layer_eagle
        assert e.server_args.disable_overlap_schedule is (not overlap)
        assert e.server_args.disable_piecewise_cuda_graph is (not piecewise)
        eng.generate(e, prompts[:2], 8)
        accept = {}
        for bs in BATCH_SIZES:
            run = eng.generate(e, prompts[:bs], MAX_NEW_TOKENS)
            eng.assert_identical(run, expected[:bs], f"bs {bs}")
            accept[bs] = round(run.accept_length, 3)
    meta = synth.load_meta(model)
    expected_accept = meta["expected_chain_accept_length"]
    record_metric("accept_length_by_bs", accept)
    record_metric("expected_accept_length", round(expected_accept, 3))
    record_metric("mtp_agreements", [round(a, 3) for a in meta["mtp_agreements"]])
    assert all(1.0 < a <= CHAIN.num_steps + 1 for a in accept.values()), accept
    # bs 8 verifies ~360 times: its mean is within a few percent of the expectation
    assert abs(accept[8] - expected_accept) <= 0.15 * expected_accept, accept
