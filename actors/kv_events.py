"""Which prefix blocks one engine's KV cache holds, from vLLM's own KV-cache events.

vLLM's scheduler publishes every block it stores in or evicts from its prefix cache
(BlockStored / BlockRemoved / AllBlocksCleared, `kv_events_config`) on a ZMQ PUB socket. The
engine actor binds that socket to an ipc path only its own engine core uses, follows it on a
thread, and keeps the set of block keys held plus a short log of changes (and, apart, the
blocks each arriving request's router saw, EngineRequest.blocks); routers follow the log by
long-poll (EngineActor.cache_updates), so every ingress replica derives the same view from the
same feed and a restarted engine (a new incarnation) starts from an empty one.

A block key is vLLM's block hash reduced to 64 bits, exactly as vLLM publishes it by default
(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES); `PrefixHasher` and `as_key` compute the same keys from a
prompt's tokens with vLLM's own hash function, so a router can ask "how much of this prompt does that
engine hold" without a call to the engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

from actors.protocol import BlockUse, EchoedUse

logger = logging.getLogger("tandem.kv_events")

# Changes kept for routers that fall behind; one further behind gets the whole set instead.
MAX_LOG = 4096
# The most block keys of arrived requests (RecentUses) an engine keeps for its routers, about
# 36 MB: under long prompts or heavy traffic they reach less far back rather than grow the
# engine actor's memory.
MAX_USE_KEYS = 1_000_000
# The block keys of the latest arrived requests an engine remembers with their routers' origin
# tags, to tell whose request stored a block (KVEventFollower.apply): the prompts in flight
# on one engine, 2M tokens at 32-token blocks, with room to spare.
MAX_ANNOUNCED_KEYS = 65_536
_MASK64 = (1 << 64) - 1


def as_key(block_hash: bytes | int) -> int:
    """vLLM's published form of a block hash (maybe_convert_block_hash): its low 64 bits."""
    if isinstance(block_hash, int):
        return block_hash & _MASK64
    return int.from_bytes(block_hash, "big") & _MASK64


class PrefixHasher:
    """Computes the block hashes vLLM's scheduler gives a plain token prompt (no LoRA,
    multimodal input or cache salt), with the engine's hash algorithm and seed."""

    def __init__(self, algo: str, seed: str, block_size: int) -> None:
        # vLLM's scheduler module takes seconds to import: here, when a router starts
        # following an engine, not inside the first request's routing on its event loop
        # (where it stalled every request of an ingress for up to 10 s on a loaded host).
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import hash_block_tokens

        self.block_size = block_size
        self._fn = get_hash_fn_by_name(algo)
        self._hash_block = hash_block_tokens
        self._none_hash: bytes = self._fn(seed)

    def hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """One hash per full block of `token_ids`, each chained on the one before."""
        out: list[bytes] = []
        parent = self._none_hash
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = self._hash_block(self._fn, parent, token_ids[start : start + self.block_size], None)
            out.append(parent)
        return out


def hash_settings(engine_args: dict[str, Any]) -> tuple[str, str]:
    """The (algorithm, seed) this process's vLLM engine hashes prefix blocks with."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

    algo = engine_args.get("prefix_caching_hash_algo", "sha256")
    return algo, resolve_none_hash_seed(get_hash_fn_by_name(algo))


class CacheDelta(msgspec.Struct, frozen=True):
    """Keys stored and removed by one batch of events (`cleared`: everything went first); none
    for a change of load (`KVEventFollower.poke`), with the origin (EngineRequest.origin) of
    the request that made it."""

    version: int
    stored: list[int]
    removed: list[int]
    cleared: bool = False
    origin: str = ""


class RecentUses:
    """The blocks of the requests that arrived at an engine lately (EngineRequest.blocks), by
    the version of its change log they arrived at, for the routers following it: those since a
    router's last call, or, for a router that starts following (a new or restarted ingress
    replica), those of the last seconds it asks for, so that it knows what traffic reuses at
    once instead of after its own memory of it has filled. The oldest go first past `max_keys`."""

    def __init__(self, max_keys: int = MAX_USE_KEYS) -> None:
        self._uses: deque[tuple[int, float, BlockUse]] = deque()
        self._keys = 0
        self._max_keys = max_keys

    def add(self, version: int, use: BlockUse, now: float) -> None:
        self._uses.append((version, now, use))
        self._keys += len(use.keys)
        while self._keys > self._max_keys:
            self._keys -= len(self._uses.popleft()[2].keys)

    def since(self, version: int, now: float) -> list[EchoedUse]:
        """Those that arrived after `version`, the oldest first (fewer, when more keys came since)."""
        return self._latest(lambda v, _t: v > version, now)

    def within(self, age_s: float, now: float) -> list[EchoedUse]:
        """Those that arrived in the last `age_s` seconds, the oldest first."""
        return self._latest(lambda _v, t: now - t <= age_s, now)

    def _latest(self, keep: Callable[[int, float], bool], now: float) -> list[EchoedUse]:
        out = []
        for version, t, use in reversed(self._uses):
            if not keep(version, t):
                break
            out.append(EchoedUse(now - t, use))
        out.reverse()
        return out


class KVEventFollower:
    """Subscribes to an engine core's KV events and keeps what its GPU cache holds.

    A thread receives and applies the events; async callers wait for changes with
    `wait_changed`. A gap in vLLM's sequence numbers (events dropped at the ZMQ high-water
    mark) is logged as a WARNING; the view then stays approximate until the evicted or stored
    blocks are seen again.
    """

    def __init__(self, endpoint: str) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.endpoint = endpoint
        self.held: set[int] = set()
        self.version = 0
        self.log: deque[CacheDelta] = deque()
        self.uses = RecentUses()
        # Block key -> origin of the latest request that announced it (EngineRequest.blocks).
        self._announced: OrderedDict[int, str] = OrderedDict()
        self._lock = threading.Lock()
        # (loop, event, origin of the router waiting) of every pending wait_changed.
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event, str]] = []
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last_seq = -1
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while self._running:
            if not poller.poll(200):
                continue
            try:
                _topic, seq_bytes, payload = self._sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if last_seq >= 0 and seq > last_seq + 1:
                    logger.warning("lost %d KV-event batches from %s; the prefix view is approximate until "
                                   "those blocks are seen again", seq - last_seq - 1, self.endpoint)
                last_seq = seq
                self.apply(self._decoder.decode(payload).events)
            except Exception:  # one bad message must not end the follower
                logger.exception("could not apply a KV-event batch from %s", self.endpoint)

    def apply(self, events: Sequence[Any]) -> None:
        """Fold one batch of vLLM KV events into the held set (GPU blocks of group 0 only), in
        order: a block evicted and stored again within the batch stays held."""
        net: dict[int, bool] = {}  # key -> held after the batch
        cleared = False
        for ev in events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                cleared, net = True, {}
            elif getattr(ev, "medium", None) not in (None, "GPU") or (getattr(ev, "group_idx", None) or 0) != 0:
                continue
            elif kind in ("BlockStored", "BlockRemoved"):
                net.update(dict.fromkeys((as_key(h) for h in ev.block_hashes), kind == "BlockStored"))
        if net or cleared:
            self._change([k for k, held in net.items() if held], [k for k, held in net.items() if not held], cleared)

    def poke(self, origin: str, use: BlockUse | None = None) -> None:
        """Something routers read with the cache changed (the engine's load: a request from the
        router tagged `origin` arrived, with the blocks that router saw in `use`, or left). It
        takes a version of its own, a delta with no keys, so that another router between two
        calls when it happens still sees it at once instead of at its next timeout. The
        request's own router knows of it already and is not woken: its answer would land on
        the engine's cores while the request computes there (docs/bench-results.md, run 134)."""
        self._change([], [], False, use, origin)

    def _change(self, stored: list[int], removed: list[int], cleared: bool, use: BlockUse | None = None,
                origin: str = "") -> None:
        """Apply one change, log it under the next version and wake every `wait_changed` but
        those of the router tagged `origin`: a change of load its own request made, or blocks
        stored that its requests announced, all of them (it counts them as held since it sent
        those requests, CacheView.expect, and hears of them at its next answer). Evictions, and
        blocks no one announced (a decode engine's output), wake every router."""
        with self._lock:
            if use is not None:
                self._announce(use.keys, origin)
            elif stored and not removed and not cleared:
                origin = self._announcer(stored)
            if cleared:
                self.held.clear()
            self.held.update(stored)
            self.held.difference_update(removed)
            self.version += 1
            self.log.append(CacheDelta(self.version, stored, removed, cleared, origin))
            if len(self.log) > MAX_LOG:
                self.log.popleft()
            if use is not None:
                self.uses.add(self.version, use, time.monotonic())
            waiters = [w for w in self._waiters if not origin or w[2] != origin]
            self._waiters = [w for w in self._waiters if origin and w[2] == origin]
        for loop, event, _ in waiters:
            loop.call_soon_threadsafe(event.set)

    def _announce(self, keys: Sequence[int], origin: str) -> None:
        """Remember that the router tagged `origin` sent a request using `keys` (under the
        lock); the oldest keys go first past MAX_ANNOUNCED_KEYS."""
        announced = self._announced
        for k in keys:
            announced[k] = origin
            announced.move_to_end(k)
        while len(announced) > MAX_ANNOUNCED_KEYS:
            announced.popitem(last=False)

    def _announcer(self, stored: Sequence[int]) -> str:
        """The origin of the router whose requests announced every block of `stored` last, or
        "" when none did (under the lock)."""
        origins = {self._announced.get(k, "") for k in stored}
        return origins.pop() if len(origins) == 1 else ""

    def changes_since(self, version: int) -> tuple[int, list[CacheDelta] | None]:
        """(current version, the deltas after `version`), or None for the deltas when the log
        no longer reaches back that far (the caller needs `snapshot`)."""
        with self._lock:
            if version == self.version:
                return version, []
            if version > self.version or not self.log or self.log[0].version > version + 1:
                return self.version, None
            return self.version, [d for d in self.log if d.version > version]

    def uses_since(self, version: int) -> list[EchoedUse]:
        """The blocks of the requests that arrived after `version` (RecentUses.since)."""
        with self._lock:
            return self.uses.since(version, time.monotonic())

    def uses_within(self, age_s: float) -> list[EchoedUse]:
        """The blocks of the requests that arrived in the last `age_s` seconds (RecentUses.within)."""
        with self._lock:
            return self.uses.within(age_s, time.monotonic())

    def _changed_for(self, version: int, origin: str) -> bool:
        """Whether a change after `version` wakes the router tagged `origin` (under the lock)."""
        if version == self.version:
            return False
        if not origin or version > self.version or not self.log or self.log[0].version > version + 1:
            return True
        return any(d.origin != origin for d in self.log if d.version > version)

    def snapshot(self) -> tuple[int, list[int]]:
        with self._lock:
            return self.version, list(self.held)

    async def wait_changed(self, version: int, timeout_s: float, origin: str = "") -> None:
        """Return when something changed after `version` (the cache, or the load by a request
        of a router other than the one tagged `origin`) or after `timeout_s`."""
        event = asyncio.Event()
        with self._lock:
            if self._changed_for(version, origin):
                return
            self._waiters.append((asyncio.get_running_loop(), event, origin))
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            with self._lock:
                self._waiters = [w for w in self._waiters if w[1] is not event]

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=1.0)
        self._sock.close()
