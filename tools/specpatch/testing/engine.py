"""Run sglang Engines on synthetic model pairs: the flags the GPU bundle needs, greedy runs,
accept-length and throughput readings. Shared by the GPU tests and the benchmarks."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

# The trimmed GPU bundle has no FA3, no FlashInfer JIT and no xgrammar (shared/gpu/README.md).
BUNDLE_FLAGS = dict(
    attention_backend="triton", sampling_backend="pytorch", grammar_backend="none"
)


def flashinfer_unavailable() -> Optional[str]:
    """Why FlashInfer's kernels cannot run here, or None: they JIT-compile against headers the
    GPU bundle drops, or load modules compiled before; specpatch.gpu_host.flashinfer_stage ships
    either (with modules only, a kernel not among them fails to compile rather than skip).
    """
    import torch

    if not torch.cuda.is_available():
        return "no CUDA"
    try:
        import flashinfer
    except ImportError as exc:
        return str(exc)
    return flashinfer_kernels_missing(Path(flashinfer.__file__).parent)


def flashinfer_kernels_missing(package: Path) -> Optional[str]:
    """Why the flashinfer package at `package` can build or load no kernel, or None."""
    data = package / "data"
    if (data / "cutlass").is_dir() or any((data / "aot").glob("*")):
        return None
    return (
        "flashinfer has neither JIT headers nor compiled modules here (the GPU bundle drops "
        "both); specpatch.gpu_host.flashinfer_stage ships them"
    )


def fa3_unavailable() -> Optional[str]:
    """Why FA3 cannot run here, or None: the GPU bundle leaves sgl_kernel's flash_ops out
    (specpatch.gpu_host.fa3_stage ships it in parts), and what it ships runs on sm_90 only.
    """
    import torch

    if not torch.cuda.is_available():
        return "no CUDA"
    if torch.cuda.get_device_capability()[0] != 9:
        return "sgl_kernel's FA3 images for this test host are sm_90 only"
    try:
        import sgl_kernel.flash_attn  # noqa: F401
    except ImportError as exc:
        return f"{exc} The GPU bundle leaves FA3 out; tools/specpatch/gpu_host/fa3_stage.py ships it in parts."
    return None


@dataclass(frozen=True)
class SpecConfig:
    """One speculative configuration; None means no speculation."""

    topk: int
    num_steps: int
    num_draft_tokens: int
    overlap: bool = True  # False: spec v1 (the base's fallback for trees)

    @property
    def label(self) -> str:
        version = "v2" if self.overlap else "v1"
        shape = "chain" if self.topk == 1 else "tree"
        return (
            f"{version}-{shape}-k{self.topk}s{self.num_steps}d{self.num_draft_tokens}"
        )


# What the synthetic pairs' KV pools may take: a 7B target's 14.5 GB of weights, this and the
# draft's pool fit sglang's default static share (0.55) of an 80 GB H100.
KV_POOL_BYTES = 16 << 30
MAX_POOL_TOKENS = 1 << 18


def pool_tokens(target_spec) -> int:
    """max_total_tokens for a synthetic target (a synth.TargetSpec): 2^18 tokens, or fewer where
    the target's KV for them would pass KV_POOL_BYTES. Sized from free memory instead, a tiny
    model's pool would fill the GPU, twice with a draft; a 7B target's would not fit at 2^18.
    """
    return min(MAX_POOL_TOKENS, KV_POOL_BYTES // target_spec.kv_bytes_per_token)


def pool_tokens_for(target: Path) -> int:
    """pool_tokens of the synthetic target written at `target`."""
    from specpatch.testing import synth

    return pool_tokens(synth.TargetSpec(**synth.load_meta(target)["spec"]))


def engine_kwargs(
    target: Path,
    draft: Optional[Path],
    spec: Optional[SpecConfig],
    *,
    cuda_graph: bool = True,
    max_running_requests: int = 64,
    mem_fraction_static: float = 0.55,
    max_total_tokens: int = 1 << 18,
    **extra,
) -> dict:
    # max_total_tokens: a tiny model's KV pool would otherwise fill the GPU, twice with a draft.
    kwargs = dict(
        model_path=str(target),
        max_total_tokens=max_total_tokens,
        skip_tokenizer_init=True,
        page_size=1,
        disable_cuda_graph=not cuda_graph,
        cuda_graph_max_bs=max_running_requests,
        max_running_requests=max_running_requests,
        mem_fraction_static=mem_fraction_static,
        random_seed=0,
        log_level="warning",
        **BUNDLE_FLAGS,
    )
    if spec is not None:
        kwargs.update(
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=str(draft),
            speculative_eagle_topk=spec.topk,
            speculative_num_steps=spec.num_steps,
            speculative_num_draft_tokens=spec.num_draft_tokens,
            disable_overlap_schedule=not spec.overlap,
        )
    kwargs.update(extra)
    return kwargs


# sglang's DP-attention engine talks over TCP from `port + ZMQ_TCP_PORT_DELTA` upwards
# (server_args.PortArgs.init_new), and its in-process tokenizer manager keeps those ports bound
# after shutdown; engines started one after another in one pytest process each need their own.
_DP_PORT_SPAN = 8  # dist_init, port_base and what PortArgs derives from it


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def dp_port_is_free(port: int) -> bool:
    """`port` and the DP-attention TCP block sglang derives from it are all bindable now."""
    from sglang.srt.server_args import ZMQ_TCP_PORT_DELTA

    first = port + ZMQ_TCP_PORT_DELTA
    return _bindable(port) and all(
        _bindable(p) for p in range(first, first + _DP_PORT_SPAN)
    )


# Above what sglang derives from a port: nccl_port is port + 100..1000 (PortArgs.init_new).
_DERIVED_PORT_SPAN = 1100


def ephemeral_port_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (ip_local_port_range)."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def chosen_port_range() -> tuple[int, int]:
    """[start, stop) for ports the tests pick. Below the ephemeral range: a server binds its port
    only after loading the model, and in that window an outgoing connection (another engine's, or
    the health poll's own, which can connect to itself) may be given the same port by the kernel;
    "address already in use" then stops the server."""
    return 20000, max(
        20000 + _DERIVED_PORT_SPAN, ephemeral_port_floor() - _DERIVED_PORT_SPAN
    )


def free_dp_port(rng: random.Random | None = None, attempts: int = 200) -> int:
    """A `port` for a DP-attention engine whose TCP block is free now (dp_port_is_free)."""
    rng = rng or random.Random()
    for _ in range(attempts):
        port = rng.randrange(*chosen_port_range())
        if dp_port_is_free(port):
            return port
    raise RuntimeError(f"no free DP-attention port block found in {attempts} attempts")


class EngineChildFailed(SystemExit):
    """One of an in-process Engine's child processes failed (a scheduler exception, a child
    killed by a signal, the host's OOM killer included).

    sglang answers with SIGQUIT to the Engine's process, whose handler SIGKILLs that process:
    a pytest run then ends in "Killed", no traceback, and the children's log is lost in
    pytest's capture (which looks like the kernel's OOM killer). engine() turns it into this
    exception instead, carrying the tail of the captured log. A SystemExit, because asyncio
    swallows anything else raised by its signal callback (the running phase's handler), and
    pytest records it as the failure of the test that was running.
    """


# The modules whose SIGQUIT handlers call kill_process_tree(os.getpid()): the launch phase's
# (Engine start-up) and the running phase's (TokenizerManager, once requests are served).
_SELF_KILLERS = (
    "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.tokenizer_manager",
)


def captured_tail(fd: int = 2, limit: int = 4000) -> str:
    """The last `limit` bytes written to `fd` when it is a regular file (pytest's capfd, a
    redirect), else "" (a terminal or a pipe keeps the log anyway)."""
    try:
        size = os.fstat(fd).st_size if stat.S_ISREG(os.fstat(fd).st_mode) else 0
        start = max(0, size - limit)
        return (
            os.pread(fd, size - start, start).decode(errors="replace") if size else ""
        )
    except OSError:
        return ""


@contextlib.contextmanager
def child_failure_raises() -> Iterator[None]:
    """While open, sglang's "kill this process" on a child's failure kills the children only
    and raises EngineChildFailed in this process."""
    import importlib

    from sglang.srt.utils.common import kill_process_tree as kill

    modules = [importlib.import_module(name) for name in _SELF_KILLERS]
    originals = [module.kill_process_tree for module in modules]

    def kill_process_tree(parent_pid, include_parent: bool = True, *args, **kwargs):
        if parent_pid != os.getpid() or not include_parent:
            return kill(parent_pid, include_parent, *args, **kwargs)
        kill(parent_pid, False)
        raise EngineChildFailed(
            "an sglang child process failed; sglang would have SIGKILLed this process "
            "(pytest: 'Killed', no traceback). Tail of the captured stderr:\n"
            + captured_tail()
        )

    for module in modules:
        module.kill_process_tree = kill_process_tree
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            module.kill_process_tree = original


@contextlib.contextmanager
def engine(**kwargs) -> Iterator[object]:
    import sglang as sgl
    from sglang.srt.utils import kill_process_tree

    if kwargs.get("enable_dp_attention"):
        kwargs.setdefault("port", free_dp_port())
    with child_failure_raises():
        try:
            eng = sgl.Engine(**kwargs)
        except BaseException:
            # A scheduler that died during start-up leaves its siblings (and their GPU memory)
            # behind; the next test in this process must not inherit them.
            kill_process_tree(os.getpid(), include_parent=False)
            raise
        try:
            yield eng
        finally:
            eng.shutdown()


@contextlib.contextmanager
def sigquit_kills_children() -> Iterator[None]:
    """While open, a SIGQUIT to this process (an sglang child's failure, or its engine's
    watchdog) goes to sglang's kill_process_tree, as the handler an Engine installs when it
    starts in the main thread; one started in another thread installs none (signal handlers
    belong to the main thread), and SIGQUIT's default would end this process with no
    traceback. Under child_failure_raises that kill raises EngineChildFailed here. Must be
    entered in the main thread; the handler before it comes back on exit."""
    import signal

    from sglang.srt.entrypoints import engine as sgl_engine

    def handler(signum, frame):
        sgl_engine.kill_process_tree(os.getpid())  # looked up now: the patched one

    previous = signal.signal(signal.SIGQUIT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGQUIT, previous)


@contextlib.contextmanager
def engine_group() -> Iterator[Callable[..., object]]:
    """Engines that run side by side in this process: yields start(**engine_kwargs), which
    starts one more and returns it; every engine started stops on exit.

    sglang assumes one engine per process: each engine's shutdown kills every child of this
    process, and each engine's watchdog signals this process (SIGQUIT) once a child of its
    engine has gone. So every watchdog stops before the children are killed, once."""
    import sglang as sgl
    from sglang.srt.utils import kill_process_tree

    started = []

    def start(**kwargs) -> object:
        started.append(sgl.Engine(**kwargs))
        return started[-1]

    with child_failure_raises():
        try:
            yield start
        finally:
            for e in started:
                # as Engine.shutdown does before its kill
                watchdog = e.tokenizer_manager._subprocess_watchdog
                if watchdog is not None:
                    watchdog.stop()
            # As Engine.shutdown: wait until the schedulers have let go of the GPU, so that
            # engines started next (another round) find its memory free.
            kill_process_tree(os.getpid(), include_parent=False, wait_timeout=60)


def free_server_port(rng: random.Random | None = None, attempts: int = 200) -> int:
    """A bindable `--port` whose derived ports are valid too (ServerArgs refuses a port above
    55535: it derives the gRPC port as port + 10000), from chosen_port_range."""
    rng = rng or random.Random()
    for _ in range(attempts):
        port = rng.randrange(*chosen_port_range())
        if _bindable(port):
            return port
    raise RuntimeError(f"no free server port found in {attempts} attempts")


@contextlib.contextmanager
def server(startup_s: float = 300, **kwargs) -> Iterator[str]:
    """`python -m sglang.launch_server` with engine_kwargs-style settings; yields its base URL
    once /health answers, and stops the whole process group afterwards."""
    import requests

    port = free_server_port()
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value not in (False, None):
            cmd += [flag, str(value)]
    proc = subprocess.Popen(cmd, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"server exited during start-up with {proc.returncode}"
                )
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"server did not become healthy in {startup_s} s")
            time.sleep(2)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have exited already
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def random_prompts(
    n: int, vocab_size: int, *, min_len: int = 8, max_len: int = 64, seed: int = 0
) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(vocab_size) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(n)
    ]


@dataclass
class GreedyRun:
    output_ids: list[list[int]]
    seconds: float
    completion_tokens: int
    verify_count: int = 0
    meta: list[dict] = field(default_factory=list)
    # Requests in flight at once at the most, as the client saw them (arrivals_generate
    # and concurrency_generate only): a clock's batch grows as far as the engine falls
    # behind it.
    peak_in_flight: Optional[int] = None

    @classmethod
    def of_outputs(cls, outs: list[dict], seconds: float) -> "GreedyRun":
        """From the Engine's outputs (output_ids and meta_info per request)."""
        meta = [o["meta_info"] for o in outs]
        return cls(
            output_ids=[list(o["output_ids"]) for o in outs],
            seconds=seconds,
            completion_tokens=sum(m["completion_tokens"] for m in meta),
            verify_count=sum(m.get("spec_verify_ct", 0) for m in meta),
            meta=meta,
        )

    @property
    def tok_per_s(self) -> float:
        return self.completion_tokens / self.seconds

    @property
    def accept_length(self) -> float:
        """Mean tokens committed per verify step (drafts + bonus), from the requests' meta_info.
        Steps without speculation (the shape policy's "none") commit a token and count no
        verify: with them in the run this is tokens per verify, above any shape's accept
        length."""
        return (
            self.completion_tokens / self.verify_count
            if self.verify_count
            else float("nan")
        )


def generate(
    eng, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0
) -> GreedyRun:
    params = dict(
        temperature=temperature, max_new_tokens=max_new_tokens, ignore_eos=True
    )
    tic = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - tic
    return GreedyRun.of_outputs(outs, seconds)


def ramp_generate(
    eng, prompts: list[list[int]], max_new_tokens: int, ramp_seconds: float
) -> GreedyRun:
    """Greedy requests that arrive one by one, evenly over ramp_seconds (request i after
    i * ramp_seconds / len(prompts)); timed from the first arrival to the last completion.
    """
    gap = ramp_seconds / len(prompts)
    return arrivals_generate(
        eng,
        prompts,
        [max_new_tokens] * len(prompts),
        [i * gap for i in range(len(prompts))],
    )


def arrivals_generate(
    eng,
    prompts: list[list[int]],
    max_new_tokens: list[int],
    delays: list[float],
) -> GreedyRun:
    """Greedy requests, request i arriving delays[i] seconds after the first and asking for
    max_new_tokens[i] tokens; timed from the first arrival to the last completion."""
    import asyncio

    async def arrive(prompt: list[int], tokens: int, delay: float) -> SentRequest:
        await asyncio.sleep(delay)
        return await timed_send(eng, prompt, tokens)

    async def all_requests() -> list[SentRequest]:
        return await asyncio.gather(
            *(arrive(*a) for a in zip(prompts, max_new_tokens, delays, strict=True))
        )

    return run_on_engine_loop(eng, all_requests())


# A request's output and its (sent, finished) times on the host's clock.
SentRequest = tuple[dict, tuple[float, float]]


async def timed_send(eng, prompt: list[int], tokens: int) -> SentRequest:
    """One greedy request of `tokens` tokens, with when it was sent and when it finished."""
    params = dict(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    sent = time.perf_counter()
    out = await eng.async_generate(input_ids=prompt, sampling_params=params)
    return out, (sent, time.perf_counter())


def run_on_engine_loop(eng, requests) -> GreedyRun:
    """Run the `requests` coroutine (a list of SentRequest in request order) to its end,
    timed, and its outputs as one run with its peak in flight."""
    tic = time.perf_counter()
    # sglang's Engine runs its tokenizer manager on its own event loop (Engine.generate):
    # the thread's current loop is the last engine's where several run side by side.
    done = eng.loop.run_until_complete(requests)
    seconds = time.perf_counter() - tic
    run = GreedyRun.of_outputs([out for out, _ in done], seconds)
    run.peak_in_flight = peak_in_flight([span for _, span in done])
    return run


def concurrency_generate(
    eng,
    prompts: list[list[int]],
    max_new_tokens: list[int],
    levels: list[int],
) -> GreedyRun:
    """Greedy requests sent in order, request i as soon as fewer than levels[i] are in
    flight (a closed loop: each completion lets the next request in); timed from the first
    send to the last completion. Every engine runs the same batch sizes in the same order
    however fast it is, where requests arriving on a clock (arrivals_generate) gather a
    batch as large as the engine is slow."""
    import asyncio

    if not len(prompts) == len(max_new_tokens) == len(levels):
        raise ValueError(
            f"{len(prompts)} prompts, {len(max_new_tokens)} lengths, {len(levels)} levels"
        )

    async def all_requests() -> list[SentRequest]:
        tasks, in_flight = [], set()
        for prompt, tokens, level in zip(prompts, max_new_tokens, levels):
            while len(in_flight) >= level:
                _, in_flight = await asyncio.wait(
                    in_flight, return_when=asyncio.FIRST_COMPLETED
                )
            tasks.append(asyncio.ensure_future(timed_send(eng, prompt, tokens)))
            in_flight.add(tasks[-1])
        return await asyncio.gather(*tasks)

    return run_on_engine_loop(eng, all_requests())


def peak_in_flight(spans: list[tuple[float, float]]) -> int:
    """The most of the (sent, finished) spans open at one time; a request finishing when
    another is sent is not counted with it."""
    events = sorted([(sent, 1) for sent, _ in spans] + [(end, -1) for _, end in spans])
    open_now = peak = 0
    for _, change in events:
        open_now += change
        peak = max(peak, open_now)
    return peak


def timed_runs(
    eng, prompts: list[list[int]], max_new_tokens: int, repeats: int
) -> list[GreedyRun]:
    """`repeats` timed runs in order, after one untimed run of the same length.

    The warm-up is full length: engines in a benchmark start one after another, and a short one
    would leave triton's JIT compiles inside the first engine's timed runs, flattering the later
    engines by more than the differences a benchmark compares."""
    generate(eng, prompts, max_new_tokens)
    return [generate(eng, prompts, max_new_tokens) for _ in range(repeats)]


def kv_pool_tokens(engine) -> int:
    """The tokens a started engine's KV pool holds (sglang's max_total_num_tokens)."""
    return engine.get_server_info()["max_total_num_tokens"]


def fastest(runs: list[GreedyRun]) -> GreedyRun:
    """The run with the most tokens per second."""
    return max(runs, key=lambda r: r.tok_per_s)


def best_of(
    eng, prompts: list[list[int]], max_new_tokens: int, repeats: int
) -> GreedyRun:
    """The fastest of timed_runs."""
    return fastest(timed_runs(eng, prompts, max_new_tokens, repeats))


def first_divergence(a: list[int], b: list[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def spec_v2_identical_by_batch_size(
    target: Path,
    draft: Path,
    spec,
    batch_sizes: tuple[int, ...],
    seed: int,
    max_new_tokens: int = 48,
    **engine_overrides,
) -> dict[int, float]:
    """Start spec v2 with CUDA graphs at `batch_sizes` (the caller sets any env switch first:
    the engine's processes read it at start-up), check each batch's greedy tokens against the
    target's table, and return the accept length by batch size. engine_overrides: further
    engine_kwargs (e.g. log_level; attention_backend, triton unless given)."""
    from specpatch.testing import synth

    vocab = synth.load_meta(target)["spec"]["vocab"]
    prompts = random_prompts(max(batch_sizes), vocab, seed=seed)
    expected = synth.table_continuations(target, prompts, max_new_tokens)
    kwargs = engine_kwargs(
        target,
        draft,
        spec,
        cuda_graph=True,
        cuda_graph_bs=list(batch_sizes),
        **engine_overrides,
    )
    with engine(**kwargs) as e:
        assert e.server_args.attention_backend == engine_overrides.get(
            "attention_backend", "triton"
        )
        assert e.server_args.disable_overlap_schedule is False
        return identical_by_batch_size(e, prompts, expected, batch_sizes)


def identical_by_batch_size(
    e, prompts, expected, batch_sizes, label: str = ""
) -> dict[int, float]:
    """On a running engine, each batch size's first prompts produce exactly `expected` (as
    long as its rows); returns the accept length by batch size."""
    accept = {}
    for bs in batch_sizes:
        run = generate(e, prompts[:bs], len(expected[0]))
        assert_identical(run, expected[:bs], f"{label} bs {bs}".strip())
        accept[bs] = round(run.accept_length, 3)
    return accept


def assert_identical(run, expected: list[list[int]], label: str) -> None:
    """Every request of `run` produced exactly `expected`; the message names each diverging
    request and the first token where it diverges."""
    mismatched = {
        i: first_divergence(a, b)
        for i, (a, b) in enumerate(zip(run.output_ids, expected))
        if a != b
    }
    assert (
        not mismatched
    ), f"{label}: {len(mismatched)}/{len(expected)} requests diverge at {mismatched}"


# What sglang's idle pool check (scheduler_runtime_checker_mixin) logs when a pool's pages do not
# add up. A bare "leak" also matches tracebacks through tests named "..._leaks_nothing".
LEAK_REPORT = re.compile(r"memory leak detected", re.IGNORECASE)


def assert_no_leak_reported(log_text: str) -> None:
    """sglang's leak check reported nothing in the captured engine output."""
    reports = [line for line in log_text.splitlines() if LEAK_REPORT.search(line)]
    assert not reports, reports


# What sglang logs when it retracts requests to free KV.
RETRACT_LOG_LINE = "KV cache pool is full. Retract requests."


def retraction_stress(target: Path, draft: Path, spec: SpecConfig, **engine_overrides):
    """256 concurrent requests of 16-96 prompt tokens and 128 new tokens each on a KV pool of
    12000 tokens (a fraction of what they need), so the scheduler retracts. Checks that spec
    v2 ran, and the greedy tokens against the target's table; returns the run (the caller
    reads the captured log for retractions and leaks)."""
    from specpatch.testing import synth

    vocab = synth.load_meta(target)["spec"]["vocab"]
    many = random_prompts(256, vocab, seed=7, min_len=16, max_len=96)
    expected = synth.table_continuations(target, many, 128)
    kwargs = engine_kwargs(
        target,
        draft,
        spec,
        max_running_requests=256,
        max_total_tokens=12000,
        **engine_overrides,
    )
    with engine(**kwargs) as e:
        assert e.server_args.disable_overlap_schedule is False, "fell back to spec v1"
        run = generate(e, many, 128)
    assert_identical(run, expected, "retract stress")
    return run
