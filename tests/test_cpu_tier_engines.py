"""The CPU KV tier with real parts: real Ray actors, real vLLM engines (tiny model), real NIXL.

One colocated deployment of two engines with the tier (prefix caching off, so the tier is
the only cache and a "cold" run is a real recompute) serves every single-node test; the
two-node test builds its own ``ray.cluster_utils.Cluster``. The tier's connector is
tests.faults' CorruptingCpuTierConnector (through the ``cpu_tier.connector`` seam): it
serves every request as the real one does, except those whose id contains "tierfail".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from vllm.sampling_params import SamplingParams

from actors.protocol import EngineRequest
from actors.stream import stream
from orchestrator.config import parse_config
from orchestrator.deploy import Deployment

pytestmark = pytest.mark.engines

BLOCK = 128  # vLLM's block size on CPU
SLOT_BYTES = 65536  # one block of every layer of the tiny model
POOL_SLOTS = 24
TIER_CONNECTOR = "CorruptingCpuTierConnector"
TIER = {
    "enabled": True,
    "size_gib": POOL_SLOTS * SLOT_BYTES / 2**30,
    "connector": TIER_CONNECTOR,
    "module_path": "tests.faults",
}
ENGINE_ARGS = {"enable_prefix_caching": False, "max_model_len": 1024}


def prompt(seed: int, num_tokens: int) -> list[int]:
    return [20 + (seed * 131 + i * 7) % 400 for i in range(num_tokens)]


async def _generate(handle: Any, request_id: str, tokens: list[int]) -> list[int]:
    out: list[int] = []
    req = EngineRequest(request_id, tokens, SamplingParams(max_tokens=8, temperature=0.0))
    address = (await handle.info.remote()).stream_address
    async for chunk in stream(address, req):
        out += chunk.outputs[0].token_ids
    return out


def generate(handle: Any, request_id: str, tokens: list[int]) -> list[int]:
    return asyncio.run(_generate(handle, request_id, tokens))


def tier_counters(handle: Any) -> dict[str, float]:
    return dict(ray.get(handle.get_stats.remote()).connector_counters.get(TIER_CONNECTOR, {}))


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


def tier_blocks(deployment: Deployment) -> int:
    return sum(held for held, _ in ray.get(deployment.kv_index.get_stats.remote()).stores.values())


def generate_saved(deployment: Deployment, handle: Any, request_id: str, tokens: list[int]) -> list[int]:
    """generate(), then wait for its full blocks to be in the tier: an engine saves them after
    the request has answered, and on a loaded host that can take a moment."""
    before = tier_blocks(deployment)
    out = generate(handle, request_id, tokens)
    deadline = time.monotonic() + 30
    while tier_blocks(deployment) < before + len(tokens) // BLOCK:
        assert time.monotonic() < deadline, f"{request_id}'s blocks never reached the tier"
        time.sleep(0.1)
    return out


@pytest.fixture(scope="module")
def deployment(tiny_model: Any, ray_local: None) -> Iterator[Deployment]:
    cfg = parse_config({"colocated": {"replicas": 2}, "cpu_tier": TIER, "engine_args": ENGINE_ARGS})
    d = Deployment(cfg)
    d.start()
    try:
        yield d
    finally:
        # The two-node test (last in the file) shuts this module's Ray down, which stops
        # these engines with it; stop them here only while that Ray is still up.
        if ray.is_initialized():
            d.stop()


def test_engine_loads_a_prefix_another_engine_computed(deployment: Deployment) -> None:
    a, b = (e.handle for e in deployment.engines)
    shared = prompt(1, 4 * BLOCK)
    generate_saved(deployment, a, "a-1", shared + prompt(2, 40))
    before = tier_counters(b)
    warm = generate(b, "b-1", shared + prompt(3, 40))
    loaded = delta(tier_counters(b), before, "tokens_loaded")
    assert loaded >= 0.9 * len(shared)
    ray.get(deployment.kv_index.clear.remote())
    cold = generate(b, "b-2", shared + prompt(3, 40))
    assert warm == cold


def test_load_failing_midway_recomputes_the_rest(deployment: Deployment) -> None:
    a, b = (e.handle for e in deployment.engines)
    shared = prompt(4, 4 * BLOCK)
    cold = generate_saved(deployment, a, "a-2", shared + prompt(5, 30))
    before = tier_counters(b)
    # tests.faults points this lookup's locations past the pool from block 2 on.
    answer = generate(b, "b-3-tierfail", shared + prompt(5, 30))
    after = tier_counters(b)
    assert answer == cold
    assert delta(after, before, "load_failures") == 1
    assert delta(after, before, "load_error_blocks") >= 2


def test_filling_past_capacity_evicts_lru_within_the_pool(deployment: Deployment) -> None:
    a, b = (e.handle for e in deployment.engines)
    prompts = [prompt(100 + i, 4 * BLOCK + 10) for i in range(POOL_SLOTS // 4 + 3)]
    for i, p in enumerate(prompts):
        generate(a, f"fill-{i}", p)
    stats = ray.get(deployment.kv_index.get_stats.remote())
    (held, capacity), = stats.stores.values()
    assert capacity == POOL_SLOTS and held <= capacity
    assert stats.num_evicted_blocks >= 12
    store = next(iter(deployment.kv_stores.values()))
    assert ray.get(store.stats.remote()).pool_bytes == POOL_SLOTS * SLOT_BYTES
    # The most recent prompt is still held, the oldest is gone.
    before = tier_counters(b)
    generate(b, "lru-new", prompts[-1])
    generate(b, "lru-old", prompts[0])
    after = tier_counters(b)
    assert delta(after, before, "tokens_loaded") == 4 * BLOCK


def test_killing_the_store_while_serving_fails_no_request(deployment: Deployment) -> None:
    a, b = (e.handle for e in deployment.engines)
    store = next(iter(deployment.kv_stores.values()))
    old = ray.get(store.info.remote())
    shared = prompt(7, 4 * BLOCK)
    generate(a, "k-warm", shared + prompt(8, 20))

    async def load() -> list[list[int]]:
        tasks = [
            asyncio.create_task(_generate((a, b)[i % 2], f"k-{i}", shared + prompt(9 + i, 20)))
            for i in range(8)
        ]
        await asyncio.sleep(0.2)
        ray.kill(store, no_restart=False)
        return await asyncio.gather(*tasks)

    answers = asyncio.run(load())
    assert all(len(ans) == 8 for ans in answers)
    # ray.kill only asks Ray to kill the actor: on a loaded host the old process can still
    # answer a call made right after the load ends, so wait for the new incarnation.
    deadline = time.monotonic() + 60
    while True:
        try:
            new = ray.get(store.info.remote(), timeout=10)
            if new.incarnation != old.incarnation:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "the store actor was not restarted"
        time.sleep(1)
    stats = ray.get(deployment.kv_index.get_stats.remote())
    assert stats.num_forgotten_blocks > 0
    # The restarted store serves again: a prefix saved now is loaded by the other engine.
    again = prompt(30, 2 * BLOCK)
    generate(a, "k-after-a", again + prompt(31, 10))
    before = tier_counters(b)
    generate(b, "k-after-b", again + prompt(32, 10))
    assert delta(tier_counters(b), before, "tokens_loaded") == 2 * BLOCK


@pytest.mark.cluster
def test_two_nodes_get_a_store_each_and_save_locally_and_a_lost_node_is_forgotten(tiny_model: Any) -> None:
    """Each node's engine saves into its own node's store; when a node leaves the cluster,
    its store (pinned there, so never restarted) is forgotten by the index with every block
    it held, and the other node's blocks stay."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    # Ray turns a loopback address given to ray.init (the driver's, and the engine
    # processes' that join as drivers to reach the tier) into this machine's
    # interface IP, while Cluster starts nodes with the literal IP it is given. Nodes
    # started on a literal 127.0.0.1 get a GCS bound to loopback only that no driver
    # can join (ray.init hangs in _init_gcs_client), so start them on the IP that
    # ray.init itself resolves loopback to: the same host, as ray_local's nodes get.
    ip = ray._private.services.resolve_ip_for_localhost("127.0.0.1")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "node_ip_address": ip})
    worker = cluster.add_node(num_cpus=2, node_ip_address=ip)
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
    cluster.wait_for_nodes()
    # One engine per node: each pool replica needs 2 CPUs, which a node has once.
    cfg = parse_config({
        "colocated": {"replicas": 2, "num_cpus": 2},
        "cpu_tier": TIER,
        "engine_args": ENGINE_ARGS,
    })
    d = Deployment(cfg)
    try:
        d.start()
        nodes = {info.engine_id: info.node_id for info in d.infos}
        assert len(set(nodes.values())) == 2
        assert set(d.kv_stores) == set(nodes.values())
        stores = {node: ray.get(s.info.remote()) for node, s in d.kv_stores.items()}
        assert all(ep.node_id == node for node, ep in stores.items())
        for i, engine in enumerate(d.engines):
            generate(engine.handle, f"n-{i}", prompt(50 + i, 3 * BLOCK + 5))
        held = ray.get(d.kv_index.get_stats.remote()).stores
        # Each engine saved its 3 blocks into the store of its own node.
        assert {nodes[e.engine_id][:12]: held[nodes[e.engine_id][:12]][0] for e in d.engines} == {
            nodes[e.engine_id][:12]: 3 for e in d.engines
        }

        def node_of(actor: Any) -> str:
            return ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))

        # The control plane runs on the head node (orchestrator.placement.ON_HEAD_NODE), and so
        # does this driver: the worker node is the one to lose.
        assert node_of(d.manager) == node_of(d.kv_index) == cluster.head_node.node_id != worker.node_id
        assert ray.get_runtime_context().get_node_id() == cluster.head_node.node_id
        lost, kept = worker.node_id[:12], cluster.head_node.node_id[:12]
        cluster.remove_node(worker)
        deadline = time.monotonic() + 120  # Ray's notice of the lost node, then the manager's next check
        while lost in (stats := ray.get(d.kv_index.get_stats.remote(), timeout=60)).stores:
            assert time.monotonic() < deadline, f"the index still counts the store of the lost node: {stats}"
            time.sleep(1)
        assert stats.num_forgotten_blocks == 3 and stats.stores[kept][0] == 3 and stats.num_blocks == 3
    finally:
        d.stop()
        ray.shutdown()
        cluster.shutdown()
