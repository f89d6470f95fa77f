"""The CPU KV tier's index: which block hashes are held, in which store and slot.

This is the scheduler role's brain of the tier. Engines' scheduler-side connectors ask it
which prefix blocks are held (and pin them for the load); worker-side connectors ask it for
free slots before writing and commit after. Bytes never pass through here.

A block hash from vLLM is chained (it covers the whole prefix up to its block), so a
lookup is "the longest run of held hashes from the first one". Capacity is per store, in
slots of one KV block (all layers); eviction is least-recently-used among unpinned,
committed blocks of the store that needs room. A store that restarts registers a new
incarnation and the index forgets every block of the old one.

``KVIndex`` is plain logic (unit-tested); ``KVIndexActor`` is its Ray actor.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import msgspec
import ray

logger = logging.getLogger("tandem.kv_index")


class StoreEndpoint(msgspec.Struct, frozen=True):
    """How a worker reaches a store's pool through NIXL; sent once per store incarnation."""

    store_id: str
    node_id: str
    # Changes on every (re)start of the store actor; slots of another incarnation are void.
    incarnation: str
    agent_name: str
    agent_metadata: bytes
    base_addr: int
    pool_bytes: int


class BlockLocation(msgspec.Struct, frozen=True, array_like=True):
    store_id: str
    incarnation: str
    slot: int


class LookupReply(msgspec.Struct, frozen=True):
    """Locations of the longest held prefix run, in order; pinned under the lookup's key."""

    locations: list[BlockLocation]


class Grant(msgspec.Struct, frozen=True):
    """Slots granted for a save: ``slots[i]`` is where ``hashes[i]`` goes."""

    store_id: str
    incarnation: str
    hashes: list[bytes]
    slots: list[int]


class IndexStats(msgspec.Struct):
    num_blocks: int = 0
    num_pinned: int = 0
    num_lookups: int = 0
    num_hit_blocks: int = 0
    num_saved_blocks: int = 0
    num_evicted_blocks: int = 0
    num_forgotten_blocks: int = 0
    # store id -> (blocks held, capacity in slots)
    stores: dict[str, tuple[int, int]] = {}


class _Entry:
    __slots__ = ("store_id", "slot", "committed", "pins")

    def __init__(self, store_id: str, slot: int) -> None:
        self.store_id = store_id
        self.slot = slot
        self.committed = False
        self.pins = 0


class _Store:
    __slots__ = ("endpoint", "free", "num_slots")

    def __init__(self, endpoint: StoreEndpoint, num_slots: int) -> None:
        self.endpoint = endpoint
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))


class KVIndex:
    """Block hash -> (store, slot), per-store capacity, LRU eviction, pins."""

    def __init__(self) -> None:
        # Bytes of one slot (one KV block of every layer); fixed by the first engine.
        self.slot_bytes: int | None = None
        self._stores: dict[str, _Store] = {}
        # Every held block, least recently used first.
        self._blocks: OrderedDict[bytes, _Entry] = OrderedDict()
        # pin key (engine id + request id) -> pinned hashes
        self._pins: dict[str, list[bytes]] = {}
        # Fault injection: the next N lookups return invalid slots from this block on.
        self._corrupt: tuple[int, int] = (0, 0)
        self.stats = IndexStats()

    # ---- stores ----

    def set_slot_bytes(self, slot_bytes: int) -> None:
        """Called by each engine worker at start; every engine of a deployment must agree."""
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        if self.slot_bytes is None:
            self.slot_bytes = slot_bytes
            for store_id, store in list(self._stores.items()):
                self._stores[store_id] = _Store(store.endpoint, store.endpoint.pool_bytes // slot_bytes)
        elif self.slot_bytes != slot_bytes:
            raise ValueError(
                f"an engine's KV block is {slot_bytes} bytes but the tier holds {self.slot_bytes}-byte "
                "blocks; every engine sharing a CPU tier must serve the same model and KV dtype"
            )

    def register_store(self, endpoint: StoreEndpoint) -> None:
        """A store (re)started: forget whatever the previous incarnation held."""
        self.forget_store(endpoint.store_id)
        num_slots = endpoint.pool_bytes // self.slot_bytes if self.slot_bytes else 0
        self._stores[endpoint.store_id] = _Store(endpoint, num_slots)

    def forget_store(self, store_id: str) -> int:
        """Drop a store and every block it held (pins included); returns blocks dropped."""
        if self._stores.pop(store_id, None) is None:
            return 0
        dropped = [h for h, e in self._blocks.items() if e.store_id == store_id]
        for h in dropped:
            del self._blocks[h]
        self.stats.num_forgotten_blocks += len(dropped)
        return len(dropped)

    def clear(self) -> int:
        """Flush the tier (every store stays registered); returns blocks dropped. Loads
        already planned may then read overwritten slots: use it on an idle deployment."""
        dropped = len(self._blocks)
        self._blocks.clear()
        self._pins.clear()
        for store_id, store in list(self._stores.items()):
            self._stores[store_id] = _Store(store.endpoint, store.num_slots)
        return dropped

    def endpoint(self, store_id: str) -> StoreEndpoint | None:
        store = self._stores.get(store_id)
        return store.endpoint if store else None

    def capacity(self, store_id: str) -> int:
        store = self._stores.get(store_id)
        return store.num_slots if store else 0

    # ---- loads ----

    def lookup(self, pin_key: str, hashes: list[bytes]) -> LookupReply:
        """The longest run of committed blocks from hashes[0], pinned under `pin_key` until
        ``unpin(pin_key)``, and marked most recently used."""
        self.unpin(pin_key)
        self.stats.num_lookups += 1
        locations: list[BlockLocation] = []
        pinned: list[bytes] = []
        for h in hashes:
            e = self._blocks.get(h)
            if e is None or not e.committed:
                break
            store = self._stores[e.store_id]
            locations.append(BlockLocation(e.store_id, store.endpoint.incarnation, e.slot))
            e.pins += 1
            pinned.append(h)
            self._blocks.move_to_end(h)
        if pinned:
            self._pins[pin_key] = pinned
        self.stats.num_hit_blocks += len(locations)
        count, after = self._corrupt
        if count and locations:
            self._corrupt = (count - 1, after)
            locations = locations[:after] + [
                BlockLocation(loc.store_id, loc.incarnation, self._stores[loc.store_id].num_slots + 1_000_000)
                for loc in locations[after:]
            ]
        return LookupReply(locations)

    def unpin(self, pin_key: str) -> None:
        """Release a lookup's pins (after its load, or when the request ends); idempotent."""
        for h in self._pins.pop(pin_key, ()):
            e = self._blocks.get(h)
            if e is not None:
                e.pins -= 1

    def corrupt_next_lookups(self, count: int, after_blocks: int) -> None:
        """Fault injection for tests and drills: the next `count` lookups with hits return
        slots past the pool from block `after_blocks` on, so the engine's load fails there."""
        self._corrupt = (count, after_blocks)

    # ---- saves ----

    def allocate(self, store_id: str, hashes: list[bytes]) -> Grant | None:
        """Reserve slots in `store_id` for the hashes not held anywhere (held ones are only
        touched). Evicts LRU blocks of that store when full; grants fewer (a prefix of the
        new hashes) when the rest of the store is pinned. None: unknown or unsized store."""
        store = self._stores.get(store_id)
        if store is None or store.num_slots == 0:
            return None
        granted: list[bytes] = []
        slots: list[int] = []
        for h in hashes:
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            if h in granted:
                continue
            if not store.free and not self._evict_one(store_id):
                break
            slot = store.free.pop()
            self._blocks[h] = _Entry(store_id, slot)
            granted.append(h)
            slots.append(slot)
        return Grant(store_id, store.endpoint.incarnation, granted, slots)

    def commit(self, grant: Grant, ok: bool) -> None:
        """The worker wrote (ok) or failed to write a grant's blocks: make them loadable, or
        give their slots back. A grant of a forgotten incarnation is ignored."""
        store = self._stores.get(grant.store_id)
        if store is None or store.endpoint.incarnation != grant.incarnation:
            return
        for h, slot in zip(grant.hashes, grant.slots):
            e = self._blocks.get(h)
            if e is None or e.store_id != grant.store_id or e.slot != slot:
                continue
            if ok:
                e.committed = True
                self.stats.num_saved_blocks += 1
            else:
                del self._blocks[h]
                store.free.append(slot)

    def _evict_one(self, store_id: str) -> bool:
        for h, e in self._blocks.items():
            if e.store_id == store_id and e.committed and e.pins == 0:
                del self._blocks[h]
                self._stores[store_id].free.append(e.slot)
                self.stats.num_evicted_blocks += 1
                return True
        return False

    # ---- introspection ----

    def contains(self, h: bytes) -> bool:
        e = self._blocks.get(h)
        return e is not None and e.committed

    def get_stats(self) -> IndexStats:
        s = self.stats
        s.num_blocks = len(self._blocks)
        s.num_pinned = sum(1 for e in self._blocks.values() if e.pins > 0)
        held: dict[str, int] = {sid: 0 for sid in self._stores}
        for e in self._blocks.values():
            held[e.store_id] = held.get(e.store_id, 0) + 1
        s.stores = {sid: (held.get(sid, 0), self.capacity(sid)) for sid in self._stores}
        return s


@ray.remote(num_cpus=0)
class KVIndexActor:
    """The index behind Ray calls. Calls are cheap and serialised by the actor; they carry
    hashes and slot numbers only. It is not restarted: without it, connectors treat every
    lookup as a miss and skip saves, so engines keep serving by recomputing."""

    def __init__(self) -> None:
        self.index = KVIndex()

    def set_slot_bytes(self, slot_bytes: int) -> None:
        self.index.set_slot_bytes(slot_bytes)

    def register_store(self, endpoint: StoreEndpoint) -> None:
        self.index.register_store(endpoint)
        logger.info("CPU tier store %s (node %s, incarnation %s, %.2f GiB) registered",
                    endpoint.store_id, endpoint.node_id, endpoint.incarnation, endpoint.pool_bytes / 2**30)

    def forget_store(self, store_id: str) -> int:
        dropped = self.index.forget_store(store_id)
        logger.warning("CPU tier store %s forgotten with its %d blocks", store_id, dropped)
        return dropped

    def clear(self) -> int:
        dropped = self.index.clear()
        logger.warning("CPU tier flushed: %d blocks dropped", dropped)
        return dropped

    def endpoint(self, store_id: str) -> StoreEndpoint | None:
        return self.index.endpoint(store_id)

    def lookup(self, pin_key: str, hashes: list[bytes]) -> LookupReply:
        return self.index.lookup(pin_key, hashes)

    def unpin(self, pin_key: str) -> None:
        self.index.unpin(pin_key)

    def allocate(self, store_id: str, hashes: list[bytes]) -> Grant | None:
        return self.index.allocate(store_id, hashes)

    def commit(self, grant: Grant, ok: bool) -> None:
        self.index.commit(grant, ok)

    def corrupt_next_lookups(self, count: int, after_blocks: int) -> None:
        self.index.corrupt_next_lookups(count, after_blocks)

    def get_stats(self) -> IndexStats:
        return self.index.get_stats()
