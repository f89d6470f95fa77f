"""Cache-aware routing with real engines: 2 prefill + 1 decode vLLM engines, NIXL, the CPU
tier, two ingress replicas sharing one port, the official openai client.

- a repeated prefix is prefilled where it is cached, whichever ingress replica routes it
  (each follows the engines' own KV events);
- blocks an engine evicts leave the routers' view of it;
- under `conditional`, a prompt with little left to compute is prefilled on the decode
  engine and a long one remotely, each decision counted on /metrics; without the tier, a
  chat is not homed on a decode engine whose cache other live histories crowd;
- what the decode engine prefills itself reaches the CPU tier, for the prefill engines, and
  so do the answers it generates, for a chat's next turn;
- usage.prompt_tokens_details.cached_tokens is right on both paths.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm.sampling_params import SamplingParams

from actors.protocol import EngineRequest
from orchestrator.config import parse_config
from orchestrator.job import Running, running
from orchestrator.router import RequestTrace, Router
from tests.conftest import free_port

pytestmark = pytest.mark.engines

MODEL = "tandem-tiny"
LOCAL_MAX = 48
CONFIG = {
    # A small KV cache in small blocks (the CPU backend's default is 128 tokens), so a
    # handful of long prompts evicts older ones.
    "engine_args": {"max_model_len": 512, "block_size": 32, "num_gpu_blocks_override": 40},
    "prefill": {"replicas": 2},
    "decode": {"replicas": 1},
    "routing": {"policy": "kv_aware", "disaggregation": "conditional", "local_prefill_max_tokens": LOCAL_MAX},
    "serve": {"ingress_replicas": 2},
    "cpu_tier": {"save_outputs": True},  # for the answer's reuse; the rest runs alike without it
}


@pytest.fixture(scope="module")
def pd(ray_local: None, tiny_model: object) -> Iterator[Running]:
    cfg = parse_config({
        **CONFIG,
        "serve": {**CONFIG["serve"], "port": free_port()},  # type: ignore[dict-item]
        "kv_transfer": {"side_channel_base_port": free_port(8)},
    })
    with running(cfg, own_ray=False) as up:
        yield up


def prompt(seed: int, n: int) -> list[int]:
    """n token ids no other seed's prompt shares a first block with."""
    return [100 + (seed * 7919 + i * 31) % 397 for i in range(n)]  # the tiny vocabulary has 502 ids


def metrics(up: Running) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(up.url.removesuffix("/v1") + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "app")))] = s.value
    return out


def prefill_tokens(up: Running) -> dict[str, dict[str, float]]:
    """Prompt tokens per prefill engine by source (computed / local cache hit / ...)."""
    out: dict[str, dict[str, float]] = {}
    for (name, labels), v in metrics(up).items():
        lab = dict(labels)
        if name == "tandem_prompt_tokens_total" and lab.get("pool") == "prefill":
            out.setdefault(lab["engine"], {})[lab["source"]] = v
    return out


def finished_on(up: Running, pool: str) -> dict[str, float]:
    return {dict(l)["engine"]: v for (n, l), v in metrics(up).items()
            if n == "tandem_engine_requests_finished_total" and dict(l).get("pool") == pool}


def complete(up: Running, ids: list[int]) -> openai.types.Completion:
    return complete_routed(up, ids)[0]


def complete_routed(up: Running, ids: list[int]) -> tuple[openai.types.Completion, dict[str, str]]:
    """The completion and its route headers (x-tandem-*)."""
    client = openai.OpenAI(base_url=up.url, api_key="-", max_retries=0, timeout=120)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0.0)
    out = raw.parse()
    assert out.choices[0].finish_reason == "length"
    return out, {k: v for k, v in raw.headers.items() if k.startswith("x-tandem-")}


def test_two_ingress_replicas_serve(pd: Running) -> None:
    from ray import serve

    status = serve.status().applications["tandem"].deployments["openai"]
    assert status.replica_states.get("RUNNING") == 2


def test_chats_spread_over_the_prefill_engines_instead_of_piling_on_the_system_prompts_holder(pd: Running) -> None:
    """Eight chats after one system prompt, one request at a time (no queue anywhere). Their
    first turns all go where the system prompt is cached; at their second turn, once their
    histories show as live there, kv_aware moves some to the other prefill engine rather than
    letting one cache hold every history (before, every turn went to the holder until its
    cache evicted the histories). First of the module's requests: a router that starts
    following the engines hears what the requests of the last WORKING_SET_S used there, and
    an earlier test's prefix, reused within it, would take the room this test measures."""
    import msgspec
    import ray

    from actors.kv_index import index_actor_name
    from orchestrator.cache_view import CacheView
    from orchestrator.cluster import NAMESPACE

    cfg = pd.deployment.cfg
    tier = ray.get_actor(index_actor_name(cfg.serve.app_name), namespace=NAMESPACE)  # as an ingress follows it
    router = Router(pd.deployment.routing_engines(), msgspec.structs.replace(cfg.routing, disaggregation="always"),
                    cache_view=CacheView(tier))
    system = prompt(300, 96)
    first = [system + prompt(310 + c, 64) for c in range(8)]

    async def go() -> list[dict[str, float]]:
        assert router.cache is not None
        router.cache.sync()
        served = []
        for turn in (first, [t + prompt(330 + c, 64) for c, t in enumerate(first)]):
            counts: dict[str, float] = {}
            for c, ids in enumerate(turn):
                before = finished_on(pd, "prefill")
                req = EngineRequest(f"chat-{c}-{time.monotonic_ns()}", ids, SamplingParams(max_tokens=1, temperature=0.0))
                async for _ in router.generate(req, RequestTrace()):
                    pass
                await asyncio.sleep(1.0)  # the engines' events and the tier's feed reach the view
                after = finished_on(pd, "prefill")
                for e, n in after.items():
                    counts[e] = counts.get(e, 0) + n - before.get(e, 0)
            served.append(counts)
        await router.close()
        return served

    turn1, turn2 = asyncio.run(asyncio.wait_for(go(), timeout=300))
    assert sum(turn1.values()) == 8 and sum(turn2.values()) == 8, (turn1, turn2)
    assert max(turn1.values()) == 8, turn1  # one-off so far: all with the system prompt's holder
    assert sorted(turn2.values())[0] >= 2, turn2  # live histories: some moved to the other engine


def test_a_repeated_prefix_is_prefilled_where_it_is_cached(pd: Running) -> None:
    shared = prompt(1, 320)
    first = complete(pd, shared + [7] * 40)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    time.sleep(3.0)  # the engines' events reach both ingress replicas (ms when idle, longer on a loaded host)
    before = prefill_tokens(pd)
    named = []
    for i in range(8):  # the kernel spreads these over both ingress replicas
        out, route = complete_routed(pd, shared + prompt(100 + i, 100))  # 100 new tokens: worth a remote prefill
        assert out.usage.prompt_tokens_details.cached_tokens >= 256, (i, out.usage, prefill_tokens(pd))
        named.append(route.get("x-tandem-prefill-engine"))
        # With the CPU tier, the other engine would load the prefix at a tenth of its cost, so
        # any queue on the holder sends the repeat there, and each router counts the other's
        # requests as of the engine's last report: let the reports of this one land first.
        time.sleep(0.5)
    after = prefill_tokens(pd)
    computed = {e: after[e].get("local_compute", 0) - before.get(e, {}).get("local_compute", 0) for e in after}
    hits = {e: after[e].get("local_cache_hit", 0) - before.get(e, {}).get("local_cache_hit", 0) for e in after}
    holder = max(hits, key=hits.get)
    # Every repeat hit the prefix on one engine; the other computed none of them.
    assert hits[holder] >= 8 * 256, (hits, computed)
    assert all(computed[e] == 0 and hits[e] == 0 for e in after if e != holder), (computed, hits)
    assert named == [holder] * 8, (named, hits)  # and each response named it


def test_evicted_blocks_leave_the_view(pd: Running) -> None:
    engines = pd.deployment.routing_engines()
    router = Router(engines, pd.deployment.cfg.routing)
    prefills = [e for e in engines if e.role == "prefill"]
    decode = next(e for e in engines if e.role == "decode")
    target = prompt(2, 320)

    async def go() -> tuple[int, int]:
        assert router.cache is not None
        router.cache.sync()

        async def send(ids: list[int]) -> None:
            req = EngineRequest(f"evict-{ids[0]}-{time.monotonic_ns()}", ids, SamplingParams(max_tokens=1, temperature=0.0))
            gen = router.generate(req, RequestTrace(), prefill_engine=prefills[0], decode_engine=decode)
            async for _ in gen:
                pass

        async def cached_on_prefill() -> int:
            await asyncio.sleep(1.0)
            return router.cache.cached_tokens(prefills[0], router.cache.prompt(target))

        await send(target)
        held = await cached_on_prefill()
        for seed in range(10, 16):  # 6 x 10 blocks through a 40-block cache
            await send(prompt(seed, 320))
        gone = await cached_on_prefill()
        await router.close()
        return held, gone

    held, gone = asyncio.run(asyncio.wait_for(go(), timeout=300))
    assert held >= 256, "the view never saw the prompt's blocks stored"
    assert gone == 0, "the view still counts blocks the engine evicted"


def test_an_engines_warm_up_leaves_no_blocks_no_counts_and_nothing_in_the_tier(pd: Running) -> None:
    """The warm-up prompt every engine computes before it serves (EngineActor.warm_up), run
    again on a prefill engine holding a prompt: the routers see its cache cleared, its
    counters stay as they were, and the tier gets none of the warm-up's blocks, only the next
    prompt's."""
    import ray

    engines = pd.deployment.routing_engines()
    router = Router(engines, pd.deployment.cfg.routing)
    engine = next(e for e in engines if e.role == "prefill")
    decode = next(e for e in engines if e.role == "decode")
    held_prompt, after_prompt = prompt(30, 320), prompt(31, 64)

    def tier_blocks() -> int:
        return sum(held for held, _ in ray.get(pd.deployment.kv_index.get_stats.remote(), timeout=60).stores.values())

    async def tier_settled(at_least: int) -> int:
        """The tier's block count once it is at least `at_least` and unchanged for a second
        (an engine saves a request's blocks at its next step, and commits them after)."""
        deadline = time.monotonic() + 60
        last, since = tier_blocks(), time.monotonic()
        while last < at_least or time.monotonic() - since < 1.0:
            assert time.monotonic() < deadline, f"the tier never settled at {at_least}+ blocks (has {last})"
            await asyncio.sleep(0.2)
            if (now := tier_blocks()) != last:
                last, since = now, time.monotonic()
        return last

    async def go() -> tuple[int, int, float, int]:
        assert router.cache is not None
        router.cache.sync()

        async def send(ids: list[int]) -> None:
            req = EngineRequest(f"warm-{ids[0]}-{time.monotonic_ns()}", ids, SamplingParams(max_tokens=1, temperature=0.0))
            async for _ in router.generate(req, RequestTrace(), prefill_engine=engine, decode_engine=decode):
                pass

        async def cached() -> int:
            await asyncio.sleep(1.0)
            return router.cache.cached_tokens(engine, router.cache.prompt(held_prompt))

        tier = tier_blocks()
        await send(held_prompt)
        held = await cached()
        tier = await tier_settled(tier + len(held_prompt) // 32)
        took = await engine.handle.warm_up.remote()
        gone = await cached()
        await send(after_prompt)
        saved = await tier_settled(tier + len(after_prompt) // 32) - tier
        await router.close()
        return held, gone, took, saved

    stats = ray.get(engine.handle.get_stats.remote(), timeout=60)
    held, gone, took, saved = asyncio.run(asyncio.wait_for(go(), timeout=300))
    after = ray.get(engine.handle.get_stats.remote(), timeout=60)
    assert took > 0
    assert held >= 256, "the view never saw the held prompt's blocks"
    assert gone == 0, "the routers still count blocks the warm-up's cache reset dropped"
    # The held and the following prompt are counted; the warm-up's 510 tokens and 2 generated are not.
    computed = after.prompt_tokens_by_source["local_compute"] - stats.prompt_tokens_by_source.get("local_compute", 0)
    assert computed == len(held_prompt) + len(after_prompt), after.prompt_tokens_by_source
    assert after.num_generation_tokens - stats.num_generation_tokens == 2
    assert saved == len(after_prompt) // 32, "the tier got blocks other than the following prompt's"


def test_without_the_tier_a_chat_is_not_homed_where_another_crowds_the_cache(pd: Running) -> None:
    """conditional, with the decode engine keeping no tier copy (as without the tier): chat
    B's two turns, then chat C's two. Whether B's turns and C's first stay on the decode engine
    depends on how its cache's room compares with the prefill engine's, which the other
    tests' prompts of the last WORKING_SET_S (heard from the engines) set too: alone, the
    caches tie and a tie counts as the decode engine evicting first (every request's KV passes
    through it), so all four go remote; after other tests that left the prefill engine the
    more crowded, B's turns stay local (`short_uncached`) and C's first goes remote beside
    B's live history. C's second turn would leave C's history where B's is live either way: it
    goes remote ("stranded_history"). A first turn, which extends no earlier prompt, is priced
    as a chat's until the router has seen prompts after its first block continued or waited
    for them in vain (B's going on says nothing of C's, whose first block differs). With the
    tier behind the decode engine (the deployment as it runs) the same turns all stay local.
    Routers as ingress replicas send the turns: the first by one, the middle two by another,
    and C's second turn by a third that starts only then (a replica scaled out or restarted).
    It sent none of the turns before it: it hears of them from the engines
    (EngineRequest.blocks), which answer its first call with the blocks the requests of the
    last WORKING_SET_S used, and the second router hears of B's first turn as it follows them."""
    import msgspec

    from orchestrator.cache_view import CacheView

    cfg = pd.deployment.cfg
    routing = msgspec.structs.replace(cfg.routing, local_prefill_max_tokens=4096)

    # Each router's openers after B's first block, after the turns: (continued, given up on).
    odds: list[tuple[int, int]] = []

    def turns(seed: int, no_tier: bool) -> tuple[list[str], dict[str, int]]:
        engines = [msgspec.structs.replace(e, saves_tier=False) if e.role == "decode" and no_tier else e
                   for e in pd.deployment.routing_engines()]
        # The tier's index unseen either way.
        routers = [Router(engines, routing, cache_view=CacheView()) for _ in range(2)]
        b1, c1 = prompt(seed, 104), prompt(seed + 1, 104)
        sequence = [b1, b1 + prompt(seed + 2, 40), c1, c1 + prompt(seed + 3, 40)]

        async def follow(new: list[Router]) -> None:
            for router in new:
                assert router.cache is not None
                router.cache.sync()
            await asyncio.sleep(1.0)  # their first answers

        async def go() -> list[str]:
            await follow(routers)
            decisions = []
            for i, (ids, sender) in enumerate(zip(sequence, (0, 1, 1, 2))):
                if sender == len(routers):
                    routers.append(Router(engines, routing, cache_view=CacheView()))
                    await follow(routers[-1:])
                trace = RequestTrace()
                req = EngineRequest(f"home-{seed}-{i}-{time.monotonic_ns()}", ids, SamplingParams(max_tokens=2, temperature=0.0))
                async for _ in routers[sender].generate(req, trace):
                    pass
                decisions.append(str(trace.disaggregation))
                await asyncio.sleep(1.0)  # the engines' events reach the views
            for router in routers:
                await router.close()
            return decisions

        decisions = asyncio.run(asyncio.wait_for(go(), timeout=120))
        decode = next(e for e in engines if e.role == "decode")
        odds[:] = [r.cache.continuations(decode, r.cache.prompt(b1)) for r in routers if r.cache is not None]
        return decisions, dict(sum((collections.Counter(r.stats.decisions) for r in routers), collections.Counter()))

    decisions, counted = turns(600, no_tier=True)
    assert decisions[3] == "remote" and set(counted) <= {"local:short_uncached", "remote:stranded_history"}, (
        decisions, counted)
    # The third router, which sent only C's second turn, heard B's turns from the engines:
    # B's first went on (one opener after its first block, continued; a router that heard
    # nothing would count none). Other tests' prompts of the last WORKING_SET_S, heard too,
    # begin with other blocks.
    assert odds == [(1, 0)] * 3, odds
    assert counted["remote:stranded_history"] == decisions.count("remote"), counted
    decisions, counted = turns(620, no_tier=False)
    assert decisions == ["local"] * 4, (decisions, counted)


def test_conditional_prefills_short_prompts_on_the_decode_engine(pd: Running) -> None:
    before = sum(finished_on(pd, "prefill").values())
    # Short enough to stay local even while the decode engine's report of the previous request
    # is a moment stale (the budget is uncached tokens x requests held up there).
    short = LOCAL_MAX // 2 - 4
    decode = [e.engine_id for e in pd.deployment.routing_engines() if e.role == "decode"]
    prefill = {e.engine_id for e in pd.deployment.routing_engines() if e.role == "prefill"}
    for i in range(4):
        out, route = complete_routed(pd, prompt(40 + i, short))
        assert out.usage.prompt_tokens == short
        # The response says so: the decode engine computed it, no prefill engine did.
        assert route == {"x-tandem-engine": decode[0], "x-tandem-disaggregation": "decision=local;reason=short_uncached"}
    assert sum(finished_on(pd, "prefill").values()) == before, "a short prompt went to the prefill pool"
    # Long and uncached: remote. The decision counters are per ingress replica, so both
    # replicas' counts are read by scraping until each has been seen.
    _, route = complete_routed(pd, prompt(60, 400))
    assert sum(finished_on(pd, "prefill").values()) == before + 1
    assert route["x-tandem-prefill-engine"] in prefill and route["x-tandem-engine"] == decode[0], route
    assert route["x-tandem-disaggregation"] == "decision=remote;reason=long_uncached"
    seen: dict[str, float] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (seen.get("local:short_uncached") and seen.get("remote:long_uncached")):
        for (name, labels), v in metrics(pd).items():
            if name == "tandem_disaggregation_decisions_total":
                key = f"{dict(labels)['decision']}:{dict(labels)['reason']}"
                seen[key] = max(seen.get(key, 0), v)
    assert seen.get("local:short_uncached", 0) >= 1 and seen.get("remote:long_uncached", 0) >= 1, seen


def test_a_prompt_prefilled_on_the_decode_engine_is_saved_to_the_tier(pd: Running) -> None:
    """Under conditional the decode engine saves what it computes (cpu_tier's default pools):
    a later remote prefill of a longer prompt loads that part from the tier, not computing it."""
    def loaded_from_tier() -> float:
        return sum(v.get("external_kv_transfer", 0) for v in prefill_tokens(pd).values())

    # A head of one full block, short: prefilled on the decode engine, unless a load report
    # of earlier requests is still stale at the other ingress replica (40 tokens x 2 held up
    # is over the budget): then another head is tried.
    for seed in range(80, 85):
        time.sleep(1.0)
        head = prompt(seed, 40)
        before_remote = sum(finished_on(pd, "prefill").values())
        complete(pd, head)
        if sum(finished_on(pd, "prefill").values()) == before_remote:
            break
    else:
        pytest.fail("every short head went to the prefill pool")
    before = loaded_from_tier()
    # Routers learn of the head's blocks in the tier from the index's feed, milliseconds after
    # the save; a request routed sooner would be told the tier holds none of it (a missed hit).
    time.sleep(0.5)
    complete(pd, head + prompt(90, 400))  # long and uncached: prefilled remotely
    deadline = time.monotonic() + 30
    while loaded_from_tier() - before < 32 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert loaded_from_tier() - before >= 32, prefill_tokens(pd)


def test_a_chats_answer_computed_on_the_decode_engine_is_loaded_for_its_next_turn(pd: Running) -> None:
    """The decode engine saves the blocks its generated tokens fill (cpu_tier.save_outputs on):
    the next turn, resending the answer as its prompt (token ids, as an agent with vLLM's
    return_token_ids does), is prefilled remotely computing only what follows the answer's
    last full block, not the answer again."""
    client = openai.OpenAI(base_url=pd.url, api_key="-", max_retries=0, timeout=120)
    first = prompt(110, 200)  # long and uncached: remote; the prefill engine saves its 6 full blocks
    out = client.completions.create(model=MODEL, prompt=first, max_tokens=80, temperature=0.0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    answer = out.choices[0].model_extra["token_ids"]
    assert len(answer) == 80, out
    # The decode engine computed the KV of tokens 0..278: blocks 6 and 7 (tokens 192..255)
    # hold the prompt's tail and the answer, and only it computed them.
    held = (len(first) + len(answer) - 1) // 32 * 32
    assert held == 256
    time.sleep(1.0)  # the index's commit of the decode engine's last writes
    second = first + answer + prompt(111, 150)
    before = sum(v.get("local_compute", 0) for v in prefill_tokens(pd).values())
    remote_before = sum(finished_on(pd, "prefill").values())
    complete(pd, second)
    assert sum(finished_on(pd, "prefill").values()) == remote_before + 1, "the second turn was not prefilled remotely"
    deadline = time.monotonic() + 30
    while (computed := sum(v.get("local_compute", 0) for v in prefill_tokens(pd).values()) - before) == 0:
        assert time.monotonic() < deadline, prefill_tokens(pd)
        time.sleep(0.5)
    # Without the answer's blocks in the tier: 430 - 192 = 238 computed.
    assert 0 < computed <= len(second) - held, (computed, prefill_tokens(pd))


def test_cached_tokens_on_the_local_path(pd: Running) -> None:
    shared = prompt(70, 300)
    complete(pd, shared)  # remote: the decode engine pulls the blocks and caches them
    time.sleep(1.0)
    out = complete(pd, shared + [5] * 20)  # 20 new tokens: local, on the decode engine's cache
    assert out.usage.prompt_tokens == 320
    assert out.usage.prompt_tokens_details.cached_tokens >= 256, out.usage


def test_the_bench_load_generator_records_each_requests_route(pd: Running) -> None:
    """`tandem bench`'s load generator reads the route headers, and its report splits the
    requests by route: short prompts local on the decode engine, long ones through a prefill
    engine."""
    from benchmarks.loadgen import run_load
    from benchmarks.report import route_table
    from benchmarks.scenarios import parse_scenario
    from benchmarks.protocol import ScenarioReport
    from benchmarks.workloads import BenchRequest

    short = [BenchRequest(f"short {i}", 2) for i in range(3)]  # 6 tokens: local
    long = [BenchRequest(f"route check {i} " + " ".join(f"w{i}{k}" for k in range(80)), 2) for i in range(2)]  # ~300
    run = asyncio.run(run_load(pd.url.removesuffix("/v1"), MODEL, [*short, *long], concurrency=1, progress=False))
    assert run.summary.num_completed == 5, run.summary.errors
    decode = next(e.engine_id for e in pd.deployment.routing_engines() if e.role == "decode")
    prefill = {e.engine_id for e in pd.deployment.routing_engines() if e.role == "prefill"}
    by_index = {q.index: q for q in run.requests}
    for i in range(3):
        q = by_index[i]
        assert (q.engine, q.prefill_engine, q.disaggregation) == (decode, None, "decision=local;reason=short_uncached"), q
    for i in (3, 4):
        q = by_index[i]
        assert q.engine == decode and q.prefill_engine in prefill, q
        assert q.disaggregation == "decision=remote;reason=long_uncached", q
    table = route_table([ScenarioReport(parse_scenario("2p1d@kv_aware+conditional"), 60.0, [run])])
    assert f"| 2p1d@kv_aware+conditional | {decode} (local) | 3 |" in table, table
    assert sum(f"| 2p1d@kv_aware+conditional | {p} → {decode} |" in table for p in prefill) >= 1, table


def test_a_router_times_real_prefills_to_learn_each_replicas_rate(pd: Running) -> None:
    """With routing.prefill_speed_samples set, the router times a real prefill (its KV handed
    over NIXL, its first token streamed) against the tokens it expected ahead of it, and the
    engine that answered gets a rate. (Which engine kv_aware picks depends on what the
    module's earlier requests left in the caches; the tests on fakes cover the choice.)"""
    import msgspec

    routing = msgspec.structs.replace(pd.deployment.cfg.routing, disaggregation="always", prefill_speed_samples=1)
    router = Router(pd.deployment.routing_engines(), routing)
    prefill = {e.engine_id for e in pd.deployment.routing_engines() if e.role == "prefill"}
    ids, trace = prompt(500, 200), RequestTrace()

    async def go() -> int:
        assert router.cache is not None
        router.cache.sync()
        await asyncio.sleep(1.0)
        req = EngineRequest(f"timed-{time.monotonic_ns()}", ids, SamplingParams(max_tokens=3, temperature=0.0))
        tokens = sum([len(out.outputs[0].token_ids) async for out in router.generate(req, trace)])
        await router.close()
        return tokens

    assert asyncio.run(asyncio.wait_for(go(), timeout=120)) == 3
    assert trace.prefill_engine in prefill and set(trace.scores) == prefill, trace
    # Nothing queued and nothing cached: the tokens ahead were the prompt's own.
    assert trace.prefill_tokens_ahead == 200.0, trace
    rates = router.stats.prefill_seconds_per_token
    assert set(rates) == {trace.prefill_engine} and 0 < rates[trace.prefill_engine] < 0.1, rates
