"""End-to-end tok/s and accept length of speculative configurations on a synthetic pair,
all measured in one run (one GPU, one engine after another, or with --side-by-side every
engine up at once and the configs taking turns run by run), printed side by side.

    python benchmark/spec/bench_e2e.py --preset bench --agreement 0.7 \
        --configs none,chain,chain-general --batch-sizes 1,8,32 --out results.json [--png plot.png]

Config names: none (no speculation), chain (v2, topk 1, the fast path), chain-general (the same
with SGLANG_SPEC_CHAIN_FAST_PATH=0), tree (v2 tree drafting, --tree K,S,D), tree-v1 (the same
tree on spec v1: what the base falls back to, i.e. --disable-overlap-schedule), narrow (tree
4,3,8), chain1 (chain 1,1,2: no draft forward), policy (the shape policy over --policy-shapes,
docs/shape-policy.md), policy-period (the same, steps timed by periods), none-v2 (a spec v2
engine whose policy takes only steps without speculation), policy-chain (an engine carrying
the policy's set that runs only its chain 1,3,4). A name may
end in @BACKEND to run that config on another attention backend than --attention-backend
(tree@flashinfer,tree-v1@flashinfer,tree@triton), and then in :PAGE to run it with
--page-size PAGE (tree@fa3:16,tree-v1@fa3:16; page size 1 without it). With both tree and tree-v1 (and chain)
measured, it also prints tree v2 / v1 tok/s and tree / chain accept length per batch size;
--ratios A/B,C/D prints tok/s ratios of any measured pairs (side by side, also each round's
pair of runs). --replot results.json redraws
the PNG only. Every greedy output is checked against the target's successor table (each row's
"diverged": requests that left it), and the run prints one token-identity line.

Presets (specpatch.testing.synth.PRESETS): toy, small, bench (1.21B) and llama8b (7.24B, Llama-3-8B's
shape). The pair is made on the GPU the first time; --models DIR keeps it for later calls on a
warm host. KV pools are sized by specpatch.testing.engine.pool_tokens so that a 7B pair fits an H100.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from specpatch.gpu_host import vcpu_speed  # noqa: E402
from specpatch.testing import engine as eng  # noqa: E402
from specpatch.testing import scheduler_host, stack_sampler, synth  # noqa: E402

CONFIGS = {
    "none": (None, {}),
    "chain": (eng.SpecConfig(1, 3, 4), {"SGLANG_SPEC_CHAIN_FAST_PATH": "1"}),
    "chain-general": (eng.SpecConfig(1, 3, 4), {"SGLANG_SPEC_CHAIN_FAST_PATH": "0"}),
    "tree": (eng.SpecConfig(4, 3, 8), {}),
    "tree-v1": (eng.SpecConfig(4, 3, 8, overlap=False), {}),
    # A second, narrower fixed tree, and the shape policy over --policy-shapes (its first
    # shape is the flags' own, the one run first): docs/shape-policy.md.
    "narrow": (eng.SpecConfig(4, 3, 8), {}),
    "chain1": (eng.SpecConfig(1, 1, 2), {}),
    "policy": (eng.SpecConfig(16, 3, 32), {}),
    "policy-period": (eng.SpecConfig(16, 3, 32), {}),
}
# The policy configs, by the "step_time" of their --speculative-adaptive-config (None: the
# default, each step's device span; "period": from the end of the step before).
POLICY_STEP_TIME = {"policy": None, "policy-period": "period"}
# Not a policy: a spec v2 engine whose shape policy takes nothing but `none` steps, its one
# speculating shape priced out by given step costs. A `none` step inside the speculative
# worker against a plain engine's step: --ratios none-v2/none. That shape is the policy's
# widest, which sets how many `none` steps run between two catch-ups of the draft.
NONE_V2 = "none-v2"
CONFIGS[NONE_V2] = (eng.SpecConfig(16, 3, 32), {})
NONE_V2_POLICY = {
    "shapes": ["16,3,32", "none"],
    "step_costs": {"16,3,32": {"1": 1.0}, "none": {"1": 1e-4}},
}
# Not a policy either: a spec v2 engine that carries the policy's whole set (--policy-shapes:
# each shape's CUDA graphs, KV reserved and the draft's top-k as wide as its widest) but whose
# given step costs make the chain win at every batch size, so it runs the chain with no step
# timed and nothing to choose. Against the fixed chain engine (--ratios policy-chain/chain):
# what carrying the set costs a chain step; the policy against it, where the policy runs the
# chain: what timing steps and choosing cost.
POLICY_CHAIN = "policy-chain"
CHAIN_SHAPE = "1,3,4"
CONFIGS[POLICY_CHAIN] = (eng.SpecConfig(16, 3, 32), {})
# Configs whose engine runs a shape policy: neither a fixed shape nor plain decoding.
ADAPTIVE_CONFIGS = frozenset({*POLICY_STEP_TIME, NONE_V2, POLICY_CHAIN})
# Kernel and host-path A/Bs, each a chain 1,3,4, a wide and a narrow tree config
# ("chain-SUFFIX", "tree-SUFFIX", "narrow-SUFFIX") with one env switch set against its
# default, for an A/B in one run:
KERNEL_AB = {
    # upstream's query tile for triton's extend attention (triton_short_extend.py sizes it
    # to the verify);
    "upstream-tile": {"SGLANG_TRITON_SHORT_EXTEND_TILE": "0"},
    # upstream's extend kernel walking a verify's whole prefix in one program per (request,
    # head) at small batch (triton_split_prefix.py splits it by default);
    "whole-prefix": {"SGLANG_TRITON_SPLIT_PREFIX_EXTEND": "0"},
    # upstream's exact host lengths, the host waiting for each verify (bounded_host_lens.py
    # makes them bounds by default);
    "exact-lens": {"SGLANG_SPEC_V2_BOUNDED_HOST_LENS": "0"},
    # upstream's copies of the extend's k and v (triton_extend_rows.py reads them in place);
    "copy-kv": {"SGLANG_TRITON_EXTEND_ROWS_IN_PLACE": "0"},
    # host lengths as bounds where a backend takes them only when asked (flashinfer's
    # chains: "chain-bounds@flashinfer"; elsewhere the same as the default).
    "bounds": {"SGLANG_SPEC_V2_BOUNDED_HOST_LENS": "1"},
    # flashinfer's fixed-width graphs planned once, without split-KV (flashinfer_host_plans.py),
    # alone and with bounds ("tree-unsplit-plan@flashinfer", "tree-bounds-unsplit@flashinfer").
    "unsplit-plan": {"SGLANG_FLASHINFER_SPEC_UNSPLIT_PLAN": "1"},
    "bounds-unsplit": {
        "SGLANG_SPEC_V2_BOUNDED_HOST_LENS": "1",
        "SGLANG_FLASHINFER_SPEC_UNSPLIT_PLAN": "1",
    },
    # FA3's own expand pass and merge_state_v2 in its tree attention (fa3_tree_expand.py
    # does both in one triton launch by default): "tree-fa3-expand@fa3".
    "fa3-expand": {"SGLANG_FA3_TREE_EXPAND": "0"},
    # FlashInfer's masked paged prefill for a tree verify (flashinfer_tree_cascade.py runs an
    # unmasked prefix pass and a triton merge by default): "tree-masked-verify@flashinfer".
    "masked-verify": {"SGLANG_FLASHINFER_TREE_CASCADE": "0"},
    # the cascade's prefix pass over whole rows, split-KV in graphs (it splits a small batch's
    # rows into sequences of their own by default): "tree-whole-rows@flashinfer".
    "whole-rows": {"SGLANG_FLASHINFER_TREE_ROW_PIECES": "1"},
    # the few-row GEMM or cuBLASLt (layers/few_row_gemm_table.py) for the layers and row
    # counts of --few-row-gemm-table's measurement (torch's GEMMs by default):
    # "tree-few-row-gemm".
    "few-row-gemm": {"SGLANG_FEW_ROW_GEMM": ""},
}
for _suffix, _env in KERNEL_AB.items():
    CONFIGS[f"chain-{_suffix}"] = (
        eng.SpecConfig(1, 3, 4),
        {"SGLANG_SPEC_CHAIN_FAST_PATH": "1", **_env},
    )
    CONFIGS[f"tree-{_suffix}"] = (eng.SpecConfig(16, 3, 32), dict(_env))
    CONFIGS[f"narrow-{_suffix}"] = (eng.SpecConfig(4, 3, 8), dict(_env))
# Spec v2 trees whose target verify and draft extend run on another attention backend than
# their decode steps: sglang's hybrid backend (--prefill-attention-backend; its default
# --speculative-attention-mode "prefill" puts verify and draft extend there). Issue #21 asks
# whether FA3's trees gain from triton's tree verify ("tree-triton-verify@fa3"): FA3 verifies
# a tree as two paged passes and a merge per layer.
VERIFY_BACKENDS = {"tree-triton-verify": "triton"}
for _name in VERIFY_BACKENDS:
    CONFIGS[_name] = (eng.SpecConfig(4, 3, 8), {})
# Env switches of the A/B configs above: not shapes, so never the policy's "best fixed".
KERNEL_SWITCHES = {key for env in KERNEL_AB.values() for key in env}
POLICY_SHAPES = ["16,3,32", "4,3,8", "1,3,4", "1,1,2"]
# A --speculative-adaptive-config for the policy config (e.g. one --write-policy-config
# wrote, with step costs); None: one with POLICY_SHAPES alone.
POLICY_CONFIG: list[Optional[str]] = [None]
# The policy's "trace" file (--policy-trace), or None.
POLICY_TRACE: list[Optional[str]] = [None]
# Prompt lengths, drawn uniformly per request (--prompt-len): the verify's prefix is a prompt
# plus what the request has generated so far.
PROMPT_LEN = [8, 64]
# The batch sizes every engine captures CUDA graphs at (--cuda-graph-bs); empty: the run's
# batch sizes, or sglang's list with a mixed load.
CUDA_GRAPH_BS: list[int] = []
# The CPUs this benchmark may use (its taskset), before --pin-scheduler moves anything.
HOST_CPUS = sorted(os.sched_getaffinity(0))
# sglang's log level in the engines (--engine-log-level): "info" logs how long each start-up
# phase took (weights, each CUDA-graph capture).
ENGINE_LOG_LEVEL = ["warning"]


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    low, high = PROMPT_LEN
    return eng.random_prompts(n, vocab, min_len=low, max_len=high, seed=seed)


# The "bs" of a mixed-load row.
MIXED = "mixed"


def set_tree_shape(topk: int, num_steps: int, num_draft_tokens: int) -> None:
    CONFIGS["tree"] = (eng.SpecConfig(topk, num_steps, num_draft_tokens), {})
    CONFIGS["tree-v1"] = (
        eng.SpecConfig(topk, num_steps, num_draft_tokens, overlap=False),
        {},
    )
    for name in [*(f"tree-{suffix}" for suffix in KERNEL_AB), *VERIFY_BACKENDS]:
        CONFIGS[name] = (
            eng.SpecConfig(topk, num_steps, num_draft_tokens),
            CONFIGS[name][1],
        )


FEW_ROW_GEMM_CONFIGS = (
    "chain-few-row-gemm",
    "tree-few-row-gemm",
    "narrow-few-row-gemm",
)


def set_few_row_gemm_table(path: str) -> None:
    """The few-row-gemm configs read this bench_verify_gemm --out file."""
    for name in FEW_ROW_GEMM_CONFIGS:
        CONFIGS[name][1]["SGLANG_FEW_ROW_GEMM"] = str(Path(path).resolve())


def set_policy_config(path: str) -> None:
    """Run the policy config with this config file; its first shape is run first."""
    POLICY_CONFIG[0] = path
    set_policy_shapes(json.loads(Path(path).read_text())["shapes"])


def set_policy_shapes(labels: list[str]) -> None:
    first = [int(x) for x in labels[0].split(",")]
    for name in [*POLICY_STEP_TIME, POLICY_CHAIN]:
        CONFIGS[name] = (eng.SpecConfig(*first), {})
    POLICY_SHAPES[:] = labels


def policy_chain_config(shapes: list[str]) -> dict:
    """The policy-chain config's --speculative-adaptive-config: the set, priced so that the
    chain wins everywhere (ValueError without the chain in the set)."""
    if CHAIN_SHAPE not in shapes:
        raise ValueError(
            f"{POLICY_CHAIN} runs the chain ({CHAIN_SHAPE}) of --policy-shapes, "
            f"which has none: {shapes}"
        )
    costs = {label: {"1": 1e-4 if label == CHAIN_SHAPE else 1.0} for label in shapes}
    return {"shapes": list(shapes), "step_costs": costs}


def policy_config_file(
    force_switch_every: int = 0, step_time: Optional[str] = None
) -> str:
    """--speculative-adaptive-config of a policy config: --policy-config, else its
    "shapes"; with --policy-trace, a copy that traces; with step_time, a copy that times
    steps so. force_switch_every > 0: a copy that cycles through the shapes that often and
    traces nothing (the JIT warm-up)."""
    given = POLICY_CONFIG[0]
    unchanged = POLICY_TRACE[0] is None and not force_switch_every and not step_time
    if given is not None and unchanged:
        return given
    config = {"shapes": POLICY_SHAPES}
    if given is not None:
        config = json.loads(Path(given).read_text())
    if step_time:
        config["step_time"] = step_time
    if force_switch_every:
        config["force_switch_every"] = force_switch_every
        config.pop("trace", None)
    elif POLICY_TRACE[0] is not None:
        # Each policy config its own trace: policy-period's goes to TRACE.period.
        config["trace"] = POLICY_TRACE[0] + (f".{step_time}" if step_time else "")
    path = Path(tempfile.mkdtemp()) / "shape-policy.json"
    path.write_text(json.dumps(config))
    return str(path)


@contextlib.contextmanager
def scoped_env(env: dict[str, str]):
    """Set env vars for the engines started inside (their scheduler processes read them at
    start-up), then restore the previous values."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def ensure_pair(models: str | None, preset: str, agreement: float) -> tuple[Path, Path]:
    """(target, draft) of the synthetic pair, made on the GPU unless `models` already has it."""
    root = Path(models or tempfile.mkdtemp()) / f"{preset}-a{agreement}"
    if not (root / "draft" / synth.META).exists():
        synth.make_pair(root, preset, agreement, device="cuda")
    return root / "target", root / "draft"


def split_config(name: str, default_backend: str) -> tuple[str, str, int]:
    """ "tree@flashinfer:16" -> ("tree", "flashinfer", 16); "tree" -> ("tree",
    default_backend, 1)."""
    rest, _, page = name.partition(":")
    config, _, backend = rest.partition("@")
    if config not in CONFIGS:
        raise SystemExit(f"unknown config {config!r} (one of {', '.join(CONFIGS)})")
    return config, backend or default_backend, int(page or 1)


@dataclass(frozen=True)
class MixedLoad:
    """`requests` requests of max_new_tokens each, arriving evenly over `ramp_seconds`: the
    batch grows towards `requests` and shrinks back as they finish. With a long tail, another
    `long_requests` requests of `long_tokens` each arrive first and keep decoding at a small
    batch after the ramp's requests have finished, so the load spends long stretches at
    both ends of the batch sizes rather than passing through them."""

    requests: int
    ramp_seconds: float
    long_requests: int = 0
    long_tokens: int = 0

    @classmethod
    def parse(cls, text: str) -> "MixedLoad":
        """ "64:2.5" -> 64 requests over 2.5 s; "64:2.5:4x1024" -> and 4 requests of 1024
        tokens at the start."""
        parts = text.split(":")
        try:
            if len(parts) == 2:
                return cls(int(parts[0]), float(parts[1]))
            if len(parts) == 3:
                count, _, tokens = parts[2].partition("x")
                return cls(int(parts[0]), float(parts[1]), int(count), int(tokens))
        except ValueError:
            pass
        raise SystemExit(
            f"--mixed-load {text!r}: want REQUESTS:RAMP_SECONDS[:LONGxTOKENS]"
        )

    @property
    def total_requests(self) -> int:
        return self.requests + self.long_requests

    @property
    def label(self) -> str:
        tail = f":{self.long_requests}x{self.long_tokens}" if self.long_requests else ""
        return f"{self.requests}:{self.ramp_seconds:g}{tail}"

    def arrivals(self, max_new_tokens: int) -> tuple[list[float], list[int]]:
        """Each request's arrival (seconds after the first) and max_new_tokens: the long
        requests first, at 0, then the ramp's."""
        gap = self.ramp_seconds / self.requests
        delays = [0.0] * self.long_requests + [i * gap for i in range(self.requests)]
        tokens = [self.long_tokens] * self.long_requests + [
            max_new_tokens
        ] * self.requests
        return delays, tokens

    @property
    def most_in_flight(self) -> int:
        """Every request may be in flight at once (the engine falls behind the clock)."""
        return self.total_requests

    def tokens(self, max_new_tokens: int) -> list[int]:
        return self.arrivals(max_new_tokens)[1]

    def generate(self, e, prompts: list[list[int]], max_new_tokens: int):
        delays, tokens = self.arrivals(max_new_tokens)
        return eng.arrivals_generate(e, prompts, tokens, delays)


@dataclass(frozen=True)
class StairLoad:
    """Phases of (most in flight, requests), each request of max_new_tokens: a phase's
    requests are sent as completions let them in, so "1x8,16x64,64x128,16x64,1x8" holds the
    batch at 1, 16 and 64 and back down for that many requests each. A closed loop: every
    engine runs the same batch sizes in the same order, where a MixedLoad's clock gathers
    a larger batch the slower the engine is."""

    phases: tuple[tuple[int, int], ...]

    @classmethod
    def parse(cls, text: str) -> "StairLoad":
        phases = []
        for part in text.split(","):
            level, _, count = part.partition("x")
            try:
                phases.append((int(level), int(count)))
            except ValueError:
                phases = []
                break
        if not phases or any(level < 1 or count < 1 for level, count in phases):
            raise SystemExit(
                f"--mixed-load {text!r}: want LEVELxREQUESTS,... (each at least 1), "
                "e.g. 1x8,16x64,64x128,16x64,1x8"
            )
        return cls(tuple(phases))

    @property
    def total_requests(self) -> int:
        return sum(count for _, count in self.phases)

    @property
    def most_in_flight(self) -> int:
        return max(level for level, _ in self.phases)

    @property
    def label(self) -> str:
        return ",".join(f"{level}x{count}" for level, count in self.phases)

    def tokens(self, max_new_tokens: int) -> list[int]:
        return [max_new_tokens] * self.total_requests

    def levels(self) -> list[int]:
        """Each request's level: it is sent once fewer than that many are in flight."""
        return [level for level, count in self.phases for _ in range(count)]

    def generate(self, e, prompts: list[list[int]], max_new_tokens: int):
        tokens = self.tokens(max_new_tokens)
        return eng.concurrency_generate(e, prompts, tokens, self.levels())


# A mixed-load row's load: arrivals on a clock or a closed loop.
Load = Union[MixedLoad, StairLoad]


def parse_load(text: str) -> Load:
    """--mixed-load's two forms: REQUESTS:RAMP_SECONDS[:LONGxTOKENS] (arrivals on a clock)
    or LEVELxREQUESTS,... (a closed loop)."""
    return MixedLoad.parse(text) if ":" in text else StairLoad.parse(text)


def engine_settings(
    target,
    draft,
    name: str,
    batch_sizes: list[int],
    attention_backend: str,
    mixed: Optional[Load] = None,
    force_switch_every: int = 0,
) -> dict:
    """Engine kwargs of config `name` for a run at `batch_sizes`. CUDA graphs are captured at
    exactly those sizes: sglang's default list for spec decoding up to bs 48 has 23 sizes,
    each captured for verify, draft and draft extend, which made engine start-up most of a
    benchmark's time. A batch that shrinks as its requests finish pads to the next size. A
    mixed load runs every batch size, so it keeps sglang's list (23 sizes up to bs 64), unless
    CUDA_GRAPH_BS (--cuda-graph-bs) names the sizes for every engine."""
    config, backend, page_size = split_config(name, attention_backend)
    spec, _ = CONFIGS[config]
    extra = {}
    if config in POLICY_STEP_TIME:
        extra.update(
            speculative_adaptive=True,
            speculative_adaptive_config=policy_config_file(
                force_switch_every, POLICY_STEP_TIME[config]
            ),
        )
    if config in (NONE_V2, POLICY_CHAIN):
        given = (
            NONE_V2_POLICY if config == NONE_V2 else policy_chain_config(POLICY_SHAPES)
        )
        if (
            POLICY_TRACE[0] is not None
        ):  # its steps beside the policy's: TRACE.policy-chain
            given = given | {"trace": f"{POLICY_TRACE[0]}.{config}"}
        path = Path(tempfile.mkdtemp()) / f"{config}.json"
        path.write_text(json.dumps(given))
        extra.update(speculative_adaptive=True, speculative_adaptive_config=str(path))
    if config in VERIFY_BACKENDS:
        extra["prefill_attention_backend"] = VERIFY_BACKENDS[config]
    if CUDA_GRAPH_BS:
        extra["cuda_graph_bs"] = list(CUDA_GRAPH_BS)
    elif mixed is None:
        extra["cuda_graph_bs"] = sorted(set(batch_sizes))
    extra["log_level"] = ENGINE_LOG_LEVEL[0]
    return eng.engine_kwargs(
        target,
        draft,
        spec,
        max_running_requests=max([*batch_sizes, mixed.most_in_flight if mixed else 0]),
        max_total_tokens=eng.pool_tokens_for(target),
        attention_backend=backend,
        page_size=page_size,
        **extra,
    )


def policy_configs(names: list[str], attention_backend: str) -> list[str]:
    """The names among a run's configs that run the shape policy."""
    return [
        n for n in names if split_config(n, attention_backend)[0] in POLICY_STEP_TIME
    ]


def warm_jit_caches(
    target,
    draft,
    names: list[str],
    batch_sizes: list[int],
    vocab: int,
    attention_backend: str,
    mixed: Optional[Load],
) -> None:
    """Start and discard one engine that runs the kernels the measured engines will.

    Triton compiles the eager kernels between graph replays on first use, per process tree,
    and keeps them in its on-disk cache; many are specialised on the batch size rounded up to
    a power of two, and on the shape. A step that compiles takes 100-500 ms instead of a few,
    and whichever engine first runs a (shape, batch size) pays it: the shape policy, which
    runs every shape of its set at every size a mixed load passes, paid for the fixed shapes
    measured after it. The first replay of each captured CUDA graph is slow too. With a policy
    config in the run, the warm-up engine is the policy cycling through its shapes every step
    at each power of two and each captured size up to the largest batch; otherwise the first
    config at bs 1 (the first engine's one-time costs)."""
    if not policy_configs(names, attention_backend):
        measure(target, draft, names[0], [1], 16, vocab, 1, attention_backend)
        return
    largest = max([*batch_sizes, mixed.most_in_flight if mixed else 0])
    sizes = {*batch_sizes, *(1 << i for i in range(largest.bit_length()))}
    kwargs = engine_settings(
        target,
        draft,
        "policy",
        sorted(sizes),
        attention_backend,
        mixed,
        force_switch_every=1,
    )
    with eng.engine(**kwargs) as e:
        captured = e.server_args.cuda_graph_bs or []
        for bs in sorted(sizes | {b for b in captured if b <= largest}):
            eng.generate(e, prompts(bs, vocab, seed=bs), 16)


def diverged_requests(
    run: eng.GreedyRun,
    prompts: list[list[int]],
    successor: Optional[list[int]],
    max_new_tokens: Union[int, list[int]],
) -> Optional[int]:
    """How many requests of a greedy run left the target's greedy table (every config,
    speculating or not, must produce it), or None without a table to check against.
    max_new_tokens: one for every request, or each request's own."""
    if successor is None:
        return None
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    expected = synth.continuations(successor, prompts, max(max_new_tokens))
    return sum(a != b[:n] for a, b, n in zip(run.output_ids, expected, max_new_tokens))


def measure(
    target,
    draft,
    name: str,
    batch_sizes: list[int],
    max_new_tokens: int,
    vocab: int,
    repeats: int = 3,
    attention_backend: str = eng.BUNDLE_FLAGS["attention_backend"],
    mixed: Optional[Load] = None,
    successor: Optional[list[int]] = None,
    pin_scheduler: str = "none",
    freeze_gc: bool = False,
) -> list[dict]:
    config, _, _ = split_config(name, attention_backend)
    spec, env = CONFIGS[config]
    rows = []
    kwargs = engine_settings(target, draft, name, batch_sizes, attention_backend, mixed)
    # Each CPU's speed before this engine's processes take one: a host-bound engine runs at
    # the speed of the CPU its scheduler lands on (specpatch.gpu_host.vcpu_speed).
    speeds = vcpu_speed.speed_map(HOST_CPUS)
    started = time.perf_counter()
    with scoped_env(env), eng.engine(**kwargs) as e:
        # How many engines a device call holds is set by start-up (weights, graph captures),
        # not by the measured runs: printed at once, so a run cut short still shows it.
        start_s = round(time.perf_counter() - started, 1)
        print(f"{name}: engine started in {start_s:.0f} s", flush=True)
        schedulers = scheduler_host.scheduler_processes()
        place_schedulers(schedulers, scheduler_cpu(pin_scheduler, speeds))
        if freeze_gc:
            # sglang's freeze_gc: the objects of start-up (an engine with more CUDA graphs
            # holds more) leave the collector's scans.
            e.freeze_gc()
        loads = [os.getloadavg()[0]]
        if mixed is not None:
            ramp = prompts(mixed.total_requests, vocab, seed=99)
            tokens = mixed.tokens(max_new_tokens)
            mixed.generate(e, ramp, max_new_tokens)  # warm-up
            before = scheduler_host.snapshot(schedulers)
            runs = [mixed.generate(e, ramp, max_new_tokens) for _ in range(repeats)]
            usage = scheduler_host.snapshot(schedulers).since(before)
            rows.append(
                mixed_row(name, spec, mixed, runs, ramp, tokens, successor)
                | scheduler_use(usage)
                | scheduler_placement(schedulers, speeds)
            )
            print_row(rows[-1])
        for bs in batch_sizes:
            # Best of `repeats`: these machines are noisy and we compare configs, not noise.
            batch = prompts(bs, vocab, seed=bs)
            before = scheduler_host.snapshot(schedulers)
            runs = eng.timed_runs(e, batch, max_new_tokens, repeats)
            usage = scheduler_host.snapshot(schedulers).since(before)
            # The same prompts to their first token only: prefill (the draft's too) and the
            # first sampled token, what every request pays once whatever its length. The
            # prompts are in the radix cache by now: the prefill extends a cached prefix.
            first = eng.best_of(e, batch, 1, repeats)
            rows.append(
                batch_row(name, spec, batch, runs, first, successor, max_new_tokens)
                | scheduler_use(usage)
                | scheduler_placement(schedulers, speeds)
            )
            print_row(rows[-1])
        loads.append(os.getloadavg()[0])
    if pin_scheduler != "none":  # the next engine's map and processes: every CPU again
        scheduler_host.move([psutil.Process()], set(HOST_CPUS))
    for r in rows:
        r["host_load"] = round(max(loads), 1)
        r["engine_start_s"] = start_s
        r["gc_frozen"] = freeze_gc
    return rows


def start_engines(
    start: Callable[..., object],
    settings: dict[str, dict],
    envs: dict[str, dict[str, str]],
    threads: Optional[contextlib.ExitStack] = None,
) -> dict[str, tuple[object, float, list]]:
    """name -> (engine, seconds its start took, its scheduler processes), in `settings`'
    order: each engine started by start(**settings[name]) with envs[name] set.

    One after another by default. With `threads`, the engines of configs with the same env
    start at once, a thread each (an Engine's start-up is mostly a wait on its scheduler
    process, which imports, loads and captures on its own), one env group after another: a
    scheduler reads this process's env when it is spawned. Which scheduler is whose comes
    from each engine's child pids there (one after another: the processes that are new).

    `threads` must close only after the engines have stopped: it holds the threads the
    engines started in, and sglang's schedulers ask the kernel for a SIGKILL when the
    thread that spawned them ends (PR_SET_PDEATHSIG is per thread, not per process).
    """
    groups: dict[tuple, list[str]] = {}
    for name in settings:
        key = tuple(sorted(envs[name].items())) if threads is not None else (name,)
        groups.setdefault(key, []).append(name)

    def start_one(name: str) -> tuple[object, float]:
        tic = time.perf_counter()
        engine = start(**settings[name])
        seconds = round(time.perf_counter() - tic, 1)
        print(f"{name}: engine started in {seconds:.0f} s", flush=True)
        return engine, seconds

    started: dict[str, tuple[object, float, list]] = {}
    for group in groups.values():
        with scoped_env(envs[group[0]]):
            if len(group) == 1:
                results = [start_one(group[0])]
            else:
                pool = threads.enter_context(ThreadPoolExecutor(len(group)))
                # Every start runs to its end before a failure is raised: the engine
                # group's exit then stops every engine, started or half started.
                futures = [pool.submit(start_one, name) for name in group]
                wait(futures)
                results = [f.result() for f in futures]
        for name, (engine, seconds) in zip(group, results):
            if len(group) == 1:
                earlier = {p for _, _, procs in started.values() for p in procs}
                procs = [
                    p for p in scheduler_host.scheduler_processes() if p not in earlier
                ]
            else:
                pids = set(engine.get_all_child_pids())
                procs = [
                    p for p in scheduler_host.scheduler_processes() if p.pid in pids
                ]
            started[name] = (engine, seconds, procs)
    return {name: started[name] for name in settings}


def measure_side_by_side(
    target,
    draft,
    names: list[str],
    batch_sizes: list[int],
    max_new_tokens: int,
    vocab: int,
    repeats: int = 3,
    attention_backend: str = eng.BUNDLE_FLAGS["attention_backend"],
    mixed: Optional[Load] = None,
    successor: Optional[list[int]] = None,
    pin_scheduler: str = "fastest",
    freeze_gc: bool = False,
    stacks_dir: Optional[Path] = None,
    deadline: Optional["Deadline"] = None,
    start_together: bool = False,
) -> list[dict]:
    """measure() for every config of `names` at once: all their engines up together, their
    schedulers on one CPU, the configs taking turns run by run.

    A host-bound engine runs at the speed of its scheduler's CPU, and a guest's CPUs differ
    and drift by up to 2x within minutes (specpatch.gpu_host.vcpu_speed), so engines measured
    one after another compare their CPUs as much as their configs. Here each run of one
    config sits between runs of the others, on the same CPU; an idle engine's scheduler
    sleeps (sglang's --sleep-on-idle) instead of spinning beside the one that runs. Each
    round of runs starts with the next config, so none always runs first. With stacks_dir,
    py-spy samples each config's schedulers over the runs (specpatch.testing.stack_sampler),
    from the CPUs the schedulers are not on. With a deadline, a load (the mixed one, then
    each batch size) that would not end in time is not started, nor any after it. With
    start_together, engines start as start_engines(threads=...) starts them."""
    speeds = vcpu_speed.speed_map(HOST_CPUS)
    settings: dict[str, dict] = {}
    live = live_tokens(batch_sizes, mixed, max_new_tokens)
    for name in names:
        kwargs = engine_settings(
            target, draft, name, batch_sizes, attention_backend, mixed
        )
        # Every engine's pool at once: each only as large as its live requests need.
        kwargs["max_total_tokens"] = min(
            kwargs["max_total_tokens"], max(MIN_SIDE_BY_SIDE_POOL, live)
        )
        settings[name] = kwargs | {
            "sleep_on_idle": True,
            "mem_fraction_static": SIDE_BY_SIDE_MEM_FRACTION,
        }
    envs = {n: CONFIGS[split_config(n, attention_backend)[0]][1] for n in names}
    # The threads engines start in end after the engines stop (start_engines).
    with (
        contextlib.ExitStack() as threads,
        eng.engine_group() as start,
        contextlib.ExitStack() as sampling,
    ):
        if start_together:  # engines started in threads install no SIGQUIT handler
            sampling.enter_context(eng.sigquit_kills_children())
        started = start_engines(
            start, settings, envs, threads if start_together else None
        )
        engines = {name: e for name, (e, _, _) in started.items()}
        refuse_short_pools(
            {name: eng.kv_pool_tokens(e) for name, e in engines.items()},
            min(live, *(s["max_total_tokens"] for s in settings.values())),
        )
        start_s = {name: seconds for name, (_, seconds, _) in started.items()}
        schedulers = {name: procs for name, (_, _, procs) in started.items()}
        if freeze_gc:
            for e in engines.values():
                e.freeze_gc()
        every_scheduler = [p for procs in schedulers.values() for p in procs]
        pin = "fastest" if pin_scheduler == "none" else pin_scheduler
        cpu = scheduler_cpu(pin, speeds)
        place_schedulers(every_scheduler, cpu)
        if stacks_dir is not None:
            # Stopped (files written) before the engines are.
            sampling.enter_context(
                stack_sampler.sampled(
                    schedulers, stacks_dir, set(HOST_CPUS) - {cpu} or set(HOST_CPUS)
                )
            )
        loads = [os.getloadavg()[0]]
        turns = Turns(engines, schedulers, repeats)
        specs = {n: CONFIGS[split_config(n, attention_backend)[0]][0] for n in names}
        rows = []
        deadline = deadline or Deadline(None)
        if mixed is not None and deadline.next_fits(
            mixed.label, "mixed", sum(mixed.tokens(max_new_tokens))
        ):
            ramp = prompts(mixed.total_requests, vocab, seed=99)
            tokens = mixed.tokens(max_new_tokens)
            runs, usage = turns.take(
                lambda e: mixed.generate(e, ramp, max_new_tokens), label=mixed.label
            )
            for name in names:
                rows.append(
                    mixed_row(
                        name, specs[name], mixed, runs[name], ramp, tokens, successor
                    )
                    | scheduler_use(usage[name])
                    | scheduler_placement(schedulers[name], speeds)
                )
                print_row(rows[-1])
        for bs in batch_sizes:
            if not deadline.next_fits(f"bs {bs}", "batch", bs * max_new_tokens):
                break
            batch = prompts(bs, vocab, seed=bs)
            runs, usage = turns.take(
                lambda e: eng.generate(e, batch, max_new_tokens), label=f"bs {bs}"
            )
            firsts, _ = turns.take(lambda e: eng.generate(e, batch, 1))
            for name in names:
                rows.append(
                    batch_row(
                        name,
                        specs[name],
                        batch,
                        runs[name],
                        eng.fastest(firsts[name]),
                        successor,
                        max_new_tokens,
                    )
                    | scheduler_use(usage[name])
                    | scheduler_placement(schedulers[name], speeds)
                )
                print_row(rows[-1])
        loads.append(os.getloadavg()[0])
    scheduler_host.move([psutil.Process()], set(HOST_CPUS))
    for r in rows:
        r["host_load"] = round(max(loads), 1)
        r["engine_start_s"] = start_s[r["config"]]
        r["gc_frozen"] = freeze_gc
        r["side_by_side"] = names
    return rows


# KV slots a speculating request holds beyond its tokens: its verify's draft tokens and the
# draft's steps (tree 16,3,32: 32 and 48), with room to spare.
SPEC_SLACK_TOKENS = 256


# The smallest pool of an engine started side by side: above the most sglang prefills at once
# (its chunked prefill, 8192-16384 tokens), so that the pool never shapes a prefill batch
# where an engine measured alone (a pool of MAX_POOL_TOKENS) would not.
MIN_SIDE_BY_SIDE_POOL = 1 << 15


# The static memory share of an engine started side by side. Its pool is capped
# (max_total_tokens), so the share decides only whether the cap is reached: sglang sizes a
# pool as the free memory after the weights load less (1 - share) x the free memory before,
# and engines that start at once load their weights into each other's two readings, so at
# sglang's default share the last engines to load get pools of a few hundred tokens.
SIDE_BY_SIDE_MEM_FRACTION = 0.85


def refuse_short_pools(pool_tokens: dict[str, int], need: int) -> None:
    """Stop the run where an engine's KV pool (config -> tokens) holds fewer than the `need`
    tokens its live requests take: sglang admits what fits and queues the rest, so that
    engine would run smaller batches than the load asks for and its tok/s compare nothing.
    """
    short = {name: n for name, n in pool_tokens.items() if n < need}
    if short:
        got = ", ".join(f"{name} {n}" for name, n in short.items())
        raise SystemExit(
            f"side by side, KV pools short of the {need} tokens a run holds at once: {got}; "
            "the engines do not fit this GPU together: run fewer --configs"
        )


def live_tokens(
    batch_sizes: list[int], mixed: Optional[Load], max_new_tokens: int
) -> int:
    """KV tokens the most a run has in flight at once needs: its largest batch or its mixed
    load (the longest of its requests that can be in flight at once: every one of a
    MixedLoad's), each request at its longest prompt, all its tokens and SPEC_SLACK_TOKENS. The radix cache gives back finished prompts' slots as needed.
    """
    per_request = PROMPT_LEN[1] + SPEC_SLACK_TOKENS
    needs = [bs * (per_request + max_new_tokens) for bs in batch_sizes]
    if mixed is not None:
        longest = sorted(mixed.tokens(max_new_tokens), reverse=True)
        needs.append(sum(per_request + n for n in longest[: mixed.most_in_flight]))
    return max(needs)


class Deadline:
    """When a side-by-side run stops starting loads: `limit_s` seconds after it was made (None:
    never). Each load is assumed to take as long as the one before it (the mixed load, then
    batch sizes in the order given), so one that would end past the limit is not started: a
    device call's time limit otherwise kills the run, its table and what the call does after
    it. The first batch size after a mixed load is assumed to take as long per generated
    token as that load did: a closed-loop load of minutes would otherwise leave no batch
    size room after it. That guess runs short where the batch is small (a bs-1 load made
    several times slower per token than a mixed load's average), so keep a margin."""

    def __init__(
        self, limit_s: Optional[float], clock: Callable[[], float] = time.monotonic
    ):
        self._clock = clock
        self._end = None if limit_s is None else clock() + limit_s
        self._previous_start: Optional[float] = None
        self._previous: Optional[tuple[str, int]] = (
            None  # (kind, tokens) of the last load
        )
        self._previous_s = 0.0
        self.expired = False

    def next_fits(self, label: str, kind: str = "batch", tokens: int = 1) -> bool:
        """Called as each load is about to start, with its kind ("mixed" or "batch") and the
        tokens one run of it generates; False (and every later call False, with one printed
        line) once this one would end past the limit."""
        now = self._clock()
        if self._previous_start is not None:
            self._previous_s = now - self._previous_start
        estimate_s = self._previous_s
        if self._previous is not None and self._previous[0] != kind:
            estimate_s *= tokens / self._previous[1]
        self._previous_start = now
        self._previous = (kind, tokens)
        if self._end is not None and not self.expired:
            self.expired = now + estimate_s > self._end
            if self.expired:
                print(
                    f"--time-limit: {label} and the loads after it not measured "
                    f"({self._end - now:.0f} s left, {label} would take about "
                    f"{estimate_s:.0f} s)",
                    flush=True,
                )
        return not self.expired


class Turns:
    """Runs of several engines in turns: `repeats` rounds after one untimed round, each
    round every engine once, the first engine of a round the next one along."""

    def __init__(
        self, engines: dict[str, object], schedulers: dict[str, list], repeats: int
    ):
        self.engines = engines
        self.schedulers = schedulers
        self.repeats = repeats

    def order(self, round_index: int) -> list[str]:
        """The engines' names in round `round_index`'s order: rotated by the round."""
        names = list(self.engines)
        k = round_index % len(names)
        return names[k:] + names[:k]

    def take(
        self, run: Callable[[object], eng.GreedyRun], label: Optional[str] = None
    ) -> tuple[dict[str, list[eng.GreedyRun]], dict[str, scheduler_host.HostUsage]]:
        """Each engine's timed results of run(engine) in order, and its schedulers' use
        over its own timed runs only. With a label, each timed run's tok/s is printed as
        it ends: a run cut by its device call's limit still shows the runs it made."""
        for name in self.order(0):  # untimed: warm-up, as timed_runs has
            run(self.engines[name])
        results = {name: [] for name in self.engines}
        usage = {name: scheduler_host.HostUsage.zero() for name in self.engines}
        for i in range(self.repeats):
            for name in self.order(i):
                before = scheduler_host.snapshot(self.schedulers[name])
                results[name].append(run(self.engines[name]))
                after = scheduler_host.snapshot(self.schedulers[name])
                usage[name] = usage[name] + after.since(before)
                if label is not None:
                    print(
                        f"{label}: {name} run {i + 1}/{self.repeats} "
                        f"{results[name][-1].tok_per_s:.0f} tok/s",
                        flush=True,
                    )
        return results, usage


def batch_row(
    name: str,
    spec: Optional[eng.SpecConfig],
    batch: list[list[int]],
    runs: list[eng.GreedyRun],
    first: eng.GreedyRun,
    successor: Optional[list[int]],
    max_new_tokens: int,
) -> dict:
    """A config's row at one batch size: its fastest of `runs` (every request to
    max_new_tokens) and `first`, the fastest run of the same prompts to their first token.
    """
    best = eng.fastest(runs)
    return {
        "config": name,
        "bs": len(batch),
        "tok_per_s": best.tok_per_s,
        # Every timed run of this engine, in order: a spread here is noise within one
        # engine, against the spread between engines (tok_per_s_per_round).
        "tok_per_s_repeats": [r.tok_per_s for r in runs],
        "decode_tok_per_s": decode_tok_per_s(best, first),
        "first_token_ms": first.seconds * 1e3,
        "accept_length": best.accept_length if spec else 1.0,
        "diverged": diverged_requests(best, batch, successor, max_new_tokens),
    }


def mixed_row(
    name: str,
    spec: Optional[eng.SpecConfig],
    mixed: Load,
    runs: list[eng.GreedyRun],
    ramp: list[list[int]],
    tokens: list[int],
    successor: Optional[list[int]],
) -> dict:
    """A config's row for the mixed load: its fastest of `runs` of the `ramp` prompts, each
    request to its own number of `tokens`."""
    run = eng.fastest(runs)
    return {
        "config": name,
        "bs": MIXED,
        "load": mixed.label,
        "tok_per_s": run.tok_per_s,
        "tok_per_s_repeats": [r.tok_per_s for r in runs],
        # Each run's batch at its largest: the load's arrivals are fixed, how far the batch
        # grows is the run's own outcome, so runs of one config can be different loads.
        "peak_in_flight_repeats": [r.peak_in_flight for r in runs],
        "accept_length": run.accept_length if spec else 1.0,
        "diverged": diverged_requests(run, ramp, successor, tokens),
    }


def print_row(row: dict) -> None:
    """One line for a row as soon as it is measured: the table comes at the end of a run,
    and a device call cut by its time limit still shows the sizes it finished."""
    print(
        f"{row['config']} bs {row['bs']}: {row['tok_per_s']:.0f} tok/s, "
        f"accept {row['accept_length']:.2f}, diverged {row['diverged']}",
        flush=True,
    )


def scheduler_use(usage: scheduler_host.HostUsage) -> dict:
    """A row's record of its scheduler processes over its timed runs: CPU seconds per second,
    involuntary context switches per second (a loop that shares its core shows both) and
    voluntary ones (a loop that blocks on something shows those).
    """
    return {
        "scheduler_busy": round(usage.busy, 2),
        "scheduler_preempted_per_s": round(usage.preempted_per_s, 1),
        "scheduler_waits_per_s": round(usage.waits_per_s),
    }


def scheduler_cpu(pin: str, speeds: dict[int, float]) -> Optional[int]:
    """The CPU --pin-scheduler asks for: None for "none", the fastest CPU of `speeds` for
    "fastest", else the CPU it names."""
    if pin == "none":
        return None
    if pin == "fastest":
        return max(speeds, key=lambda cpu: (speeds[cpu], -cpu))
    return int(pin)


def place_schedulers(schedulers: list, cpu: Optional[int]) -> None:
    """An engine's scheduler processes on `cpu` alone and the rest of this process tree
    (this process, the detokenizer) on the other CPUs of HOST_CPUS; nothing for None."""
    if cpu is None:
        return
    this = psutil.Process()
    others = [this] + [p for p in this.children(recursive=True) if p not in schedulers]
    scheduler_host.move(schedulers, {cpu})
    if len(HOST_CPUS) > 1:
        scheduler_host.move(others, set(HOST_CPUS) - {cpu})


def scheduler_placement(schedulers: list, speeds: dict[int, float]) -> dict:
    """Where a row's scheduler processes ran when it ended, and the slowest of those CPUs'
    speeds (relative to the fastest CPU) before the engine started; None for a CPU outside
    the map."""
    cpus = scheduler_host.cpus_of(schedulers)
    known = [speeds[c] for c in cpus if c in speeds]
    return {
        "scheduler_cpus": cpus,
        "scheduler_cpu_speed": round(min(known), 2) if known else None,
    }


def decode_tok_per_s(run: eng.GreedyRun, first_token: eng.GreedyRun) -> float:
    """Tokens per second after each request's first token: the run's tokens and seconds less
    those of the same prompts run to their first token."""
    tokens = run.completion_tokens - first_token.completion_tokens
    return tokens / max(run.seconds - first_token.seconds, 1e-9)


def spec_efficiency(rows: list[dict], key: str = "tok_per_s") -> dict:
    """Issue #23's measure per (config, bs): tok/s / (no-speculation tok/s x accept length),
    the share of a speculating step's committed tokens its time delivers against plain
    decoding. With key "decode_tok_per_s", the same past each request's first token, where
    the decode loop alone decides it. {(config, bs): efficiency}."""
    none = {r["bs"]: r for r in rows if r["config"] == "none" and key in r}
    return {
        (r["config"], r["bs"]): r[key] / (none[r["bs"]][key] * r["accept_length"])
        for r in rows
        # The policy's accept length counts its unspeculated steps' tokens (tokens per
        # verify); a mixed load's rows have no one batch size.
        if r["config"] not in ("none", *ADAPTIVE_CONFIGS) and r["bs"] != MIXED
        if r["bs"] in none and key in r
    }


def print_spec_efficiency(rows: list[dict]) -> None:
    whole = spec_efficiency(rows)
    decode = spec_efficiency(rows, "decode_tok_per_s")
    if whole:
        print("spec efficiency, whole requests / past the first token:")
        for (config, bs), value in whole.items():
            past = decode.get((config, bs))
            print(
                f"  {config} bs {bs}: {value:.3f}"
                + (f" / {past:.3f}" if past is not None else "")
            )
    first = [r for r in rows if "first_token_ms" in r]
    if first:
        print("first token (the batch's prompts to one token, best run), ms:")
        for r in first:
            print(f"  {r['config']} bs {r['bs']}: {r['first_token_ms']:.1f}")


def print_scheduler_use(rows: list[dict]) -> None:
    """Each row's scheduler CPU use: a host-bound engine whose scheduler lost its core to
    other work (preemptions, CPU seconds per second under 1) measured its host, not only its
    config. A slower core at full use does not show here."""
    used = [r for r in rows if "scheduler_busy" in r]
    if used:
        print(
            "scheduler CPU seconds per second / involuntary switches per second"
            " / voluntary switches per second:"
        )
        for r in used:
            speed = r.get("scheduler_cpu_speed")
            print(
                f"  {r['config']} bs {r['bs']}: {r['scheduler_busy']:.2f} / "
                f"{r['scheduler_preempted_per_s']:.1f} / "
                f"{r.get('scheduler_waits_per_s', '-')}"
                + (
                    f" | cpu {r['scheduler_cpus']}, speed {speed:.2f} before start"
                    if speed is not None
                    else ""
                )
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="toy", choices=sorted(synth.PRESETS))
    parser.add_argument("--agreement", type=float, default=0.7)
    parser.add_argument("--configs", default="none,chain,chain-general")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--models", help="directory for the pair (default: a temp dir)")
    parser.add_argument("--out")
    parser.add_argument(
        "--prompt-len",
        default="8,64",
        help="MIN,MAX prompt tokens per request (uniform); e.g. 1024,4096 for long contexts",
    )
    parser.add_argument("--png")
    parser.add_argument(
        "--tree",
        default="4,3,8",
        help="topk,num_steps,num_draft_tokens of the tree configs",
    )
    parser.add_argument(
        "--policy-shapes",
        default=" ".join(POLICY_SHAPES),
        help='shapes of the "policy" config, space-separated TOPK,STEPS,DRAFT_TOKENS; '
        "the first is run first",
    )
    parser.add_argument(
        "--policy-trace",
        help='the policy config\'s "trace" file: per decode result, what the policy '
        "measured and its scores after",
    )
    parser.add_argument(
        "--mixed-load",
        help="REQUESTS:RAMP_SECONDS[:LONGxTOKENS]: also run REQUESTS requests arriving "
        "evenly over RAMP_SECONDS (the batch grows to about REQUESTS and back), after LONG "
        "requests of TOKENS tokens that arrive first (a tail at a small batch), a row with "
        "bs 'mixed'; or LEVELxREQUESTS,... (e.g. 1x8,16x64,64x128,16x64,1x8): phases of "
        "REQUESTS requests sent as completions let them in, at most LEVEL in flight, the "
        "same batch sizes for every engine",
    )
    parser.add_argument(
        "--policy-config",
        help="--speculative-adaptive-config of the policy config (e.g. one "
        "--write-policy-config wrote); overrides --policy-shapes",
    )
    parser.add_argument(
        "--write-policy-config",
        help="write a --speculative-adaptive-config with --policy-shapes and the step costs "
        "this run measured for them (fixed-shape configs on --attention-backend, page 1): "
        "seconds per step = bs x accept length / tok/s",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--no-warm-up-engine",
        action="store_true",
        help="do not start the discarded first engine (a policy config needs its warm-up "
        "cycling unless --side-by-side): each cell is already the best of --repeats runs, so the "
        "first engine's compiles cost it a run, not its result; for device calls one more "
        "engine start does not fit",
    )
    parser.add_argument(
        "--engine-log-level",
        default=ENGINE_LOG_LEVEL[0],
        help="sglang's --log-level in the engines: info logs each start-up phase's time",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="start every config's engine this many times, alternating configs, and keep "
        "each cell's best: engine-to-engine spread is larger than the gaps compared",
    )
    parser.add_argument(
        "--pin-scheduler",
        default="none",
        help="none, fastest or a CPU number: once each engine is up, run its scheduler "
        "processes on that CPU alone (fastest: the fastest by specpatch.gpu_host.vcpu_speed "
        "just before the engine started); a host-bound engine runs at its CPU's speed, and "
        "CPUs of a guest differ",
    )
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="start every config's engine at once and run the configs in turns, run by "
        "run, their schedulers on one CPU (--pin-scheduler's, the fastest for none): engines "
        "measured one after another also compare the CPUs they drew, which on a guest "
        "differ and drift (docs/benchmarks.md); needs GPU memory for every engine at once",
    )
    parser.add_argument(
        "--start-together",
        action="store_true",
        help="with --side-by-side: start the engines of configs that need the same env at "
        "once, a thread each, rather than one after another (each engine's start is most "
        "of a minute of its own scheduler's imports and graph captures)",
    )
    parser.add_argument(
        "--cuda-graph-bs",
        help="B1,B2,...: the batch sizes every engine captures CUDA graphs at, up to the "
        "run's largest batch (default: the run's batch sizes, or with --mixed-load sglang's "
        "23 sizes, whose captures made five engines' start-up 276 s); a batch between two "
        "pads to the next",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        metavar="SECONDS",
        help="with --side-by-side: start no load (the mixed load, a batch size) that would "
        "end more than SECONDS after this benchmark started, guessing each takes as long as "
        "the one before; the run then prints and writes what it measured, inside a device "
        "call's limit",
    )
    parser.add_argument(
        "--py-spy",
        metavar="DIR",
        help="with --side-by-side: sample each config's scheduler processes with py-spy over "
        "the measured runs, into DIR/stacks-CONFIG-PID.txt (collapsed stacks; compare two "
        "with benchmark/spec/stack_diff.py): which Python frames one engine adds per step",
    )
    parser.add_argument(
        "--freeze-gc",
        action="store_true",
        help="call sglang's freeze_gc once each engine is up (Engine.freeze_gc): the "
        "garbage collector then leaves start-up's objects out of its scans",
    )
    parser.add_argument(
        "--attention-backend",
        default=eng.BUNDLE_FLAGS["attention_backend"],
        help="the attention backend of configs without @BACKEND (fa3 needs sgl_kernel's "
        "flash_ops, flashinfer its JIT headers: README 'GPU tier')",
    )
    parser.add_argument(
        "--ratios",
        default="",
        help="A/B,C/D: print tok/s of config A over config B per bs (with --side-by-side, "
        "also run i of A over run i of B, each round's pair)",
    )
    parser.add_argument(
        "--few-row-gemm-table",
        metavar="FILE",
        help="bench_verify_gemm.py --out rows from this GPU: what the *-few-row-gemm configs "
        "run the few-row GEMM for (SGLANG_FEW_ROW_GEMM)",
    )
    parser.add_argument(
        "--replot", help="results.json of an earlier run: only draw --png"
    )
    args = parser.parse_args()
    if args.pin_scheduler not in ("none", "fastest") and (
        not args.pin_scheduler.isdigit() or int(args.pin_scheduler) not in HOST_CPUS
    ):
        parser.error(
            f"--pin-scheduler {args.pin_scheduler}: want none, fastest or one of the CPUs "
            f"this process may run on ({HOST_CPUS})"
        )
    if args.replot:
        rows = json.loads(Path(args.replot).read_text())
        names = list(dict.fromkeys(r["config"] for r in rows))
        # the run's own title, given the same --preset, --agreement and --tree
        plot(
            rows,
            names,
            args.png,
            f"{args.preset} target, draft agreement {args.agreement}, tree {args.tree}",
        )
        return
    set_tree_shape(*(int(x) for x in args.tree.split(",")))
    set_policy_shapes(args.policy_shapes.split())
    wants_table = [c for c in args.configs.split(",") if "few-row-gemm" in c]
    if wants_table and not args.few_row_gemm_table:
        parser.error(f"{wants_table[0]} runs the GEMMs of --few-row-gemm-table FILE")
    if args.few_row_gemm_table:
        set_few_row_gemm_table(args.few_row_gemm_table)
    if args.policy_config:
        set_policy_config(args.policy_config)
    POLICY_TRACE[0] = args.policy_trace
    PROMPT_LEN[:] = [int(n) for n in args.prompt_len.split(",")]
    ENGINE_LOG_LEVEL[0] = args.engine_log_level
    if not 1 <= PROMPT_LEN[0] <= PROMPT_LEN[1]:
        parser.error(
            f"--prompt-len {args.prompt_len}: want MIN,MAX with 1 <= MIN <= MAX"
        )
    deadline = Deadline(args.time_limit)
    if args.time_limit is not None and not args.side_by_side:
        parser.error("--time-limit cuts the loads of --side-by-side")
    if args.start_together and not args.side_by_side:
        parser.error("--start-together starts the engines of --side-by-side")
    if args.py_spy:
        if not args.side_by_side:
            parser.error("--py-spy samples the engines of --side-by-side")
        try:
            stack_sampler.py_spy_path()
        except FileNotFoundError as e:
            parser.error(f"--py-spy: {e}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]  # "": mixed only
    mixed = parse_load(args.mixed_load) if args.mixed_load else None
    if args.cuda_graph_bs:
        CUDA_GRAPH_BS[:] = sorted({int(b) for b in args.cuda_graph_bs.split(",")})
        largest = max([*batch_sizes, mixed.most_in_flight if mixed else 0])
        if CUDA_GRAPH_BS[-1] < largest:
            parser.error(
                f"--cuda-graph-bs {args.cuda_graph_bs}: the run reaches bs {largest}, "
                "which would run without CUDA graphs"
            )
    names = args.configs.split(",")
    if any(split_config(n, args.attention_backend)[0] == POLICY_CHAIN for n in names):
        try:
            policy_chain_config(POLICY_SHAPES)
        except ValueError as e:
            parser.error(str(e))
    policies = policy_configs(names, args.attention_backend)
    if args.no_warm_up_engine and policies and not args.side_by_side:
        # One after another, the policy's first steps at each (shape, size) compile kernels
        # for the fixed shapes measured after it; side by side, every config's first run at
        # each size pays its own, and the best of --repeats drops that run for all alike.
        parser.error(
            f"--no-warm-up-engine: {policies} need the warm-up engine's cycling "
            "(or --side-by-side)"
        )

    target, draft = ensure_pair(args.models, args.preset, args.agreement)
    vocab = synth.load_meta(target)["spec"]["vocab"]
    # Every greedy output is checked against the target's table: an A/B is an identity run.
    successor = greedy_table(target)
    # The first engine in a process pays one-time costs (kernel JIT and autotune caches) that
    # otherwise favour whichever config is measured later: start and discard one first.
    backend = {"attention_backend": args.attention_backend}
    if not args.no_warm_up_engine:
        warm_jit_caches(
            target, draft, names, batch_sizes, vocab, args.attention_backend, mixed
        )
    best: dict[tuple, dict] = {}  # (config, bs) -> the fastest row of its engines
    per_round: dict[tuple, list] = {}  # (config, bs) -> tok/s of each round's engine
    common = dict(
        repeats=args.repeats,
        mixed=mixed,
        successor=successor,
        pin_scheduler=args.pin_scheduler,
        freeze_gc=args.freeze_gc,
        **backend,
    )
    for _ in range(args.rounds):
        if deadline.expired:  # a round's engines would start only to measure nothing
            break
        if args.side_by_side:
            groups = [
                measure_side_by_side(
                    target,
                    draft,
                    names,
                    batch_sizes,
                    args.max_new_tokens,
                    vocab,
                    stacks_dir=Path(args.py_spy) if args.py_spy else None,
                    deadline=deadline,
                    start_together=args.start_together,
                    **common,
                )
            ]
        else:  # one engine after another, each measured while it is the only one
            groups = (
                measure(
                    target,
                    draft,
                    name,
                    batch_sizes,
                    args.max_new_tokens,
                    vocab,
                    **common,
                )
                for name in names
            )
        for group in groups:
            for r in group:
                name = r["config"]
                r["engines"] = args.rounds
                per_round.setdefault((name, r["bs"]), []).append(r["tok_per_s"])
                r["tok_per_s_per_round"] = per_round[name, r["bs"]]
                if (name, r["bs"]) not in best or r["tok_per_s"] > best[name, r["bs"]][
                    "tok_per_s"
                ]:
                    best[name, r["bs"]] = r
            if args.out:  # a run cut short still leaves the engines it finished
                Path(args.out).write_text(json.dumps(list(best.values()), indent=1))
    rows = sorted(best.values(), key=row_order(names))

    base = names[0]
    print(
        f"preset={args.preset} ({synth.load_meta(target)['num_params'] / 1e9:.2f}B) "
        f"agreement={synth.load_meta(draft)['agreement']:.2f} max_new_tokens={args.max_new_tokens} "
        f"attention_backend={args.attention_backend}"
    )
    print(f"{'config':>14} {'bs':>4} {'tok/s':>9} {'accept':>7} {'vs ' + base:>10}")
    for r in rows:
        ref = next(x for x in rows if x["config"] == base and x["bs"] == r["bs"])
        r["ratio_vs_" + base] = r["tok_per_s"] / ref["tok_per_s"]
        print(
            f"{r['config']:>14} {r['bs']:>4} {r['tok_per_s']:>9.1f} {r['accept_length']:>7.2f} {r['ratio_vs_' + base]:>9.2f}x"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print(identity_line(rows))
    warning = host_load_line(rows, os.cpu_count() or 1)
    if warning:
        print(warning)
    print_pair_ratios(rows, "tree", "tree-v1", "tok_per_s", "tree v2 / v1 tok/s")
    if args.rounds > 1:
        spread = round_ratios(per_round, "tree", "tree-v1")
        if spread:
            print(
                "tree v2 / v1 tok/s, each round's engines: "
                + ", ".join(
                    f"bs {bs} [{' '.join(f'{x:.2f}' for x in ratios)}]"
                    for bs, ratios in spread.items()
                )
            )
    print_pair_ratios(
        rows, "tree", "chain", "accept_length", "tree / chain accept length"
    )
    print_policy_ratios(rows)
    print_spec_efficiency(rows)
    print_scheduler_use(rows)
    spread = spread_lines(rows)
    if spread:
        print("tok/s spread over 10 % of the best (each run or engine, in order):")
        print("\n".join(spread))
    mixed_runs = mixed_run_lines(rows)
    if mixed_runs:
        print("mixed load, each run's tok/s at its most requests in flight, in order:")
        print("\n".join(mixed_runs))
    for pair in filter(None, args.ratios.split(",")):
        num, den = pair.split("/")
        print_pair_ratios(rows, num, den, "tok_per_s", f"{num} / {den} tok/s")
        turns = turn_ratio_line(rows, num, den)
        if turns:
            print(turns)
    if args.write_policy_config:
        write_policy_config(
            rows, POLICY_SHAPES, args.attention_backend, args.write_policy_config
        )
    if args.png:
        plot(
            rows,
            names,
            args.png,
            f"{args.preset} target, draft agreement {args.agreement}, tree {args.tree}",
        )


def greedy_table(target) -> list[int]:
    """The target's greedy successor table, read on the GPU where there is one (a 7B-class
    target's embed x lm_head is minutes on a few CPU cores), then freed for the engines.
    """
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    table = synth.successor_table(target, device=device).tolist()
    if device == "cuda":
        torch.cuda.empty_cache()
    return table


def identity_line(rows: list[dict]) -> str:
    """One line on whether every measured cell kept the target's greedy output."""
    checked = [r for r in rows if r.get("diverged") is not None]
    bad = [r for r in checked if r["diverged"]]
    if not bad:
        return (
            f"token identity: all {len(checked)} cells match the target's greedy table"
        )
    return "token identity: DIVERGED in " + ", ".join(
        f"{r['config']} bs {r['bs']} ({r['diverged']} requests)" for r in bad
    )


def host_load_line(rows: list[dict], cpus: int) -> Optional[str]:
    """A warning when the host's 1-minute load average passed half its cores while a config
    ran: host-bound engines (a small target, small batches) then lose up to half their speed
    to other processes (a JIT compile, another GPU's benchmark), and the rows compare with
    nothing."""
    busy = {
        r["config"]: r["host_load"] for r in rows if r.get("host_load", 0) > cpus / 2
    }
    if not busy:
        return None
    return f"host load: over {cpus / 2:g} (half of {cpus} cores) while " + ", ".join(
        f"{config} ran ({load})" for config, load in busy.items()
    )


def spread_lines(rows: list[dict], least: float = 0.10) -> list[str]:
    """One line per cell whose runs spread by more than `least` of its best, within one
    engine (its repeats) or between the engines of its rounds. A cell steady within its
    engine and not across engines measured the engine, not the config."""
    lines = []
    for r in rows:
        for where, key in (
            ("runs", "tok_per_s_repeats"),
            ("engines", "tok_per_s_per_round"),
        ):
            values = r.get(key) or []
            if len(values) > 1 and min(values) < (1 - least) * max(values):
                lines.append(
                    f"  {r['config']} bs {r['bs']}, {where}: "
                    + " / ".join(f"{v:.0f}" for v in values)
                )
    return lines


# Runs of one config whose peaks differ by more than this factor ran different loads.
PEAK_SPREAD = 1.5


def mixed_run_lines(rows: list[dict]) -> list[str]:
    """One line per mixed-load row: each run's tok/s with its batch at its largest, and a
    last line where one config's runs peaked PEAK_SPREAD apart or more."""
    lines, spread = [], []
    for r in rows:
        peaks = r.get("peak_in_flight_repeats")
        if r["bs"] != MIXED or not peaks:
            continue
        runs = zip(r["tok_per_s_repeats"], peaks)
        lines.append(
            f"  {r['config']}: " + " / ".join(f"{t:.0f} at {p}" for t, p in runs)
        )
        if max(peaks) >= PEAK_SPREAD * max(min(peaks), 1):
            spread.append(r["config"])
    if spread:
        lines.append(
            f"  runs of {', '.join(spread)} peaked {PEAK_SPREAD}x apart or more: different "
            "loads, not noise (a closed-loop --mixed-load LEVELxREQUESTS,... holds the sizes)"
        )
    return lines


def fixed_shape_rows(rows: list[dict], backend: str) -> Iterator[tuple[str, dict]]:
    """(shape label, row) of each row of a fixed-shape spec v2 config on `backend` at page
    size 1 and a fixed batch size: what a step of that shape costs at that size."""
    for r in rows:
        config, row_backend, page = split_config(r["config"], backend)
        spec, _ = CONFIGS[config]
        if (
            config in ADAPTIVE_CONFIGS
            or config in VERIFY_BACKENDS
            or spec is None
            or not spec.overlap
            or (row_backend, page) != (backend, 1)
            or r["bs"] == MIXED
        ):
            continue
        yield f"{spec.topk},{spec.num_steps},{spec.num_draft_tokens}", r


def measured_step_costs(rows: list[dict], backend: str) -> dict[str, dict[str, float]]:
    """Seconds per decode step by shape label and batch size, from fixed_shape_rows: a step
    commits accept_length tokens for each of bs requests."""
    costs: dict[str, dict[str, float]] = {}
    for label, r in fixed_shape_rows(rows, backend):
        seconds = r["bs"] * r["accept_length"] / r["tok_per_s"]
        costs.setdefault(label, {})[str(r["bs"])] = seconds
    return costs


def write_policy_config(
    rows: list[dict], shapes: list[str], backend: str, path: str
) -> None:
    costs = measured_step_costs(rows, backend)
    missing = [s for s in shapes if s not in costs]
    if missing:
        print(
            f"--write-policy-config: no {backend} rows for {missing}; nothing written"
        )
        return
    config = {"shapes": shapes, "step_costs": {s: costs[s] for s in shapes}}
    Path(path).write_text(json.dumps(config, indent=1))
    print(f"--write-policy-config: wrote {path}")


def row_order(names: list[str]):
    """Rows by config, then batch size, the mixed load last."""
    return lambda r: (
        names.index(r["config"]),
        r["bs"] == MIXED,
        0 if r["bs"] == MIXED else r["bs"],
    )


def round_ratios(
    per_round: dict[tuple, list], num: str, den: str
) -> dict[int, list[float]]:
    """bs -> num / den tok/s of each round (the engines started next to each other): how far
    one round's ratio strays from another's, the noise that best-of-rounds smooths."""
    return {
        bs: [a / b for a, b in zip(values, per_round[den, bs])]
        for (name, bs), values in per_round.items()
        if name == num and (den, bs) in per_round
    }


def is_fixed_shape_like(name: str, policy: str) -> bool:
    """Whether config `name` is a fixed spec v2 shape on the policy's backend and page size:
    what the policy chooses among."""
    config, backend, page = split_config(name, "")
    spec, env = CONFIGS[config]
    return (
        config not in ADAPTIVE_CONFIGS
        and config not in VERIFY_BACKENDS  # another backend's verify, not a shape
        and not KERNEL_SWITCHES & env.keys()  # an A/B of a switch, not a shape
        and spec is not None
        and spec.overlap
        and (backend, page) == split_config(policy, "")[1:]
    )


def best_run(row: dict) -> float:
    return row["tok_per_s"]


def median_run(row: dict) -> float:
    """The row's median run: with a few runs per engine and runs that spread by a third on a
    host-bound target, the best of each of five engines stands above a sixth's best on noise
    alone; medians compare like with like."""
    return statistics.median(row.get("tok_per_s_repeats") or [row["tok_per_s"]])


def policy_ratios(
    rows: list[dict], policy: str = "policy", statistic: Callable = best_run
) -> dict:
    """Per bs (and the mixed load): policy config `policy`'s tok/s over no speculation and
    over the best fixed shape measured in the same run (the shape policy's targets,
    docs/shape-policy.md), each row's tok/s read by `statistic` (its best run by default).
    {bs: (vs_none or None, vs_best_fixed or None, best fixed config or None)}."""
    out = {}
    for r in rows:
        if r["config"] != policy:
            continue
        same_bs = [x for x in rows if x["bs"] == r["bs"]]
        none = next((x for x in same_bs if x["config"] == "none"), None)
        fixed = [x for x in same_bs if is_fixed_shape_like(x["config"], r["config"])]
        best = max(fixed, key=statistic, default=None)
        out[r["bs"]] = (
            statistic(r) / statistic(none) if none else None,
            statistic(r) / statistic(best) if best else None,
            best["config"] if best else None,
        )
    return out


# Runs per engine from which print_policy_ratios also compares medians.
MEDIAN_RUNS = 3


def policy_round_margins(rows: list[dict], policy: str = "policy") -> dict:
    """Per bs, side by side: in each round, the policy's run over the best fixed shape's run
    of that round (run i of every engine comes from round i, Turns). #24's mixed-load target
    is "more than every fixed shape"; a margin above 1 in every round says so of the runs,
    not only of each config's luckiest one. {bs: [margin per round]}."""
    out = {}
    for r in rows:
        if r["config"] != policy or not r.get("side_by_side"):
            continue
        fixed = [
            x["tok_per_s_repeats"]
            for x in rows
            if x["bs"] == r["bs"]
            and x.get("side_by_side")
            and x.get("tok_per_s_repeats")
            and is_fixed_shape_like(x["config"], policy)
        ]
        runs = r.get("tok_per_s_repeats") or []
        if fixed and runs:
            out[r["bs"]] = [
                run / max(f[i] for f in fixed)
                for i, run in enumerate(runs)
                if all(i < len(f) for f in fixed)
            ]
    return out


def print_policy_ratios(rows: list[dict]) -> None:
    medians = all(len(r.get("tok_per_s_repeats") or ()) >= MEDIAN_RUNS for r in rows)
    for policy in POLICY_STEP_TIME:
        ratios = policy_ratios(rows, policy)
        if ratios:
            print_one_policy_ratios(policy, ratios)
            if medians:
                print_one_policy_ratios(
                    policy, policy_ratios(rows, policy, median_run), "median runs"
                )
        margins = policy_round_margins(rows, policy)
        if margins:
            print(f"{policy} over the round's best fixed shape, each round:")
            for bs, values in margins.items():
                print(f"  bs {bs} {rounds_cell(values)}")


def print_one_policy_ratios(policy: str, ratios: dict, runs: str = "best runs") -> None:
    print(
        f"{policy}, {runs} (targets: >= 1.00x none, >= 0.95x the best fixed shape; "
        "mixed: > 1.00x):"
    )
    for bs, (vs_none, vs_best, best) in ratios.items():
        cells = [f"bs {bs}"]
        if vs_none is not None:
            cells.append(f"{vs_none:.2f}x none")
        if vs_best is not None:
            cells.append(f"{vs_best:.2f}x {best}")
        print("  " + ", ".join(cells))


def print_pair_ratios(
    rows: list[dict], num: str, den: str, key: str, title: str
) -> None:
    pairs = [
        (a, b)
        for a in rows
        for b in rows
        if a["config"] == num and b["config"] == den and a["bs"] == b["bs"]
    ]
    if pairs:
        print(
            title
            + ": "
            + ", ".join(f"bs {a['bs']} {a[key] / b[key]:.2f}x" for a, b in pairs)
        )


def turn_ratios(rows: list[dict], num: str, den: str) -> dict:
    """bs -> num / den tok/s of each turn of a side-by-side run: run i of one engine over
    run i of the other, both from round i (Turns), minutes apart at most. Best of N picks
    each config's luckiest run, and two configs' best runs can come from different rounds;
    pairs from one round share the host's state at the time, so their ratios show whether
    one config is ahead run after run or only in its best run."""
    out = {}
    for a in rows:
        if a["config"] != num or not a.get("side_by_side"):
            continue
        b = next((x for x in rows if x["config"] == den and x["bs"] == a["bs"]), None)
        if b is None or not b.get("side_by_side"):
            continue
        pairs = zip(a.get("tok_per_s_repeats") or (), b.get("tok_per_s_repeats") or ())
        ratios = [x / y for x, y in pairs]
        if ratios:
            out[a["bs"]] = ratios
    return out


def turn_ratio_line(rows: list[dict], num: str, den: str) -> Optional[str]:
    """One line of turn_ratios: each turn's ratio, their median and how many are above 1."""
    ratios = turn_ratios(rows, num, den)
    if not ratios:
        return None
    cells = [f"bs {bs} {rounds_cell(values)}" for bs, values in ratios.items()]
    return f"{num} / {den} tok/s, each turn's pair: " + "; ".join(cells)


def rounds_cell(ratios: list[float]) -> str:
    """One ratio per round, their median and how many rounds are above 1."""
    wins = sum(v > 1 for v in ratios)
    return (
        f"[{' '.join(f'{v:.2f}' for v in ratios)}] median "
        f"{statistics.median(ratios):.2f}, {wins} of {len(ratios)} above 1"
    )


def plot(rows: list[dict], names: list[str], png: str, title: str) -> None:
    # The Figure API, not pyplot: pyplot probes IPython, which the GPU bundle replaces by a shim.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for name in names:
        pts = [r for r in rows if r["config"] == name and r["bs"] != MIXED]
        ax.plot(
            [p["bs"] for p in pts],
            [p["tok_per_s"] for p in pts],
            marker="o",
            label=name,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tok/s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
