"""The CPU tier worker with real parts and no engine: a real NIXL agent over a small fake KV
cache, a real index actor and a real store actor (a pool of a few KiB)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from actors.kv_index import Lookup
from connectors.index_client import IndexClient
from connectors.offload_worker import CpuTierWorker

NUM_BLOCKS = 8
PAGE = 4096  # bytes of one block of one layer
SLOT = 2 * PAGE  # two layers
APP, NAMESPACE = "nixl-test", "tandem-test"


@pytest.fixture(scope="module")
def tier(ray_local: None) -> Iterator[tuple[Any, Any, str]]:
    from actors.kv_index import KVIndexActor, index_actor_name, store_actor_name
    from actors.kv_store import KVStoreActor

    index = KVIndexActor.options(name=index_actor_name(APP), namespace=NAMESPACE).remote(APP, NAMESPACE)
    node_id = ray.get_runtime_context().get_node_id()
    store = KVStoreActor.options(name=store_actor_name(APP, node_id), namespace=NAMESPACE).remote(
        node_id[:12], 16 * SLOT, index_actor_name(APP), NAMESPACE
    )
    yield index, store, ray.get(store.info.remote(), timeout=120).store_id
    ray.kill(store, no_restart=True)
    ray.kill(index, no_restart=True)


def kv_caches() -> dict[str, torch.Tensor]:
    """Two layers; block b of layer l holds the byte value 10 * l + b."""
    caches = {}
    for layer in range(2):
        cache = torch.zeros(NUM_BLOCKS, PAGE, dtype=torch.uint8)
        for b in range(NUM_BLOCKS):
            cache[b] = 10 * layer + b
        caches[f"layer{layer}"] = cache
    return caches


def save(worker: CpuTierWorker, client: IndexClient, hashes: list[bytes], block_ids: list[int]) -> None:
    call = worker.request_slots(hashes)
    assert call is not None
    client.wait([call], 60)
    worker.save([(block_ids, hashes, call)], block_size=16)


def load(worker: CpuTierWorker, req_id: str, block_ids: list[int], locations: list[Any]) -> set[int]:
    """Post a load and poll as the engine's steps would until it ends; its error blocks."""
    worker.start_load(req_id, block_ids, locations)
    deadline = time.monotonic() + 60
    while req_id not in worker.poll():
        assert time.monotonic() < deadline, f"load {req_id} never ended"
        time.sleep(0.01)
    return worker.take_error_blocks()


def test_saved_blocks_load_back_and_a_killed_store_fails_loads_then_serves_again(tier: tuple[Any, Any, str]) -> None:
    index, store, store_id = tier
    caches = kv_caches()
    client = IndexClient(ray.get(index.get_channel_address.remote()))
    worker = CpuTierWorker(client, store_id, "e@1")
    worker.register_kv_caches(caches, NUM_BLOCKS)
    hashes = [b"h-one", b"h-two"]

    save(worker, client, hashes, [1, 2])  # the grant brings the store's endpoint: no fetch, no skip
    assert worker.take_counters()["bytes_saved"] == 2 * SLOT
    lookup = client.call(Lookup("e@1/r1", hashes))  # after the commit: one socket keeps the order
    assert client.wait([lookup], 60)
    locations = client.result(lookup).locations
    assert len(locations) == 2
    assert load(worker, "r1", [5, 6], locations) == set()
    for cache in caches.values():
        assert torch.equal(cache[5], cache[1]) and torch.equal(cache[6], cache[2])

    old = ray.get(store.info.remote())
    ray.kill(store, no_restart=False)
    deadline = time.monotonic() + 120
    while True:  # wait for the new incarnation, so the old process is surely gone
        try:
            if ray.get(store.info.remote(), timeout=10).incarnation != old.incarnation:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "the store was not restarted"
        time.sleep(0.5)
    t0 = time.monotonic()
    assert load(worker, "r2", [5, 6], locations) == {5, 6}  # the dead pool fails the load...
    assert time.monotonic() - t0 < 10  # ...at once, it does not hang

    save(worker, client, [b"h-three"], [3])  # the new incarnation's endpoint comes with the grant
    assert worker.take_counters()["bytes_saved"] == SLOT
    client.close()
