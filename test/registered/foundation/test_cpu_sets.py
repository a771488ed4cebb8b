"""specpatch.gpu_host.cpu_sets: disjoint physical cores on each GPU's NUMA node."""

from __future__ import annotations

import pytest

from specpatch.gpu_host import cpu_sets


def two_socket_lscpu(cores_per_node: int = 16) -> str:
    """`lscpu -p=CPU,CORE,NODE` of a two-socket host with hyperthreads numbered as Linux
    usually numbers them: CPU i and CPU i + 2 * cores_per_node are one core's two threads.
    """
    physical = 2 * cores_per_node
    lines = ["# The following is the parsable format", "# CPU,Core,Node"]
    for cpu in range(2 * physical):
        core = cpu % physical
        lines.append(f"{cpu},{core},{core // cores_per_node}")
    return "\n".join(lines)


def test_each_gpu_gets_its_own_physical_cores_on_its_node():
    cpus = cpu_sets.parse_lscpu(two_socket_lscpu())
    gpu_nodes = [0, 0, 1, 1]
    sets = [cpu_sets.cpus_for_gpu(cpus, gpu_nodes, g) for g in range(4)]
    assert sets == [
        list(range(0, 8)),
        list(range(8, 16)),
        list(range(16, 24)),
        list(range(24, 32)),
    ]
    cores = {c.cpu: (c.node, c.core) for c in cpus}
    used = [cores[cpu] for s in sets for cpu in s]
    assert len(used) == len(set(used)), "two GPUs share a physical core"
    for gpu, s in enumerate(sets):
        assert {cores[cpu][0] for cpu in s} == {gpu_nodes[gpu]}


def test_a_hyperthread_sibling_is_never_handed_out():
    """Without the sibling filter GPU 0's 16 CPUs of a 64-CPU host would be 0-15 and GPU 2's
    32-47: the same 16 physical cores."""
    cpus = cpu_sets.parse_lscpu(two_socket_lscpu())
    sets = [cpu_sets.cpus_for_gpu(cpus, [0, 0, 1, 1], g) for g in range(4)]
    assert max(cpu for s in sets for cpu in s) < 32


def test_a_host_without_nodes_or_threads_splits_all_cores():
    text = "# CPU,Core,Node\n" + "\n".join(f"{i},{i}," for i in range(8))
    cpus = cpu_sets.parse_lscpu(text)
    assert [cpu_sets.cpus_for_gpu(cpus, [0, 0], g) for g in range(2)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]


def test_gpus_on_a_node_without_cpus_share_every_core():
    cpus = cpu_sets.parse_lscpu(two_socket_lscpu(cores_per_node=2))
    assert cpu_sets.cpus_for_gpu(cpus, [5, 5], 1) == [2, 3]


def test_too_few_cores_is_refused():
    cpus = cpu_sets.parse_lscpu("0,0,0\n1,0,0")
    with pytest.raises(ValueError, match="fewer than one each"):
        cpu_sets.cpus_for_gpu(cpus, [0, 0], 1)


@pytest.mark.parametrize(
    "cpus,text",
    [([0, 1, 2, 5], "0-2,5"), ([7], "7"), ([3, 1, 2, 9, 10], "1-3,9-10")],
)
def test_cpu_list_is_tasksets_form(cpus, text):
    assert cpu_sets.cpu_list(cpus) == text
