"""Cache-aware routing, pure logic and the event channel without engines: the prefix keys
match vLLM's own block hashes, the KV-event follower reads vLLM's real ZMQ publisher, the
scorers and filter, the disaggregation decider, and the router's choices against fake
engines. Real engines: tests/test_cache_routing.py."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

from actors.kv_events import MAX_USE_KEYS, CacheDelta, KVEventFollower, PrefixHasher, RecentUses, as_key
from actors.kv_index import TIER_HINT, TierChanges
from actors.protocol import BlockUse, CacheUpdate, EchoedUse, EngineRequest
from connectors.config import PREFILLED_TOKENS
from orchestrator.cache_view import EngineCache
from orchestrator.config import ConfigError, RoutingConfig, ScorerWeights, parse_config
from orchestrator.disaggregation import decide, remote_ahead_tokens
from orchestrator.metrics import TandemMetrics
from orchestrator.protocol import EngineRef
from orchestrator.router import CoreNeighbours, RequestTrace, Router, RouterStats
from orchestrator.scoring import EngineFacts, ahead_tokens, queue_tokens, rank, score, tier_tokens
from orchestrator.speed import MAX_SLOWDOWN, PrefillSpeed, Price
from tests.fake_engine import FakeEngineBase
from tests.outputs import output

BLOCK = 16
SEED = "vllm-none-hash"


def vllm_block_hashes(token_ids: list[int]) -> list[bytes]:
    """What vLLM's scheduler computes for a plain prompt (its own Request and hasher)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    req = Request("r", token_ids, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(BLOCK, fn))
    return [bytes(h) for h in req.block_hashes]


def test_prefix_keys_are_vllms_block_hashes() -> None:
    prompt = list(range(500, 500 + 5 * BLOCK + 7))  # 5 full blocks and a partial one
    mine = PrefixHasher("sha256", SEED, BLOCK).hashes(prompt)
    assert mine == vllm_block_hashes(prompt)
    assert len(mine) == 5
    # A different first block changes every hash after it (the chain).
    other = PrefixHasher("sha256", SEED, BLOCK).hashes([1] + prompt[1:])
    assert not set(mine) & set(other)


def test_follower_reads_vllms_publisher(tmp_path: Path) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    endpoint = f"ipc://{tmp_path}/events"
    follower = KVEventFollower(endpoint)
    publisher = ZmqEventPublisher(0, endpoint=endpoint)
    hashes = PrefixHasher("sha256", SEED, BLOCK).hashes(list(range(4 * BLOCK)))
    published = [maybe_convert_block_hash(h) for h in hashes]  # as vLLM's block pool sends them

    def stored(hs: list[Any]) -> BlockStored:
        return BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=[], block_size=BLOCK,
                           lora_id=None, medium="GPU", lora_name=None)

    def wait_version(v: int) -> None:
        deadline = time.monotonic() + 10
        while follower.version < v and time.monotonic() < deadline:
            time.sleep(0.02)
        assert follower.version >= v

    try:
        # PUB/SUB drops what is sent before the subscription lands: resend the first batch.
        deadline = time.monotonic() + 10
        while follower.version == 0 and time.monotonic() < deadline:
            publisher.publish(KVEventBatch(ts=time.time(), events=[stored(published[:3])]))
            time.sleep(0.1)
        assert follower.held == {as_key(h) for h in hashes[:3]}
        v = follower.version
        # CPU-medium blocks (vLLM's own offloading) are not the engine's prefix cache.
        publisher.publish(KVEventBatch(ts=time.time(), events=[
            BlockStored(block_hashes=[published[3]], parent_block_hash=None, token_ids=[], block_size=BLOCK,
                        lora_id=None, medium="CPU", lora_name=None),
            BlockRemoved(block_hashes=[published[0]], medium="GPU"),
        ]))
        wait_version(v + 1)
        assert follower.held == {as_key(h) for h in hashes[1:3]}
        current, deltas = follower.changes_since(v)
        assert current == v + 1 and deltas is not None and deltas[0].removed == [as_key(hashes[0])]
        # Evicted and stored again within one batch: held, as the events' order says.
        publisher.publish(KVEventBatch(ts=time.time(), events=[
            BlockRemoved(block_hashes=[published[1]], medium="GPU"), stored([published[1]])]))
        wait_version(v + 2)
        assert follower.held == {as_key(h) for h in hashes[1:3]}
        v += 1
        publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        wait_version(v + 2)
        assert follower.held == set()
        assert follower.changes_since(10_000)[1] is None  # a version it never had: snapshot
    finally:
        publisher.shutdown()
        follower.close()


def test_a_load_change_between_two_router_calls_is_not_missed(tmp_path: Path) -> None:
    """A request that ends while a router is between two cache_updates calls (no waiter at
    that moment) must answer the router's next call at once, not at its 1 s timeout: the
    other ingress replicas would count the finished request as queued until then."""
    follower = KVEventFollower(f"ipc://{tmp_path}/events")
    try:
        v = follower.version
        follower.poke("r0")  # the engine's load changed; nobody is waiting

        # Its own timeout far beyond the 10 s given: only a change seen at once returns in time.
        asyncio.run(asyncio.wait_for(follower.wait_changed(v, timeout_s=3600.0), timeout=10.0))
        current, deltas = follower.changes_since(v)  # an empty delta, not a full snapshot
        assert current == v + 1 and deltas is not None and not deltas[0].stored and not deltas[0].removed
        # A request's arrival carries its blocks, for every router following the engine: the
        # ones since its last call, or, for a router that starts following it, those of the
        # seconds it asks for.
        follower.poke("r1", BlockUse([5, 6], 1, "r1"))
        assert follower.changes_since(v + 1)[1] == [CacheDelta(v + 2, [], [], False, "r1")]
        [echoed] = follower.uses_since(v + 1)
        assert echoed.use == BlockUse([5, 6], 1, "r1") and 0.0 <= echoed.age_s < 5.0
        assert follower.uses_since(v + 2) == [] and [e.use for e in follower.uses_within(60.0)] == [echoed.use]
        assert follower.uses_within(0.0) == []
        # Long prompts shorten what is kept instead of growing the engine's memory.
        long_prompt = BlockUse(list(range(100_000)), 0, "r1")
        for _ in range(MAX_USE_KEYS // 100_000):
            follower.poke("r1", long_prompt)
        assert [e.use for e in follower.uses_since(v + 1)][:1] == [long_prompt]  # [5, 6] went first
        assert len(follower.uses_within(60.0)) == MAX_USE_KEYS // 100_000
    finally:
        follower.close()


async def long_poll_woken(follower: KVEventFollower, version: int, origin: str, change: Callable[[], None]) -> bool:
    """Whether a long-poll of the router tagged `origin`, waiting since `version`, returns
    within 0.5 s of `change` (its own timeout is an hour: only a wake returns it)."""
    waiting = asyncio.create_task(follower.wait_changed(version, timeout_s=3600.0, origin=origin))
    await asyncio.sleep(0.05)  # waiting now
    change()
    done, _ = await asyncio.wait({waiting}, timeout=0.5)
    waiting.cancel()
    return bool(done)


def test_a_routers_own_requests_do_not_wake_its_long_poll(tmp_path: Path) -> None:
    """A change of load by a router's own request is no news to it: waking its long-poll put
    an answer on the engine's cores in the middle of that request's prefill (run 134: kv_aware's
    prefill compute 35.4 against round robin's 29.2 ms, 29.9 against 31.1 without). Another
    router's requests and the cache's own events still wake it at once."""
    from vllm.distributed.kv_events import BlockStored

    follower = KVEventFollower(f"ipc://{tmp_path}/events")

    async def woken(version: int, origin: str, change: Callable[[], None]) -> bool:
        return await long_poll_woken(follower, version, origin, change)

    async def go() -> None:
        v = follower.version
        assert not await woken(v, "r1", lambda: follower.poke("r1"))  # its own request arrived
        assert await woken(v, "r2", lambda: None)  # that change is news to another router
        assert await woken(v + 1, "r1", lambda: follower.poke("r2"))  # another router's request
        stored = BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=None, token_ids=[], block_size=BLOCK,
                             lora_id=None, medium="GPU", lora_name=None)
        assert await woken(v + 2, "r1", lambda: follower.apply([stored]))  # the cache changed
        # Between two calls: only its own pokes since its version, so it waits; any other returns.
        follower.poke("r1")
        assert not await woken(v + 3, "r1", lambda: None)
        assert await woken(v + 3, "", lambda: None)  # a caller without an origin hears everything

    try:
        asyncio.run(asyncio.wait_for(go(), timeout=20))
    finally:
        follower.close()


def test_blocks_a_routers_own_requests_stored_do_not_wake_its_long_poll(tmp_path: Path) -> None:
    """The blocks a router's request stores are no news to it either: it counts them as held
    from the moment it sends the request (CacheView.expect), so the engine's answer after
    each prefill's step would only cost the engine's cores. They reach it with its next
    answer. Blocks no router announced (a decode engine's output), a batch of blocks two
    routers announced, and evictions still wake it at once; another router always."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    follower = KVEventFollower(f"ipc://{tmp_path}/events")
    mine, theirs, output_block = [bytes([i]) * 32 for i in (1, 2)], bytes([3]) * 32, bytes([4]) * 32

    def stored(hashes: list[bytes]) -> Callable[[], None]:
        return lambda: follower.apply([BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                                   block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None)])

    async def woken(origin: str, change: Callable[[], None], version: int | None = None) -> bool:
        return await long_poll_woken(follower, follower.version if version is None else version, origin, change)

    async def go() -> None:
        follower.poke("r1", BlockUse([as_key(h) for h in mine], 0, "r1"))  # r1's request arrived
        follower.poke("r2", BlockUse([as_key(theirs)], 0, "r2"))
        v = follower.version
        assert not await woken("r1", stored(mine))  # its prefill stored them
        _, deltas = follower.changes_since(v)  # in the log for its next answer
        assert deltas is not None and sorted(deltas[0].stored) == sorted(as_key(h) for h in mine)
        assert await woken("r2", lambda: None, v)  # news to the other router
        assert await woken("r1", stored([theirs]))  # the other router's blocks
        assert await woken("r1", stored([output_block]))  # blocks no router announced
        assert await woken("r1", lambda: follower.apply([BlockRemoved(block_hashes=[mine[0]], medium="GPU")]))
        follower.poke("r2", BlockUse([as_key(mine[0])], 1, "r2"))  # r2's request reuses r1's prefix
        assert await woken("r2", stored([mine[0], mine[1]]))  # announced last by two routers: news to both
        assert follower.held == {as_key(h) for h in (*mine, theirs, output_block)}

    try:
        asyncio.run(asyncio.wait_for(go(), timeout=20))
    finally:
        follower.close()


def test_engine_cache_longest_run_and_expectations() -> None:
    cache = EngineCache(EngineRef("e", "decode", None))
    cache.apply(CacheUpdate("i1", 1, True, [1, 2, 4], [], 0, 0, 0.1))
    assert cache.prefix_blocks([1, 2, 3, 4], now=0.0) == 2  # the run stops at the first miss
    cache.expect([3], now=0.0)
    assert cache.prefix_blocks([1, 2, 3, 4], now=1.0) == 4
    assert cache.prefix_blocks([1, 2, 3, 4], now=100.0) == 2  # expectation expired
    cache.apply(CacheUpdate("i1", 2, False, [], [2], 3, 40, 0.5))  # evicted
    assert cache.prefix_blocks([1, 2], now=0.0) == 1
    assert (cache.num_requests, cache.kv_cache_usage) == (3, 0.5)
    cache.apply(CacheUpdate("i2", 1, False, [9], [], 0, 0, 0.0))  # a restarted engine
    assert cache.held == {9}


def test_free_blocks_are_the_capacity_less_held_and_expected_blocks() -> None:
    cache = EngineCache(EngineRef("e", "prefill", None, num_blocks=10))
    cache.apply(CacheUpdate("i1", 1, True, [1, 2, 3], [], 0, 0, 0.0))
    cache.expect([3, 4, 5], now=0.0)  # 3 is held already
    assert cache.free_blocks(now=1.0) == 10 - 3 - 2
    assert cache.free_blocks(now=100.0) == 10 - 3  # expectations expired
    cache.apply(CacheUpdate("i1", 2, False, list(range(10, 30)), [], 0, 0, 0.0))
    assert cache.free_blocks(now=100.0) == 0  # never below zero
    assert EngineCache(EngineRef("e", "prefill", None)).free_blocks(now=0.0) is None  # capacity unknown


def test_the_working_set_is_what_requests_sent_there_reused_lately_and_it_still_holds() -> None:
    from orchestrator.cache_view import WORKING_SET_S

    cache = EngineCache(EngineRef("e", "prefill", None, num_blocks=10))
    cache.apply(CacheUpdate("i1", 1, True, [1, 2, 3, 4, 5], [], 0, 0, 0.0))
    cache.expect([1, 2, 3], now=0.0)
    assert cache.working_set(now=0.0) == 0  # a first use: a one-off question's blocks do not count
    cache.expect([1, 2, 4], now=10.0)
    cache.reuse([1, 2], 10.0)
    cache.expect([1, 2, 4, 6], now=50.0)  # 6 expected, never stored
    cache.reuse([1, 2, 4, 6], 50.0)
    assert cache.working_set(now=51.0) == 4 and cache.live_blocks([1, 3, 4, 6]) == 3
    cache.apply(CacheUpdate("i1", 2, False, [], [2], 0, 0, 0.0))  # vLLM evicted 2
    assert cache.working_set(now=51.0) == 3
    # What traffic asks the cache to keep still counts 2: evicting it made no room for it.
    assert cache.demand(51.0, []) == 4 and cache.demand(51.0, [1, 9]) == 3
    assert cache.demand(WORKING_SET_S + 51.0, []) == 0
    # 6, never stored, counts as long as a block reused before it; then none is left.
    assert cache.working_set(now=WORKING_SET_S + 49.0) == 3
    assert cache.working_set(now=WORKING_SET_S + 51.0) == 0
    cache.expect([1, 5], now=200.0)
    cache.reuse([1, 5], 200.0)
    assert cache.working_set(now=201.0) == 2
    cache.reuse([1], 150.0)  # an older use heard late does not make 1 the least recent
    assert list(cache.live) == [1, 5] and cache.live[1] == 200.0
    cache.apply(CacheUpdate("i2", 1, True, [1, 5], [], 0, 0, 0.0))  # a restarted engine
    assert cache.working_set(now=201.0) == 0
    # An engine's first answer keeps what this router recorded before it; only a restart drops it.
    fresh = EngineCache(EngineRef("e", "prefill", None, num_blocks=10))
    fresh.expect([1, 2], now=0.0)
    fresh.reuse([1, 2], 0.0)
    fresh.apply(CacheUpdate("i1", 1, True, [1, 2], [], 0, 0, 0.0))
    assert fresh.working_set(now=1.0) == 2


def test_a_router_hears_what_other_routers_requests_used_as_of_when_they_arrived() -> None:
    """Uses an engine passes on (lately, or from before the router followed it) count as of
    their arrival: one older than WORKING_SET_S is not a use any more, and the router's own
    are not counted twice."""
    from orchestrator.cache_view import WORKING_SET_S, CacheView

    view = CacheView()
    a = EngineRef("a", "prefill", None, "i0", BLOCK, "sha256", SEED, num_blocks=100)
    view.set_engines([a])
    recent, old, mine = (list(range(start, start + 3 * BLOCK)) for start in (2000, 3000, 4000))
    keys = {name: view.prompt(p).for_engine(a)[1] for name, p in (("recent", recent), ("old", old), ("mine", mine))}
    view._heard(view.caches["a"], [
        EchoedUse(WORKING_SET_S + 30.0, BlockUse(keys["old"], 0, "another router")),
        EchoedUse(30.0, BlockUse(keys["recent"], 0, "another router")),
        EchoedUse(1.0, BlockUse(keys["mine"], 0, view.origin)),
    ], time.monotonic())
    assert abs(time.monotonic() - view._seen[keys["recent"][0]] - 30.0) < 1.0  # used as of its arrival
    assert keys["old"][0] not in view._seen

    def reused(tokens: list[int]) -> int:
        prompt = view.prompt(tokens + [1] * BLOCK)
        view.expect(a, prompt)
        return prompt.uses[("sha256", SEED, BLOCK)].reused

    assert (reused(recent), reused(old), reused(mine)) == (3, 0, 0)


def room(view: Any, ref: EngineRef, tokens: list[int]) -> int | None:
    """CacheView.room_blocks for a prompt of `tokens`, its cached run as the router finds it."""
    prompt = view.prompt(tokens)
    return view.room_blocks(ref, prompt, view.cached_tokens(ref, prompt))


def test_a_block_is_live_where_the_request_reusing_it_goes() -> None:
    """A chat's history becomes live on the engine its next turn goes to, even when that turn
    moved it there; the engine it left keeps the history, not as live."""
    from orchestrator.cache_view import CacheView

    view = CacheView()
    a, b = (EngineRef(name, "prefill", None, "i0", BLOCK, "sha256", SEED, num_blocks=100) for name in "ab")
    view.set_engines([a, b])
    turn1 = list(range(2000, 2000 + 3 * BLOCK))
    view.expect(a, view.prompt(turn1))
    assert room(view, a, [9] * BLOCK) == 100  # used once: nothing live yet
    view.expect(b, view.prompt(turn1 + list(range(5000, 5000 + 2 * BLOCK))))
    other = [9] * BLOCK
    assert (room(view, a, other), room(view, b, other)) == (100, 97)
    # The turn's own cached run is what it reuses, not competition for its room.
    assert room(view, b, turn1 + [7] * BLOCK) == 100
    # One request claimed on a prefill then a decode engine is one use: its new blocks are
    # live on neither (before, the decode engine's claim found them "reused").
    d = EngineRef("d", "decode", None, "i0", BLOCK, "sha256", SEED, num_blocks=100)
    view.set_engines([a, b, d])
    question = view.prompt(list(range(7000, 7000 + 4 * BLOCK)))
    view.expect(a, question)
    view.expect(d, question)
    assert room(view, d, other) == 100
    # A prompt extending an earlier one (holding its last full block) continues it; another
    # question after the same prefix does not.
    assert view.continues(a, view.prompt(list(range(7000, 7000 + 4 * BLOCK + 5)) + [1] * BLOCK))
    assert not view.continues(a, view.prompt(list(range(7000, 7000 + 3 * BLOCK)) + [1] * BLOCK))
    # Nor does the same prompt again, or another question whose first block past the earlier
    # prompt's last is not full (it differed only within that block).
    assert not view.continues(a, view.prompt(list(range(7000, 7000 + 4 * BLOCK))))
    assert not view.continues(a, view.prompt(list(range(7000, 7000 + 4 * BLOCK)) + [1] * (BLOCK - 1)))


def choose(candidates: list[EngineFacts], prompt_tokens: int, cfg: RoutingConfig) -> EngineFacts | None:
    """The replica kv_aware picks (`rank`'s winner)."""
    return rank(candidates, prompt_tokens, cfg)[0]


def facts(eid: str, outstanding: int = 0, cached: int = 0, tier: float = 0.0, usage: float = 0.0,
          queued: float = 0.0, evicted: float = 0.0, crowded: float = 0.0) -> EngineFacts:
    return EngineFacts(eid, outstanding, cached, tier, usage, queued, evicted, crowded_tokens=crowded)


def test_work_counts_the_room_a_working_set_leaves() -> None:
    """A new chat sharing only the system prompt goes where live prefixes leave more room,
    once the holder's extra working set outweighs the system prompt the other computes once;
    a chat's next turn stays with its history while the imbalance is smaller than it."""
    cfg = RoutingConfig(policy="kv_aware")
    # 340-token first turn, the 256-token system prompt on `busy` only.
    assert choose([facts("busy", cached=256, crowded=160), facts("empty")], 340, cfg).engine_id == "busy"
    assert choose([facts("busy", cached=256, crowded=352), facts("empty")], 340, cfg).engine_id == "empty"
    # A 700-token turn whose 576-token history one replica holds, both holding the system prompt.
    assert choose([facts("holder", cached=576, crowded=256), facts("other", cached=256)], 700, cfg).engine_id == "holder"
    # Where the tier keeps what is evicted, the room costs a load.
    reload = msgspec.structs.replace(facts("busy", cached=256, crowded=352), evictions_reload=True)
    assert choose([reload, facts("empty")], 340, cfg).engine_id == "busy"


def test_work_counts_what_a_full_cache_would_evict() -> None:
    """A replica holding only a shared system prompt, its cache full, against one with room:
    storing the new chat there would push out another chat's blocks, which that chat's next
    turn computes again."""
    cfg = RoutingConfig(policy="kv_aware")
    # 600-token prompt, 256 of it the system prompt on `full`, whose cache has no room left.
    assert choose([facts("full", cached=256, evicted=344), facts("room")], 600, cfg).engine_id == "room"
    # The same replica with room keeps its prefix advantage.
    assert choose([facts("full", cached=256), facts("room")], 600, cfg).engine_id == "full"
    # A holder of most of the prompt stays the choice even when full: it stores little.
    assert choose([facts("full", cached=560, evicted=40), facts("room")], 600, cfg).engine_id == "full"
    # evict_cost 0: evictions are free, the old choice.
    free_evictions = RoutingConfig(policy="kv_aware", evict_cost=0.0)
    assert choose([facts("full", cached=256, evicted=344), facts("room")], 600, free_evictions).engine_id == "full"


def test_an_eviction_the_cpu_tier_keeps_costs_a_load_and_does_not_pile_a_burst_on_one_replica() -> None:
    """Two new chats at once, both caches full (2026-11-28, routing run 40): the second should
    not queue behind the first to spare the idle replica an eviction the tier would undo."""
    cfg = RoutingConfig(policy="kv_aware")

    def pick(reload: bool) -> str:
        busy = msgspec.structs.replace(facts("busy", 1, cached=256, queued=82, evicted=96), evictions_reload=reload)
        idle = msgspec.structs.replace(facts("idle", tier=256, evicted=352), evictions_reload=reload)
        return choose([busy, idle], 338, cfg).engine_id

    # Tokens ahead, counted: busy 82 queued + 82 new + 96 evicted = 260; idle 82 new + 25.6 for
    # the 256 it loads + 352 evicted = 459.6.
    assert pick(reload=False) == "busy"
    assert pick(reload=True) == "idle"  # the evictions at kv_load_cost 0.1: 173.6 against 142.8
    # Never dearer than evict_cost: 0 stays 0.
    free = msgspec.structs.replace(facts("f", evicted=100), evictions_reload=True)
    assert choose([free, facts("g", queued=5)], 100, RoutingConfig(policy="kv_aware", evict_cost=0.0)).engine_id == "f"


def test_work_weighs_what_a_cache_saves_against_the_queue_ahead() -> None:
    cfg = RoutingConfig(policy="kv_aware")  # default weights: work alone
    # The holder of 90% of the prompt computes 100 tokens; the idle engine 1000.
    assert choose([facts("idle"), facts("holder", 1, cached=900, queued=500)], 1000, cfg).engine_id == "holder"
    # Once more than the 900 saved tokens wait ahead of it, the repeat goes elsewhere.
    assert choose([facts("holder", 2, cached=900, queued=1200), facts("idle")], 1000, cfg).engine_id == "idle"
    # A prefix in the CPU tier is a cheap load (kv_load_cost 0.1): 190 tokens' work, so a
    # holder with a queue loses to the engine that would load it...
    assert choose([facts("holder", 1, cached=900, queued=200), facts("loads", tier=900)], 1000, cfg).engine_id == "loads"
    # ...and an idle holder wins over it.
    assert choose([facts("loads", tier=900), facts("holder", cached=900)], 1000, cfg).engine_id == "holder"
    # With kv_load_cost 1 the tier saves nothing.
    dear_tier = RoutingConfig(policy="kv_aware", kv_load_cost=1.0)
    assert choose([facts("loads", tier=900), facts("idle", queued=100)], 1000, dear_tier).engine_id == "loads"
    assert choose([facts("loads", tier=900, queued=100), facts("idle")], 1000, dear_tier).engine_id == "idle"
    # Equal scores go to the engine with fewer decode engines computing on its cores, then
    # to the one with fewer requests in flight.
    assert choose([facts("a", 2), facts("b", 1)], 10, cfg).engine_id == "b"
    beside_passes = msgspec.structs.replace(facts("a"), decoding_neighbours=1, computing_neighbours=1)
    beside_processes = msgspec.structs.replace(facts("b", 1), decoding_neighbours=1)
    for pair in ([beside_passes, beside_processes], [beside_processes, beside_passes]):
        assert choose(pair, 10, cfg).engine_id == "b"
    # A nearly full KV cache is filtered out unless every engine is that full.
    full = facts("full", cached=1000, usage=0.99)
    assert choose([full, facts("other", outstanding=3, queued=3000)], 1000, cfg).engine_id == "other"
    assert choose([full], 1000, cfg).engine_id == "full"
    # rank gives the winner with every candidate's score, the filtered one's too (the log
    # shows why the holder lost), each the score `score` gives.
    best, scores = rank([full, facts("other", outstanding=3, queued=3000)], 1000, cfg)
    assert best.engine_id == "other" and scores["full"] > scores["other"]
    assert scores == {"full": score(full, 1000, cfg), "other": score(facts("other", 3, queued=3000), 1000, cfg)}
    assert rank([], 1000, cfg) == (None, {})
    # Score: 1 / (1 + tokens ahead / prompt tokens); a fully cached prompt still computes one.
    assert score(facts("x", cached=1000), 1000, cfg) == pytest.approx(1 / (1 + 1 / 1000))
    assert score(facts("x", queued=500, cached=500), 1000, cfg) == pytest.approx(0.5)


def test_scorer_weights_compose_other_policies() -> None:
    """The other scorers are config away: llm-d's sum of prefix share and load, say."""
    llmd = RoutingConfig(policy="kv_aware", scorers=ScorerWeights(work=0.0, prefix=1.0, load=1.0, kv_free=0.2))
    assert choose([facts("idle"), facts("holder", outstanding=2, cached=900)], 1000, llmd).engine_id == "holder"
    assert choose([facts("holder", outstanding=2, cached=500), facts("idle")], 1000, llmd).engine_id == "idle"
    prefix_only = RoutingConfig(policy="kv_aware", scorers=ScorerWeights(work=0.0, prefix=1.0))
    assert choose([facts("holder", 9, cached=500, queued=9000), facts("idle")], 1000, prefix_only).engine_id == "holder"
    weights = ScorerWeights(work=0.0, prefix=1.0, tier=0.5, load=1.0, kv_free=0.2)
    f = facts("x", outstanding=1, cached=500, tier=250, usage=0.5)
    assert score(f, 1000, RoutingConfig(scorers=weights)) == pytest.approx(0.5 + 0.5 * 0.25 + 0.5 + 0.2 * 0.5)


def test_tier_tokens_count_beyond_the_engine_and_halve_other_nodes() -> None:
    assert tier_tokens({}, "n1", 0, BLOCK) == 0.0
    assert tier_tokens({"n1": 4}, "n1", 1, BLOCK) == 3 * BLOCK
    assert tier_tokens({"n1": 4}, "n1", 5, BLOCK) == 0.0
    assert tier_tokens({"n2": 4}, "n1", 0, BLOCK) == 2 * BLOCK
    assert tier_tokens({"n1": 2, "n2": 2}, "n1", 0, BLOCK) == 3 * BLOCK


def test_decider_modes_and_thresholds() -> None:
    cond = RoutingConfig(disaggregation="conditional", local_prefill_max_tokens=100)
    assert decide(RoutingConfig(), 5000, 0, 0) == ("remote", "always")
    assert decide(RoutingConfig(disaggregation="never"), 5000, 0, 0) == ("local", "never")
    assert decide(cond, 80, 0, 0) == ("local", "short_uncached")
    assert decide(cond, 5000, 4950, 0) == ("local", "short_uncached")  # decode holds the prefix
    # The same 50 tokens would hold up 3 running requests on the decode engine: remote.
    assert decide(cond, 5000, 4950, 3) == ("remote", "long_uncached")
    # 50 tokens of local prefills already queued there come first: 100 x 2 held up.
    assert decide(cond, 5000, 4950, 1, decode_queued_tokens=0) == ("local", "short_uncached")
    assert decide(cond, 5000, 4950, 1, decode_queued_tokens=50) == ("remote", "long_uncached")
    # The same 100 tokens x 2 held up, where the best prefill replica lacks 400 of the prompt
    # the decode engine holds (it prefilled the earlier turns): local.
    assert decide(cond, 5000, 4950, 1, decode_queued_tokens=50, prefill_ahead_tokens=500) == ("local", "remote_costlier")
    # A prefill replica with the same cache as the decode engine adds nothing to the budget.
    assert decide(cond, 5000, 4950, 1, decode_queued_tokens=50, prefill_ahead_tokens=50) == ("remote", "long_uncached")
    assert decide(cond, 5000, 0, 0) == ("remote", "long_uncached")
    # A saturated prefill pool is weighed in tokens: 4 prompts of 5000 queued on the best
    # replica outweigh computing this one on an idle decode engine...
    assert decide(cond, 5000, 0, 0, prefill_ahead_tokens=25000) == ("local", "remote_costlier")
    # ...but not on one running 8 decodes, each stalled for the whole prompt.
    assert decide(cond, 5000, 0, 8, prefill_ahead_tokens=25000) == ("remote", "long_uncached")


def test_with_the_first_token_from_prefill_local_prefills_must_not_start_later_than_remote_ones() -> None:
    """routing.first_token: prefill leaves the KV move out of a remote prefill's time to first
    token, so a local prefill pays only when the decode engine would compute no more before
    this request's first token than the best prefill replica."""
    cond = RoutingConfig(disaggregation="conditional", local_prefill_max_tokens=1000)
    # 80 tokens on the decode engine (40 queued there) against 60 on a prefill replica: remote.
    assert decide(cond, 100, 60, 0, decode_queued_tokens=40, prefill_ahead_tokens=60, first_from_prefill=True) == ("remote", "prefill_sooner")
    # The first token from the decode engine either way: the budget allows the local one.
    assert decide(cond, 100, 60, 0, decode_queued_tokens=40, prefill_ahead_tokens=60) == ("local", "short_uncached")
    # As much on both sides: local, sparing the KV move; unknown: the budget alone.
    assert decide(cond, 100, 60, 0, decode_queued_tokens=40, prefill_ahead_tokens=80, first_from_prefill=True) == ("local", "short_uncached")
    assert decide(cond, 100, 60, 0, decode_queued_tokens=40, first_from_prefill=True) == ("local", "short_uncached")
    # A saturated prefill pool that would still answer sooner gets the request.
    assert decide(cond, 5000, 0, 0, prefill_ahead_tokens=4000, first_from_prefill=True) == ("remote", "prefill_sooner")


def test_what_the_decode_engine_would_load_from_the_tier_costs_as_a_prefill_replicas_load() -> None:
    """A token loaded from the CPU tier costs routing.kv_load_cost of a computed one on both
    sides: a decode engine that would load 400 tokens a prefill replica holds in its own
    prefix cache is no tie with it (the load is a wait for the tier and a scheduler step)."""
    cond = RoutingConfig(disaggregation="conditional", local_prefill_max_tokens=1000, kv_load_cost=0.1)
    # 100 computed + 400 loaded (40) on the decode engine against 100 computed on the prefill
    # replica: the prefill replica streams the first token sooner.
    assert decide(cond, 500, 0, 0, decode_loaded_tokens=400, prefill_ahead_tokens=100,
                  first_from_prefill=True) == ("remote", "prefill_sooner")
    # The same 400 in the decode engine's own cache: a tie, local (no KV move).
    assert decide(cond, 500, 400, 0, prefill_ahead_tokens=100, first_from_prefill=True) == ("local", "short_uncached")
    # Both would load them: a tie again.
    assert decide(cond, 500, 0, 0, decode_loaded_tokens=400, prefill_ahead_tokens=140,
                  first_from_prefill=True) == ("local", "short_uncached")
    # The load counts in the stall budget too: 100 + 40 tokens x 2 requests held up is over 250.
    tight = msgspec.structs.replace(cond, local_prefill_max_tokens=250)
    assert decide(tight, 500, 400, 1) == ("local", "short_uncached")
    assert decide(tight, 500, 0, 1, decode_loaded_tokens=400) == ("remote", "long_uncached")
    # Loads are never free: a fully cached prompt still computes its last token.
    assert decide(cond, 500, 500, 0, prefill_ahead_tokens=1, first_from_prefill=True) == ("local", "short_uncached")


def test_a_history_a_local_prefill_would_likely_lose_counts_against_it() -> None:
    """`at_risk_tokens`: what the decode engine would hold alone and likely lose, computed
    again by the conversation's next turn."""
    cond = RoutingConfig(disaggregation="conditional", local_prefill_max_tokens=100)
    # 50 tokens left on the decode engine against a prefill replica that lacks 500: local...
    assert decide(cond, 5000, 4950, 0, prefill_ahead_tokens=500) == ("local", "short_uncached")
    assert decide(cond, 5000, 4950, 0, prefill_ahead_tokens=500, first_from_prefill=True) == ("local", "short_uncached")
    # ...unless those 500 stay on the decode engine alone, likely lost before the next turn.
    assert decide(cond, 5000, 4950, 0, prefill_ahead_tokens=500, at_risk_tokens=500) == ("remote", "stranded_history")
    assert (decide(cond, 5000, 4950, 0, prefill_ahead_tokens=500, first_from_prefill=True, at_risk_tokens=500)
            == ("remote", "stranded_history"))
    # A risk small enough for the budget leaves the request local; one that would go remote
    # anyway keeps its own reason; so does a local prefill the pool's queue pays for.
    assert decide(cond, 5000, 4950, 0, prefill_ahead_tokens=500, at_risk_tokens=40) == ("local", "short_uncached")
    assert decide(cond, 5000, 0, 0, at_risk_tokens=500) == ("remote", "long_uncached")
    assert decide(cond, 5000, 4950, 0, prefill_ahead_tokens=5000, at_risk_tokens=500) == ("local", "remote_costlier")


def test_routing_config_names_the_bad_field() -> None:
    with pytest.raises(ConfigError, match="disaggregation"):
        parse_config({"routing": {"disaggregation": "sometimes"}})
    with pytest.raises(ConfigError, match="scorers"):
        parse_config({"routing": {"scorers": {"prefixx": 1.0}}})
    # A field since removed (the pool's queue is weighed in tokens instead) is named, not ignored.
    with pytest.raises(ConfigError, match="routing.prefill_busy_requests"):
        parse_config({"routing": {"prefill_busy_requests": 4}})


# ---- the router against fake engines that report a prefix cache --------------------------


def _done(value: Any) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


class _Method:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class CachingEngine(FakeEngineBase):
    """An engine that holds the prefix blocks of the prompts it was told to, reports them
    through cache_updates, and answers every request with one token."""

    def __init__(self, name: str, held_prompts: list[list[int]] = ()) -> None:
        super().__init__()
        self.name = name
        self.hasher = PrefixHasher("sha256", SEED, BLOCK)
        self.held = {as_key(h) for p in held_prompts for h in self.hasher.hashes(p)}
        self.requests: list[EngineRequest] = []
        self.requests_by_origin: dict[str, int] = {}  # the load it reports
        self.abort = _Method(lambda rid, kv_params=None: _done(None))
        self.cache_updates = _Method(self._cache_updates)

    def ref(self, role: str, cores: tuple[int, ...] = (), node_ip: str = "10.0.0.1",
            process_cores: tuple[int, ...] = ()) -> EngineRef:
        return EngineRef(self.name, role, self, "i0", BLOCK, "sha256", SEED,  # type: ignore[arg-type]
                         stream_address=self.address, node_ip=node_ip, compute_cores=cores, process_cores=process_cores)

    async def _cache_updates(self, incarnation: str, version: int, timeout_s: float, history_s: float = 0.0,
                             origin: str = "") -> CacheUpdate:
        if version == 1:
            await asyncio.sleep(timeout_s)
        by_origin = self.requests_by_origin
        return CacheUpdate("i0", 1, True, sorted(self.held), [], sum(by_origin.values()), 0, 0.0, dict(by_origin))

    async def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(req)
        params = {"remote_engine_id": self.name} if req.kv_transfer_params == {"do_remote_decode": True} else None
        keys = [as_key(h) for h in self.hasher.hashes(req.prompt_token_ids)]
        cached = next((i for i, k in enumerate(keys) if k not in self.held), len(keys)) * BLOCK
        yield output("x", [7], finished=True, finish_reason="length", num_cached_tokens=cached, kv_transfer_params=params)


async def serve_traced(router: Router, traces: list[RequestTrace], prompt: list[int], max_tokens: int = 2) -> None:
    """Serves `prompt` to its end; its trace joins `traces` before routing starts, so a test
    can wait on its decisions while it runs."""
    traces.append(trace := RequestTrace())
    async for _ in router.generate(EngineRequest(f"r{len(traces)}", prompt, SamplingParams(max_tokens=max_tokens)), trace):
        pass


def serve_one(router: Router, prompt: list[int], trace: RequestTrace) -> list[RequestOutput]:
    async def go() -> list[RequestOutput]:
        router.cache.sync()  # type: ignore[union-attr]
        await asyncio.sleep(0.05)  # the view's first long-poll answers
        # Two tokens: a one-token request is served by its prefill engine alone.
        out = [c async for c in router.generate(EngineRequest("r", prompt, SamplingParams(max_tokens=2)), trace)]
        await router.close()
        return out

    return asyncio.run(asyncio.wait_for(go(), timeout=10))


SYSTEM = list(range(1000, 1000 + 8 * BLOCK))


def test_kv_aware_sends_a_prefix_to_the_engine_holding_it() -> None:
    cold, warm = CachingEngine("cold"), CachingEngine("warm", [SYSTEM])
    router = Router([cold.ref("both"), warm.ref("both")], RoutingConfig(policy="kv_aware"))
    for i in range(4):
        serve_one(router, SYSTEM + [i] * 20, RequestTrace())
    assert len(warm.requests) == 4 and not cold.requests
    assert router.pools["both"].queued_tokens == {"warm": 0.0}  # every estimate given back


def test_kv_aware_sends_the_repeat_elsewhere_when_the_holders_queue_is_longer_than_it_saves() -> None:
    cold, warm = CachingEngine("cold"), CachingEngine("warm", [SYSTEM])
    router = Router([cold.ref("both"), warm.ref("both")], RoutingConfig(policy="kv_aware"))
    picker, prompt = router.pools["both"], SYSTEM + [5] * 20
    # This router's own requests in flight on `warm`: their estimate is what counts, not their number.
    picker.acquire(warm.ref("both"), 10.0)
    serve_one(router, prompt, RequestTrace())
    assert len(warm.requests) == 1
    picker.acquire(warm.ref("both"), 2.0 * len(prompt))
    serve_one(router, prompt, RequestTrace())
    assert len(warm.requests) == 1 and len(cold.requests) == 1


def test_load_counts_other_routers_requests_but_not_this_routers_ended_ones() -> None:
    """An engine's load report lags: requests this router already saw end may still be in it.
    The router counts its own requests itself and takes only the others' from the report."""
    prompt = SYSTEM[: 2 * BLOCK] + list(range(6 * BLOCK))  # a quarter of it held by `warm`
    for reported, expect_warm in (("mine", True), ("other", False)):
        cold, warm = CachingEngine("cold"), CachingEngine("warm", [SYSTEM])
        router = Router([cold.ref("both"), warm.ref("both")], RoutingConfig(policy="kv_aware"))
        warm.requests_by_origin = {router.origin if reported == "mine" else "another-router": 3}
        serve_one(router, prompt, RequestTrace())
        assert (len(warm.requests), len(cold.requests)) == ((1, 0) if expect_warm else (0, 1)), reported
        assert (warm.requests + cold.requests)[0].origin == router.origin  # what engines count it by


def test_conditional_prefills_a_short_remainder_on_the_decode_engine() -> None:
    prefill, decode = CachingEngine("p"), CachingEngine("d", [SYSTEM])
    cfg = RoutingConfig(policy="kv_aware", disaggregation="conditional", local_prefill_max_tokens=64)
    router = Router([prefill.ref("prefill"), decode.ref("decode")], cfg)
    local = RequestTrace()
    out = serve_one(router, SYSTEM + list(range(40)), local)  # 40 uncached tokens: local
    assert local.disaggregation == "local" and not prefill.requests
    assert decode.requests[-1].kv_transfer_params is None
    assert out[-1].num_cached_tokens == local.num_cached_tokens == len(SYSTEM)  # usage stays right
    remote = RequestTrace()
    serve_one(router, list(range(3000, 3000 + 10 * BLOCK)), remote)  # nothing cached: remote
    assert remote.disaggregation == "remote" and len(prefill.requests) == 1
    # The decode goes on from the prompt plus the prefill's token, pulling the prompt's KV.
    assert decode.requests[-1].kv_transfer_params == {"remote_engine_id": "p", PREFILLED_TOKENS: 10 * BLOCK}
    assert decode.requests[-1].prompt_token_ids == list(range(3000, 3000 + 10 * BLOCK)) + [7]
    assert router.stats.decisions["local:short_uncached"] == 1
    assert router.stats.decisions["remote:long_uncached"] == 1


def test_conditional_keeps_a_history_only_the_decode_engine_holds_local() -> None:
    """A chat's earlier turns were prefilled on the decode engine; the prefill replica holds
    only the system prompt. The next turn's remainder is over the budget for the request it
    holds up, but a remote prefill would compute the whole history again: local. (The
    engines' capacities are unknown here, so nothing counts as at risk of eviction; the
    2P1D replay below has them.)"""
    history = SYSTEM + list(range(5000, 5000 + 8 * BLOCK))
    prefill, decode = CachingEngine("p", [SYSTEM]), CachingEngine("d", [history])
    decode.requests_by_origin = {"another-ingress": 1}  # a request decoding there
    cfg = RoutingConfig(policy="kv_aware", disaggregation="conditional", local_prefill_max_tokens=64)
    router = Router([prefill.ref("prefill"), decode.ref("decode")], cfg)
    turn = RequestTrace()
    serve_one(router, history + list(range(9000, 9040)), turn)  # 40 new x 2 held up > 64
    assert turn.disaggregation == "local" and not prefill.requests
    assert router.stats.decisions["local:remote_costlier"] == 1
    fresh = RequestTrace()  # neither holds it: the budget alone decides
    serve_one(router, SYSTEM + list(range(7000, 7040)), fresh)
    assert fresh.disaggregation == "remote" and len(prefill.requests) == 1


class GatedEngine(CachingEngine):
    """A CachingEngine that holds every answer until `gate` is set (still prefilling)."""

    def __init__(self, name: str, held_prompts: list[list[int]] = ()) -> None:
        super().__init__(name, held_prompts)
        self.gate = threading.Event()  # set by the test's thread, read in the fake engines' loop

    async def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        while not self.gate.is_set():
            await asyncio.sleep(0.005)
        async for out in super().generate(req):
            yield out


@pytest.mark.parametrize(("budget", "first_token", "second"), [
    (100, "decode", "remote:long_uncached"),  # (40 queued + 40) x 2 requests held up > 100
    (1000, "decode", "local:short_uncached"),  # within the budget: the KV move and decode leg are saved
    (1000, "prefill", "remote:prefill_sooner"),  # 80 tokens before its first token there, 40 remotely
])
def test_conditional_counts_the_local_prefills_queued_on_the_decode_engine(budget: int, first_token: str, second: str) -> None:
    """A burst of short remainders: while the first one's tokens are still to be computed on
    the decode engine, the next would wait behind them and hold up one more request, so it
    goes remote unless the budget allows the stall and the remote path would also cost the
    KV move before its first token; once the first has its first token, a short remainder is
    local again."""
    prefill, decode = CachingEngine("p", [SYSTEM]), GatedEngine("d", [SYSTEM])
    cfg = RoutingConfig(policy="kv_aware", disaggregation="conditional", local_prefill_max_tokens=budget,
                        first_token=first_token)  # type: ignore[arg-type]
    router = Router([prefill.ref("prefill"), decode.ref("decode")], cfg)
    traces = [RequestTrace() for _ in range(3)]

    async def one(i: int) -> None:
        req = EngineRequest(f"r{i}", SYSTEM + list(range(100 * i, 100 * i + 40)), SamplingParams(max_tokens=1))
        async for _ in router.generate(req, traces[i]):
            pass

    async def go() -> None:
        assert router.cache is not None
        router.cache.sync()
        await asyncio.sleep(0.05)
        first = asyncio.create_task(one(0))  # 40 x 1 request, as many as remotely: local
        await asyncio.sleep(0.05)
        second = asyncio.create_task(one(1))
        await asyncio.sleep(0.05)
        decode.gate.set()
        await asyncio.gather(first, second)
        await one(2)  # nothing queued any more: local
        await router.close()

    asyncio.run(asyncio.wait_for(go(), timeout=10))
    assert [t.disaggregation for t in traces] == ["local", second.split(":")[0], "local"]
    made = {k: v for k, v in router.stats.decisions.items() if v}
    assert made == dict(Counter(["local:short_uncached", second, "local:short_uncached"]))
    assert router._local_queued == {}


@pytest.mark.parametrize(("p1_cores", "p1_ip", "expect"), [
    ((0,), "10.0.0.1", "local:short_uncached"),  # one core for both replicas: 40 + 95 ahead there
    ((2,), "10.0.0.1", "remote:prefill_sooner"),  # a core of its own: 40 ahead on p1
    ((0,), "10.0.0.2", "remote:prefill_sooner"),  # core 0 of another host
])
def test_conditional_counts_the_prompts_queued_on_a_prefill_replicas_cores(
        p1_cores: tuple[int, ...], p1_ip: str, expect: str) -> None:
    """Two prefill replicas given one core compute their prompts in turns: a replica with an
    empty queue still waits for its neighbour's. The decode engine, on a core of its own,
    would reach the first token sooner (the short chats' burst of first turns, run 100)."""
    p0, p1 = CachingEngine("p0", [SYSTEM]), CachingEngine("p1", [SYSTEM])
    decode = CachingEngine("d", [SYSTEM[: 4 * BLOCK]])
    cfg = RoutingConfig(policy="kv_aware", disaggregation="conditional", local_prefill_max_tokens=200,
                        first_token="prefill")
    refs = [p0.ref("prefill", (0,)), p1.ref("prefill", p1_cores, p1_ip), decode.ref("decode", (1,))]
    router = Router(refs, cfg)
    router.pools["prefill"].acquire(refs[0], 95.0)  # a remote prefill of 95 tokens in flight on p0
    trace = RequestTrace()
    # The decode engine computes 4 x 16 + 40 = 104 tokens; p1 the 40 new ones, after p0's 95 if they share a core.
    serve_one(router, SYSTEM + list(range(40)), trace)
    assert {k: v for k, v in router.stats.decisions.items() if v} == {expect: 1}
    assert trace.disaggregation == expect.split(":")[0]
    assert len(decode.requests) == 1 and len(p0.requests) + len(p1.requests) == (expect.startswith("remote"))


def test_a_remote_prefill_goes_to_the_replica_that_does_not_share_the_local_prefills_core() -> None:
    """Bursts of two short prompts on a 2-core host (2P1D, the decode engine on p0's core):
    the first of each is prefilled on the decode engine; the decider sends the second remote
    because p1, on a core of its own, would reach its first token sooner, and the prefill pick
    counts the same queues, so it goes to p1: on p0 it would take turns with the local prefill
    (the 64-token prompts' slowest requests, docs/bench-results.md run 115)."""
    p0, p1, decode = CachingEngine("p0"), CachingEngine("p1"), GatedEngine("d")
    cfg = RoutingConfig(policy="kv_aware", disaggregation="conditional", first_token="prefill")
    router = Router([p0.ref("prefill", (0,)), p1.ref("prefill", (1,)), decode.ref("decode", (0,))], cfg)
    traces: list[RequestTrace] = []

    def one(start: int) -> Coroutine[None, None, None]:
        return serve_traced(router, traces, list(range(start, start + 4 * BLOCK)), max_tokens=1)

    async def go() -> None:
        assert router.cache is not None
        router.cache.sync()
        await asyncio.sleep(0.05)
        for burst in range(4):
            decode.gate.clear()
            first = asyncio.create_task(one(10_000 * burst))
            await asyncio.sleep(0.02)
            await one(10_000 * burst + 5_000)  # the local prefill still to compute on core 0
            decode.gate.set()
            await first
        await router.close()

    asyncio.run(asyncio.wait_for(go(), timeout=10))
    assert [t.disaggregation for t in traces] == ["local", "remote"] * 4
    assert router.stats.decisions["remote:prefill_sooner"] == 4
    assert len(p1.requests) == 4 and not p0.requests
    assert router._local_queued == {}


def test_an_engine_decoding_on_a_replicas_cores_stretches_its_tokens_ahead_by_the_measured_rate() -> None:
    """Between replicas: 1.6x beside a decode engine's forward passes, 1.3x beside only its
    processes. Against the decode engine's own prefill (the decider): once more for each."""
    cfg = RoutingConfig()
    alone = EngineFacts("p", 0, 64, 0.0, 0.0, queued_tokens=100)
    beside_processes = msgspec.structs.replace(alone, decoding_neighbours=1)
    beside_passes = msgspec.structs.replace(alone, decoding_neighbours=1, computing_neighbours=1)
    beside_both = msgspec.structs.replace(alone, decoding_neighbours=2, computing_neighbours=1)
    assert queue_tokens(alone, 200, cfg) == ahead_tokens(alone, 200, cfg) == 236  # 100 queued + 136 of its own
    assert [round(ahead_tokens(f, 200, cfg), 6) for f in (beside_processes, beside_passes, beside_both)] == [306.8, 377.6, 448.4]
    assert [remote_ahead_tokens(f, 200, cfg) for f in (alone, beside_processes, beside_passes, beside_both)] == [236, 472, 472, 708]


def test_a_new_prefix_goes_beside_the_decode_engines_processes_though_a_live_prefix_takes_room_there() -> None:
    """The held-out check's request 22 (docs/bench-results.md, runs 150-151): a 576-token
    prefix no one holds, the decode engine decoding, prefill-1 beside its processes holding a
    live prefix (about 500 tokens of room, priced at kv_load_cost as its evictions reload from
    the tier), prefill-0 beside its forward passes. Priced alike (2x) the room decided it and
    prefill-0 computed it 1.2x slower; priced by the measured rates it goes to prefill-1."""
    cfg = RoutingConfig()
    p0 = EngineFacts("prefill-0", 0, 0, 0.0, 0.0, decoding_neighbours=1, computing_neighbours=1)
    p1 = EngineFacts("prefill-1", 0, 0, 0.0, 0.0, crowded_tokens=500, evictions_reload=True, decoding_neighbours=1)
    for candidates in ([p0, p1], [p1, p0]):
        assert choose(candidates, 576, cfg).engine_id == "prefill-1"
    # Real room pressure still wins: without the tier the eviction costs in full.
    p1_no_tier = msgspec.structs.replace(p1, evictions_reload=False)
    assert choose([p0, p1_no_tier], 576, cfg).engine_id == "prefill-0"


def _decode_busy_then(router: Router, decode: GatedEngine, then: list[list[int]],
                      until: Callable[[RequestTrace], bool] = lambda t: t.disaggregation is not None,
                      after: Sequence[list[int]] = ()) -> list[RequestTrace]:
    """Serves a 20-block prompt that ends up decoding on `decode` (held there by its gate),
    then each prompt of `then` while it does, each once the one before is `until` (routed, by
    default), then opens the gate, lets them all end and serves each prompt of `after` in turn."""
    traces: list[RequestTrace] = []

    async def go() -> None:
        assert router.cache is not None
        router.cache.sync()
        await asyncio.sleep(0.05)
        decode.gate.clear()
        running = [asyncio.create_task(serve_traced(router, traces, list(range(50_000, 50_000 + 20 * BLOCK))))]
        while not router.pools["decode"].outstanding.get(decode.name):
            await asyncio.sleep(0.005)
        for prompt in then:
            running.append(asyncio.create_task(serve_traced(router, traces, prompt)))
            while len(traces) < len(running) or not until(traces[-1]):
                await asyncio.sleep(0.005)
        decode.gate.set()
        await asyncio.gather(*running)
        for prompt in after:
            await serve_traced(router, traces, prompt)
        await router.close()

    asyncio.run(asyncio.wait_for(go(), timeout=10))
    return traces


def test_a_prefill_goes_to_the_replica_whose_cores_no_decode_engine_is_decoding_on() -> None:
    """2P1D on a 2-core host, the decode engine computing on p0's core: while it decodes, p0's
    forward passes take turns with its steps, so a prompt p0 holds a block of goes to p1, which
    computes the rest alone sooner (0.33 against 0.20 ms a token, run 122); once the decode
    engine is idle, it goes back to p0."""
    held = list(range(5_000, 5_000 + BLOCK))
    p0, p1, decode = CachingEngine("p0", [held]), CachingEngine("p1"), GatedEngine("d")
    router = Router([p0.ref("prefill", (0,)), p1.ref("prefill", (1,)), decode.ref("decode", (0,))],
                    RoutingConfig(policy="kv_aware"))
    prompt = held + list(range(6_000, 6_000 + 3 * BLOCK))
    [_, trace] = _decode_busy_then(router, decode, [prompt])
    assert [r.prompt_token_ids for r in p1.requests][-1] == prompt
    assert not any(r.prompt_token_ids == prompt for r in p0.requests)
    # The request log's scores say why: p1's beat p0's.
    assert set(trace.scores) == {"p0", "p1"} and trace.scores["p1"] > trace.scores["p0"], trace.scores
    assert f"[scores p1 {trace.scores['p1']:.3f}, p0 {trace.scores['p0']:.3f}]" in trace.describe(len(prompt), 2)  # best first
    p0.requests.clear()
    p1.requests.clear()
    serve_one(router, held + list(range(7_000, 7_000 + 3 * BLOCK)), RequestTrace())
    assert len(p0.requests) == 1 and not p1.requests


def test_a_fresh_prompt_goes_beside_the_decode_engines_processes_rather_than_its_forward_passes() -> None:
    """2P1D on a 2-core host as placed: the decode engine computes on p0's core and runs its
    processes on p1's. While it decodes, both replicas count it beside them and score a fresh
    prompt alike, but p0 takes turns with its forward passes, 1.25x slower a prompt token than
    p1 beside its processes (docs/bench-results.md, run 122): every fresh prompt goes to p1,
    whatever else p1 has in flight. With the decode engine idle, p0 gets them again."""
    p0, p1, decode = CachingEngine("p0"), CachingEngine("p1"), GatedEngine("d")
    router = Router([p0.ref("prefill", (0,)), p1.ref("prefill", (1,)), decode.ref("decode", (0,), process_cores=(1,))],
                    RoutingConfig(policy="kv_aware"))
    fresh = [list(range(10_000 * k, 10_000 * k + 4 * BLOCK)) for k in range(1, 7)]
    # Each sent once the one before has its prefill, so p1 has requests in flight but none queued.
    _decode_busy_then(router, decode, fresh[:4], until=lambda t: t.t_prefill_done is not None, after=fresh[4:])
    on = {name: [r.prompt_token_ids for r in e.requests] for name, e in (("p0", p0), ("p1", p1))}
    assert all(prompt in on["p1"] and prompt not in on["p0"] for prompt in fresh[:4])
    assert any(prompt in on["p0"] for prompt in fresh[4:])


@pytest.mark.parametrize(("p1_holds", "process_cores", "expect"), [
    (False, (), "local:remote_costlier"),  # p0 beside its steps, p1 would compute the history
    (True, (), "remote:long_uncached"),  # p1 holds it too, on a core of its own
    (True, (1,), "local:remote_costlier"),  # ... where the decode engine's processes run
])
def test_conditional_prefills_locally_rather_than_beside_the_engines_decodes(
        p1_holds: bool, process_cores: tuple[int, ...], expect: str) -> None:
    """The decode engine holds a chat's history and decodes another request, computing on
    p0's core. The rest of the prompt is too long to stall that decode for by the budget
    alone, but a replica's prefill beside those decodes (their forward passes, or the decode
    engine's processes, which handle every token) takes about twice as long: unless a replica
    apart from them holds the history, the turn is prefilled locally (remote_costlier)."""
    history = list(range(5_000, 5_000 + 6 * BLOCK))
    p0, p1 = CachingEngine("p0", [history]), CachingEngine("p1", [history] if p1_holds else [])
    decode = GatedEngine("d", [history])
    cfg = RoutingConfig(policy="kv_aware", disaggregation="conditional", first_token="prefill")
    router = Router([p0.ref("prefill", (0,)), p1.ref("prefill", (1,)),
                     decode.ref("decode", (0,), process_cores=process_cores)], cfg)
    traces = _decode_busy_then(router, decode, [history + list(range(6_000, 6_000 + 10 * BLOCK))])
    assert [t.disaggregation for t in traces] == ["remote", expect.split(":")[0]]
    assert {k: v for k, v in router.stats.decisions.items() if v} == {"remote:long_uncached": 1} | {expect: 1 + expect.startswith("remote")}
    assert router._local_queued == {}


def test_a_decode_engine_steps_beside_the_engines_on_its_compute_or_process_cores() -> None:
    decode = EngineRef("d", "decode", None, node_ip="10.0.0.1", compute_cores=(0,), process_cores=(1,))
    on = [EngineRef(f"p{c}", "prefill", None, node_ip="10.0.0.1", compute_cores=(c,)) for c in range(3)]
    assert [p.steps_beside(decode) for p in on] == [True, True, False]
    assert [p.shares_cores(decode) for p in on] == [True, False, False]  # prompts queue on its compute cores only
    elsewhere = EngineRef("q", "prefill", None, node_ip="10.0.0.2", compute_cores=(0,))
    assert not elsewhere.steps_beside(decode) and not decode.steps_beside(decode)


def test_core_neighbours_pair_the_engines_of_one_hosts_cores_once_per_table() -> None:
    decode = EngineRef("d", "decode", None, node_ip="10.0.0.1", compute_cores=(0,), process_cores=(1,))
    on = [EngineRef(f"p{c}", "prefill", None, node_ip="10.0.0.1", compute_cores=(c,)) for c in (0, 1, 1)]
    on[2] = msgspec.structs.replace(on[2], engine_id="p1b")
    elsewhere = EngineRef("q", "prefill", None, node_ip="10.0.0.2", compute_cores=(0,))
    gpus = [EngineRef(f"g{i}", role, None, node_ip="10.0.0.3") for i, role in enumerate(("prefill", "decode"))]
    near = CoreNeighbours([decode, *on, elsewhere, *gpus])
    assert near.mates == {"d": ("p0",), "p0": ("d",), "p1": ("p1b",), "p1b": ("p1",)}
    assert {eid: [d.engine_id for d in ds] for eid, ds in near.decoders.items()} == {"p0": ["d"], "p1": ["d"], "p1b": ["d"]}
    assert {eid: [d.engine_id for d in ds] for eid, ds in near.computing_decoders.items()} == {"p0": ["d"]}
    queued = {"d": 5.0, "p0": 7.0, "p1": 11.0, "p1b": 13.0, "q": 17.0}
    assert [near.queued_beside(e, queued) for e in ("d", "p0", "p1", "p1b", "q", "g0")] == [7.0, 5.0, 13.0, 11.0, 0.0, 0.0]
    # Every pair the router reads agrees with the engines' own predicates.
    refs = [decode, *on, elsewhere, *gpus]
    for e in refs:
        assert set(near.mates.get(e.engine_id, ())) == {o.engine_id for o in refs if e.shares_cores(o)}
        assert set(near.decoders.get(e.engine_id, ())) == {d for d in refs if d.role == "decode" and e.steps_beside(d)}
        assert set(near.computing_decoders.get(e.engine_id, ())) == {d for d in refs if d.role == "decode" and e.shares_cores(d)}


def test_decode_replicas_balance_on_the_kv_they_hold_before_prefix_affinity() -> None:
    """A decode replica pulls what it lacks over NIXL (cheap, kv_load_cost), so the prefix it
    holds only decides between replicas holding alike; the KV its running requests hold (read
    at every decode step) counts in full."""
    prefill, warm, cold = CachingEngine("p"), CachingEngine("warm", [SYSTEM]), CachingEngine("cold")
    router = Router([prefill.ref("prefill"), warm.ref("decode"), cold.ref("decode")], RoutingConfig(policy="kv_aware"))
    prompt = SYSTEM + list(range(2 * BLOCK))
    seen: list[float] = []
    answer = warm.generate

    def noting_the_queue(req: EngineRequest) -> AsyncIterator[RequestOutput]:
        seen.append(router.pools["decode"].queued_tokens["warm"])
        return answer(req)

    warm.generate = noting_the_queue  # type: ignore[method-assign]
    serve_one(router, prompt, RequestTrace())
    assert len(warm.requests) == 1 and not cold.requests
    assert seen == [len(prompt)]  # while it decoded, the request weighed its whole KV there
    assert router.pools["decode"].queued_tokens["warm"] == 0.0  # given back when it ended
    router.pools["decode"].acquire(warm.ref("decode"), float(len(prompt)))  # one like it still decoding
    serve_one(router, prompt, RequestTrace())
    assert len(warm.requests) == 1 and len(cold.requests) == 1


class LruEngine(CachingEngine):
    """A fake engine with vLLM's prefix cache in small: `num_blocks` blocks, the least
    recently used evicted first (a finished request's last block before its first), every
    change reported at once through cache_updates."""

    def __init__(self, name: str, num_blocks: int) -> None:
        super().__init__(name)
        self.num_blocks = num_blocks
        self.lru: dict[int, None] = {}  # insertion order = eviction order
        self.version = 0
        self.computed = 0
        self.uses = RecentUses()  # the requests' blocks, by the version they came at
        self.echo_history = True  # False: a router that starts following hears nothing before it

    def arrived(self, req: EngineRequest) -> None:
        """As the engine actor does: a request's blocks take a version, for its routers."""
        if req.blocks is not None:
            self.version += 1
            self.uses.add(self.version, req.blocks, time.monotonic())

    def ref(self, role: str) -> EngineRef:
        return msgspec.structs.replace(super().ref(role), num_blocks=self.num_blocks)

    async def _cache_updates(self, incarnation: str, version: int, timeout_s: float, history_s: float = 0.0,
                             origin: str = "") -> CacheUpdate:
        # The requests run in the fake engines' loop: a change there is seen by polling. A
        # router's first call (another incarnation) is answered at once, as a real engine does.
        deadline = time.monotonic() + timeout_s
        while incarnation == "i0" and version == self.version and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        now = time.monotonic()
        uses = self.uses.since(version, now) if incarnation == "i0" else self.uses.within(history_s * self.echo_history, now)
        return CacheUpdate("i0", self.version, True, list(self.lru), [], 0, 0, 0.0, {}, uses)

    async def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.arrived(req)
        keys = [as_key(h) for h in self.hasher.hashes(req.prompt_token_ids)]
        hit = next((i for i, k in enumerate(keys) if k not in self.lru), len(keys))
        self.computed += len(req.prompt_token_ids) - hit * BLOCK
        self.store(keys)
        yield output("x", [7], finished=True, finish_reason="length", num_cached_tokens=hit * BLOCK)

    def store(self, keys: list[int]) -> None:
        """Cache `keys` as vLLM does a finished request's blocks, evicting the least recent."""
        for k in reversed(keys):
            self.lru.pop(k, None)
            self.lru[k] = None
        while len(self.lru) > self.num_blocks:
            del self.lru[next(iter(self.lru))]
        self.version += 1


def chats(num_chats: int, turns: int, rng: random.Random) -> list[list[int]]:
    """Prompts of multi-turn chats after one shared 4-block system prompt, turn by turn, the
    chats in a new order every turn (the shape of `tandem bench --workload conversation`)."""
    system = list(range(1000, 1000 + 4 * BLOCK))
    histories = [list(system) for _ in range(num_chats)]
    prompts = []
    for _ in range(turns):
        for c in rng.sample(range(num_chats), num_chats):
            histories[c] += [rng.randrange(2000, 30000) for _ in range(rng.randint(2 * BLOCK, 4 * BLOCK))]
            prompts.append(list(histories[c]))
    return prompts


def test_kv_aware_spreads_chats_over_the_pools_caches_instead_of_thrashing_one() -> None:
    """16 chats whose histories fit in two engines' caches together but not in one. Sent one
    at a time (no queue anywhere), kv_aware without the eviction cost sent every chat to the
    engine that held the system prompt, which then evicted each history before its next turn
    (as much computed as round robin); with it, the chats spread and stay. Counting only the
    evictions a request makes at once, they spread late, once that engine was full (1.23x
    the least possible); counting the room live histories leave, at their second turn
    (1.09-1.16x)."""

    async def run(policy: str, evict_cost: float) -> tuple[int, list[int]]:
        engines = [LruEngine("a", 150), LruEngine("b", 150)]
        router = Router([e.ref("both") for e in engines], RoutingConfig(policy=policy, evict_cost=evict_cost))
        for i, prompt in enumerate(chats(16, 5, random.Random(0))):
            async for _ in router.generate(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=1)), RequestTrace()):
                pass
            await asyncio.sleep(0.005)  # the engines' events reach the view
        await router.close()
        return sum(e.computed for e in engines), [len(e.lru) for e in engines]

    def go(policy: str, evict_cost: float = 1.0) -> tuple[int, list[int]]:
        return asyncio.run(asyncio.wait_for(run(policy, evict_cost), timeout=60))

    async def least_possible() -> int:  # one engine whose cache never evicts
        engine = LruEngine("all", 10**6)
        for i, prompt in enumerate(chats(16, 5, random.Random(0))):
            async for _ in engine.generate(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=1))):
                pass
        return engine.computed

    bound = asyncio.run(least_possible())
    round_robin, _ = go("round_robin")
    piled, (a_held, b_held) = go("kv_aware", evict_cost=0.0)
    spread, held = go("kv_aware")
    assert min(a_held, b_held) <= 4  # the old way: one cache full, the other holding next to nothing
    assert min(held) > 60  # both caches in use
    # Computed prompt tokens: 1.09-1.16x what caches that never evict would compute (four
    # workloads: one routing choice that differs early changes every later one), where round
    # robin and the piled-up way compute 1.6-1.7x.
    assert spread <= 1.2 * bound and spread < 0.8 * min(round_robin, piled), (bound, spread, round_robin, piled)


def test_one_off_questions_after_a_shared_prefix_stay_with_its_holder() -> None:
    """Questions asked once each after one system prompt: their blocks are never reused, so
    they take no room from anything live, and every question goes where the prefix is cached
    (as chats' first turns would, until their next turns show the histories live)."""

    async def run() -> list[int]:
        engines = [LruEngine("a", 150), LruEngine("b", 150)]
        router = Router([e.ref("both") for e in engines], RoutingConfig(policy="kv_aware"))
        rng = random.Random(1)
        system = list(range(1000, 1000 + 8 * BLOCK))
        for i in range(24):
            question = [rng.randrange(2000, 30000) for _ in range(3 * BLOCK)]
            async for _ in router.generate(EngineRequest(f"q{i}", system + question, SamplingParams(max_tokens=1)), RequestTrace()):
                pass
            await asyncio.sleep(0.005)  # the engines' events reach the view
        await router.close()
        return [e.computed for e in engines]

    computed = asyncio.run(asyncio.wait_for(run(), timeout=60))
    # The system prompt computed once, then only the questions, all on one engine.
    assert sorted(computed) == [0, 8 * BLOCK + 24 * 3 * BLOCK], computed


class PdLruEngine(LruEngine):
    """An LruEngine in a 2P1D: as a prefill (kv_transfer_params do_remote_decode) it hands
    its KV on; as a decode that pulls the KV it computes nothing; whatever decodes stores the
    conversation's reply too (`history`: the conversation after this turn, set by the test;
    its reply starts with the token a prefill answers, 7)."""

    history: list[int] = []

    async def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.arrived(req)
        keys = [as_key(h) for h in self.hasher.hashes(req.prompt_token_ids)]
        hit = next((i for i, k in enumerate(keys) if k not in self.lru), len(keys))
        hand_off = req.kv_transfer_params == {"do_remote_decode": True}
        if not (req.kv_transfer_params and "remote_engine_id" in req.kv_transfer_params):
            self.computed += len(req.prompt_token_ids) - hit * BLOCK
        self.store(keys if hand_off else [as_key(h) for h in self.hasher.hashes(self.history)])
        yield output("x", [7], finished=True, finish_reason="length", num_cached_tokens=hit * BLOCK,
                     kv_transfer_params={"remote_engine_id": self.name} if hand_off else None)


def replay_2p1d(disaggregation: str, chats: int, turns: int, decode_blocks: int,
                retokenized: bool = False, routers: int = 1, joining: int = 0,
                echo_history: bool = True, seed: int = 0, staggered: bool = False,
                one_offs: list[str] | None = None) -> tuple[list[int], int]:
    """Chats after one system prompt, turn by turn in a new order each turn (`staggered`:
    chat c's turn t at step 2t + c, as `tandem bench --chat-order staggered` sends them; with
    `one_offs`, each turn followed by a one-off question after another system prompt, which
    the prefill engines hold from the start, its decision going to that list), one request
    at a time, through kv_aware on 2 prefill engines of 390 blocks and a decode engine of
    `decode_blocks` (a turn: 2-6 blocks from the user, a 2-block reply; 16 chats' histories
    reach about 580 blocks). `retokenized`: the next turn carries the reply as other tokens
    than the engine generated (a client sending text through a chat template), so the
    decode engine's reply blocks match nothing. `routers`: ingress replicas, each chat's turns
    sent by each in turn; all but the first join at turn `joining` (the first sends every turn
    before it), hearing from the engines what was used before they joined unless
    `echo_history` is False. Returns the prompt tokens each request computed, and how many
    were prefilled locally."""

    async def run() -> tuple[list[int], int]:
        rng = random.Random(seed)
        prefill = [PdLruEngine("p0", 390), PdLruEngine("p1", 390)]
        decode = PdLruEngine("d", decode_blocks)
        engines = [*prefill, decode]
        for e in engines:
            e.echo_history = echo_history

        def router() -> Router:
            return Router([prefill[0].ref("prefill"), prefill[1].ref("prefill"), decode.ref("decode")],
                          RoutingConfig(policy="kv_aware", disaggregation=disaggregation))

        ingress = [router() for _ in range(1 if joining else routers)]
        histories = [list(range(1000, 1000 + 8 * BLOCK)) for _ in range(chats)]
        computed, local = [], 0
        other_system = list(range(40_000, 40_000 + 8 * BLOCK))
        if one_offs is not None:
            for e in prefill:
                e.store([as_key(h) for h in e.hasher.hashes(other_system)])

        def order() -> Iterator[tuple[int, int]]:
            if staggered:
                yield from sorted(((t, c) for c in range(chats) for t in range(turns)), key=lambda tc: 4 * tc[0] + 2 * tc[1])
                return
            for turn in range(turns):
                for c in rng.sample(range(chats), chats):
                    yield turn, c

        for turn, c in order():
            if turn == joining and len(ingress) < routers:
                ingress += [router() for _ in range(routers - 1)]
                for r in ingress[1:]:
                    r.cache.sync()  # type: ignore[union-attr]
                await asyncio.sleep(0.05)  # their first answers: the engines' state, and what was used lately
            histories[c] += [rng.randrange(2000, 30000) for _ in range(rng.randint(2 * BLOCK, 6 * BLOCK))]
            reply = [7] + [rng.randrange(2000, 30000) for _ in range(2 * BLOCK - 1)]
            PdLruEngine.history = histories[c] + ([7] + [5] * (len(reply) - 1) if retokenized else reply)
            before = sum(e.computed for e in engines)
            trace = RequestTrace()
            request = EngineRequest(f"c{c}-{turn}", list(histories[c]), SamplingParams(max_tokens=2))
            async for _ in ingress[(c + turn) % len(ingress)].generate(request, trace):
                pass
            await asyncio.sleep(0.005)  # the engines' events reach the view
            histories[c] += reply
            computed.append(sum(e.computed for e in engines) - before)
            local += trace.disaggregation == "local"
            if one_offs is not None:
                question = other_system + [rng.randrange(2000, 30000) for _ in range(3 * BLOCK)]
                PdLruEngine.history = question + reply
                trace = RequestTrace()
                async for _ in ingress[0].generate(EngineRequest(f"q{len(one_offs)}", question, SamplingParams(max_tokens=2)), trace):
                    pass
                await asyncio.sleep(0.005)
                one_offs.append(str(trace.disaggregation))
        for router in ingress:
            await router.close()
        return computed, local

    return asyncio.run(asyncio.wait_for(run(), timeout=120))


def test_conditional_homes_conversations_where_their_histories_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CPU tier, 16 chats of 6 turns whose histories fit in the two prefill engines'
    caches together but not in the decode engine's alike one. Before, every turn was
    prefilled on the decode engine (nothing queued, and it held the history), and from turn 5
    its cache evicted histories that the next turns computed whole: 1.34x the tokens always
    disaggregating computes, the worst turn 1.8x its worst. Now a conversation goes remote
    where the decode engine's cache, which every request passes through, has no more room
    than a prefill engine's, and stays with the prefill pool. With a decode cache four times
    larger every turn stays local. A client that sends the replies back as other tokens
    leaves the decode engine no longer a history than a prefill engine's after a remote turn:
    the turn after it still goes remote (it continues an earlier request), where before it
    went local and the next one moved it back, computing that turn twice (1.29x always).

    The 16 first turns come before any second one, each extending no earlier prompt, as a
    one-off question does. They were kept local while the caches were alike (a tie counted as
    room to spare) and the router counted openers not yet continued as one-offs (odds 0):
    17 local prefills, and each chat's second turn computed its first message again on a
    prefill replica (1.01-1.06x always's tokens over three seeds, the worst turn up to 1.20x
    always's). Now a tie counts as the decode engine evicting first, and a prompt extending
    none is priced as a chat's first turn until the router has seen such prompts continued
    or waited for them in vain (CONTINUATION_WAIT_S): none local, always's tokens. One-off
    questions after a shared prompt go remote too while the router knows nothing, and stay
    local once it has waited for their continuation."""
    from orchestrator import cache_view

    for seed in (2, 1, 0):
        always, none_local = replay_2p1d("always", 16, 6, 390, seed=seed)
        assert none_local == 0
        homed, local = replay_2p1d("conditional", 16, 6, 390, seed=seed)
        assert local == 0 and sum(homed) <= 1.02 * sum(always) and max(homed) <= 1.02 * max(always), (
            seed, local, sum(homed), sum(always), max(homed), max(always))
    homed, _ = replay_2p1d("conditional", 16, 6, 390, retokenized=True)
    assert sum(homed) <= 1.02 * sum(always), (sum(homed), sum(always))
    roomy, local = replay_2p1d("conditional", 16, 6, 1600)
    assert local == 96 and sum(roomy) < 0.75 * sum(always), (local, sum(roomy), sum(always))
    _, local = replay_2p1d("conditional", 48, 1, 390)
    assert local == 0  # within CONTINUATION_WAIT_S of the first: any may be a chat's first turn
    monkeypatch.setattr(cache_view, "CONTINUATION_WAIT_S", 0.0)
    _, local = replay_2p1d("conditional", 48, 1, 390)
    assert local == 47  # all but the first, once the ones before it went without a next turn


def test_conditional_learns_that_first_turns_open_chats() -> None:
    """A chat's first turn looks like a one-off prompt after the shared system prompt (it
    continues nothing), and a local prefill leaves it on the decode engine alone, so the
    second turn computes the first message again on a prefill replica. With chats opening
    while others go on (as a service's chats do, not all at once as in the replay above), the
    router sees how often such prompts were continued lately and prices a first turn's
    stranding at those odds: every first turn goes remote as later turns do (none local;
    17 when its odds were taken as 0, 4 when the openers not yet continued counted as
    one-offs; 0.97-1.00x always's tokens, against 1.05-1.10x and 0.99-1.03x), while one-off
    questions, never continued, keep their local path once the router has waited for their
    next turns in vain (the replay above, and below between the chats' turns)."""
    for seed in (0, 1, 2):
        always, _ = replay_2p1d("always", 16, 6, 390, seed=seed, staggered=True)
        homed, local = replay_2p1d("conditional", 16, 6, 390, seed=seed, staggered=True)
        assert local <= 2 and sum(homed) <= 1.02 * sum(always), (seed, local, sum(homed), sum(always))
    # One-off questions after another system prompt, which the prefill replicas hold, between
    # the turns: they keep their local path, as the odds are counted by first block (counted
    # over all, 95 of the 96 went remote), and the chats keep theirs. The first few go remote,
    # before the router has seen how long a chat pauses between turns.
    questions: list[str] = []
    _, local = replay_2p1d("conditional", 16, 6, 390, staggered=True, one_offs=questions)
    assert local <= 2 and len(questions) == 96 and questions.count("local") >= 90, (local, Counter(questions))


def test_the_continuation_rate_counts_prompts_that_extended_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """Of the prompts sent lately that extended none, the share a later prompt extended, of
    those extended or given up on (older than CONTINUATION_WAIT_S before any continuation
    was seen, then than the longest pause seen), by their first block; 1 while none is
    either: a repeat or a sibling after the same prefix is no continuation, a later turn's own
    continuation not a first turn's, an opener given up on and then continued counts as
    continued, one-off prompts after another system prompt leave the odds after this one as
    they were, and what is older than WORKING_SET_S is forgotten."""
    from orchestrator import cache_view
    from orchestrator.cache_view import CacheView

    clock = [time.monotonic()]
    monkeypatch.setattr(cache_view.time, "monotonic", lambda: clock[0])
    view = CacheView()
    a = EngineRef("a", "prefill", None, "i0", BLOCK, "sha256", SEED, num_blocks=100)
    view.set_engines([a])
    shared = list(range(1000, 1000 + 4 * BLOCK))
    other_system = list(range(50_000, 50_000 + 4 * BLOCK))

    def send(tokens: list[int]) -> None:
        view.expect(a, view.prompt(tokens))

    def after(prefix: list[int]) -> tuple[float, tuple[int, int]]:
        p = view.prompt(prefix + [9] * BLOCK)
        return view.continuation_rate(a, p), view.continuations(a, p)

    assert view.continuation_rate() == 1.0  # nothing known
    first, other = shared + [1] * BLOCK, shared + [2] * BLOCK
    send(first)
    send(other)  # a sibling: extends the shared prefix, no earlier prompt's last block
    send(first)  # a repeat
    clock[0] += cache_view.CONTINUATION_WAIT_S - 1
    assert after(shared) == (1.0, (0, 0))  # not given up on yet
    clock[0] += 2
    assert after(shared) == (0.0, (0, 2))
    second = first + [3] * BLOCK
    send(second)  # the first turn's next, after a longer pause than the router waited
    assert after(shared) == (0.5, (1, 1))
    send(second + [4] * BLOCK)  # a third turn continues the second, not an opener
    assert after(shared) == (0.5, (1, 1))
    for i in range(4):
        send(other_system + [10 + i] * BLOCK)
    clock[0] += cache_view.CONTINUATION_WAIT_S  # less than the pause seen (the wait now)
    assert after(other_system) == (1.0, (0, 0))
    clock[0] += 2
    assert after(other_system) == (0.0, (0, 4))
    assert after(shared) == (0.5, (1, 1))
    assert view.continuation_rate(a, view.prompt([9] * (BLOCK - 1))) == 0.0  # no full block
    assert view.continuation_rate() == pytest.approx(1 / 6)  # over every first block: 1 of 6 openers
    page = TandemMetrics("app").render([], {}, router=RouterStats(continuation_rate=view.continuation_rate())).decode()
    assert f'tandem_continuation_rate{{app="app"}} {1 / 6}' in page
    clock[0] += cache_view.WORKING_SET_S
    send(shared + [5] * BLOCK)
    assert view.continuation_rate() == 1.0  # the earlier openers forgotten, the new one not given up on
    clock[0] += cache_view.CONTINUATION_WAIT_S + 1  # the pause seen forgotten with them
    assert view.continuation_rate() == 0.0


def test_an_opener_is_given_up_on_after_the_longest_pause_seen_lately() -> None:
    """Openers' wait for a continuation follows the traffic: the longest pause between an
    opener and its next turn among those remembered, shorter again once that one is
    forgotten (an agent's tool loop answers in seconds, a person in tens of them)."""
    from orchestrator.cache_view import CONTINUATION_WAIT_S, Openers

    openers = Openers()
    openers.open(1, 100, t=0.0)
    assert openers.rate(now=CONTINUATION_WAIT_S - 1) == 1.0  # none known yet
    openers.extend(1, t=5.0)  # a pause of 5 s
    openers.open(2, 100, t=6.0)
    openers.extend(2, t=8.0)  # 2 s
    openers.open(3, 200, t=9.0)
    assert openers.rate(now=13.0, first=200) == 1.0  # 4 s old: within the longest pause
    openers.forget(before=1.0, keep=10)  # the 5 s pause forgotten with opener 1
    assert openers.rate(now=13.0, first=200) == 0.0 and openers.rate(now=13.0) == 0.5
    openers.extend(3, t=14.0)  # given up on, then continued after all: counted as continued
    assert openers.rate(now=14.0, first=200) == 1.0 and openers.rate(now=14.0) == 1.0


def test_ingress_replicas_hear_of_each_others_requests_from_the_engines() -> None:
    """The replay above with two ingress replicas, each chat's turns sent by each in turn:
    every request's blocks reach both routers from the engines (EngineRequest.blocks, echoed
    in CacheUpdate.uses), so each knows a turn continues a chat and which histories are live
    where, as one router does. Before, each router saw every other turn of a chat: under
    conditional it took them for one-off prompts and kept twice as many local, leaving
    histories on the decode engine that later turns computed whole (1.18x the tokens of one
    router), and kv_aware, blind to half the live histories, crowded caches (1.08x).

    A replica that joins later (scaled out, or restarted: a new one) hears from each engine,
    in its first answer, what the requests of the last WORKING_SET_S used there: joining at
    the fourth turn it routes as if it had been there from the start. Told nothing of before,
    it took its first turns for one-off prompts while it counted openers not yet continued
    as one-offs (25 local prefills instead of 17 under conditional, 1.11x the tokens, the
    worst turn 1.8x); now that it prices a prompt as a chat's turn until it knows better, it
    computes within 2-3% of one router's tokens either way (tests/test_cache_routing.py checks
    that a late replica hears what went before)."""
    for disaggregation in ("always", "conditional"):  # conditional's `one` stays for the last check
        one, one_local = replay_2p1d(disaggregation, 16, 6, 390)
        for joining in (0, 3):
            two, two_local = replay_2p1d(disaggregation, 16, 6, 390, routers=2, joining=joining)
            assert sum(two) <= 1.03 * sum(one) and abs(two_local - one_local) <= 2, (
                disaggregation, joining, sum(two), sum(one), two_local, one_local)
    blind, blind_local = replay_2p1d("conditional", 16, 6, 390, routers=2, joining=3, echo_history=False)
    assert sum(blind) <= 1.05 * sum(one) and blind_local <= one_local + 2, (sum(blind), sum(one), blind_local, one_local)


def test_routers_follow_only_the_pools_whose_caches_they_look_at() -> None:
    """Following an engine costs it a long-poll answer per KV event batch, on its own cores:
    a pool kv_aware never scores (one replica) is not followed unless conditional
    disaggregation needs what the decode engine holds."""
    p1, p2, d = CachingEngine("p1"), CachingEngine("p2"), CachingEngine("d")

    def followed(engines: list[EngineRef], **routing: Any) -> set[str]:
        router = Router(engines, RoutingConfig(**routing))
        assert router.cache is not None
        return set(router.cache.caches)

    one_each = [p1.ref("prefill"), d.ref("decode")]
    assert followed(one_each, policy="kv_aware") == set()
    assert followed(one_each, policy="round_robin", disaggregation="conditional") == {"p1", "d"}
    assert followed([*one_each, p2.ref("prefill")], policy="kv_aware") == {"p1", "p2"}
    router = Router(one_each, RoutingConfig(policy="kv_aware"))
    router.set_engines([*one_each, p2.ref("prefill")])  # the prefill pool grew: now it has a choice
    assert set(router.cache.caches) == {"p1", "p2"}  # type: ignore[union-attr]


class _Tier:
    """A CPU-tier index handle whose tier holds these prompts' blocks, on node n1, with a real
    feed that publishes nothing new."""

    def __init__(self, *held_prompts: list[int]) -> None:
        hasher = PrefixHasher("sha256", SEED, BLOCK)
        held = {h: "n1" for p in held_prompts for h in hasher.hashes(p)}
        self.feed = zmq.Context.instance().socket(zmq.PUB)
        address = f"tcp://127.0.0.1:{self.feed.bind_to_random_port('tcp://127.0.0.1')}"
        self.changes = _Method(lambda incarnation, version: _done(TierChanges("t0", 0, 1, True, held, [], address)))


def test_the_tier_counts_for_a_local_prefill_only_where_the_decode_engine_loads_from_it() -> None:
    """A decode engine that does not load from the tier (cpu_tier.load_into) would compute a prefix
    the tier holds, so the tier must not make a local prefill there look cheap."""
    from orchestrator.cache_view import CacheView

    prompt = list(range(5000, 5000 + 10 * BLOCK))
    cfg = RoutingConfig(disaggregation="conditional", local_prefill_max_tokens=64)
    for loads_tier, expected in ((False, "remote"), (True, "local")):
        prefill, decode = CachingEngine("p"), CachingEngine("d")
        decode_ref = msgspec.structs.replace(decode.ref("decode"), node_id="n1", loads_tier=loads_tier)
        router = Router([prefill.ref("prefill"), decode_ref], cfg, cache_view=CacheView(_Tier(prompt)))
        trace = RequestTrace()
        serve_one(router, prompt, trace)
        assert trace.disaggregation == expected, loads_tier


def test_a_turn_a_prefill_replica_holds_goes_there_rather_than_to_a_decode_engine_loading_it_from_the_tier() -> None:
    """The prefill replica holds the chat's history in its own prefix cache, the decode
    engine only through the tier: remote (prefill_sooner), and the decode engine is not
    counted the history as a local prefill's queue. Held in the decode engine's own cache
    instead, the same turn is a tie and stays local."""
    from orchestrator.cache_view import CacheView

    history = list(range(5000, 5000 + 10 * BLOCK))
    turn = history + list(range(9000, 9000 + BLOCK // 2))
    cfg = RoutingConfig(disaggregation="conditional", local_prefill_max_tokens=10 * BLOCK)
    for decode_holds, expected in (([], "remote"), ([history], "local")):
        prefill, decode = CachingEngine("p", [history]), CachingEngine("d", decode_holds)
        decode_ref = msgspec.structs.replace(decode.ref("decode"), node_id="n1", loads_tier=True)
        router = Router([prefill.ref("prefill"), decode_ref], cfg, cache_view=CacheView(_Tier(history)))
        trace = RequestTrace()
        serve_one(router, turn, trace)
        assert trace.disaggregation == expected, decode_holds
        reason = "prefill_sooner" if expected == "remote" else "short_uncached"
        assert router.stats.decisions[f"{expected}:{reason}"] == 1, router.stats.decisions


def test_engines_hear_how_much_of_the_prompt_the_tier_holds_so_a_miss_skips_their_lookup() -> None:
    """The router follows the tier's index; each request tells an engine that loads from the
    tier how many of its prompt's blocks the tier holds past the engine's own prefix cache
    (0: the engine does not ask the index)."""
    from orchestrator.cache_view import CacheView

    held, fresh = SYSTEM, list(range(7000, 7000 + 4 * BLOCK))
    for prompt, expected in ((held, 8), (fresh, 0)):
        engine = CachingEngine("e")
        ref = msgspec.structs.replace(engine.ref("both"), loads_tier=True)
        serve_one(Router([ref], RoutingConfig(policy="kv_aware"), cache_view=CacheView(_Tier(held))), prompt, RequestTrace())
        assert engine.requests[-1].kv_transfer_params == {TIER_HINT: expected}
    # An engine whose prefix cache the router follows (kv_aware has a choice of two) is told
    # what the tier holds past what the engine holds itself: a chat's next turn on the engine
    # holding its history asks the index nothing.
    turn = held + list(range(9000, 9000 + 2 * BLOCK))
    for engine_holds, expected in ((held[: 4 * BLOCK], 4), (held, 0)):
        warm, cold = CachingEngine("warm", [engine_holds]), CachingEngine("cold")
        refs = [msgspec.structs.replace(e.ref("both"), loads_tier=True) for e in (warm, cold)]
        serve_one(Router(refs, RoutingConfig(policy="kv_aware"), cache_view=CacheView(_Tier(held))), turn, RequestTrace())
        assert not cold.requests and warm.requests[-1].kv_transfer_params == {TIER_HINT: expected}
    # An engine that does not load from the tier is told nothing (the connector asks nothing).
    engine = CachingEngine("e")
    serve_one(Router([engine.ref("both")], RoutingConfig(policy="kv_aware"), cache_view=CacheView(_Tier(held))),
              held, RequestTrace())
    assert engine.requests[-1].kv_transfer_params is None


def test_a_chats_next_turn_is_told_the_tier_holds_nothing_past_the_history_its_engine_just_computed() -> None:
    """The blocks a router's own request stores reach it with the engine's next answer (up
    to POLL_S later; CachingEngine never reports them): until then the router takes the
    request's answer for them, so a turn sent at once after the one before is not told to
    look up in the tier the history its engine holds (and wait for the index to say
    "nothing more"). An engine that has not answered yet has computed nothing."""
    from orchestrator.cache_view import CacheView

    first = SYSTEM + list(range(9000, 9000 + 2 * BLOCK))
    second = first + list(range(9500, 9500 + 2 * BLOCK))
    warm, cold = CachingEngine("warm", [SYSTEM[: 4 * BLOCK]]), CachingEngine("cold")
    refs = [msgspec.structs.replace(e.ref("both"), loads_tier=True) for e in (warm, cold)]
    view = CacheView(_Tier(first))
    router = Router(refs, RoutingConfig(policy="kv_aware"), cache_view=view)
    serve_one(router, first, RequestTrace())
    assert warm.requests[-1].kv_transfer_params == {TIER_HINT: 6}  # the tier's 10 blocks past the engine's 4
    serve_one(router, second, RequestTrace())
    assert not cold.requests and warm.requests[-1].kv_transfer_params == {TIER_HINT: 0}
    # Claimed (sent) but not answered: the blocks are expected there, not held.
    third = view.prompt(second + list(range(9900, 9900 + 2 * BLOCK)))
    view.expect(refs[1], third)
    assert view.tier_blocks(refs[1], third) == 10


def test_the_tier_view_follows_commits_and_evictions() -> None:
    from orchestrator.cache_view import TierView

    view = TierView()
    assert not view.synced and view.prefix([b"a"]) == {}
    view.apply(TierChanges("t0", 0, 2, True, {b"a": "n1", b"b": "n2"}, []))
    assert view.synced and view.prefix([b"a", b"b", b"c"]) == {"n1": 1, "n2": 1}
    view.apply(TierChanges("t0", 2, 3, False, {b"c": "n1"}, [b"a"]))
    assert view.prefix([b"a", b"b"]) == {} and view.prefix([b"b", b"c"]) == {"n2": 1, "n1": 1}
    view.apply(TierChanges("t1", 0, 0, True, {}, []))  # the index restarted empty
    assert view.held == {} and view.incarnation == "t1"


def test_an_engine_dropped_and_listed_again_is_followed_into_its_new_view() -> None:
    from orchestrator.cache_view import CacheView

    engine = CachingEngine("e", [SYSTEM])

    async def go() -> bool:
        view = CacheView()
        view.set_engines([engine.ref("both")])
        view.sync()
        await asyncio.sleep(0.05)
        view.set_engines([])  # out of routing (unhealthy), then back
        view.set_engines([engine.ref("both")])
        view.sync()
        await asyncio.sleep(0.05)
        held = view.cached_tokens(engine.ref("both"), view.prompt(SYSTEM)) == len(SYSTEM)
        await view.close()
        return held

    assert asyncio.run(asyncio.wait_for(go(), timeout=10))


# ---- learned prefill speed ------------------------------------------------------------------


def _timed(speed: PrefillSpeed, lines: dict[str, tuple[float, float]], n: int, rng: random.Random,
           tokens: tuple[float, float] = (16, 600)) -> None:
    """`n` answers from each replica of `lines` (fixed seconds, seconds a token), a little noisy."""
    for _ in range(n):
        for engine, (fixed, rate) in lines.items():
            x = rng.uniform(*tokens)
            speed.observe(engine, x, fixed + rate * x + rng.gauss(0, 0.0005))


def test_prefill_speed_fits_each_replicas_fixed_time_and_time_per_token() -> None:
    """Seconds = a fixed part (the hops, its cores' work for every request) + a time per token,
    per replica: a replica slower per token is priced by a factor, one with more fixed time by
    that time in the fastest's tokens, and a replica sent short remainders is not priced
    slower per token for its fixed part (a ratio of sums would price it 0.2 + 4/100 ms a
    token against 0.2 + 4/500 for one sent whole prompts)."""
    rng = random.Random(0)
    speed = PrefillSpeed(min_samples=16)
    lines = {"a": (0.004, 0.0002), "b": (0.004, 0.0003), "c": (0.014, 0.0002)}
    _timed(speed, lines, 15, rng)
    assert speed.lines == {} and speed.prices(["a", "b"]) is None  # not yet enough answers
    _timed(speed, lines, 1, rng)
    assert {e: (line.fixed, line.per_token) for e, line in speed.lines.items()} == {
        e: (pytest.approx(f, abs=0.0015), pytest.approx(r, rel=0.1)) for e, (f, r) in lines.items()}
    prices = speed.prices(["a", "b", "c"])
    assert prices is not None and prices["a"] == Price()
    assert prices["b"].slowdown == pytest.approx(1.5, rel=0.1) and prices["b"].delay_tokens == 0.0
    assert prices["c"].slowdown == 1.0 and prices["c"].delay_tokens == pytest.approx(50, rel=0.3)  # 10 ms at 0.2 ms
    assert speed.prices(["b"]) is None and speed.prices(["a", "d"]) is None  # one line says nothing
    # d has answered none yet: priced as the fastest, so that it is tried and timed.
    assert speed.prices(["b", "d", "a"]) == {"a": Price(), "b": prices["b"], "d": Price()}
    # Short remainders on `a`, whole prompts on `b`, one line: priced alike.
    short = PrefillSpeed(min_samples=16)
    _timed(short, {"a": (0.004, 0.0002)}, 40, rng, tokens=(16, 150))
    _timed(short, {"b": (0.004, 0.0002)}, 40, rng, tokens=(300, 900))
    assert short.prices(["a", "b"]) == {"a": Price(), "b": Price()}
    # Rates 3% apart and fixed times 2% of a mean prefill apart are one line (the fit's
    # noise): exact ties, which rotate.
    near = PrefillSpeed(min_samples=16)
    _timed(near, {"a": (0.004, 0.0002), "b": (0.0055, 0.000206)}, 60, rng)
    assert near.prices(["a", "b"]) == {"a": Price(), "b": Price()}
    # Prompts all of one size do not tell a fixed time from a rate: the line goes through 0.
    alike = PrefillSpeed(min_samples=4)
    _timed(alike, {"a": (0.004, 0.0002)}, 8, rng, tokens=(400, 420))
    assert alike.lines["a"].fixed == 0.0 and alike.lines["a"].per_token == pytest.approx(0.0002 + 0.004 / 410, rel=0.05)


def test_prefill_speed_follows_a_replica_that_speeds_up_and_forgets_removed_ones() -> None:
    rng = random.Random(1)
    speed = PrefillSpeed(min_samples=8)
    _timed(speed, {"a": (0.004, 0.0002), "b": (0.004, 0.0004)}, 64, rng)
    assert speed.prices(["a", "b"])["b"].slowdown == pytest.approx(2.0, rel=0.05)  # type: ignore[index]
    _timed(speed, {"a": (0.004, 0.0002), "b": (0.004, 0.0002)}, 256, rng)  # b's decode neighbour went idle
    assert speed.prices(["a", "b"])["b"].slowdown < 1.1  # type: ignore[index]
    # A stalled host: 10x per token and a second a prefill, priced at most 4x a's rate and 3x
    # a's time for a prompt of the mean size (308 tokens) on top.
    _timed(speed, {"a": (0.004, 0.0002), "b": (1.0, 0.002)}, 256, rng)
    b = speed.prices(["a", "b"])["b"]  # type: ignore[index]
    assert b.slowdown == MAX_SLOWDOWN and b.delay_tokens == pytest.approx(3 * (0.004 / 0.0002 + 308), rel=0.1)
    speed.keep(["a"])
    assert set(speed.lines) == {"a"} and speed.prices(["a", "b"]) is None
    off = PrefillSpeed(min_samples=0)
    _timed(off, {"a": (0.004, 0.0002)}, 64, rng)
    assert off.lines == {}


class PacedEngine(CachingEngine):
    """A CachingEngine that takes `fixed_ms` and `ms_per_token` for each prompt token."""

    def __init__(self, name: str, ms_per_token: float, fixed_ms: float = 0.0) -> None:
        super().__init__(name)
        self.ms_per_token = ms_per_token
        self.fixed_ms = fixed_ms

    async def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        await asyncio.sleep((self.fixed_ms + len(req.prompt_token_ids) * self.ms_per_token) / 1000)
        async for out in super().generate(req):
            yield out


@pytest.mark.parametrize(("slow_ms_per_token", "slow_fixed_ms"), [(0.3, 0.0), (0.1, 20.0)])
def test_kv_aware_learns_which_prefill_replica_is_slower_and_prices_it_so(slow_ms_per_token: float,
                                                                           slow_fixed_ms: float) -> None:
    """Two prefill replicas on GPUs (no cores shared: no fixed factor tells them apart), one
    computing a token 3x slower, or taking 20 ms more for every prefill (what other work on its
    cores does to each request on a small host). Until each has answered
    `prefill_speed_samples` prefills kv_aware scores them alike and fresh prompts alternate;
    then the slow one costs its learned difference and fresh prompts go to the fast one, unless
    its queue is longer than the difference. The learned lines are on /metrics."""
    fast, decode = PacedEngine("fast", 0.1), CachingEngine("d")
    slow = PacedEngine("slow", slow_ms_per_token, slow_fixed_ms)
    router = Router([fast.ref("prefill"), slow.ref("prefill"), decode.ref("decode")],
                    RoutingConfig(policy="kv_aware", prefill_speed_samples=6))
    rng = random.Random(2)
    fresh = [list(range(10_000 * k, 10_000 * k + rng.randint(2, 12) * BLOCK)) for k in range(1, 19)]
    traces: list[RequestTrace] = []

    async def go() -> None:
        assert router.cache is not None
        router.cache.sync()
        await asyncio.sleep(0.05)
        for prompt in fresh:
            await serve_traced(router, traces, prompt)
        # A queue on the fast replica longer than what the slow one's rate costs: the slow one.
        fast_ref = router.pools["prefill"].engines[0]
        router.pools["prefill"].acquire(fast_ref, 20.0 * len(fresh[0]))
        await serve_traced(router, traces, list(range(900_000, 900_000 + len(fresh[0]))))
        router.pools["prefill"].release(fast_ref, 20.0 * len(fresh[0]))
        await router.close()

    asyncio.run(asyncio.wait_for(go(), timeout=30))
    on = ["fast" if any(r.prompt_token_ids == p for r in fast.requests) else "slow" for p in fresh]
    assert on[:12].count("fast") == 6, on  # learning: alike, so they alternate
    assert on[12:] == ["fast"] * 6, on
    assert traces[12].scores["fast"] > traces[12].scores["slow"], traces[12].scores
    rates, fixed = router.stats.prefill_seconds_per_token, router.stats.prefill_fixed_seconds
    assert set(rates) == set(fixed) == {"fast", "slow"}, (rates, fixed)
    if slow_fixed_ms:
        assert fixed["slow"] - fixed["fast"] > 0.01, fixed
    else:
        assert rates["slow"] / rates["fast"] > 2, rates
    assert slow.requests[-1].prompt_token_ids[0] == 900_000  # the queue on fast outweighs its speed
    page = TandemMetrics("app").render([], {}, router=router.stats).decode()
    assert f'tandem_prefill_seconds_per_token{{app="app",engine="slow"}} {rates["slow"]}' in page
    assert f'tandem_prefill_fixed_seconds{{app="app",engine="slow"}} {fixed["slow"]}' in page
    assert "tandem_continuation_rate{" not in page  # kv_aware without conditional never prices it
