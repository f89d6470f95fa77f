"""Specification of the CPU tier's index (pure logic), of how deploy wires the tier, and of the
connector's scheduler side against a real index actor."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from actors.kv_index import KVIndex, StoreEndpoint
from actors.kv_store import TierSettings
from orchestrator.config import ConfigError, parse_config
from orchestrator.specs import kv_transfer_for

SLOT = 1024


def endpoint(store_id: str = "s0", slots: int = 4, incarnation: str = "i0") -> StoreEndpoint:
    return StoreEndpoint(store_id, f"node-{store_id}", incarnation, b"", 0, slots * SLOT)


def index_with(*stores: StoreEndpoint) -> KVIndex:
    index = KVIndex()
    for ep in stores:
        index.register_store(ep)
    index.set_slot_bytes(SLOT)
    return index


def save(index: KVIndex, store_id: str, hashes: list[bytes]) -> list[int]:
    grant = index.allocate(store_id, hashes, "e")
    assert grant is not None
    index.commit(grant, ok=True)
    return grant.slots


H = [bytes([i]) * 8 for i in range(16)]


def test_capacity_is_pool_bytes_over_slot_bytes() -> None:
    index = index_with(endpoint(slots=4))
    assert index.capacity("s0") == 4


def test_lookup_returns_the_longest_held_run_from_the_first_hash() -> None:
    index = index_with(endpoint())
    save(index, "s0", [H[0], H[1], H[3]])
    reply = index.lookup("e/r1", [H[0], H[1], H[2], H[3]])
    assert [loc.store_id for loc in reply.locations] == ["s0", "s0"]


def test_uncommitted_blocks_are_not_visible_to_lookups() -> None:
    index = index_with(endpoint())
    grant = index.allocate("s0", [H[0]], "e")
    assert grant is not None and index.lookup("e/r1", [H[0]]).locations == []
    index.commit(grant, ok=True)
    assert len(index.lookup("e/r1", [H[0]]).locations) == 1


def test_failed_save_frees_its_slots() -> None:
    index = index_with(endpoint(slots=1))
    grant = index.allocate("s0", [H[0]], "e")
    assert grant is not None
    index.commit(grant, ok=False)
    assert not index.contains(H[0])
    assert save(index, "s0", [H[1]]) == grant.slots


def test_held_hashes_are_not_saved_twice() -> None:
    index = index_with(endpoint())
    save(index, "s0", [H[0]])
    grant = index.allocate("s0", [H[0], H[1]], "e")
    assert grant is not None and grant.hashes == [H[1]]


def test_full_store_evicts_least_recently_used() -> None:
    index = index_with(endpoint(slots=2))
    save(index, "s0", [H[0]])
    save(index, "s0", [H[1]])
    index.lookup("e/r1", [H[0]])  # H[0] is now the most recently used
    index.unpin("e/r1")
    save(index, "s0", [H[2]])
    assert index.contains(H[0]) and index.contains(H[2]) and not index.contains(H[1])
    assert index.get_stats().num_evicted_blocks == 1


def test_never_holds_more_blocks_than_capacity() -> None:
    index = index_with(endpoint(slots=3))
    for h in H:
        save(index, "s0", [h])
    assert index.get_stats().stores["s0"] == (3, 3)
    assert all(index.contains(h) for h in H[-3:])


def test_pinned_blocks_are_not_evicted() -> None:
    index = index_with(endpoint(slots=2))
    save(index, "s0", [H[0], H[1]])
    index.lookup("e/r1", [H[0], H[1]])  # pins both while a load reads them
    grant = index.allocate("s0", [H[2]], "e")
    assert grant is not None and grant.hashes == []
    index.unpin("e/r1")
    grant = index.allocate("s0", [H[2]], "e")
    assert grant is not None and grant.hashes == [H[2]]


def test_a_new_lookup_of_the_same_key_replaces_its_pins() -> None:
    index = index_with(endpoint(slots=2))
    save(index, "s0", [H[0], H[1]])
    index.lookup("e/r1", [H[0], H[1]])
    index.lookup("e/r1", [H[0], H[1]])
    index.unpin("e/r1")
    assert index.get_stats().num_pinned == 0


def test_eviction_stays_within_the_store_that_needs_room() -> None:
    index = index_with(endpoint("a", slots=1), endpoint("b", slots=1))
    save(index, "a", [H[0]])
    save(index, "b", [H[1]])
    save(index, "b", [H[2]])
    assert index.contains(H[0]) and not index.contains(H[1]) and index.contains(H[2])


def test_restarted_store_makes_the_index_forget_its_blocks() -> None:
    index = index_with(endpoint("a"), endpoint("b"))
    save(index, "a", [H[0]])
    save(index, "b", [H[1]])
    index.register_store(endpoint("a", incarnation="i1"))
    assert not index.contains(H[0]) and index.contains(H[1])
    assert index.get_stats().num_forgotten_blocks == 1


def test_commit_of_a_dead_incarnation_is_ignored() -> None:
    index = index_with(endpoint("a"))
    grant = index.allocate("a", [H[0]], "e")
    assert grant is not None
    index.register_store(endpoint("a", incarnation="i1"))
    index.commit(grant, ok=True)
    assert not index.contains(H[0])


def test_a_grant_carries_the_store_endpoint_unless_the_caller_knows_its_incarnation() -> None:
    index = index_with(endpoint(incarnation="i0"))
    assert index.allocate("s0", [H[0]], "e").endpoint == endpoint(incarnation="i0")  # type: ignore[union-attr]
    assert index.allocate("s0", [H[1]], "e", known_incarnation="i0").endpoint is None  # type: ignore[union-attr]
    restarted = index.allocate("s0", [H[2]], "e", known_incarnation="old")
    assert restarted is not None and restarted.endpoint == endpoint(incarnation="i0")


def test_slot_size_mismatch_is_refused() -> None:
    index = index_with(endpoint())
    with pytest.raises(ValueError, match="same model"):
        index.set_slot_bytes(SLOT * 2)


def test_unsized_store_grants_nothing() -> None:
    index = KVIndex()
    index.register_store(endpoint())
    assert index.allocate("s0", [H[0]], "e") is None


# ---- config and deploy wiring ----

TIER = TierSettings(index_address="tcp://10.0.0.1:5700", store_id="n1")


def test_the_change_log_tells_followers_what_was_committed_and_what_left() -> None:
    index = index_with(endpoint("s0", slots=2))
    first = index.changes("", 0)  # a new follower gets everything, at the current version
    assert first.full and first.held == {} and first.version == index.version
    save(index, "s0", [H[0], H[1]])
    grant = index.allocate("s0", [H[2]], "e")  # full: evicts H[0]; uncommitted H[2] is not announced
    assert grant is not None
    delta = index.changes(first.incarnation, first.version)
    assert not delta.full and delta.since == first.version and delta.version == index.version
    assert delta.held == {H[1]: "node-s0"} and delta.gone == [H[0]]  # H[0] came and went: its last state counts
    index.commit(grant, ok=True)
    later = index.changes(delta.incarnation, delta.version)
    assert later.held == {H[2]: "node-s0"} and later.gone == []
    index.forget_store("s0")
    gone = index.changes(later.incarnation, later.version)
    assert gone.held == {} and sorted(gone.gone) == [H[1], H[2]]
    assert index.changes("another life", 3).full  # a restarted index's followers start over


def test_tier_is_on_by_default() -> None:
    cfg = parse_config(None)
    assert cfg.cpu_tier.enabled is True
    kv = kv_transfer_for(cfg, "decode", TIER)
    assert kv is not None and kv["kv_connector"] == "TandemMultiConnector"
    children = kv["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in children] == [cfg.kv_transfer.connector, "TandemCpuTierConnector"]


def test_tier_can_be_turned_off() -> None:
    cfg = parse_config({"cpu_tier": {"enabled": False}})
    assert kv_transfer_for(cfg, "prefill", TIER)["kv_connector"] == cfg.kv_transfer.connector  # type: ignore[index]
    assert kv_transfer_for(parse_config({"colocated": {}, "cpu_tier": {"enabled": False}}), "both") is None


def test_disaggregated_engines_run_nixl_then_the_tier_under_the_multi_connector() -> None:
    cfg = parse_config({"cpu_tier": {"enabled": True}})
    kv = kv_transfer_for(cfg, "prefill", TIER)
    assert kv is not None and kv["kv_connector"] == "TandemMultiConnector"
    children = kv["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in children] == [cfg.kv_transfer.connector, "TandemCpuTierConnector"]
    assert children[0]["kv_role"] == "kv_producer"
    assert children[1]["kv_connector_extra_config"]["store_id"] == "n1"


def test_colocated_engines_run_the_tier_alone_under_the_multi_connector() -> None:
    cfg = parse_config({"colocated": {}, "cpu_tier": {"enabled": True}})
    kv = kv_transfer_for(cfg, "both", TIER)
    assert kv is not None
    assert [c["kv_connector"] for c in kv["kv_connector_extra_config"]["connectors"]] == ["TandemCpuTierConnector"]


def test_tier_size_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="cpu_tier.size_gib"):
        parse_config({"cpu_tier": {"size_gib": 0}})


def test_tier_pools_are_pool_roles() -> None:
    with pytest.raises(ConfigError, match=r"cpu_tier.save_from\[0\]"):
        parse_config({"cpu_tier": {"save_from": ["prefil"]}})


@pytest.mark.parametrize(
    ("disaggregation", "tier", "expected"),
    [
        ("always", {}, ({"prefill", "both"}, {"prefill", "both"})),
        ("always", {"save_outputs": True}, ({"prefill", "decode", "both"}, {"prefill", "both"})),
        ("conditional", {}, ({"prefill", "decode", "both"}, {"prefill", "decode", "both"})),
        ("conditional", {"save_outputs": True}, ({"prefill", "decode", "both"}, {"prefill", "decode", "both"})),
        ("never", {}, ({"prefill", "decode", "both"}, {"prefill", "decode", "both"})),
        ("conditional", {"save_from": ["prefill"], "load_into": []}, ({"prefill"}, set())),
    ],
)
def test_tier_pools_default_to_the_pools_that_compute_prompts(
    disaggregation: str, tier: dict[str, Any], expected: tuple[set[str], set[str]]
) -> None:
    """A decode engine that may prefill (conditional, never) saves and loads unless told not
    to; one that only decodes saves the answers it generates (save_outputs) and loads nothing."""
    cfg = parse_config({"routing": {"disaggregation": disaggregation}, "cpu_tier": tier})
    assert cfg.tier_pools() == expected


def planned_saves(save_outputs: bool, steps: list[int], num_prompt_tokens: int,
                  kv_transfer_params: dict[str, Any] | None = None) -> list[list[int]]:
    """The block ids a saving scheduler-role connector plans to save, step by step, for one
    request whose tokens' KV is computed up to each of `steps` (a fake kv cache manager
    hands out block ids 100, 101, ...; vLLM's configs faked: only the fields it reads)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connectors.offload import TandemCpuTierConnector

    settings = TierSettings(index_address="tcp://127.0.0.1:9", store_id="s0", load=False, save_outputs=save_outputs)
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=msgspec.to_builtins(settings), engine_id="e0"),
        cache_config=SimpleNamespace(block_size=BS),
    )
    conn = TandemCpuTierConnector(vllm_config, KVConnectorRole.SCHEDULER, SimpleNamespace(num_blocks=64))
    total = max(steps) + 1
    conn.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: [list(range(100, 100 + total // BS + 1))],
                                               block_pool=None))
    # vLLM hashes every full block, generated tokens' included, as the tokens arrive.
    req = SimpleNamespace(request_id="r", num_prompt_tokens=num_prompt_tokens, block_hashes=H[: total // BS],
                          num_tokens=total, kv_transfer_params=kv_transfer_params)
    conn.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: [[]]), 0)
    planned, computed = [], 0
    for after in steps:
        out = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="r", num_computed_tokens=computed)] if not computed else [],
            scheduled_cached_reqs=SimpleNamespace(req_ids=["r"] if computed else [], num_computed_tokens=[computed] if computed else []),
            num_scheduled_tokens={"r": after - computed},
        )
        planned.append([b for job in conn.build_connector_meta(out).saves for b in job.block_ids])
        computed = after
    conn.request_finished(req, [])
    conn.shutdown()
    return planned


def test_a_saving_engine_saves_the_blocks_its_generated_tokens_fill() -> None:
    """A decode engine's answer is the part of a chat's next prompt no prefill engine computed:
    each block the generated tokens fill is saved as it fills (save_outputs), the prompt's
    first; without save_outputs only the prompt's full blocks are."""
    prompt = 2 * BS + 10  # two full prompt blocks, the third filled by generated tokens
    steps = [prompt, prompt + 1, 3 * BS - 1, 3 * BS, 4 * BS + 5]  # the prefill, then decode steps
    assert planned_saves(True, steps, prompt) == [[100, 101], [], [], [102], [103]]
    assert planned_saves(False, steps, prompt) == [[100, 101], [], [], [], []]


def test_a_decode_engine_leaves_the_pulled_prompt_to_the_prefill_engine_that_saves_it() -> None:
    """TIER_SAVED: the prompt tokens the prefill engine computed and saves. The decode engine
    that pulled them plans no save of their blocks (nor asks the index for slots for them),
    only of the blocks its own tokens fill: with the prefill's token in its prompt
    (routing.first_token: prefill), the block that token completes is its own."""
    from actors.kv_index import TIER_SAVED

    prompt = 2 * BS + 10
    steps = [prompt, prompt + 1, 3 * BS - 1, 3 * BS, 4 * BS + 5]
    assert planned_saves(True, steps, prompt, {TIER_SAVED: prompt}) == [[], [], [], [102], [103]]
    assert planned_saves(False, steps, prompt, {TIER_SAVED: prompt}) == [[], [], [], [], []]
    assert planned_saves(False, [2 * BS, 2 * BS + 1], 2 * BS, {TIER_SAVED: 2 * BS - 1}) == [[101], []]


def test_a_request_that_keeps_the_tier_out_is_neither_saved_nor_looked_up(tier_scheduler: tuple[Any, Any]) -> None:
    """TIER_SKIP (an engine's warm-up prompt): no save planned, no lookup though the tier holds its prefix."""
    from actors.kv_index import TIER_SKIP

    prompt = 2 * BS + 10
    assert planned_saves(True, [prompt, prompt + 1], prompt, {TIER_SKIP: True}) == [[], []]
    conn, index = tier_scheduler
    lookups = ray_get(index.get_stats.remote()).num_lookups
    req = request("kept-out", H[:3], {TIER_SKIP: True})
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert ray_get(index.get_stats.remote()).num_lookups == lookups
    conn.request_finished(req, [])


def test_clear_drops_every_block_but_keeps_stores() -> None:
    index = index_with(endpoint(slots=2))
    save(index, "s0", [H[0], H[1]])
    assert index.clear() == 2
    assert not index.contains(H[0])
    assert save(index, "s0", [H[2], H[3]]) and index.capacity("s0") == 2


# ---- engine processes and Ray ----------------------------------------------------------


def test_an_engine_process_reaches_the_index_without_joining_ray(ray_local) -> None:
    """vLLM's engine processes reach the index on its channel: as Ray drivers they ran Ray's
    core worker threads and GCS connections beside the forward pass (and Ray's error listener
    busy-polled the GCS, 0.2-0.5 core idle). A process that is not in the cluster builds both
    connector roles, looks up a held prefix and saves nothing it was not granted."""
    import subprocess
    import sys
    import textwrap

    import ray

    from actors.kv_index import KVIndexActor

    index = KVIndexActor.remote()
    ray.get(index.register_store.remote(endpoint()))
    ray.get(index.set_slot_bytes.remote(SLOT))
    ray.get(index.commit.remote(ray.get(index.allocate.remote("s0", [H[0], H[1]], "e0")), True))
    settings = TierSettings(index_address=ray.get(index.get_channel_address.remote()), store_id="s0")
    code = textwrap.dedent(f"""
        import time
        from types import SimpleNamespace
        import ray
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from connectors.offload import TandemCpuTierConnector

        config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={msgspec.to_builtins(settings)!r},
                                                                    engine_id="e0"),
                                 cache_config=SimpleNamespace(block_size={BS}))
        conn = TandemCpuTierConnector(config, KVConnectorRole.SCHEDULER, SimpleNamespace(num_blocks=64))
        assert conn.index.wait_connected(60)
        req = SimpleNamespace(request_id="r", block_hashes={H[:3]!r}, num_tokens={3 * BS + 1}, kv_transfer_params=None)
        conn.on_new_request(req)
        deadline = time.monotonic() + 60
        while (matched := conn.get_num_new_matched_tokens(req, 0))[0] is None:
            assert time.monotonic() < deadline, "no answer from the index"
        conn.request_finished(req, [])
        assert matched == ({2 * BS}, True), matched
        assert not ray.is_initialized(), "the engine process joined Ray"
        conn.shutdown()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    unpinned_soon(index)  # request_finished's unpin
    ray.kill(index)


# ---- the connector's scheduler side against a real index actor ------------------------


BS = 128  # vLLM's block size on CPU


@pytest.fixture(scope="module")
def tier_scheduler(ray_local: None) -> Iterator[tuple[Any, Any]]:
    """A scheduler-role TandemCpuTierConnector (vLLM's configs faked: only the fields it reads)
    and an index actor holding H[0], H[1]."""
    import ray
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from actors.kv_index import KVIndexActor
    from connectors.offload import TandemCpuTierConnector

    index = KVIndexActor.options(name="sched-test-index", namespace="tandem-test").remote()
    ray.get(index.register_store.remote(endpoint()))
    ray.get(index.set_slot_bytes.remote(SLOT))
    ray.get(index.commit.remote(ray.get(index.allocate.remote("s0", [H[0], H[1]], "e0")), True))
    settings = TierSettings(index_address=ray.get(index.get_channel_address.remote()), load=True)
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=msgspec.to_builtins(settings), engine_id="e0"),
        cache_config=SimpleNamespace(block_size=BS),
    )
    conn = TandemCpuTierConnector(vllm_config, KVConnectorRole.SCHEDULER, SimpleNamespace(num_blocks=64))
    assert conn.index.wait_connected(60)
    yield conn, index
    conn.shutdown()
    ray.kill(index)


def ray_get(ref: Any) -> Any:
    import ray

    return ray.get(ref, timeout=60)


def unpinned_soon(index: Any) -> None:
    """Until the index holds no pins (an unpin is sent without an answer)."""
    deadline = time.monotonic() + 10
    while ray_get(index.get_stats.remote()).num_pinned:
        assert time.monotonic() < deadline, "pins were not released"
        time.sleep(0.02)


def request(req_id: str, hashes: list[bytes], kv_transfer_params: dict[str, Any] | None = None) -> SimpleNamespace:
    """A vLLM Request as the connector reads it: full blocks of `hashes` plus one token."""
    return SimpleNamespace(request_id=req_id, block_hashes=hashes, num_tokens=len(hashes) * BS + 1,
                           kv_transfer_params=kv_transfer_params)


def arrived(conn: Any, index: Any, req_id: str, num_blocks: int = 3) -> SimpleNamespace:
    """A request of `num_blocks` full blocks (+1 token) handed to the connector on arrival;
    returns once the index has served its lookup."""
    req = request(req_id, H[:num_blocks])
    conn.on_new_request(req)
    conn.index.wait([conn._lookups[req_id].call], 10)  # answered, as an arrival a few ms before scheduling is
    return req


def test_the_lookup_started_on_arrival_answers_the_first_scheduling(tier_scheduler: tuple[Any, Any]) -> None:
    conn, index = tier_scheduler
    req = arrived(conn, index, "first")
    assert conn.get_num_new_matched_tokens(req, 0) == (2 * BS, True)  # H[0], H[1]; no "not yet"
    conn.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: [[10, 11, 12]]), 2 * BS)
    (load,) = conn.build_connector_meta(SimpleNamespace()).loads
    assert load.block_ids == [10, 11] and len(load.locations) == 2
    conn.request_finished(req, [10, 11, 12])


def test_a_local_prefix_hit_uses_the_arrival_lookup_past_it(tier_scheduler: tuple[Any, Any]) -> None:
    conn, index = tier_scheduler
    req = arrived(conn, index, "local-hit")
    assert conn.get_num_new_matched_tokens(req, BS) == (BS, True)  # vLLM's cache has H[0]; the tier gives H[1]
    conn.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: [[10, 11, 12]]), BS)
    (load,) = conn.build_connector_meta(SimpleNamespace()).loads
    assert load.block_ids == [11]
    assert load.locations == ray_get(index.lookup.remote("probe", [H[1]])).locations
    index.unpin.remote("probe")
    conn.request_finished(req, [10, 11, 12])


def test_a_local_hit_longer_than_the_tier_run_is_a_miss(tier_scheduler: tuple[Any, Any]) -> None:
    conn, index = tier_scheduler
    req = arrived(conn, index, "longer-local")
    assert conn.get_num_new_matched_tokens(req, 2 * BS) == (0, False)
    conn.request_finished(req, [10, 11, 12])
    unpinned_soon(index)  # request_finished released the lookup's pins


def test_a_request_seen_first_by_the_scheduler_is_answered_once_the_index_replies(tier_scheduler: tuple[Any, Any]) -> None:
    conn, _ = tier_scheduler
    req = request("no-arrival", H[:3])
    deadline = time.monotonic() + 60
    while (answer := conn.get_num_new_matched_tokens(req, 0)) == (None, False):
        assert time.monotonic() < deadline, "the lookup was never answered"
        time.sleep(0.01)
    assert answer == (2 * BS, True)
    conn.request_finished(req, [])


def test_a_request_whose_router_knows_the_tier_holds_none_of_it_asks_the_index_nothing(
    tier_scheduler: tuple[Any, Any],
) -> None:
    """TIER_HINT 0: no lookup, no wait; a hint above 0 (or none) looks up as before."""
    from actors.kv_index import TIER_HINT

    conn, index = tier_scheduler
    lookups = ray_get(index.get_stats.remote()).num_lookups
    req = request("told-none", H[:3], {TIER_HINT: 0})
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert ray_get(index.get_stats.remote()).num_lookups == lookups
    conn.request_finished(req, [])
    req = request("told-some", H[:3], {TIER_HINT: 2})
    conn.on_new_request(req)
    conn.index.wait([conn._lookups[req.request_id].call], 10)
    assert conn.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    assert ray_get(index.get_stats.remote()).num_lookups == lookups + 1
    conn.request_finished(req, [])


def test_a_request_whose_kv_is_pulled_from_its_prefill_engine_asks_the_index_nothing_until_the_pull_is_planned(
    tier_scheduler: tuple[Any, Any],
) -> None:
    """A decode request with vLLM's `do_remote_prefill`: no lookup, no wait, though the tier
    holds its prefix. Once the P/D connector has planned the pull (it clears the flag), a
    failed pull's second admission asks the tier as any request does."""
    conn, index = tier_scheduler
    lookups = ray_get(index.get_stats.remote()).num_lookups
    req = request("pulled", H[:3], {"do_remote_prefill": True, "remote_engine_id": "prefill-0"})
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert ray_get(index.get_stats.remote()).num_lookups == lookups
    req.kv_transfer_params["do_remote_prefill"] = False  # what NixlConnector does when it plans the pull
    deadline = time.monotonic() + 60
    while (answer := conn.get_num_new_matched_tokens(req, 0)) == (None, False):
        assert time.monotonic() < deadline, "the lookup was never answered"
        time.sleep(0.01)
    assert answer == (2 * BS, True)
    assert ray_get(index.get_stats.remote()).num_lookups == lookups + 1
    conn.request_finished(req, [])


def test_only_a_request_holding_pins_costs_the_index_an_unpin_when_it_ends(tier_scheduler: tuple[Any, Any]) -> None:
    """A request told the tier holds none of it, or whose load has ended, holds no pins: its end
    asks the index nothing (a Ray call from the engine core per request). One that ends
    during its load releases the load's pins."""
    conn, index = tier_scheduler
    unpinned: list[str] = []
    real_unpin = conn._unpin
    conn._unpin = lambda req_id: (unpinned.append(req_id), real_unpin(req_id))
    try:
        from actors.kv_index import TIER_HINT

        none = request("pinless", H[:3], {TIER_HINT: 0})
        conn.on_new_request(none)
        assert conn.get_num_new_matched_tokens(none, 0) == (0, False)
        conn.update_state_after_alloc(none, SimpleNamespace(get_block_ids=lambda: [[10, 11, 12]]), 0)
        conn.request_finished(none, [10, 11, 12])
        assert unpinned == []

        loaded = arrived(conn, index, "load-ends")
        assert conn.get_num_new_matched_tokens(loaded, 0) == (2 * BS, True)
        conn.update_state_after_alloc(loaded, SimpleNamespace(get_block_ids=lambda: [[10, 11, 12]]), 2 * BS)
        conn.update_connector_output(SimpleNamespace(finished_recving={"load-ends"}))
        conn.request_finished(loaded, [10, 11, 12])
        assert unpinned == ["load-ends"]  # when its load ended, not again at its end

        cut = arrived(conn, index, "ends-mid-load")
        assert conn.get_num_new_matched_tokens(cut, 0) == (2 * BS, True)
        conn.update_state_after_alloc(cut, SimpleNamespace(get_block_ids=lambda: [[10, 11, 12]]), 2 * BS)
        assert ray_get(index.get_stats.remote()).num_pinned > 0
        conn.request_finished(cut, [10, 11, 12])
        assert unpinned[-1] == "ends-mid-load"
        unpinned_soon(index)
    finally:
        del conn._unpin
        conn.build_connector_meta(SimpleNamespace())  # drop the planned loads


def test_a_router_follows_the_tier_from_the_index_feed(tier_scheduler: tuple[Any, Any]) -> None:
    """The CacheView's TierView takes the index's answer, then every commit and eviction from
    its feed, with no call per request."""
    import asyncio

    from orchestrator.cache_view import CacheView

    _, index = tier_scheduler
    ray_get(index.register_store.remote(endpoint("feed", slots=1)))

    async def follow() -> None:
        view = CacheView(index)
        view.sync()
        tier = view.tier
        assert tier is not None

        async def until(check: Any) -> None:
            for _ in range(600):
                if tier.synced and check():
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"the view never caught up: {tier.held}")

        await until(lambda: H[0] in tier.held)  # committed before the router came
        grant = await index.allocate.remote("feed", [H[13]], "e0")
        await index.commit.remote(grant, True)
        await until(lambda: tier.held.get(H[13]) == "node-feed")
        grant = await index.allocate.remote("feed", [H[14]], "e0")  # the store is full: H[13] is evicted
        await index.commit.remote(grant, True)
        await until(lambda: H[13] not in tier.held and H[14] in tier.held)
        await view.close()

    asyncio.run(asyncio.wait_for(follow(), timeout=60))
    ray_get(index.forget_store.remote("feed"))


def test_a_corrupting_connector_fails_only_marked_requests_from_the_given_block(tier_scheduler: tuple[Any, Any]) -> None:
    """tests.faults' connector (loaded through the cpu_tier.connector seam) points the lookups
    of "tierfail" requests past the pool from CORRUPT_FROM_BLOCK on; others are untouched."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tests.faults import BAD_SLOT, CORRUPT_FROM_BLOCK, CorruptingCpuTierConnector

    conn, index = tier_scheduler
    held = H[8:12]  # in a store of its own, so the other tests' blocks stay held
    ray_get(index.register_store.remote(endpoint("faults", slots=len(held))))
    ray_get(index.commit.remote(ray_get(index.allocate.remote("faults", held, "e0")), True))
    faulty = CorruptingCpuTierConnector(conn._vllm_config, KVConnectorRole.SCHEDULER, SimpleNamespace(num_blocks=64))
    assert faulty.index.wait_connected(60)
    slots = {}
    for req_id in ("plain", "x-tierfail-1"):
        req = request(req_id, held)
        faulty.on_new_request(req)
        faulty.index.wait([faulty._lookups[req_id].call], 10)
        assert faulty.get_num_new_matched_tokens(req, 0) == (len(held) * BS, True)
        slots[req_id] = [loc.slot for loc in faulty._lookups[req_id].locations]
        faulty.request_finished(req, [])
    assert BAD_SLOT not in slots["plain"]
    assert slots["x-tierfail-1"][:CORRUPT_FROM_BLOCK] == slots["plain"][:CORRUPT_FROM_BLOCK]
    assert set(slots["x-tierfail-1"][CORRUPT_FROM_BLOCK:]) == {BAD_SLOT}
