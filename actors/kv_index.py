"""The CPU KV tier's index: which block hashes are held, in which store and slot.

This is the scheduler role's brain of the tier. Engines' scheduler-side connectors ask it
which prefix blocks are held (and pin them for the load); worker-side connectors ask it for
free slots before writing and commit after. Bytes never pass through here.

A block hash from vLLM is chained (it covers the whole prefix up to its block), so a
lookup is "the longest run of held hashes from the first one". Capacity is per store, in
slots of one KV block (all layers); eviction is least-recently-used among unpinned,
committed blocks of the store that needs room. A store that restarts registers a new
incarnation and the index forgets every block of the old one.

Safety under faults. Stores' pools are written and read with one-sided NIXL transfers that
the index never sees, so a slot must not be handed out again while a transfer may still
touch it:
- every pin and grant has an owner (an engine incarnation); ``release_owner`` drops a dead
  engine's pins and reclaims its uncommitted grants, whose slots rest in a quarantine first
  (a WRITE the dead process posted may still land);
- leases reclaim what nobody released (a lost unpin, an engine that died unnoticed);
- an index that restarted comes back empty, finds the deployment's live stores, and grants
  nothing for a while, because READs planned from its previous life's answers may still be
  in flight against slots it no longer knows are in use.

``KVIndex`` is plain logic (unit-tested); ``KVIndexActor`` is its Ray actor. Engines reach it
over the index's channel, not Ray: one ZMQ socket the actor serves (the calls below,
``IndexCall``), so vLLM's engine processes never join the Ray cluster; the control plane's
calls (stores, releases, stats, the routers' feed) stay Ray calls.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import msgspec
import ray
import zmq

logger = logging.getLogger("tandem.kv_index")

# Slots reclaimed from a dead owner or an expired grant rest this long before reuse: a
# one-sided WRITE posted just before its process died may still land. Transfers to or from a
# dead peer fail within about 0.1 s over UCX (measured with nixl 1.5.1 on TCP), so 2 s is a
# wide margin that costs little capacity.
SLOT_QUARANTINE_S = 2.0
# An uncommitted grant older than this is reclaimed: a healthy worker writes and commits (or
# gives back) by the end of the engine step after the one that asked for it, milliseconds; a grant this old
# belongs to an engine that died without ``release_owner`` (or a store stalled for a minute).
GRANT_LEASE_S = 60.0
# A pin older than this is dropped: a lookup's answer is used within LOOKUP_FRESH_S (5 s,
# connectors.offload) and a healthy load takes milliseconds to seconds, so a pin this old was
# lost (an unpin that never arrived, a dead engine). Longer than the grant lease because an
# early expiry costs a wrong load, a late one only capacity.
PIN_LEASE_S = 120.0
# A restarted index grants nothing this long: READs planned from its previous life's answers
# (answers are used for at most LOOKUP_FRESH_S = 5 s, loads take ms to seconds) must end
# before any slot can be written again. Lookups miss meanwhile; engines recompute.
RESTART_QUARANTINE_S = 30.0
# How often a restarted index retries finding the deployment's stores when the search fails.
STORE_SEARCH_RETRY_S = 5.0
# How long the index keeps trying to listen on its channel's port when it is taken.
CHANNEL_BIND_WAIT_S = 30.0
# Changes of what the tier holds kept for followers (``KVIndex.changes``); one further
# behind gets everything held instead.
CHANGE_LOG_LEN = 100_000


class StoreEndpoint(msgspec.Struct, frozen=True):
    """How a worker reaches a store's pool through NIXL; sent once per store incarnation."""

    store_id: str
    node_id: str
    # Changes on every (re)start of the store actor; slots of another incarnation are void.
    incarnation: str
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

    # Unique across index restarts, so a commit can only ever settle the grant it names.
    grant_id: str
    store_id: str
    incarnation: str
    hashes: list[bytes]
    slots: list[int]
    # The store's endpoint, when the caller did not know this incarnation (it saves into the
    # grant at once, without another round trip).
    endpoint: StoreEndpoint | None = None


# The key in a request's kv_transfer_params under which a router tells the engine how many of
# the prompt's blocks the tier holds as far as it knows (TierChanges): told none, the tier's
# connector skips its lookup, which would hold the request for a round trip to the index.
TIER_HINT = "tandem_tier_blocks"
# The key in a request's kv_transfer_params that keeps the tier out of it (neither looked up
# nor saved): an engine's warm-up prompt (EngineActor.warm_up), which no one will ask for.
TIER_SKIP = "tandem_tier_skip"
# The key in a decode request's kv_transfer_params under which a router says how many of the
# prompt's first tokens the prefill engine that computed them saves to the tier: the decode
# engine that pulls them saves only what comes after (under conditional disaggregation a
# decode engine saves what it computes), instead of asking the index about every pulled block.
TIER_SAVED = "tandem_tier_saved_tokens"


class TierChanges(msgspec.Struct, frozen=True):
    """What the tier holds, for a router that follows it (``KVIndex.changes``): from `since`
    to `version`, every block committed (hash -> node of its store) and every one gone, or,
    when `full`, everything held at `version`."""

    # The index's life: a restarted index starts over, and a follower with it.
    incarnation: str
    since: int
    version: int
    full: bool
    held: dict[bytes, str]
    gone: list[bytes]
    # Where the index publishes its changes as they happen (ZMQ PUB); set on Ray answers.
    feed: str = ""


# ---- the index's channel: what engines send it, over ZMQ (``KVIndexActor.channel_address``)


class Lookup(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """``KVIndex.lookup``; answered with a LookupReply."""

    answer: ClassVar[Any] = LookupReply
    pin_key: str
    hashes: list[bytes]


class Unpin(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """``KVIndex.unpin``; never answered."""

    answer: ClassVar[Any] = None
    pin_key: str


class Allocate(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """``KVIndex.allocate``; answered with a Grant or None."""

    answer: ClassVar[Any] = Grant | None
    store_id: str
    hashes: list[bytes]
    owner: str
    slot_bytes: int | None = None
    known_incarnation: str | None = None


class Commit(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """``KVIndex.commit``; never answered."""

    answer: ClassVar[Any] = None
    grant: Grant
    ok: bool


class Endpoint(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """``KVIndex.endpoint``; answered with a StoreEndpoint or None."""

    answer: ClassVar[Any] = StoreEndpoint | None
    store_id: str


class SetSlotBytes(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """``KVIndex.set_slot_bytes``; answered with None, or an error when the engine's blocks
    differ from the tier's (``invalid``)."""

    answer: ClassVar[Any] = None
    slot_bytes: int


IndexRequest = Lookup | Unpin | Allocate | Commit | Endpoint | SetSlotBytes


class IndexCall(msgspec.Struct, frozen=True, array_like=True):
    """One request on the channel; `call_id` 0 asks for no answer."""

    call_id: int
    request: IndexRequest


class IndexAnswer(msgspec.Struct, frozen=True, array_like=True):
    """The answer to call `call_id`: `value` (msgpack of the request's ``answer`` type), or
    `error`; `invalid` when the request itself was refused (a ValueError in the index)."""

    call_id: int
    value: msgspec.Raw = msgspec.Raw(b"\xc0")
    error: str | None = None
    invalid: bool = False


class OwnerRelease(msgspec.Struct, frozen=True):
    """What ``release_owner`` reclaimed from a dead engine incarnation."""

    num_pins: int  # lookups whose pins were dropped
    num_grants: int  # uncommitted grants reclaimed
    num_slots: int  # their slots, now in quarantine


class IndexStats(msgspec.Struct):
    num_blocks: int = 0
    num_pinned: int = 0
    num_lookups: int = 0
    num_hit_blocks: int = 0
    num_saved_blocks: int = 0
    num_evicted_blocks: int = 0
    num_forgotten_blocks: int = 0
    # Open (uncommitted) grants, and slots resting in quarantine before reuse.
    num_open_grants: int = 0
    num_quarantined_slots: int = 0
    # Pins and grants reclaimed by their lease (nobody released them).
    num_expired_pins: int = 0
    num_expired_grants: int = 0
    # store id -> (blocks held, capacity in slots)
    stores: dict[str, tuple[int, int]] = {}
    # The index actor's process (what a fault drill kills); 0 from the plain KVIndex.
    pid: int = 0


class _Entry:
    """A held block; ``grant_id`` is set while it is being written (not loadable yet)."""

    __slots__ = ("store_id", "slot", "grant_id", "pins")

    def __init__(self, store_id: str, slot: int, grant_id: str) -> None:
        self.store_id = store_id
        self.slot = slot
        self.grant_id: str | None = grant_id
        self.pins = 0


class _Store:
    __slots__ = ("endpoint", "free", "num_slots")

    def __init__(self, endpoint: StoreEndpoint, num_slots: int) -> None:
        self.endpoint = endpoint
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))


class _OpenGrant:
    __slots__ = ("owner", "store_id", "hashes", "entries", "created")

    def __init__(self, owner: str, store_id: str, created: float) -> None:
        self.owner = owner
        self.store_id = store_id
        self.hashes: list[bytes] = []
        self.entries: list[_Entry] = []
        self.created = created


class _Pin:
    __slots__ = ("entries", "created")

    def __init__(self, entries: list[_Entry], created: float) -> None:
        self.entries = entries
        self.created = created


class KVIndex:
    """Block hash -> (store, slot), per-store capacity, LRU eviction, owned pins and grants
    with leases, and a quarantine for slots a transfer may still touch."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, hold_grants_s: float = 0.0) -> None:
        """`hold_grants_s`: grant nothing for this long (a restarted index, see
        RESTART_QUARANTINE_S). `clock` is injectable so tests can step time."""
        self._clock = clock
        self._grants_from = clock() + hold_grants_s
        # Makes grant ids unique across restarts: a commit meant for a previous life's grant
        # can never settle one of this life.
        self._incarnation = uuid.uuid4().hex[:8]
        self._num_grants = 0
        # Bytes of one slot (one KV block of every layer); fixed by the first engine.
        self.slot_bytes: int | None = None
        self._stores: dict[str, _Store] = {}
        # Every held block, least recently used first.
        self._blocks: OrderedDict[bytes, _Entry] = OrderedDict()
        # pin key (owner + "/" + request id) -> pinned entries, oldest first
        self._pins: dict[str, _Pin] = {}
        # grant id -> open grant, oldest first
        self._grants: dict[str, _OpenGrant] = {}
        # (free again at, store id, incarnation, slot), in time order
        self._quarantine: deque[tuple[float, str, str, int]] = deque()
        self.stats = IndexStats()
        # What followers need: (version, hash, node of its store, or None once gone), in
        # version order; `version` counts every change of the committed blocks.
        self.version = 0
        self._log: deque[tuple[int, bytes, str | None]] = deque(maxlen=CHANGE_LOG_LEN)

    @property
    def incarnation(self) -> str:
        return self._incarnation

    def _changed(self, h: bytes, e: _Entry, held: bool) -> None:
        """Log a committed block becoming loadable (`held`) or going away."""
        if not held and e.grant_id is not None:
            return  # never loadable, never announced
        self.version += 1
        self._log.append((self.version, h, self._stores[e.store_id].endpoint.node_id if held else None))

    def changes(self, incarnation: str, version: int) -> TierChanges:
        """What changed in the held blocks since a follower's `version` of this `incarnation`;
        everything held when it follows another life or fell out of the log."""
        since_log = self._log[0][0] - 1 if self._log else self.version
        if incarnation != self._incarnation or version < since_log or version > self.version:
            held = {h: self._stores[e.store_id].endpoint.node_id for h, e in self._blocks.items() if e.grant_id is None}
            return TierChanges(self._incarnation, 0, self.version, True, held, [])
        now: dict[bytes, str | None] = {}
        for v, h, node in reversed(self._log):
            if v <= version:
                break
            now.setdefault(h, node)
        return TierChanges(self._incarnation, version, self.version, False,
                           {h: node for h, node in now.items() if node is not None},
                           [h for h, node in now.items() if node is None])

    # ---- stores ----

    def set_slot_bytes(self, slot_bytes: int) -> None:
        """Every engine worker sends its slot size (at start and with each allocate); every
        engine of a deployment must agree."""
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
        """A store (re)started: forget whatever the previous incarnation held. Registering the
        incarnation already known changes nothing (a store and a restarted index may both
        announce it)."""
        known = self._stores.get(endpoint.store_id)
        if known is not None and known.endpoint.incarnation == endpoint.incarnation:
            return
        self.forget_store(endpoint.store_id)
        num_slots = endpoint.pool_bytes // self.slot_bytes if self.slot_bytes else 0
        self._stores[endpoint.store_id] = _Store(endpoint, num_slots)

    def forget_store(self, store_id: str) -> int:
        """Drop a store with every block and grant it held (its pool is gone, so no slot of it
        can be reused); returns blocks dropped."""
        if store_id not in self._stores:
            return 0
        dropped = [h for h, e in self._blocks.items() if e.store_id == store_id]
        for h in dropped:
            self._changed(h, self._blocks.pop(h), held=False)
        del self._stores[store_id]
        for grant_id in [g for g, grant in self._grants.items() if grant.store_id == store_id]:
            del self._grants[grant_id]
        self._quarantine = deque(q for q in self._quarantine if q[1] != store_id)
        self.stats.num_forgotten_blocks += len(dropped)
        return len(dropped)

    def clear(self) -> int:
        """Flush the tier (every store stays registered); returns blocks dropped. Slots of
        open grants and pinned blocks go through quarantine, but a load planned before the
        flush may still read an overwritten slot later: use it on an idle deployment."""
        dropped = len(self._blocks)
        for h, e in self._blocks.items():
            self._changed(h, e, held=False)
            if e.pins or e.grant_id is not None:
                self._quarantine_slot(e)
            else:
                self._stores[e.store_id].free.append(e.slot)
        self._blocks.clear()
        self._pins.clear()
        self._grants.clear()
        return dropped

    def endpoint(self, store_id: str) -> StoreEndpoint | None:
        store = self._stores.get(store_id)
        return store.endpoint if store else None

    def capacity(self, store_id: str) -> int:
        store = self._stores.get(store_id)
        return store.num_slots if store else 0

    # ---- loads ----

    def lookup(self, pin_key: str, hashes: list[bytes]) -> LookupReply:
        """The longest run of committed blocks from hashes[0], pinned under `pin_key`
        (``owner + "/" + request id``) until ``unpin(pin_key)``, ``release_owner(owner)`` or
        PIN_LEASE_S, and marked most recently used."""
        self._expire()
        self.unpin(pin_key)
        self.stats.num_lookups += 1
        locations: list[BlockLocation] = []
        pinned: list[_Entry] = []
        for h in hashes:
            e = self._blocks.get(h)
            if e is None or e.grant_id is not None:
                break
            store = self._stores[e.store_id]
            locations.append(BlockLocation(e.store_id, store.endpoint.incarnation, e.slot))
            e.pins += 1
            pinned.append(e)
            self._blocks.move_to_end(h)
        if pinned:
            self._pins[pin_key] = _Pin(pinned, self._clock())
        self.stats.num_hit_blocks += len(locations)
        return LookupReply(locations)

    def unpin(self, pin_key: str) -> None:
        """Release a lookup's pins (after its load, or when the request ends); idempotent."""
        pin = self._pins.pop(pin_key, None)
        if pin is not None:
            for e in pin.entries:
                e.pins -= 1

    # ---- saves ----

    def allocate(
        self,
        store_id: str,
        hashes: list[bytes],
        owner: str,
        slot_bytes: int | None = None,
        known_incarnation: str | None = None,
    ) -> Grant | None:
        """Reserve slots in `store_id` for the hashes not held anywhere (held ones are only
        touched), owned by `owner` until committed. Evicts LRU blocks of that store when full;
        grants fewer (a prefix of the new hashes) when the rest of the store is pinned or in
        quarantine. `slot_bytes` (the engine's) sizes the stores of an index that restarted
        empty; the grant carries the store's endpoint unless the caller knows its incarnation
        (`known_incarnation`). None: unknown or unsized store, or an index still in its
        restart quarantine."""
        if slot_bytes is not None:
            self.set_slot_bytes(slot_bytes)
        self._expire()
        store = self._stores.get(store_id)
        if store is None or store.num_slots == 0 or self._clock() < self._grants_from:
            return None
        self._num_grants += 1
        grant_id = f"{self._incarnation}-{self._num_grants}"
        grant = _OpenGrant(owner, store_id, self._clock())
        slots: list[int] = []
        for h in hashes:
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            if not store.free and not self._evict_one(store_id):
                break
            e = self._blocks[h] = _Entry(store_id, store.free.pop(), grant_id)
            grant.hashes.append(h)
            grant.entries.append(e)
            slots.append(e.slot)
        if grant.entries:
            self._grants[grant_id] = grant
        incarnation = store.endpoint.incarnation
        endpoint = store.endpoint if known_incarnation != incarnation else None
        return Grant(grant_id, store_id, incarnation, grant.hashes, slots, endpoint)

    def commit(self, grant: Grant, ok: bool) -> None:
        """The worker's transfer into a grant's slots has ended: it wrote them (ok: make the
        blocks loadable) or failed (free the slots now; the caller guarantees no transfer of
        the grant is still in flight). A grant already reclaimed (released owner, expired
        lease, forgotten store, previous index life) is ignored."""
        self._expire()
        open_grant = self._grants.pop(grant.grant_id, None)
        if open_grant is None:
            return
        store = self._stores[open_grant.store_id]
        for h, e in zip(open_grant.hashes, open_grant.entries):
            if self._blocks.get(h) is not e:
                continue
            if ok:
                e.grant_id = None
                self.stats.num_saved_blocks += 1
                self._changed(h, e, held=True)
            else:
                del self._blocks[h]
                store.free.append(e.slot)

    def _evict_one(self, store_id: str) -> bool:
        for h, e in self._blocks.items():
            if e.store_id == store_id and e.grant_id is None and e.pins == 0:
                del self._blocks[h]
                self._changed(h, e, held=False)
                self._stores[store_id].free.append(e.slot)
                self.stats.num_evicted_blocks += 1
                return True
        return False

    # ---- owners, leases, quarantine ----

    def release_owner(self, owner: str) -> OwnerRelease:
        """An engine incarnation died: drop every pin under ``owner + "/"`` and reclaim its
        open grants (slots through quarantine: its last WRITEs may still land)."""
        self._expire()
        prefix = owner + "/"
        pin_keys = [key for key in self._pins if key.startswith(prefix)]
        for key in pin_keys:
            self.unpin(key)
        grant_ids = [g for g, grant in self._grants.items() if grant.owner == owner]
        num_slots = sum(self._reclaim(self._grants.pop(g)) for g in grant_ids)
        return OwnerRelease(len(pin_keys), len(grant_ids), num_slots)

    def _reclaim(self, grant: _OpenGrant) -> int:
        """Drop an open grant's blocks and quarantine their slots; returns slots reclaimed."""
        num = 0
        for h, e in zip(grant.hashes, grant.entries):
            if self._blocks.get(h) is e:
                del self._blocks[h]
                self._quarantine_slot(e)
                num += 1
        return num

    def _quarantine_slot(self, e: _Entry) -> None:
        store = self._stores.get(e.store_id)
        if store is not None:
            self._quarantine.append((self._clock() + SLOT_QUARANTINE_S, e.store_id, store.endpoint.incarnation, e.slot))

    def _expire(self) -> None:
        """Reclaim pins and grants past their lease and free slots out of quarantine. Pins,
        grants and quarantined slots are kept in time order, so this stops at the first one
        still valid."""
        now = self._clock()
        while self._pins:
            key, pin = next(iter(self._pins.items()))
            if now - pin.created < PIN_LEASE_S:
                break
            self.unpin(key)
            self.stats.num_expired_pins += 1
        while self._grants:
            grant_id, grant = next(iter(self._grants.items()))
            if now - grant.created < GRANT_LEASE_S:
                break
            self._reclaim(self._grants.pop(grant_id))
            self.stats.num_expired_grants += 1
        while self._quarantine and self._quarantine[0][0] <= now:
            _, store_id, incarnation, slot = self._quarantine.popleft()
            store = self._stores.get(store_id)
            if store is not None and store.endpoint.incarnation == incarnation:
                store.free.append(slot)

    # ---- introspection ----

    def contains(self, h: bytes) -> bool:
        e = self._blocks.get(h)
        return e is not None and e.grant_id is None

    def get_stats(self) -> IndexStats:
        self._expire()
        s = self.stats
        s.num_blocks = len(self._blocks)
        s.num_pinned = sum(1 for e in self._blocks.values() if e.pins > 0)
        s.num_open_grants = len(self._grants)
        s.num_quarantined_slots = len(self._quarantine)
        held: dict[str, int] = {sid: 0 for sid in self._stores}
        for e in self._blocks.values():
            held[e.store_id] = held.get(e.store_id, 0) + 1
        s.stores = {sid: (held.get(sid, 0), self.capacity(sid)) for sid in self._stores}
        return s


def store_actor_name(app_name: str, node_id: str) -> str:
    """The named actor of a node's store (one per node that hosts engines)."""
    return f"{app_name}:kv-store:{node_id[:12]}"


def index_actor_name(app_name: str) -> str:
    return f"{app_name}:kv-index"


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _locked(method: _Method) -> _Method:
    """Run an actor method under the actor's lock: Ray's thread and the channel's both call
    the index."""

    @functools.wraps(method)
    def run(self: KVIndexActor, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class KVIndexActor:
    """The index behind Ray calls (the control plane) and its channel (engines). Calls are
    cheap and serialised by one lock; they carry hashes and slot numbers only.

    Ray restarts it when it dies; it comes back empty (connectors see misses and skipped
    saves meanwhile, so engines keep serving by recomputing), grants nothing for
    `restart_quarantine_s`, and finds the live stores of `app_name` by their actor names
    (``store_actor_name``) to register them again. Calls in flight when it dies fail rather
    than being retried (``max_task_retries=0``; the channel's are never answered): a retried
    allocate or lookup would pin or reserve for a caller that already gave up on it. The
    channel listens on `channel_port` again after a restart, so engines reconnect by
    themselves (0: a port the OS picks, which a restart does not keep)."""

    def __init__(
        self,
        app_name: str | None = None,
        namespace: str | None = None,
        restart_quarantine_s: float = RESTART_QUARANTINE_S,
        channel_port: int = 0,
    ) -> None:
        """`app_name`/`namespace`: whose stores to look for after a restart (None: never look;
        namespace None: this job's)."""
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.index = KVIndex(hold_grants_s=restart_quarantine_s if restarted else 0.0)
        self._lock = threading.Lock()
        host = ray.util.get_node_ip_address()
        bind_host = f"[{host}]" if ":" in host else host
        # Routers follow what the tier holds from this feed (orchestrator.cache_view.TierView):
        # every change is published as it happens, so no router asks per request.
        self._feed = zmq.Context.instance().socket(zmq.PUB)
        self._feed.setsockopt(zmq.SNDHWM, 0)  # followers resync after a gap; nothing is dropped here
        self._feed.setsockopt(zmq.LINGER, 0)
        self.feed_address = f"tcp://{bind_host}:{self._feed.bind_to_random_port(f'tcp://{bind_host}')}"
        self._channel = zmq.Context.instance().socket(zmq.ROUTER)
        self._channel.setsockopt(zmq.LINGER, 0)
        self._channel.setsockopt(zmq.SNDHWM, 0)
        self._channel.setsockopt(zmq.RCVHWM, 0)
        if channel_port:
            self._bind_channel(bind_host, channel_port)
        else:
            channel_port = self._channel.bind_to_random_port(f"tcp://{bind_host}")
        self.channel_address = f"tcp://{bind_host}:{channel_port}"
        self._published = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._store_search: _StoreSearch | None = None
        if restarted:
            logger.warning("CPU tier index restarted empty; granting no slots for %.0f s", restart_quarantine_s)
            if app_name is not None:
                self._store_search = _StoreSearch(app_name, namespace or ray.get_runtime_context().namespace)
        threading.Thread(target=self._serve_channel, name="tier-index-channel", daemon=True).start()

    def _bind_channel(self, bind_host: str, port: int) -> None:
        """Listen on `port`, retrying for a while: after a crash the port may still be held for
        a moment, and a restarted actor whose constructor fails is not restarted again."""
        deadline = time.monotonic() + CHANNEL_BIND_WAIT_S
        while True:
            try:
                self._channel.bind(f"tcp://{bind_host}:{port}")
                return
            except zmq.ZMQError as err:
                if time.monotonic() >= deadline:
                    raise OSError(f"the CPU tier index cannot listen on {bind_host}:{port} ({err}); fix: free the "
                                  "port, or set cpu_tier.index_port to one no other process on the node uses") from None
                time.sleep(0.2)

    def _serve_channel(self) -> None:
        """Answer engines' calls, in the order each engine sent them, for the process's life."""
        decoder = msgspec.msgpack.Decoder(IndexCall)
        while True:
            frames = self._channel.recv_multipart()
            try:
                peer, payload = frames
                call = decoder.decode(payload)
            except (ValueError, msgspec.DecodeError) as err:
                logger.warning("CPU tier index: dropped a call it cannot read (%s); an engine of another "
                               "Tandem version?", err)
                continue
            answer = self._answer(call)
            if call.call_id:  # a caller that left meanwhile is dropped by the ROUTER socket
                self._channel.send_multipart([peer, self._encoder.encode(answer)])

    def _answer(self, call: IndexCall) -> IndexAnswer:
        request = call.request
        try:
            if isinstance(request, Lookup):
                value: Any = self.lookup(request.pin_key, request.hashes)
            elif isinstance(request, Unpin):
                value = self.unpin(request.pin_key)
            elif isinstance(request, Allocate):
                value = self.allocate(request.store_id, request.hashes, request.owner, request.slot_bytes,
                                      request.known_incarnation)
            elif isinstance(request, Commit):
                value = self.commit(request.grant, request.ok)
            elif isinstance(request, Endpoint):
                value = self.endpoint(request.store_id)
            else:
                value = self.set_slot_bytes(request.slot_bytes)
        except ValueError as err:
            return IndexAnswer(call.call_id, error=str(err), invalid=True)
        except Exception as err:
            logger.exception("CPU tier index: %s failed", type(request).__name__)
            return IndexAnswer(call.call_id, error=f"{type(err).__name__}: {err}")
        return IndexAnswer(call.call_id, msgspec.Raw(self._encoder.encode(value)))

    def _adopt_stores(self) -> None:
        if self._store_search is None:
            return
        for endpoint in self._store_search.poll():
            if self.index.endpoint(endpoint.store_id) is None:  # the store's own registration wins
                self._register(endpoint)
        if self._store_search.done:
            self._store_search = None

    def _publish(self) -> None:
        """Send followers what changed since the last message (called after every call that
        may change the held blocks)."""
        if self.index.version != self._published:
            changes = self.index.changes(self.index.incarnation, self._published)
            self._published = changes.version
            self._feed.send(self._encoder.encode(changes))

    def _register(self, endpoint: StoreEndpoint) -> None:
        self.index.register_store(endpoint)
        self._publish()
        logger.info("CPU tier store %s (node %s, incarnation %s, %.2f GiB) registered",
                    endpoint.store_id, endpoint.node_id, endpoint.incarnation, endpoint.pool_bytes / 2**30)

    # ---- Ray calls: the control plane ----

    @_locked
    def changes(self, incarnation: str, version: int) -> TierChanges:
        """What changed since a follower's `version` of this `incarnation` (everything, when it
        follows another life or fell behind), and where the feed is."""
        return msgspec.structs.replace(self.index.changes(incarnation, version), feed=self.feed_address)

    @_locked
    def register_store(self, endpoint: StoreEndpoint) -> None:
        self._register(endpoint)

    @_locked
    def forget_store(self, store_id: str) -> int:
        dropped = self.index.forget_store(store_id)
        self._publish()
        logger.warning("CPU tier store %s forgotten with its %d blocks", store_id, dropped)
        return dropped

    @_locked
    def clear(self) -> int:
        dropped = self.index.clear()
        self._publish()
        logger.warning("CPU tier flushed: %d blocks dropped", dropped)
        return dropped

    @_locked
    def release_owner(self, owner: str) -> OwnerRelease:
        """Called by the control plane when it sees an engine incarnation die."""
        released = self.index.release_owner(owner)
        logger.info("CPU tier released engine %s: %d lookups' pins, %d grants (%d slots in quarantine)",
                    owner, released.num_pins, released.num_grants, released.num_slots)
        return released

    @_locked
    def get_stats(self) -> IndexStats:
        self._adopt_stores()
        stats = self.index.get_stats()
        stats.pid = os.getpid()
        return stats

    def get_channel_address(self) -> str:
        return self.channel_address

    # ---- the channel's calls: engines ----

    @_locked
    def set_slot_bytes(self, slot_bytes: int) -> None:
        self.index.set_slot_bytes(slot_bytes)

    @_locked
    def endpoint(self, store_id: str) -> StoreEndpoint | None:
        self._adopt_stores()
        return self.index.endpoint(store_id)

    @_locked
    def lookup(self, pin_key: str, hashes: list[bytes]) -> LookupReply:
        self._adopt_stores()
        return self.index.lookup(pin_key, hashes)

    @_locked
    def unpin(self, pin_key: str) -> None:
        self.index.unpin(pin_key)

    @_locked
    def allocate(
        self,
        store_id: str,
        hashes: list[bytes],
        owner: str,
        slot_bytes: int | None = None,
        known_incarnation: str | None = None,
    ) -> Grant | None:
        self._adopt_stores()
        grant = self.index.allocate(store_id, hashes, owner, slot_bytes, known_incarnation)
        self._publish()  # a full store evicts
        return grant

    @_locked
    def commit(self, grant: Grant, ok: bool) -> None:
        self.index.commit(grant, ok)
        self._publish()


class _StoreSearch:
    """A restarted index's search for the live stores of its deployment. Never blocks a call
    on a store: it asks each for its endpoint and collects the answers on later calls (a
    store that is itself starting may be waiting on this very index)."""

    def __init__(self, app_name: str, namespace: str) -> None:

        self.prefix = store_actor_name(app_name, "")
        self.namespace = namespace
        self.pending: list[Any] = []
        self.searched = False
        self.last_try = time.monotonic()
        self._search()

    @property
    def done(self) -> bool:
        return self.searched and not self.pending

    def poll(self) -> list[StoreEndpoint]:
        """Endpoints answered since the last poll; retries a search that failed."""
        if not self.searched and time.monotonic() - self.last_try >= STORE_SEARCH_RETRY_S:
            self.last_try = time.monotonic()
            self._search()
        if not self.pending:
            return []
        ready, self.pending = ray.wait(self.pending, num_returns=len(self.pending), timeout=0)
        endpoints = []
        for ref in ready:
            try:
                endpoints.append(ray.get(ref))
            except Exception as err:  # that store died; its restart registers itself
                logger.warning("CPU tier index: a store did not answer after the index restarted: %s", err)
        return endpoints

    def _search(self) -> None:
        try:
            names = [
                a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == self.namespace and a["name"].startswith(self.prefix)
            ]
            self.pending = [ray.get_actor(name, namespace=self.namespace).info.remote() for name in names]
        except Exception as err:
            logger.warning("CPU tier index: could not list the stores (%s); retrying in %.0f s",
                           err, STORE_SEARCH_RETRY_S)
            return
        self.searched = True
        logger.info("CPU tier index: re-registering %d store(s) after its restart", len(names))
