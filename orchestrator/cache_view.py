"""What each engine's prefix cache holds and how busy it is, as a router sees it.

Every router (one per ingress replica) follows every engine it routes to by long-poll
(EngineActor.cache_updates): the block keys vLLM's own KV events say the engine stored or
evicted, and the engine's load, counted over every router. All ingress replicas therefore
derive the same view from the same events, with no shared state to keep consistent; a
restarted engine is a new incarnation and starts from an empty view.

Events lag a request by an engine step or two, so a router also counts the blocks of the
requests it just sent to an engine as held there for a few seconds (`expect`): a burst of
requests sharing a prefix then follows the first one instead of scattering. The CPU tier's
index answers for the tier (`tier_prefix`), when the deployment has one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from ray.exceptions import RayError

from actors.kv_events import PrefixHasher, as_key
from actors.protocol import CacheUpdate
from orchestrator.protocol import EngineRef

logger = logging.getLogger("tandem.cache_view")

# A cache_updates call returns at the latest after this long, with the engine's load.
POLL_S = 1.0
# Blocks of a request just routed to an engine count as held there this long, or until the
# engine's events say otherwise.
EXPECT_TTL_S = 5.0
# A router waits this long for the CPU tier's answer before deciding without it.
TIER_TIMEOUT_S = 0.05


class EngineCache:
    """One engine's prefix cache and load, as the router last heard."""

    def __init__(self, ref: EngineRef) -> None:
        self.ref = ref
        self.incarnation = ""
        self.version = 0
        self.held: set[int] = set()
        self.expected: dict[int, float] = {}
        self.num_requests = 0
        self.num_tokens = 0
        self.requests_by_origin: dict[str, int] = {}
        self.kv_cache_usage = 0.0

    def apply(self, update: CacheUpdate) -> None:
        if update.full or update.incarnation != self.incarnation:
            self.held = set(update.stored)
        else:
            self.held.update(update.stored)
            self.held.difference_update(update.removed)
        self.expected = {k: t for k, t in self.expected.items() if k not in self.held}
        for k in update.removed:
            self.expected.pop(k, None)
        self.incarnation, self.version = update.incarnation, update.version
        self.num_requests, self.num_tokens = update.num_requests, update.num_tokens
        self.requests_by_origin = update.requests_by_origin
        self.kv_cache_usage = update.kv_cache_usage

    def prefix_blocks(self, keys: Sequence[int], now: float) -> int:
        """How many of `keys`, from the first on, the engine holds (or is expected to)."""
        n = 0
        for k in keys:
            if k not in self.held and self.expected.get(k, -math.inf) < now:
                break
            n += 1
        return n

    def free_blocks(self, now: float) -> int | None:
        """Blocks the engine can still store before its prefix cache evicts one (held and
        expected blocks count as taken); None when its capacity is unknown."""
        if not self.ref.num_blocks:
            return None
        expected = sum(t >= now for t in self.expected.values())
        return max(0, self.ref.num_blocks - len(self.held) - expected)

    def expect(self, keys: Sequence[int], now: float) -> None:
        deadline = now + EXPECT_TTL_S
        if len(self.expected) > 4 * len(keys) + 1024:  # drop the expired before growing further
            self.expected = {k: t for k, t in self.expected.items() if t >= now}
        for k in keys:
            if k not in self.held:
                self.expected[k] = deadline


class PromptKeys:
    """A prompt's block hashes and keys per block geometry, computed once per request."""

    def __init__(self, view: CacheView, token_ids: Sequence[int]) -> None:
        self._view = view
        self.token_ids = token_ids
        self._by_hasher: dict[tuple[str, str, int], tuple[list[bytes], list[int]]] = {}
        # The CPU tier's answer (CacheView.tier_prefix), asked once per request.
        self.tier: dict[str, int] | None = None

    def for_engine(self, ref: EngineRef) -> tuple[list[bytes], list[int]]:
        spec = (ref.hash_algo, ref.hash_seed, ref.block_size)
        got = self._by_hasher.get(spec)
        if got is None:
            hashes = self._view.hasher(*spec).hashes(self.token_ids)
            got = self._by_hasher[spec] = (hashes, [as_key(h) for h in hashes])
        return got


class CacheView:
    """Follows the prefix cache and load of every engine a router may route to."""

    def __init__(self, tier_index: Any | None = None) -> None:
        """`tier_index`: the CPU tier's KVIndexActor handle, None when there is no tier."""
        self.tier_index = tier_index
        self.caches: dict[str, EngineCache] = {}
        # engine id -> the task following it and the EngineCache that task fills
        self._tasks: dict[str, tuple[asyncio.Task[None], EngineCache]] = {}
        self._hashers: dict[tuple[str, str, int], PrefixHasher] = {}

    def set_engines(self, engines: Sequence[EngineRef]) -> None:
        """Follow these engines (from the next `sync` on the event loop); forget the rest.
        Their block hashers are made now, before any request needs them (`PrefixHasher`)."""
        self.caches = {e.engine_id: self.caches.get(e.engine_id) or EngineCache(e) for e in engines}
        for e in engines:
            self.caches[e.engine_id].ref = e
            self.hasher(e.hash_algo, e.hash_seed, e.block_size)

    def sync(self) -> None:
        """Start following new engines and stop following gone ones; needs a running loop."""
        for eid, (task, cache) in list(self._tasks.items()):
            if self.caches.get(eid) is not cache:  # gone, or dropped and listed again meanwhile
                task.cancel()
                del self._tasks[eid]
        for eid, cache in self.caches.items():
            followed = self._tasks.get(eid)
            if followed is None or followed[0].done():
                self._tasks[eid] = (asyncio.get_running_loop().create_task(self._follow(cache)), cache)

    async def _follow(self, cache: EngineCache) -> None:
        while True:
            try:
                update = await cache.ref.handle.cache_updates.remote(cache.incarnation, cache.version, POLL_S)
            except RayError as err:
                # The engine died or restarts: the routing table drops or renews it meanwhile.
                logger.debug("cache updates of engine %s failed: %s", cache.ref.engine_id, err)
                await asyncio.sleep(POLL_S)
                continue
            if update.incarnation != cache.incarnation and cache.incarnation:
                logger.info("engine %s is a new incarnation (%s); its prefix view starts anew",
                            cache.ref.engine_id, update.incarnation)
            cache.apply(update)

    def hasher(self, algo: str, seed: str, block_size: int) -> PrefixHasher:
        spec = (algo, seed, block_size)
        if spec not in self._hashers:
            self._hashers[spec] = PrefixHasher(algo, seed, block_size)
        return self._hashers[spec]

    def prompt(self, token_ids: Sequence[int]) -> PromptKeys:
        return PromptKeys(self, token_ids)

    def cached_tokens(self, ref: EngineRef, prompt: PromptKeys) -> int:
        """Prompt tokens engine `ref` holds in its prefix cache (whole blocks from the first)."""
        cache = self.caches.get(ref.engine_id)
        if cache is None:
            return 0
        _, keys = prompt.for_engine(ref)
        return cache.prefix_blocks(keys, time.monotonic()) * ref.block_size

    def evicted_tokens(self, ref: EngineRef, prompt: PromptKeys, cached_tokens: int) -> int:
        """Prompt tokens of other prefixes that engine `ref` would evict from its prefix cache
        to store this prompt's blocks beyond its `cached_tokens` (0 while it has room for them,
        or when its capacity is unknown)."""
        cache = self.caches.get(ref.engine_id)
        free = cache.free_blocks(time.monotonic()) if cache is not None else None
        if free is None:
            return 0
        stored = len(prompt.for_engine(ref)[1]) - cached_tokens // ref.block_size
        return max(0, stored - free) * ref.block_size

    def expect(self, ref: EngineRef, prompt: PromptKeys) -> None:
        """Count the prompt's blocks as held on `ref` until its events catch up."""
        cache = self.caches.get(ref.engine_id)
        if cache is not None:
            cache.expect(prompt.for_engine(ref)[1], time.monotonic())

    def seen(self, engine_id: str) -> EngineCache | None:
        """What the router last heard from the engine (its load included), if anything."""
        return self.caches.get(engine_id)

    async def tier_prefix(self, ref: EngineRef, prompt: PromptKeys) -> dict[str, int]:
        """The CPU tier's run of the prompt's blocks from the first, counted by node; empty
        when there is no tier or it does not answer in TIER_TIMEOUT_S (routing goes on)."""
        if self.tier_index is None:
            return {}
        if prompt.tier is None:
            prompt.tier = {}
            hashes, _ = prompt.for_engine(ref)
            if hashes:
                with contextlib.suppress(RayError, asyncio.TimeoutError):
                    prompt.tier = await asyncio.wait_for(self.tier_index.held_prefix.remote(hashes), TIER_TIMEOUT_S)
        return prompt.tier

    async def close(self) -> None:
        tasks = [task for task, _ in self._tasks.values()]
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
