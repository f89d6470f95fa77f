"""Where engines run and what each engine process is told about it.

Everything here is derived from Ray: the node a placement group put a replica on, that
node's IP, and the cores that node's processes may use. Nothing assumes localhost or a
single node.
"""

from __future__ import annotations

import os
from collections import defaultdict

import msgspec
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator.models import resolve_local


class NodeFacts(msgspec.Struct, frozen=True):
    node_id: str
    node_ip: str
    # Cores this node's processes may use (its CPU affinity mask).
    cores: list[int]
    # The model as vLLM opens it on this node (see orchestrator.models.resolve_local).
    model_path: str


class EngineSlot(msgspec.Struct, frozen=True):
    """One engine's place: its node, its side-channel port and the cores it binds to."""

    node_id: str
    node_ip: str
    model_path: str
    side_channel_port: int
    # VLLM_CPU_OMP_THREADS_BIND value ("0,1,2", or "0|1" for TP ranks); None: unbound.
    cpu_binding: str | None
    # Cores of the engine's whole process tree (actor, engine core, workers); None: unbound.
    cores: list[int] | None = None


@ray.remote(num_cpus=0)
def _probe(model_source: str) -> tuple[list[int], str]:
    return sorted(os.sched_getaffinity(0)), resolve_local(model_source)


def node_facts(node_ids: set[str], model_source: str) -> dict[str, NodeFacts]:
    """Probe each node with a zero-CPU task pinned to it: usable cores and the model folder."""
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    refs = {
        nid: _probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(model_source)
        for nid in node_ids
    }
    facts = {}
    for nid, ref in refs.items():
        cores, model_path = ray.get(ref)
        facts[nid] = NodeFacts(nid, ips[nid], cores, model_path)
    return facts


def _share(items: list[int], parts: int, i: int) -> list[int]:
    """Part i of `items` cut into `parts` contiguous, disjoint slices; shared when too few."""
    per = len(items) // parts
    return items[i * per : (i + 1) * per] if per else [items[i % len(items)]]


def engine_cores(cores: list[int], num_engines: int, index: int) -> list[int]:
    """The cores of engine `index` of `num_engines` sharing `cores`: disjoint contiguous
    slices while there are enough cores, shared round robin otherwise."""
    return _share(cores, num_engines, index)


def omp_binding(mine: list[int], tp: int) -> str:
    """The VLLM_CPU_OMP_THREADS_BIND of an engine owning cores `mine`, with `tp` ranks.

    The last core is left out of OpenMP whenever every rank still gets one: it runs the
    engine's threads that are not OpenMP (vLLM's scheduler process, the actor's event loop,
    NIXL/UCX, Python threads), which would otherwise preempt a compute thread mid-step.
    Each rank gets a sub-slice; ranks are joined by "|".
    """
    usable = mine[:-1] if len(mine) > tp else mine
    return "|".join(",".join(map(str, _share(usable, tp, r))) for r in range(tp))


def split_cores(cores: list[int], num_engines: int, index: int, tp: int) -> str:
    """The VLLM_CPU_OMP_THREADS_BIND of engine `index` of `num_engines` sharing `cores`."""
    return omp_binding(engine_cores(cores, num_engines, index), tp)


def assign_slots(
    replica_nodes: list[str],
    tp_sizes: list[int],
    base_port: int,
    bind_cores: bool,
    model_source: str,
) -> list[EngineSlot]:
    """Give every engine a distinct side-channel port on its host and its own cores.

    `replica_nodes[i]` is the node engine i was placed on. Ports are counted per node IP,
    not per Ray node, so several Ray nodes on one host (ray.cluster_utils.Cluster, or
    raylets sharing a machine) never hand out the same port twice. Cores are split among
    the engines of each Ray node, which is what its affinity mask covers.
    """
    facts = node_facts(set(replica_nodes), model_source)
    per_node: dict[str, list[int]] = defaultdict(list)
    per_ip: dict[str, list[int]] = defaultdict(list)
    for i, nid in enumerate(replica_nodes):
        per_node[nid].append(i)
        per_ip[facts[nid].node_ip].append(i)
    slots: list[EngineSlot] = []
    for i, nid in enumerate(replica_nodes):
        f = facts[nid]
        k, n = per_node[nid].index(i), len(per_node[nid])
        mine = engine_cores(f.cores, n, k) if bind_cores else None
        binding = omp_binding(mine, tp_sizes[i]) if mine is not None else None
        port = base_port + per_ip[f.node_ip].index(i)
        slots.append(EngineSlot(nid, f.node_ip, f.model_path, port, binding, mine))
    return slots
