"""What each engine's prefix cache holds and how busy it is, as a router sees it.

Every router (one per ingress replica) follows every engine it routes to by long-poll
(EngineActor.cache_updates): the block keys vLLM's own KV events say the engine stored or
evicted, the engine's load, counted over every router, and the blocks of every request that
arrived there, as the router that sent it claimed them (EngineRequest.blocks): which of them
traffic reuses, which no event says. All ingress replicas therefore derive the same view
from the same feed, with no shared state to keep consistent; a restarted engine is a new
incarnation and starts from an empty view.

Events lag a request by an engine step or two, so a router also counts the blocks of the
requests it just sent to an engine as held there for a few seconds (`expect`): a burst of
requests sharing a prefix then follows the first one instead of scattering. The CPU tier is
followed too, when the deployment has one (`TierView`: the index publishes every change of
what it holds, `KVIndexActor.changes` answers the rest): asking the index per request would
put a round trip on every request's path, and on an engine's, its lookup.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from ray.exceptions import RayError

from actors.kv_events import PrefixHasher, as_key
from actors.kv_index import TierChanges
from actors.protocol import BlockUse, CacheUpdate, EchoedUse
from orchestrator.background import spawn
from orchestrator.protocol import EngineRef

logger = logging.getLogger("tandem.cache_view")

# A cache_updates call returns at the latest after this long, with the engine's load.
POLL_S = 1.0
# Blocks of a request just routed to an engine count as held there this long, or until the
# engine's events say otherwise.
EXPECT_TTL_S = 5.0
# A block is live on an engine while requests routed there reuse it (a block some earlier
# request used), the last time this recently: long enough to span a chat's pause between
# turns, short enough that prefixes nobody came back to (vLLM evicts those first, at no cost)
# do not count.
WORKING_SET_S = 120.0
# How long a prompt that extended none waits for its continuation before it counts as not
# continued, until some continuation has been seen (then the longest wait seen lately is the
# mark): a user's pause between two turns of a chat.
CONTINUATION_WAIT_S = 30.0
# The most block keys a router remembers as used lately, to tell a reuse from a first use
# (about 33 MB; a router seeing more distinct blocks than this in WORKING_SET_S forgets the
# oldest first uses, and their reuses count from the next one).
SEEN_MAX = 200_000
# The most uses from an engine's answer taken in at once before other tasks (requests) run.
HEARD_BATCH = 256


class EngineCache:
    """One engine's prefix cache and load, as the router last heard."""

    def __init__(self, ref: EngineRef) -> None:
        self.ref = ref
        self.incarnation = ""
        self.version = 0
        self.held: set[int] = set()
        self.expected: dict[int, float] = {}
        # key -> when a request this router sent here last reused it, the least recent first.
        self.live: collections.OrderedDict[int, float] = collections.OrderedDict()
        # The same, kept when the engine evicts the block: what traffic asks this cache to keep.
        self.wanted: collections.OrderedDict[int, float] = collections.OrderedDict()
        self.num_requests = 0
        self.num_tokens = 0
        self.requests_by_origin: dict[str, int] = {}
        self.kv_cache_usage = 0.0

    def apply(self, update: CacheUpdate) -> None:
        if update.full or update.incarnation != self.incarnation:
            self.held = set(update.stored)
            if self.incarnation and update.incarnation != self.incarnation:  # a restart, not the first answer
                self.live.clear()
                self.wanted.clear()
        else:
            self.held.update(update.stored)
            self.held.difference_update(update.removed)
        self.expected = {k: t for k, t in self.expected.items() if k not in self.held}
        for k in update.removed:
            self.expected.pop(k, None)
            self.live.pop(k, None)
        self.incarnation, self.version = update.incarnation, update.version
        self.num_requests, self.num_tokens = update.num_requests, update.num_tokens
        self.requests_by_origin = update.requests_by_origin
        self.kv_cache_usage = update.kv_cache_usage

    def prefix_blocks(self, keys: Sequence[int], now: float) -> int:
        """How many of `keys`, from the first on, the engine holds (or is expected to hold at
        `now`; at `math.inf`, held blocks only)."""
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

    def working_set(self, now: float) -> int:
        """Live blocks: those that requests sent here reused (CacheView.expect), the last time
        within WORKING_SET_S, and the engine still holds (or is expected to): the prefixes
        traffic keeps coming back to here, a chat's history or a shared system prompt, not a
        one-off question's, nor a history whose chat has moved on to another engine. Dropped
        from the least recently used end, so a block whose expectation lapsed unstored counts
        as long as the blocks used before it."""
        live = self.live
        while live:
            key, t = next(iter(live.items()))
            if t >= now - WORKING_SET_S and (key in self.held or self.expected.get(key, -math.inf) >= now):
                break
            del live[key]
        return len(live)

    def live_blocks(self, keys: Sequence[int]) -> int:
        """How many of `keys` are live here (as of the last `working_set`)."""
        return sum(k in self.live for k in keys)

    def demand(self, now: float, keys: Sequence[int]) -> int:
        """Blocks that requests sent here reused within WORKING_SET_S, held or since evicted,
        other than `keys`: what traffic asks this cache to keep. Unlike the working set, a
        cache that evicts what is asked of it does not look roomier for it."""
        wanted = self.wanted
        while wanted and next(iter(wanted.values())) < now - WORKING_SET_S:
            wanted.popitem(last=False)
        return len(wanted) - sum(k in wanted for k in keys)

    def expect(self, keys: Sequence[int], now: float) -> None:
        """A request using `keys` was sent here: they count as held for EXPECT_TTL_S (until
        events say otherwise)."""
        deadline = now + EXPECT_TTL_S
        if len(self.expected) > 4 * len(keys) + 1024:  # drop the expired before growing further
            self.expected = {k: t for k, t in self.expected.items() if t >= now}
        for k in keys:
            if k not in self.held:
                self.expected[k] = deadline

    def reuse(self, keys: Sequence[int], t: float) -> None:
        """A request sent here at `t` reused `keys`: they are live (and wanted) as of then,
        unless a later use is known already."""
        for lately in (self.live, self.wanted):
            _touch(lately, keys, t)


class TierView:
    """What the CPU tier holds (block hash -> node of its store), as the router last heard.
    Until the first answer, and while the index does not answer, it knows nothing (`synced`
    False): routing then counts no tier hits and engines look the tier up themselves."""

    def __init__(self) -> None:
        self.incarnation = ""
        self.version = 0
        self.held: dict[bytes, str] = {}
        self.synced = False

    def apply(self, changes: TierChanges) -> None:
        if changes.full:
            self.held = dict(changes.held)
        else:
            self.held.update(changes.held)
            for h in changes.gone:
                self.held.pop(h, None)
        self.incarnation, self.version, self.synced = changes.incarnation, changes.version, True

    def prefix(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """The run of `hashes` held from the first on, counted by node."""
        by_node: dict[str, int] = {}
        for h in hashes:
            node = self.held.get(h)
            if node is None:
                break
            by_node[node] = by_node.get(node, 0) + 1
        return by_node


class Openers:
    """Prompts that extended no earlier one (a chat's first turn, a one-off question), by
    their last full block, the least recent first, and which of them a later prompt
    extended; counted by their first block (a system prompt's, say), so that traffic after
    one prefix keeps odds of its own. One not extended counts as missed only once it is older
    than the longest wait seen lately between an opener and its continuation
    (CONTINUATION_WAIT_S while none was seen): a first turn whose user is still typing is no
    evidence that such prompts are one-offs. Missed and then extended, it counts as continued."""

    def __init__(self) -> None:
        self.since: collections.OrderedDict[int, tuple[float, int]] = collections.OrderedDict()  # last -> (t, first)
        # Openers neither extended nor missed yet, the least recent first.
        self.pending: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.gaps: dict[int, float] = {}  # extended opener -> how long after it the extension came
        # The rest of `since` was missed (given up on).
        self.continued: collections.Counter[int] = collections.Counter()  # first block -> openers extended
        self.missed_by: collections.Counter[int] = collections.Counter()  # first block -> openers missed
        self.longest = 0.0  # the longest of `gaps`

    def open(self, last: int, first: int, t: float) -> None:
        if last not in self.since:
            self.since[last] = (t, first)
            self.pending[last] = None

    def extend(self, last: int, t: float) -> None:
        """A prompt sent at `t` holds this block: the opener ending in it, if any, was continued."""
        if last not in self.since or last in self.gaps:
            return
        opened, first = self.since[last]
        self.gaps[last] = gap = max(0.0, t - opened)
        self.longest = max(self.longest, gap)
        self.continued[first] += 1
        if last in self.pending:
            del self.pending[last]
        else:
            _drop(self.missed_by, first)

    def forget(self, before: float, keep: int) -> None:
        """Drop the openers sent before `before`, and the least recent past `keep`."""
        since = self.since
        while since and (len(since) > keep or next(iter(since.values()))[0] < before):
            last, (_, first) = since.popitem(last=False)
            gap = self.gaps.pop(last, None)
            if gap is not None:
                _drop(self.continued, first)
                if gap >= self.longest:
                    self.longest = max(self.gaps.values(), default=0.0)
            elif last in self.pending:
                del self.pending[last]
            else:
                _drop(self.missed_by, first)

    def settle(self, now: float) -> None:
        """Count as missed the openers not extended that are older than the longest wait
        seen lately (CONTINUATION_WAIT_S while none was seen)."""
        wait = self.longest if self.gaps else CONTINUATION_WAIT_S
        pending = self.pending
        while pending and self.since[next(iter(pending))][0] < now - wait:
            last, _ = pending.popitem(last=False)
            self.missed_by[self.since[last][1]] += 1

    def rate(self, now: float, first: int | None = None) -> float:
        """The odds that an opener (after block `first`, or any) is extended: the share of
        those extended or missed by `now` that were extended; 1 while none is either."""
        self.settle(now)
        if first is None:
            extended, missed = len(self.gaps), len(self.since) - len(self.pending) - len(self.gaps)
        else:
            extended, missed = self.continued[first], self.missed_by[first]
        return extended / (extended + missed) if extended + missed else 1.0


def _drop(counts: collections.Counter[int], key: int) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]


def _touch(lately: collections.OrderedDict[int, float], keys: Sequence[int], t: float) -> None:
    """Stamp `keys` used at `t` in `lately` (the least recent first), each moved to the end
    unless it was used later than `t` already (a use heard late, from an engine's history)."""
    for k in keys:
        if lately.get(k, -math.inf) <= t:
            lately[k] = t
            lately.move_to_end(k)


def _subscribe(address: str) -> zmq.asyncio.Socket:
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(address)
    return sub


def _geometry(ref: EngineRef) -> tuple[str, str, int]:
    """What an engine's block keys depend on: engines alike in it share keys."""
    return ref.hash_algo, ref.hash_seed, ref.block_size


class PromptKeys:
    """A prompt's block hashes and keys per block geometry, computed once per request."""

    def __init__(self, view: CacheView, token_ids: Sequence[int]) -> None:
        self._view = view
        self.token_ids = token_ids
        self._by_hasher: dict[tuple[str, str, int], tuple[list[bytes], list[int]]] = {}
        # The CPU tier's run of the prompt, by node (CacheView.tier_prefix), once per request.
        self.tier: dict[str, int] | None = None
        # The prompt's blocks and how many of them an earlier request used, per block geometry
        # (CacheView.expect), found at the request's first claim: its prefill's and its
        # decode's claims alike.
        self.uses: dict[tuple[str, str, int], BlockUse] = {}

    def for_engine(self, ref: EngineRef) -> tuple[list[bytes], list[int]]:
        spec = _geometry(ref)
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
        # Tags the uses of the requests of the router this view is for (BlockUse.origin,
        # EngineRequest.origin), which it applies when it claims them, not again when the
        # engines pass them on.
        self.origin = uuid.uuid4().hex[:12]
        self.tier = TierView() if tier_index is not None else None
        self._tier_task: asyncio.Task[None] | None = None
        self.caches: dict[str, EngineCache] = {}
        # engine id -> the task following it and the EngineCache that task fills
        self._tasks: dict[str, tuple[asyncio.Task[None], EngineCache]] = {}
        self._hashers: dict[tuple[str, str, int], PrefixHasher] = {}
        # Block keys the requests this router sent used lately (any engine), the least recent
        # first: a request's block found here is a reuse (EngineCache.live).
        self._seen: collections.OrderedDict[int, float] = collections.OrderedDict()
        # The last full block of each prompt those requests sent, the least recent first: a
        # prompt holding one extends an earlier request's (`continues`).
        self._tails: collections.OrderedDict[int, float] = collections.OrderedDict()
        # Those of these prompts that extended none, and which a later one did (`continuation_rate`).
        self._openers = Openers()

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
                self._tasks[eid] = (spawn(self._follow(cache)), cache)
        if self.tier is not None and (self._tier_task is None or self._tier_task.done()):
            self._tier_task = spawn(self._follow_tier(self.tier))

    async def _follow(self, cache: EngineCache) -> None:
        while True:
            try:
                # A new incarnation's first answer (or this router's) brings what traffic
                # used there over the last WORKING_SET_S, as if this router had sent it.
                update = await cache.ref.handle.cache_updates.remote(cache.incarnation, cache.version, POLL_S, WORKING_SET_S,
                                                                     self.origin)
            except RayError as err:
                # The engine died or restarts: the routing table drops or renews it meanwhile.
                logger.debug("cache updates of engine %s failed: %s", cache.ref.engine_id, err)
                await asyncio.sleep(POLL_S)
                continue
            if update.incarnation != cache.incarnation and cache.incarnation:
                logger.info("engine %s is a new incarnation (%s); its prefix view starts anew",
                            cache.ref.engine_id, update.incarnation)
            received = time.monotonic()
            cache.apply(update)
            for start in range(0, len(update.uses), HEARD_BATCH):
                self._heard(cache, update.uses[start : start + HEARD_BATCH], received)
                await asyncio.sleep(0)  # a long history (a first answer) does not hold up requests

    async def _follow_tier(self, tier: TierView) -> None:
        """Follow the index's feed of changes; ask it over Ray at the start, after a gap in the
        feed (a message lost to a reconnect), and after POLL_S without news (a restarted
        index has a new feed)."""
        decoder = msgspec.msgpack.Decoder(TierChanges)
        sub: zmq.asyncio.Socket | None = None
        feed = ""
        ask = True
        try:
            while True:
                if ask:
                    try:
                        answer = await self.tier_index.changes.remote(tier.incarnation, tier.version)
                    except RayError as err:
                        # The index restarts (Ray brings it back empty): until it answers, no tier hits.
                        logger.debug("CPU tier changes failed: %s", err)
                        tier.synced = False
                        await asyncio.sleep(POLL_S)
                        continue
                    if answer.incarnation != tier.incarnation and tier.incarnation:
                        logger.info("the CPU tier's index is a new incarnation (%s); its view starts anew", answer.incarnation)
                    tier.apply(answer)
                    if answer.feed != feed:
                        if sub is not None:
                            sub.close(linger=0)
                        sub, feed = _subscribe(answer.feed), answer.feed
                    ask = False
                assert sub is not None
                try:
                    changes = decoder.decode(await asyncio.wait_for(sub.recv(), POLL_S))
                except asyncio.TimeoutError:
                    ask = True
                    continue
                if changes.incarnation == tier.incarnation and changes.version <= tier.version:
                    continue  # already known from an answer over Ray
                if changes.incarnation == tier.incarnation and (changes.full or changes.since == tier.version):
                    tier.apply(changes)
                else:
                    ask = True
        finally:
            if sub is not None:
                sub.close(linger=0)

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

    def room_blocks(self, ref: EngineRef, prompt: PromptKeys, cached_tokens: int) -> int | None:
        """Blocks of engine `ref`'s prefix cache that other prefixes' live blocks leave for
        this prompt's new ones and what grows from them (EngineCache.working_set; the prompt's
        own cached run, its `cached_tokens`, is what it reuses, not competition for room);
        None when its capacity is unknown."""
        cache = self.caches.get(ref.engine_id)
        if cache is None or not ref.num_blocks:
            return None
        live = cache.working_set(time.monotonic())
        _, keys = prompt.for_engine(ref)
        own = cache.live_blocks(keys[: cached_tokens // ref.block_size])
        return max(0, ref.num_blocks - (live - own))

    def continues(self, ref: EngineRef, prompt: PromptKeys) -> bool:
        """Whether the prompt extends one a router sent lately (it holds that prompt's last
        full block and goes on for at least a block more): a conversation's next turn, which
        the turn after it will extend in turn, and not a one-off prompt after a shared
        prefix, whose blocks past the prefix no one reuses, nor the same prompt again, nor
        one that differs from an earlier one only within its last block (a shared prefix
        with a short question after it)."""
        tails = self._tails
        return any(k in tails for k in prompt.for_engine(ref)[1][:-1])

    def continuation_rate(self, ref: EngineRef | None = None, prompt: PromptKeys | None = None) -> float:
        """How likely a prompt that `continues` nothing is to be continued: of the prompts
        sent lately (WORKING_SET_S) that extended none and began with this prompt's first
        block (any first block without a prompt), those a later prompt extended over those
        extended or given up on (Openers: older than the longest pause seen before a
        continuation); 1 before any is either, 0 for a prompt without a full block. A chat's
        first turn looks like a one-off prompt after a shared prefix; only the traffic that
        follows tells them apart, and traffic after one system prompt (a chat application)
        from traffic after another (one-off requests of an API). Until it does, a first turn
        is priced as the turn of a chat it may be: stranding a chat's history costs its next
        turn the history, a remote prefill of a one-off prompt only the hop."""
        now = time.monotonic()
        if prompt is None or ref is None:
            return self._openers.rate(now)
        keys = prompt.for_engine(ref)[1]
        return self._openers.rate(now, keys[0]) if keys else 0.0

    def continuations(self, ref: EngineRef, prompt: PromptKeys) -> tuple[int, int]:
        """Of the openers lately with this prompt's first block: how many were extended, and
        how many given up on (`continuation_rate`'s counts; (0, 0) without a full block)."""
        keys = prompt.for_engine(ref)[1]
        if not keys:
            return 0, 0
        self._openers.settle(time.monotonic())
        return self._openers.continued[keys[0]], self._openers.missed_by[keys[0]]

    def spare_tokens(self, ref: EngineRef, prompt: PromptKeys) -> int | None:
        """Tokens of engine `ref`'s prefix cache left over by what traffic sent there reuses,
        other than this prompt's own blocks (EngineCache.demand): how long a new prefix would
        last there. None when its capacity is unknown."""
        cache = self.caches.get(ref.engine_id)
        if cache is None or not ref.num_blocks:
            return None
        return (ref.num_blocks - cache.demand(time.monotonic(), prompt.for_engine(ref)[1])) * ref.block_size

    def expect(self, ref: EngineRef, prompt: PromptKeys) -> None:
        """The prompt goes to `ref`: its blocks count as held there until its events catch up,
        and the run of them an earlier request used (there or elsewhere) as live there. A
        chat's history is live where its next turn goes, and a history the chat left behind is
        not. A request's own claims (its prefill's, then its decode's) are one use: the second
        does not find the first's blocks reused. The request carries the same (`block_use`),
        so that every other router hears of it from the engine."""
        now = time.monotonic()
        use = prompt.uses.get(_geometry(ref))
        if use is None:
            _, keys = prompt.for_engine(ref)
            self._forget(now)
            reused = next((i for i, k in enumerate(keys) if k not in self._seen), len(keys))
            use = prompt.uses[_geometry(ref)] = BlockUse(keys, reused, self.origin)
            self._note(use, now)
        cache = self.caches.get(ref.engine_id)
        if cache is not None:
            cache.expect(use.keys, now)
            cache.reuse(use.keys[: use.reused], now)

    def stored(self, ref: EngineRef, prompt: PromptKeys) -> None:
        """A request's prompt was computed (or pulled) on `ref`: its blocks are in the engine's
        prefix cache now, as its events will say. Those events reach this router up to POLL_S
        later (the blocks its own requests store do not wake its long-poll), so until then
        the router takes its own request's word for them: a chat's next turn sent there in that
        second is told the tier holds nothing past its history (`tier_blocks`), not the
        history itself. Later events (an eviction) apply over this as over any store."""
        cache = self.caches.get(ref.engine_id)
        if cache is None:
            return
        _, keys = prompt.for_engine(ref)
        cache.held.update(keys)
        for k in keys:
            cache.expected.pop(k, None)

    def block_use(self, ref: EngineRef, prompt: PromptKeys) -> BlockUse | None:
        """What a request claimed on `ref` tells the routers following the engine
        (EngineRequest.blocks); None when none follows it."""
        return prompt.uses.get(_geometry(ref)) if ref.engine_id in self.caches else None

    def _heard(self, cache: EngineCache, uses: Sequence[EchoedUse], now: float) -> None:
        """Requests of other routers arrived at the engine `cache` follows (lately, or, when
        this router starts following it, over the last WORKING_SET_S), as its answer received
        at `now` said: taken as if this router had sent them there when they arrived."""
        self._forget(now)
        for echoed in uses:
            use = echoed.use
            if use.origin == self.origin or echoed.age_s > WORKING_SET_S:
                continue
            t = now - echoed.age_s
            self._note(use, t)
            if echoed.age_s < EXPECT_TTL_S:  # not yet in the engine's events, maybe
                cache.expect(use.keys, t)
            cache.reuse(use.keys[: use.reused], t)

    def _note(self, use: BlockUse, t: float) -> None:
        """A request used these blocks at `t`: later ones using them reuse them, and a prompt
        that holds its last block continues it. Its first blocks are the latest used, so that
        `SEEN_MAX` forgets a prompt's last blocks first and a reused run stays a run. A prompt
        that extends none is an opener, continued once a later one holds its last block."""
        extended = [k for k in use.keys[:-1] if k in self._tails]
        for k in extended:
            self._openers.extend(k, t)
        if use.keys and not extended:
            self._openers.open(use.keys[-1], use.keys[0], t)
        _touch(self._seen, use.keys[::-1], t)
        _touch(self._tails, use.keys[-1:], t)

    def _forget(self, now: float) -> None:
        """Drop the uses older than WORKING_SET_S, and the least recent past SEEN_MAX."""
        for lately in (self._seen, self._tails):
            while lately and (len(lately) > SEEN_MAX or next(iter(lately.values())) < now - WORKING_SET_S):
                lately.popitem(last=False)
        self._openers.forget(now - WORKING_SET_S, SEEN_MAX)

    def seen(self, engine_id: str) -> EngineCache | None:
        """What the router last heard from the engine (its load included), if anything."""
        return self.caches.get(engine_id)

    def tier_prefix(self, ref: EngineRef, prompt: PromptKeys) -> dict[str, int]:
        """The CPU tier's run of the prompt's blocks from the first, counted by node; empty
        when there is no tier or the router has not heard from it."""
        if self.tier is None or not self.tier.synced:
            return {}
        if prompt.tier is None:
            prompt.tier = self.tier.prefix(prompt.for_engine(ref)[0])
        return prompt.tier

    def tier_blocks(self, ref: EngineRef, prompt: PromptKeys) -> int | None:
        """How many of the prompt's blocks the CPU tier holds past the run engine `ref` holds
        itself, as its KV events last said or this router's requests computed there (`stored`;
        blocks merely expected there do not count), for the engine's tier lookup (TIER_HINT);
        None when the router does not know. None past that run means the lookup could only
        answer "nothing more": a chat's next turn, sent to the engine holding its history, would
        wait for that answer on its way to the first token."""
        if self.tier is None or not self.tier.synced:
            return None
        hashes, keys = prompt.for_engine(ref)
        cache = self.caches.get(ref.engine_id)
        local = cache.prefix_blocks(keys, math.inf) if cache is not None else 0
        held = self.tier.held
        return sum(1 for h in hashes[local:] if h in held)

    async def close(self) -> None:
        tasks = [task for task, _ in self._tasks.values()]
        self._tasks.clear()
        if self._tier_task is not None:
            tasks.append(self._tier_task)
            self._tier_task = None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
