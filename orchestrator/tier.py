"""The CPU KV tier's actors of one deployment: the index, and a store on every node that hosts
engines (created when the first engine lands there, so pools that grow onto new nodes get one).

Both kinds of actor are restarted by Ray when they die (the tier may come back empty; engines
recompute meanwhile). The pool manager owns this object and tells it when an engine dies, so
the index releases that engine's pins and slots at once instead of at their leases' end.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.kv_index import KVIndexActor, index_actor_name, store_actor_name
from actors.kv_store import KVStoreActor, TierSettings
from actors.protocol import Role
from orchestrator.config import TandemConfig
from orchestrator.placement import ON_HEAD_NODE
from orchestrator.protocol import TierStatus

logger = logging.getLogger("tandem.tier")

# How long a store may take to allocate and register its pool.
STORE_START_TIMEOUT_S = 600.0
# The pool manager's status answers without the tier's fill rather than wait longer than this
# for the index (well inside the ingress's own wait for the status).
STATUS_TIMEOUT_S = 2.0
# How often the pool manager checks that the nodes holding stores are still in the cluster
# (one GCS call listing the nodes).
NODE_CHECK_S = 5.0


class TierError(RuntimeError):
    """A store could not start; the message says what to check."""


def free_port() -> int:
    """A TCP port free on this node right now, above the kernel's range for outgoing
    connections where the host leaves room: a port from that range could be taken as some
    connection's local port while the index restarts, and the index could not listen again."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first = int(f.read().split()[1]) + 1
    except (OSError, ValueError, IndexError):
        first = 65536
    for port in random.sample(range(first, 65536), min(64, 65536 - first)):
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no room above the range: any free port
        sock.bind(("", 0))
        return sock.getsockname()[1]


class CpuTier:
    def __init__(self, cfg: TandemConfig, namespace: str) -> None:
        """Runs in the pool manager, on the head node like the index: so a port free here is
        the index's to take (`cpu_tier.index_port` unset), and a restarted index takes it again."""
        self.cfg = cfg
        self.namespace = namespace
        self.app = cfg.serve.app_name
        port = cfg.cpu_tier.index_port or free_port()
        self.index: Any = KVIndexActor.options(name=index_actor_name(self.app), resources=ON_HEAD_NODE).remote(
            self.app, namespace, channel_port=port)
        # Where engines reach the index (known once it has started, see `ensure_store`).
        self.index_address: str | None = None
        self.stores: dict[str, Any] = {}
        self._starting: dict[str, asyncio.Task[None]] = {}
        # Stores of nodes that left the cluster, not yet forgotten by the index.
        self._lost: set[str] = set()

    async def ensure_store(self, node_id: str) -> None:
        """Start the store of `node_id` unless it runs (concurrent callers share one start);
        every engine start waits for this, so the index's address is learnt here too."""
        if self.index_address is None:
            self.index_address = await self.index.get_channel_address.remote()
        if node_id in self.stores:
            return
        if node_id not in self._starting:
            self._starting[node_id] = asyncio.ensure_future(self._start_store(node_id))
        await self._starting[node_id]

    async def _start_store(self, node_id: str) -> None:
        size = self.cfg.cpu_tier.size_gib
        store = KVStoreActor.options(
            name=store_actor_name(self.app, node_id),
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(node_id[:12], int(size * 2**30), index_actor_name(self.app), self.namespace)
        try:
            await asyncio.wait_for(store.info.remote(), STORE_START_TIMEOUT_S)
        except Exception as err:
            ray.kill(store, no_restart=True)
            raise TierError(
                f"the CPU tier store of node {node_id} did not start ({err}); check that the node has "
                f"{size} GiB of free host memory (cpu_tier.size_gib) and that nixl is installed"
            ) from err
        self.stores[node_id] = store
        logger.info("CPU tier store of node %s up: %.2f GiB", node_id[:12], size)

    def settings(self, role: Role, node_id: str) -> TierSettings:
        """How an engine of `role` on `node_id` reaches the tier (its node's store)."""
        save_from, load_into = self.cfg.tier_pools()
        assert self.index_address is not None, "ensure_store runs before any engine of the node starts"
        return TierSettings(
            index_address=self.index_address,
            store_id=node_id[:12] if role in save_from else None,
            load=role in load_into,
            save_outputs=self.cfg.cpu_tier.save_outputs,
        )

    async def forget_lost_nodes(self) -> None:
        """Forget the stores of nodes that left the cluster, with every block they held.

        A store is pinned to its node, so Ray cannot bring it back anywhere else; until the
        index forgets it, lookups hand out its blocks (every load of them fails and the engine
        recomputes) and routers count them as tier hits. A store whose process died on a live
        node is restarted by Ray instead, and its new incarnation replaces the old one when it
        registers."""
        if self.stores:
            alive = {n["NodeID"] for n in await asyncio.to_thread(ray.nodes) if n["Alive"]}
            for node_id in [n for n in self.stores if n not in alive]:
                ray.kill(self.stores.pop(node_id), no_restart=True)
                self._starting.pop(node_id, None)
                self._lost.add(node_id[:12])
        for store_id in sorted(self._lost):
            try:
                dropped = await asyncio.wait_for(self.index.forget_store.remote(store_id), STATUS_TIMEOUT_S)
            except Exception as err:  # the index is restarting: the next check tries again
                logger.warning("the CPU tier index did not forget store %s of a lost node yet (%s)", store_id, err)
                continue
            self._lost.discard(store_id)
            logger.warning("the node of CPU tier store %s left the cluster: the store is gone with the %d blocks "
                           "it held (engines compute those prefixes again)", store_id, dropped)

    def release_engine(self, owner: str) -> None:
        """An engine incarnation died: free its pins and slots now (fire and forget; the
        index's leases are the backstop if this call is lost)."""
        self.index.release_owner.remote(owner)

    async def status(self) -> TierStatus | None:
        try:
            stats = await asyncio.wait_for(self.index.get_stats.remote(), STATUS_TIMEOUT_S)
        except Exception:  # the index is restarting or gone: the tier's fill is unknown
            return None
        stores = {sid: (held, cap) for sid, (held, cap) in stats.stores.items()}
        return TierStatus(
            blocks=stats.num_blocks,
            capacity=sum(cap for _, cap in stores.values()),
            pinned=stats.num_pinned,
            open_grants=stats.num_open_grants,
            stores=stores,
            lookups=stats.num_lookups,
            hit_blocks=stats.num_hit_blocks,
            saved_blocks=stats.num_saved_blocks,
            evicted_blocks=stats.num_evicted_blocks,
            forgotten_blocks=stats.num_forgotten_blocks,
            expired_pins=stats.num_expired_pins,
            expired_grants=stats.num_expired_grants,
        )

    def stop(self) -> None:
        for actor in [*self.stores.values(), self.index]:
            ray.kill(actor, no_restart=True)
        logger.info("stopped the CPU tier (%d stores)", len(self.stores))
        self.stores = {}
