"""The shell scripts and documented command lines that run on hosts the CPU suite cannot reach.

tools/gpu-tests.sh and tools/gpu-env.sh run on the GPU host only: here they must at least parse,
every `python -m specpatch.X` that a script or a document names must be a runnable module, and
the summary gpu-tests.sh prints must read the junit XML that this suite's conftest produces
(record_metric's numbers included).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = sorted((REPO / "tools").glob("*.sh"))
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MODULE_RUN = re.compile(r"python[0-9.]*\s+-m\s+(specpatch(?:\.\w+)*)")
IMPORT = re.compile(r"from\s+(specpatch(?:\.\w+)*)\s+import\s+(\w+)")


def _env() -> dict[str, str]:
    path = os.pathsep.join(
        filter(None, [str(REPO / "tools"), os.environ.get("PYTHONPATH")])
    )
    return dict(os.environ, PYTHONPATH=path)


def test_the_gpu_scripts_exist():
    names = {p.name for p in SCRIPTS}
    assert {"gpu-tests.sh", "gpu-env.sh", "setup.sh"} <= names, names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _module_runs() -> list[tuple[str, str]]:
    found = []
    for path in SCRIPTS + DOCS:
        for module in MODULE_RUN.findall(path.read_text()):
            found.append((path.relative_to(REPO).as_posix(), module))
    return found


def test_the_scripts_run_the_staging_modules():
    """The GPU host's calls, as gpu-env.sh and gpu-tests.sh spell them."""
    runs = set(_module_runs())
    for script, module in [
        ("tools/gpu-env.sh", "specpatch.gpu_host.flashinfer_stage"),
        ("tools/gpu-env.sh", "specpatch.gpu_host.fa3_stage"),
        ("tools/gpu-tests.sh", "specpatch.gpu_host.flashinfer_stage"),
        ("tools/gpu-env.sh", "specpatch.gpu_host.triton_cache"),
        ("tools/gpu-tests.sh", "specpatch.gpu_host.triton_cache"),
        ("tools/gpu-lanes.sh", "specpatch.gpu_host.triton_cache"),
        ("tools/gpu-env.sh", "specpatch.gpu_host.jit_cache"),
        ("tools/gpu-tests.sh", "specpatch.gpu_host.jit_cache"),
        ("tools/gpu-lanes.sh", "specpatch.gpu_host.jit_cache"),
        ("tools/setup.sh", "specpatch.testing.cudastub"),
    ]:
        assert (script, module) in runs, (script, module, sorted(runs))


@pytest.mark.parametrize("where,module", sorted(set(_module_runs())))
def test_named_module_is_runnable(where, module):
    spec = importlib.util.find_spec(module)
    assert (
        spec is not None and spec.origin
    ), f"{where} runs {module}, which does not exist"
    source = Path(spec.origin)
    if spec.submodule_search_locations:  # a package: `python -m` runs its __main__
        source = source.parent / "__main__.py"
        assert source.exists(), f"{where} runs package {module}, which has no __main__"
    else:
        assert 'if __name__ == "__main__":' in source.read_text(), (where, module)


def test_named_modules_import_from_a_bare_checkout():
    """The GPU host runs them with PYTHONPATH=tools and no install, before the bundle's
    site-packages are set up: with site-packages off (-S), tools/ and the stdlib must suffice.
    """
    modules = sorted({m for _, m in _module_runs() if ".gpu_host." in m})
    assert modules
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code, *modules],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_documented_imports_resolve():
    for path in DOCS:
        for module, name in IMPORT.findall(path.read_text()):
            mod = importlib.import_module(module)
            found = hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}")
            assert found, f"{path.name}: from {module} import {name}"


SAMPLE = """
import pytest


def test_fast(record_metric):
    record_metric("tok_per_s", 1834.2)
    record_metric("accept_length_by_bs", {1: 2.5})


def test_broken():
    assert 1 == 2, "the failure text"


@pytest.mark.skip(reason="not here")
def test_elsewhere():
    pass


@pytest.fixture
def bad_fixture():
    raise RuntimeError("setup broke")


def test_setup_error(bad_fixture):
    pass
"""


def _summary_script() -> str:
    text = (REPO / "tools" / "gpu-tests.sh").read_text()
    match = re.search(r"<<'PY'\n(.*?)\nPY\n", text, re.S)
    assert match, "gpu-tests.sh lost its summary heredoc"
    return match.group(1)


def _summary(report: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-", str(report)],
        input=_summary_script(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    prefix = "gpu summary: "
    assert proc.stdout.startswith(prefix), proc.stdout
    return ast.literal_eval(proc.stdout[len(prefix) :].strip())


def test_gpu_report_carries_outcomes_and_metrics(tmp_path):
    """gpu-tests.sh's pytest call (--junitxml, this suite's conftest) on a stand-in test file:
    the XML holds each outcome, the failure text, record_metric's numbers and the stub in use,
    and the summary line counts it."""
    (tmp_path / "conftest.py").write_text(
        (REPO / "test" / "registered" / "conftest.py").read_text()
    )
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    report = tmp_path / "out" / "gpu-junit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts="]
        + ["--rootdir", str(tmp_path), "test_sample.py", "--junitxml", str(report)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    root = ET.parse(report).getroot()
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert set(cases) == {
        "test_fast",
        "test_broken",
        "test_elsewhere",
        "test_setup_error",
    }
    metrics = {
        p.get("name"): p.get("value") for p in cases["test_fast"].iter("property")
    }
    assert metrics == {"tok_per_s": "1834.2", "accept_length_by_bs": "{1: 2.5}"}
    assert float(cases["test_fast"].get("time")) >= 0
    assert "the failure text" in cases["test_broken"].find("failure").get("message")
    assert cases["test_elsewhere"].find("skipped").get("message") == "not here"
    suite = root.find("testsuite") if root.tag == "testsuites" else root
    stub = [
        p.get("value")
        for p in suite.findall("properties/property")
        if p.get("name") == "cuda_stub"
    ]
    assert len(stub) == 1 and stub[0], ET.tostring(suite)[:2000]

    assert _summary(report) == {"passed": 1, "failed": 1, "skipped": 1, "error": 1}


def test_gpu_summary_without_a_report(tmp_path):
    """pytest died before writing the XML: the summary says so, and gpu-tests.sh still exits
    with pytest's status."""
    proc = subprocess.run(
        [sys.executable, "-", str(tmp_path / "missing.xml")],
        input=_summary_script(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and proc.stdout.startswith(
        "gpu summary: no junit report"
    )


def test_readme_demo_request_is_json_that_the_server_accepts():
    """The demo's curl declares its JSON body (the server answers 400 otherwise); the GPU tier
    sends this very line to a server (test_eagle_engine_gpu.py, the mission command test).
    """
    import json
    import shlex

    line = next(
        ln.strip()
        for ln in (REPO / "README.md").read_text().splitlines()
        if ln.strip().startswith("curl localhost:30000/generate")
    )
    args = shlex.split(line)
    assert args[args.index("-H") + 1] == "Content-Type: application/json"
    body = json.loads(args[args.index("-d") + 1])
    assert body["input_ids"] and body["sampling_params"]["max_new_tokens"] > 0


@pytest.mark.parametrize(
    "has_plugin,limit,expected",
    [
        (True, None, "--timeout=420"),
        (True, "90", "--timeout=90"),
        (True, "0", ""),
        (False, None, ""),  # pytest would refuse --timeout without pytest-timeout
    ],
)
def test_per_test_timeout_needs_pytest_timeout(tmp_path, has_plugin, limit, expected):
    if has_plugin:
        (tmp_path / "pytest_timeout.py").write_text("")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("PER_TEST_TIMEOUT_S", None)
    if limit is not None:
        env["PER_TEST_TIMEOUT_S"] = limit
    installed = subprocess.run(
        ["python3", "-c", "import pytest_timeout"], env=env, capture_output=True
    )
    if not has_plugin and installed.returncode == 0:
        pytest.skip("python3 here imports pytest-timeout of its own")
    out = subprocess.run(
        ["bash", "-c", "source tools/gpu-timeouts.sh && per_test_timeout"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == expected


def test_leftover_engines_are_named_and_killed():
    """stop_leftover_engines kills a process titled as sglang's (sglang::...) and says so;
    with none left it prints nothing."""
    leftover = subprocess.Popen(["bash", "-c", 'exec -a "sglang::scheduler" sleep 60'])
    try:
        deadline = time.monotonic() + 5
        while "sglang::" not in Path(f"/proc/{leftover.pid}/cmdline").read_text():
            assert time.monotonic() < deadline, "the stand-in never took its title"
            time.sleep(0.01)
        script = "source tools/gpu-timeouts.sh && stop_leftover_engines"
        out = subprocess.run(
            ["bash", "-c", script], cwd=REPO, capture_output=True, text=True, check=True
        )
        assert leftover.wait(timeout=5) == -9
        assert f"{leftover.pid} sglang::scheduler" in out.stdout, out.stdout
        again = subprocess.run(
            ["bash", "-c", script], cwd=REPO, capture_output=True, text=True, check=True
        )
        assert again.stdout == ""
    finally:
        leftover.kill()
