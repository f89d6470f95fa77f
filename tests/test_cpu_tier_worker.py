"""Specification of the CPU tier worker's safety under faults, against a scripted NIXL agent and
a scripted index channel (no engine): the engine step never waits long, and no memory a
transfer may still touch is handed on. Ends with the real index actor over its real channel:
engine start against a dead or mismatched index, and the index's restart with a real store
registered, which engines reach again on the same address."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
import torch

from actors.kv_index import Allocate, BlockLocation, Commit, Endpoint, Grant, SetSlotBytes, StoreEndpoint
from connectors.index_client import IndexClient
from connectors.offload_worker import GRANT_WAIT_S, SLOT_BYTES_WAIT_S, STUCK_TRANSFER_S, WRITE_TIMEOUT_S, CpuTierWorker

NUM_BLOCKS = 8
PAGE = 64  # bytes of one block of one layer; two layers, so a slot is 128 bytes
SLOT = 2 * PAGE
STORE = StoreEndpoint("s0", "node", "i0", b"store-agent", 0x10000, 16 * SLOT)


class Clock:
    """A clock that moves on by `tick` each time it is read (the worker spins on it while it
    waits for a WRITE)."""

    def __init__(self, tick: float = 0.0) -> None:
        self.now = 1000.0
        self.tick = tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


class FakeAgent:
    """The NIXL agent calls the worker makes. Transfers end as `script` says: a list of states
    check_xfer_state returns in turn (the last one repeats); "RAISE" raises like NIXL does when
    the remote disconnected."""

    def __init__(self) -> None:
        self.script: list[str] = ["DONE"]
        self.posted: dict[int, tuple[str, list[int]]] = {}  # handle -> (op, local addresses)
        self.states: dict[int, list[str]] = {}
        self.released: list[int] = []
        self.removed: list[str] = []
        self._ids = itertools.count(1)

    def register_memory(self, descs: Any, kind: str) -> None:
        pass

    def get_xfer_descs(self, rows: np.ndarray, kind: str) -> list[int]:
        return [int(r[0]) for r in rows]

    def add_remote_agent(self, metadata: bytes) -> str:
        return metadata.decode()

    def remove_remote_agent(self, name: str) -> None:
        self.removed.append(name)

    def initialize_xfer(self, op: str, local: list[int], remote: list[int], agent: str) -> int:
        handle = next(self._ids)
        self.posted[handle] = (op, local)
        self.states[handle] = list(self.script)
        return handle

    def transfer(self, handle: int) -> str:
        return "PROC"

    def check_xfer_state(self, handle: int) -> str:
        assert handle not in self.released, "a released handle was polled"
        states = self.states[handle]
        state = states.pop(0) if len(states) > 1 else states[0]
        if state == "RAISE":
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        return state

    def end(self, handle: int, state: str = "DONE") -> None:
        self.states[handle] = [state]

    def release_xfer_handle(self, handle: int) -> None:
        self.released.append(handle)


class _Method:
    """One kind of call on the index's channel: answers `answer` `delay_s` after it is made (0:
    at once) and records the requests."""

    def __init__(self, answer: Any = None, delay_s: float = 0.0) -> None:
        self.answer = answer
        self.delay_s = delay_s
        self.calls: list[Any] = []


class FakeIndex:
    """The index's channel as the worker uses it (``IndexClient``'s calls), with each kind of
    call answering as configured, in real time."""

    def __init__(self) -> None:
        self.endpoint = _Method(STORE)
        self.allocate = _Method()
        self.commit = _Method()
        self.set_slot_bytes = _Method()
        self._ids = itertools.count(1)
        self._due: dict[int, tuple[float, Any]] = {}  # call id -> (answered at, answer)

    def _method(self, request: Any) -> _Method:
        return {Endpoint: self.endpoint, Allocate: self.allocate, Commit: self.commit,
                SetSlotBytes: self.set_slot_bytes}[type(request)]

    def wait_connected(self, timeout: float) -> bool:
        return True

    def call(self, request: Any) -> int:
        method = self._method(request)
        method.calls.append(request)
        call_id = next(self._ids)
        self._due[call_id] = (time.monotonic() + method.delay_s, method.answer)
        return call_id

    def send(self, request: Any) -> bool:
        self._method(request).calls.append(request)
        return True

    def wait(self, call_ids: Any, timeout: float) -> set[int]:
        deadline = time.monotonic() + timeout
        while True:
            done = {c for c in call_ids if c in self._due and self._due[c][0] <= time.monotonic()}
            if len(done) == len(call_ids) or time.monotonic() >= deadline:
                return done
            time.sleep(0.001)

    def result(self, call_id: int) -> Any:
        return self._due.pop(call_id)[1]

    def forget(self, call_id: int) -> None:
        self._due.pop(call_id, None)

    def wait_answered(self) -> None:
        """Until every call made so far has its answer."""
        time.sleep(max([0.0] + [due - time.monotonic() for due, _ in self._due.values()]))


def grant(slots: list[int], endpoint: StoreEndpoint | None = None) -> Grant:
    return Grant("g1", "s0", "i0", [bytes([s]) for s in slots], slots, endpoint)


def loc(slot: int, store: StoreEndpoint = STORE) -> BlockLocation:
    return BlockLocation(store.store_id, store.incarnation, slot)


def kv_caches() -> dict[str, torch.Tensor]:
    """Two small layers of NUM_BLOCKS blocks, PAGE bytes each."""
    return {f"layer{i}": torch.zeros(NUM_BLOCKS, PAGE, dtype=torch.uint8) for i in range(2)}


def worker_with(index: FakeIndex, agent: FakeAgent, clock: Clock, knows_store: bool = True) -> CpuTierWorker:
    """A started worker saving to STORE; `knows_store`: it has learnt STORE's endpoint (from a
    first load, which failed for want of it)."""
    worker = CpuTierWorker(index, "s0", "e@1", agent=agent, clock=clock)  # type: ignore[arg-type]
    worker.register_kv_caches(kv_caches(), NUM_BLOCKS)
    if knows_store:
        worker.start_load("warm-up", [0], [loc(0)])
        index.wait_answered()
        assert worker.poll() == {"warm-up"} and worker.take_error_blocks() == {0}
    return worker


def commits(index: FakeIndex) -> list[bool]:
    return [call.ok for call in index.commit.calls]


def save_one(worker: CpuTierWorker, index: FakeIndex, slots: list[int]) -> None:
    """One step's save of len(slots) blocks, whose grant (of `slots`) is in by wait_for_save."""
    index.allocate.answer = grant(slots)
    hashes = [bytes([s]) for s in slots]
    call = worker.request_slots(hashes)
    assert call is not None
    index.wait([call], 10)
    worker.save([(list(range(len(slots))), hashes, call)], block_size=16)


# ---- saves ----


def test_a_write_that_ends_commits_its_grant() -> None:
    index, agent = FakeIndex(), FakeAgent()
    worker = worker_with(index, agent, Clock(tick=0.001))
    save_one(worker, index, [3])
    assert commits(index) == [True] and agent.released == [1]
    # The owner, the slot size (for an index that restarted empty), the store incarnation known.
    (asked,) = index.allocate.calls
    assert (asked.owner, asked.slot_bytes, asked.known_incarnation) == ("e@1", SLOT, "i0")


def test_the_first_grant_brings_the_endpoint_of_the_store() -> None:
    index, agent = FakeIndex(), FakeAgent()
    worker = worker_with(index, agent, Clock(tick=0.001), knows_store=False)
    index.allocate.answer = grant([3], endpoint=STORE)
    call = worker.request_slots([b"\x03"])
    assert call is not None
    index.wait([call], 10)
    worker.save([([0], [b"\x03"], call)], block_size=16)
    assert index.allocate.calls[0].known_incarnation is None  # it asked as a worker knowing no incarnation
    assert index.endpoint.calls == [] and commits(index) == [True]


def test_a_steps_saves_are_asked_for_before_its_forward_pass_and_written_at_the_start_of_the_next() -> None:
    """The connector asks the index for a step's slots when the step is bound, so the answer
    comes during the forward pass, and writes the blocks when the next step starts
    (handle_preemptions, in every step, forward pass or not), not around the forward pass that
    computed them, where the WRITE would delay that step's tokens."""
    from types import SimpleNamespace

    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from actors.kv_store import TierSettings
    from connectors.offload import SaveJob, TandemCpuTierConnector, TierMetadata

    settings = TierSettings(index_address="tcp://127.0.0.1:9", store_id="s0")
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=msgspec.to_builtins(settings),
                                                                engine_id="e1"),
                             cache_config=SimpleNamespace(block_size=16))
    conn = TandemCpuTierConnector(config, KVConnectorRole.WORKER, SimpleNamespace(num_blocks=NUM_BLOCKS))
    index, agent = FakeIndex(), FakeAgent()
    conn.worker = worker_with(index, agent, Clock(tick=0.001))
    index.allocate.answer = grant([5, 6])
    writes = lambda: [local for op, local in agent.posted.values() if op == "WRITE"]  # noqa: E731

    conn.handle_preemptions(TierMetadata())
    conn.bind_connector_metadata(TierMetadata(saves=[SaveJob([2, 3], [bytes([5]), bytes([6])])]))
    (asked,) = index.allocate.calls  # before the forward pass: its answer comes meanwhile
    assert asked.hashes == [bytes([5]), bytes([6])]
    conn.wait_for_save()  # the forward pass that computed blocks 2 and 3 has ended
    assert writes() == [] and commits(index) == []  # nothing written around it
    conn.clear_connector_metadata()
    conn.handle_preemptions(TierMetadata())  # the next step, before it can touch the KV cache
    (local,) = writes()
    assert len(local) == 4 and commits(index) == [True]  # blocks 2 and 3 of both layers
    conn.bind_connector_metadata(TierMetadata())
    conn.wait_for_save()
    conn.handle_preemptions(TierMetadata())
    assert len(writes()) == 1 and len(index.allocate.calls) == 1  # nothing asked for or written twice


def test_a_write_outliving_its_step_keeps_its_grant_until_the_transfer_ends() -> None:
    index, agent = FakeIndex(), FakeAgent()
    agent.script = ["PROC"]
    clock = Clock(tick=0.01)
    worker = worker_with(index, agent, clock)
    start = clock.now
    save_one(worker, index, [3])
    assert clock.now - start >= WRITE_TIMEOUT_S  # the step waited its bound, no longer
    assert commits(index) == [] and agent.released == []  # the WRITE may still land: slots stay granted
    worker.poll()
    assert commits(index) == [] and agent.released == []
    agent.end(1, "DONE")
    worker.poll()
    # Ended after its step: the blocks it read may have been reused, so the grant is given back.
    assert commits(index) == [False] and agent.released == [1]


def test_saves_to_a_store_with_a_stuck_write_are_skipped_and_given_back() -> None:
    index, agent = FakeIndex(), FakeAgent()
    agent.script = ["PROC"]
    worker = worker_with(index, agent, Clock(tick=0.01))
    save_one(worker, index, [3])
    save_one(worker, index, [4])
    assert len(agent.posted) == 1  # no second WRITE into a stalled store
    assert commits(index) == [False]


def test_a_grant_missing_its_step_is_skipped_and_given_back_when_it_arrives() -> None:
    index, agent = FakeIndex(), FakeAgent()
    worker = worker_with(index, agent, Clock(tick=0.001))
    index.allocate = _Method(grant([3]), delay_s=0.5)
    call = worker.request_slots([b"\x03"])
    t0 = time.perf_counter()
    worker.save([([0], [b"\x03"], call)], block_size=16)
    assert time.perf_counter() - t0 < GRANT_WAIT_S + 0.1  # the step did not wait for the index
    assert agent.posted == {} and commits(index) == []
    index.wait_answered()
    worker.poll()
    assert agent.posted == {} and commits(index) == [False]


def test_a_grant_for_a_store_the_worker_cannot_reach_is_given_back_without_waiting() -> None:
    index, agent = FakeIndex(), FakeAgent()
    index.endpoint = _Method(STORE, delay_s=0.5)
    worker = worker_with(index, agent, Clock(tick=0.001), knows_store=False)
    t0 = time.perf_counter()
    save_one(worker, index, [3])  # a grant without the endpoint the worker lacks
    assert time.perf_counter() - t0 < 0.3
    assert agent.posted == {} and commits(index) == [False]
    assert len(index.endpoint.calls) == 1  # fetched in the background for next time


# ---- loads ----


def test_a_load_stuck_past_its_bound_keeps_its_blocks_until_the_transfer_ends() -> None:
    index, agent = FakeIndex(), FakeAgent()
    agent.script = ["PROC"]
    clock = Clock()
    worker = worker_with(index, agent, clock)
    worker.start_load("r1", [5, 6], [loc(0), loc(1)])
    clock.now += STUCK_TRANSFER_S + 1
    assert worker.poll() == set() and worker.take_error_blocks() == set()
    assert agent.released == []  # releasing would not stop the READ
    agent.end(1, "DONE")
    assert worker.poll() == {"r1"}
    assert worker.take_error_blocks() == set() and agent.released == [1]  # the blocks did arrive


def test_a_load_ends_only_when_every_transfer_of_it_has_ended() -> None:
    """One READ failed, another still writes the request's blocks: vLLM must not recompute
    into them yet."""
    index, agent = FakeIndex(), FakeAgent()
    other = StoreEndpoint("s1", "node", "i9", b"other-agent", 0x90000, 16 * SLOT)
    worker = worker_with(index, agent, Clock())
    index.endpoint = _Method(other)
    worker.start_load("r0", [5], [loc(0, other)])  # fails (unknown store) and fetches its endpoint
    index.wait_answered()
    assert worker.poll() == {"r0"} and worker.take_error_blocks() == {5}
    agent.script = ["PROC"]
    worker.start_load("r1", [5, 6], [loc(0), loc(0, other)])
    agent.end(1, "RAISE")  # the store died
    assert worker.poll() == set() and worker.take_error_blocks() == set()
    agent.end(2, "DONE")
    assert worker.poll() == {"r1"}
    assert worker.take_error_blocks() == {5, 6}


def test_a_load_from_an_unknown_store_fails_at_once_and_fetches_the_endpoint() -> None:
    index, agent = FakeIndex(), FakeAgent()
    index.endpoint = _Method(STORE, delay_s=0.3)
    worker = worker_with(index, agent, Clock(), knows_store=False)
    t0 = time.perf_counter()
    worker.start_load("r1", [5, 6], [loc(0), loc(1)])
    assert worker.poll() == {"r1"} and worker.take_error_blocks() == {5, 6}
    assert time.perf_counter() - t0 < 0.2 and agent.posted == {}
    index.wait_answered()
    worker.poll()  # the endpoint is taken in, for the next load
    worker.start_load("r2", [5, 6], [loc(0), loc(1)])
    assert len(agent.posted) == 1 and worker.poll() == {"r2"} and worker.take_error_blocks() == set()


def test_loads_from_a_store_with_a_stuck_transfer_fail_at_once() -> None:
    index, agent = FakeIndex(), FakeAgent()
    agent.script = ["PROC"]
    clock = Clock()
    worker = worker_with(index, agent, clock)
    worker.start_load("r1", [5], [loc(0)])
    clock.now += STUCK_TRANSFER_S + 1
    worker.poll()
    worker.start_load("r2", [6], [loc(1)])
    assert worker.poll() == {"r2"} and worker.take_error_blocks() == {6}
    assert len(agent.posted) == 1


def test_a_new_store_incarnation_retires_the_old_agent_once_its_transfers_end() -> None:
    index, agent = FakeIndex(), FakeAgent()
    agent.script = ["PROC"]
    worker = worker_with(index, agent, Clock())
    worker.start_load("r1", [5], [loc(0)])
    restarted = StoreEndpoint("s0", "node", "i1", b"store-agent-2", 0x10000, 16 * SLOT)
    index.endpoint = _Method(restarted)
    worker.start_load("r2", [6], [loc(0, restarted)])  # an unknown incarnation: fails, fetched
    index.wait_answered()
    worker.poll()
    assert agent.removed == []  # r1's READ still uses the old agent
    agent.end(1, "RAISE")
    assert worker.poll() == {"r1"}
    assert agent.removed == ["store-agent"]


# ---- engine start ----


def test_engine_start_survives_a_dead_index(ray_local: None) -> None:
    from actors.kv_index import KVIndexActor

    index = KVIndexActor.remote()
    address = ray.get(index.get_channel_address.remote())
    ray.kill(index, no_restart=True)
    deadline = time.monotonic() + 60
    while True:  # until it is gone, with its channel (the kill lands asynchronously)
        try:
            ray.get(index.get_channel_address.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the index was not killed"
        time.sleep(0.05)
    client = IndexClient(address)
    t0 = time.perf_counter()
    worker = CpuTierWorker(client, "s0", "e@1", agent=FakeAgent(), clock=Clock())
    worker.register_kv_caches(kv_caches(), NUM_BLOCKS)
    assert worker.slot_bytes == SLOT
    assert time.perf_counter() - t0 < SLOT_BYTES_WAIT_S + 5  # gave up after its bound
    client.close()


def test_engine_start_fails_when_its_blocks_do_not_fit_the_tier(ray_local: None) -> None:
    from actors.kv_index import KVIndexActor

    index = KVIndexActor.remote()
    ray.get(index.set_slot_bytes.remote(SLOT * 2))
    client = IndexClient(ray.get(index.get_channel_address.remote()))
    worker = CpuTierWorker(client, "s0", "e@1", agent=FakeAgent(), clock=Clock())
    with pytest.raises(ValueError, match="same model"):
        worker.register_kv_caches(kv_caches(), NUM_BLOCKS)
    client.close()
    ray.kill(index)


def test_a_call_the_index_never_answers_fails_after_its_bound_and_a_forgotten_one_is_dropped() -> None:
    """An index that dies with calls in flight never answers them: each fails after
    CALL_TIMEOUT_S, so nothing the engine waits on (an endpoint fetch, a late grant) stays
    open for ever. (A socket that reads and never answers stands in for the dying index.)"""
    import zmq

    from actors.kv_index import Lookup
    from connectors.index_client import CALL_TIMEOUT_S, IndexCallError

    silent = zmq.Context.instance().socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    clock = Clock()
    client = IndexClient(f"tcp://127.0.0.1:{port}", clock=clock)
    assert client.wait_connected(60)
    lost, dropped = client.call(Endpoint("s0")), client.call(Lookup("e@1/r", [b"h"]))
    assert silent.poll(10_000) and client.wait([lost], 0) == set()
    client.forget(dropped)
    clock.now += CALL_TIMEOUT_S + 1
    assert client.wait([lost], 0) == {lost}
    with pytest.raises(IndexCallError, match="did not answer"):
        client.result(lost)
    assert client._pending == {} and client._answers == {}  # nothing kept for the dropped one
    client.close()
    silent.close(linger=0)


# ---- the index actor's restart ----

RESTART_QUARANTINE_S = 3.0


@pytest.fixture
def tier_actors(ray_local: None) -> Iterator[tuple[Any, Any, str]]:
    """An index (restart quarantine shortened to RESTART_QUARANTINE_S, its channel on a port
    chosen as a deployment chooses it) with a real store of a small pool, both named as a
    deployment names them."""
    from actors.kv_index import KVIndexActor
    from actors.kv_index import index_actor_name, store_actor_name
    from actors.kv_store import KVStoreActor
    from orchestrator.tier import free_port

    app, namespace = "restart-test", "tandem-test"
    index = KVIndexActor.options(name=index_actor_name(app), namespace=namespace).remote(
        app, namespace, restart_quarantine_s=RESTART_QUARANTINE_S, channel_port=free_port()
    )
    node_id = ray.get_runtime_context().get_node_id()
    store = KVStoreActor.options(name=store_actor_name(app, node_id), namespace=namespace).remote(
        node_id[:12], 16 * SLOT, index_actor_name(app), namespace
    )
    endpoint = ray.get(store.info.remote(), timeout=120)
    yield index, store, endpoint.store_id
    ray.kill(store, no_restart=True)
    ray.kill(index, no_restart=True)


def channel_call(client: IndexClient, request: Any) -> Any:
    client.wait_connected(10)
    call = client.call(request)
    assert client.wait([call], 10) == {call}
    return client.result(call)


def test_a_killed_index_comes_back_finds_its_store_and_grants_after_its_quarantine(
    tier_actors: tuple[Any, Any, str],
) -> None:
    """An engine's channel to the index, connected before the kill, reaches the restarted index
    on the same address without being told."""
    from connectors.index_client import IndexCallError

    index, store, store_id = tier_actors
    client = IndexClient(ray.get(index.get_channel_address.remote()))
    saved = channel_call(client, Allocate(store_id, [b"h0"], "e@1", SLOT))
    client.send(Commit(saved, True))
    unsettled = channel_call(client, Allocate(store_id, [b"h1"], "e@1", SLOT))

    killed = time.monotonic()
    ray.kill(index, no_restart=False)
    while True:  # back empty (the old life held 2 blocks), with the store it asked to re-register
        try:
            stats = ray.get(index.get_stats.remote(), timeout=10)
            if stats.num_blocks == 0 and store_id in stats.stores:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < killed + 60, "the index did not come back empty with its store"
        time.sleep(0.2)
    while True:  # libzmq reconnects by itself; calls made before that fail at once
        try:
            assert channel_call(client, Endpoint(store_id)) == ray.get(store.info.remote())
            break
        except IndexCallError:
            assert time.monotonic() < killed + 60, "the engine's channel never reached the restarted index"
            time.sleep(0.1)
    client.send(Commit(unsettled, True))  # a grant of its previous life settles nothing
    while (granted := channel_call(client, Allocate(store_id, [b"h2"], "e@1", SLOT))) is None:
        assert time.monotonic() < killed + 60, "the restarted index never granted again"
        time.sleep(0.1)
    assert time.monotonic() - killed >= RESTART_QUARANTINE_S  # (the quarantine itself: test_cpu_tier_leases)
    assert granted.hashes == [b"h2"] and ray.get(index.get_stats.remote()).num_blocks == 1
    client.close()
