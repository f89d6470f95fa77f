"""The CPU KV tier's store: one host-memory pool per Ray node, registered with NIXL.

This is the worker role's memory of the tier. Engine workers write KV blocks into the pool
and read them back with one-sided NIXL transfers (DRAM<->DRAM over UCX); the store actor
itself never touches the bytes, it only owns the memory and announces where it is. Slot
bookkeeping lives in the index actor.

The store's NIXL agent needs a UCX progress thread (without one, writes into the pool never
complete); it is built with a nonzero progress delay so it does not spin a whole core
(`STORE_PROGRESS_DELAY_US`, ``actors.nixl_agent.make_nixl_agent``). Engine-side agents initiate every
transfer and drive their own progress by polling, so they run without the thread.

A store is restartable (``max_restarts``): a restart allocates a fresh pool, registers a
new incarnation with the index, and the index forgets the old incarnation's blocks. When
the index itself restarts, it asks the live stores for their endpoints (by actor name).
"""

from __future__ import annotations

import logging
import os
import uuid

import msgspec
import numpy as np
import ray

from actors.kv_index import StoreEndpoint
from actors.nixl_agent import make_nixl_agent

logger = logging.getLogger("tandem.kv_store")

# How long a starting store waits for the index to take its registration. An index that is
# restarting answers once it is back; past this the store starts unregistered and the
# restarted index finds it by name (actors.kv_index.KVIndexActor).
REGISTER_TIMEOUT_S = 60.0
# How long the store's UCX progress thread sleeps between unprompted polls. It wakes at once
# when a transfer needs it (it also waits on the UCX worker's event file descriptor), so the
# delay is only a fallback: saves and loads took as long with 20 ms as with 0.2 ms (WRITE +
# grant 0.3-0.7 ms, READ 0.03 ms over shared memory; 1.9 / 0.2-0.7 ms with UCX_TLS=tcp,self),
# while at 0.2 ms (NIXL rounds it up to 1 ms) the thread woke 900 times a second and
# preempted the engines' compute threads on a small host.
STORE_PROGRESS_DELAY_US = 20_000


class TierSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How an engine reaches the tier: kv_connector_extra_config of the CPU tier connector
    (connectors.offload), built per engine by orchestrator.tier. The engine's processes
    reach the index on its channel and the stores through NIXL; they never join Ray."""

    # The index's channel ("tcp://ip:port", KVIndexActor.channel_address).
    index_address: str
    # Store id this engine saves to (its node's store); None: the engine does not save.
    store_id: str | None = None
    # Whether this engine loads prefixes from the tier.
    load: bool = True
    # Whether a saving engine also saves the full blocks of the tokens it generates, not only
    # of the prompt (cpu_tier.save_outputs).
    save_outputs: bool = False


class StoreStats(msgspec.Struct, frozen=True):
    """Which process and incarnation serve a store (what a fault drill kills), and its size."""

    store_id: str
    incarnation: str
    pid: int
    # Bytes of the registered pool (fixed at start; the store never grows it).
    pool_bytes: int


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class KVStoreActor:
    """A pinned-size host pool behind a NIXL agent, registered with the index at start."""

    def __init__(self, store_id: str, pool_bytes: int, index_name: str, namespace: str) -> None:
        self.store_id = store_id
        self.incarnation = uuid.uuid4().hex[:8]
        # Touch every page now so the pool's memory is committed (and measured) up front.
        self.pool = np.zeros(pool_bytes, dtype=np.uint8)
        self.agent = make_nixl_agent(f"tandem-kv-store-{store_id}-{self.incarnation}", progress_thread=True,
                                     progress_delay_us=STORE_PROGRESS_DELAY_US)
        self.agent.register_memory([(self.pool.ctypes.data, pool_bytes, 0, "")], "DRAM")
        self.endpoint = StoreEndpoint(
            store_id=store_id,
            node_id=ray.get_runtime_context().get_node_id(),
            incarnation=self.incarnation,
            agent_metadata=self.agent.get_agent_metadata(),
            base_addr=self.pool.ctypes.data,
            pool_bytes=pool_bytes,
        )
        try:
            index = ray.get_actor(index_name, namespace=namespace)
            ray.get(index.register_store.remote(self.endpoint), timeout=REGISTER_TIMEOUT_S)
        except Exception as err:  # a store that fails its constructor is never restarted again
            logger.warning("CPU tier store %s could not register with the index (%s); the index registers "
                           "it when it comes back", store_id, err)
        logger.info("CPU tier store %s up: %.2f GiB pool, incarnation %s",
                    store_id, pool_bytes / 2**30, self.incarnation)

    def info(self) -> StoreEndpoint:
        return self.endpoint

    def stats(self) -> StoreStats:
        return StoreStats(self.store_id, self.incarnation, os.getpid(), self.pool.nbytes)

