"""Which CPUs a benchmark driving one GPU of a multi-GPU host should run on.

Speculative decoding at small batch is bound by the host loop of its engine, so two benchmarks
that share a physical core (two hyperthreads of it) or run far from their GPU's memory measure
each other as much as their configs. Each GPU gets whole physical cores of its own NUMA node,
one hyperthread each, split evenly between the GPUs of that node:

    python -m specpatch.gpu_host.cpu_sets GPU   # prints e.g. 0-7, for taskset -c

Topology comes from `lscpu -p=CPU,CORE,NODE` and each GPU's NUMA node from sysfs (through its
PCI bus id from nvidia-smi); a host that reports no node puts every CPU and GPU on node 0.
"""

from __future__ import annotations

import argparse
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Cpu:
    cpu: int
    core: int
    node: int


def parse_lscpu(text: str) -> list[Cpu]:
    """Rows of `lscpu -p=CPU,CORE,NODE` (comment lines start with #; an empty NODE is 0)."""
    cpus = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        cpu, core, node = (line.split(",") + ["", ""])[:3]
        cpus.append(Cpu(int(cpu), int(core), int(node) if node else 0))
    return cpus


def first_threads(cpus: list[Cpu]) -> dict[int, list[int]]:
    """Per NUMA node, one CPU of each physical core (its lowest-numbered thread), sorted."""
    by_core: dict[tuple[int, int], int] = {}
    for c in cpus:
        key = (c.node, c.core)
        by_core[key] = min(c.cpu, by_core.get(key, c.cpu))
    nodes: dict[int, list[int]] = {}
    for (node, _), cpu in sorted(by_core.items()):
        nodes.setdefault(node, []).append(cpu)
    return {node: sorted(found) for node, found in nodes.items()}


def cpus_for_gpu(cpus: list[Cpu], gpu_nodes: list[int], gpu: int) -> list[int]:
    """The CPUs of `gpu` (an index into gpu_nodes, each GPU's NUMA node): an equal, disjoint
    share of its node's physical cores, in the order of the GPUs on that node. A node with no
    CPUs (GPUs reported on a memory-only node) falls back to every node's cores."""
    cores = first_threads(cpus)
    node = gpu_nodes[gpu]
    if node not in cores:
        pool = sorted(cpu for found in cores.values() for cpu in found)
        peers = list(range(len(gpu_nodes)))
    else:
        pool = cores[node]
        peers = [g for g, n in enumerate(gpu_nodes) if n == node]
    share = len(pool) // len(peers)
    if share == 0:
        raise ValueError(
            f"{len(pool)} physical cores for {len(peers)} GPUs: fewer than one each"
        )
    start = peers.index(gpu) * share
    return pool[start : start + share]


def cpu_list(cpus: list[int]) -> str:
    """taskset's form: runs of consecutive CPUs as ranges, e.g. [0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def gpu_numa_nodes() -> list[int]:
    """Each visible GPU's NUMA node, in nvidia-smi's order (-1, unknown, counts as 0)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    nodes = []
    for bus_id in out.split():
        # nvidia-smi prints an 8-digit PCI domain; sysfs names the device with 4.
        path = Path("/sys/bus/pci/devices") / bus_id[-12:].lower() / "numa_node"
        node = int(path.read_text()) if path.exists() else 0
        nodes.append(max(node, 0))
    return nodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specpatch.gpu_host.cpu_sets",
        description="the CPU list (taskset -c) for a benchmark driving one GPU",
    )
    parser.add_argument("gpu", type=int, help="the GPU's index in nvidia-smi")
    args = parser.parse_args(argv)
    topology = subprocess.run(
        ["lscpu", "-p=CPU,CORE,NODE"], check=True, capture_output=True, text=True
    ).stdout
    print(cpu_list(cpus_for_gpu(parse_lscpu(topology), gpu_numa_nodes(), args.gpu)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
