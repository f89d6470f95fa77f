"""The pool manager's pure parts: autoscaling decisions, the engines' load meter, placement
shapes for tensor parallelism, core sharing for added replicas, and the operator's status view."""

from __future__ import annotations

import asyncio
import json
import os
import socket

import msgspec
import pytest

from actors.affinity import NODE_CORES_ENV, node_cores, parse_cores
from actors.load import LoadMeter
from orchestrator.autoscale import ScaleDecider
from orchestrator.cluster import join_ray, serves_actor
from orchestrator.config import AutoscalingConfig, ConfigError, PoolConfig, parse_config
from orchestrator.placement import (
    EngineSlot,
    NodeFacts,
    PortBases,
    SlotAllocator,
    actor_resources,
    assign_slots,
    control_cores,
    least_used_cores,
    placement_bundles,
)
from orchestrator.protocol import DeploymentStatus, PoolStatus, ReplicaStatus, TierStatus
from orchestrator.status import render, to_json

# ---- autoscaling ------------------------------------------------------------------------


def decider(**kw: float) -> ScaleDecider:
    return ScaleDecider(AutoscalingConfig(target_per_replica=4, upscale_delay_s=5, downscale_delay_s=30, **kw), 1, 3)


def test_the_pool_wants_total_load_over_target_within_its_bounds() -> None:
    d = decider()
    assert [d.wanted(load) for load in (0, 4, 4.1, 8, 9, 100)] == [1, 1, 2, 2, 3, 3]


def test_growth_waits_for_the_upscale_delay_and_moves_one_replica_at_a_time() -> None:
    d = decider()
    assert d.decide(0.0, 12.0, 1) == 1
    assert d.decide(4.9, 12.0, 1) == 1
    assert d.decide(5.0, 12.0, 1) == 2  # wanted 3: one at a time
    assert d.decide(5.1, 12.0, 2) == 2  # the next step waits for a new delay
    assert d.decide(10.1, 12.0, 2) == 3


def test_a_burst_shorter_than_the_delay_starts_nothing() -> None:
    d = decider()
    assert d.decide(0.0, 12.0, 1) == 1
    assert d.decide(3.0, 2.0, 1) == 1  # the wish is interrupted
    assert d.decide(6.0, 12.0, 1) == 1  # and starts over
    assert d.decide(11.0, 12.0, 1) == 2


def test_shrinking_waits_for_the_downscale_delay_and_never_goes_below_min() -> None:
    d = decider()
    assert d.decide(0.0, 0.0, 3) == 3
    assert d.decide(29.0, 0.0, 3) == 3
    assert d.decide(30.0, 0.0, 3) == 2
    assert d.decide(100.0, 0.0, 1) == 1


def test_pool_bounds_are_checked_against_the_starting_size() -> None:
    with pytest.raises(ConfigError, match=r"replicas \(3\) must lie within min_replicas \(1\) and max_replicas \(2\)"):
        parse_config({"prefill": {}, "decode": {"replicas": 3, "min_replicas": 1, "max_replicas": 2}})
    pool = parse_config({"prefill": {}, "decode": {"max_replicas": 4}}).pools["decode"]
    assert (pool.min_size, pool.replicas, pool.max_size, pool.autoscaled) == (1, 1, 4, True)
    assert not PoolConfig(replicas=2).autoscaled


# ---- the engines' load meter ------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_load_is_averaged_over_time_since_the_last_report() -> None:
    clock = Clock()
    meter = LoadMeter(clock)
    meter.add(1, 100)  # a request arrives at 0 with 100 tokens to compute
    clock.now = 1.0
    meter.add(1, 50)  # another at 1 s
    clock.now = 2.0
    meter.add(-1, -100)  # the first leaves at 2 s
    clock.now = 4.0
    load = meter.report(kv_cache_usage=0.25)
    # requests: 1 for 1 s, 2 for 1 s, 1 for 2 s = 5 request-seconds over 4 s
    assert (load.num_requests, load.num_tokens) == (1, 50)
    assert load.mean_requests == pytest.approx(5 / 4)
    assert load.mean_tokens == pytest.approx((100 + 150 + 100) / 4)
    assert load.kv_cache_usage == 0.25
    clock.now = 6.0
    assert meter.report(0.0).mean_requests == pytest.approx(1.0)  # a new window


def test_a_request_shorter_than_the_period_still_shows_in_the_average() -> None:
    clock = Clock()
    meter = LoadMeter(clock)
    clock.now = 0.5
    meter.add(1, 10)
    clock.now = 0.6
    meter.add(-1, -10)
    clock.now = 1.0
    load = meter.report(0.0)
    assert load.num_requests == 0 and load.mean_requests == pytest.approx(0.1)


# ---- placement ---------------------------------------------------------------------------


def test_a_tensor_parallel_gpu_replica_gets_one_gpu_bundle_per_rank_as_vllms_ray_executor_expects() -> None:
    pool = PoolConfig(num_cpus=8, num_gpus=2, tensor_parallel_size=2)
    assert placement_bundles(pool, "cuda") == [{"CPU": 8.0}, {"GPU": 1.0}, {"GPU": 1.0}]
    # The engine actor sits in the CPU bundle; vLLM's workers take the GPUs.
    assert actor_resources(pool, "cuda") == {"num_cpus": 8.0, "num_gpus": 0.0, "resources": {}}


def test_the_gpu_example_config_has_the_shape_vllm_verifies() -> None:
    from orchestrator.config import load_config
    from orchestrator.specs import engine_spec
    from orchestrator.placement import EngineSlot

    cfg = load_config("examples/2p2d-gpu.json")
    decode = cfg.pools["decode"]
    bundles = placement_bundles(decode, cfg.device)
    # vllm/v1/executor/ray_utils.py: every device bundle holds exactly one GPU, and there
    # are at least world_size of them.
    gpu_bundles = [b for b in bundles if b.get("GPU")]
    assert len(gpu_bundles) == decode.tensor_parallel_size and all(b["GPU"] == 1 for b in gpu_bundles)
    spec = engine_spec(cfg, "decode", "decode-0", EngineSlot("n", "10.0.0.1", "/m", 5600, None), None)
    assert spec.engine_args["distributed_executor_backend"] == "ray" and spec.tensor_parallel_size == 2
    prefill = cfg.pools["prefill"]
    assert placement_bundles(prefill, cfg.device) == [{"CPU": 8.0, "GPU": 1.0}]


def test_cpu_replicas_keep_one_bundle_whatever_their_tp() -> None:
    assert placement_bundles(PoolConfig(num_cpus=2, tensor_parallel_size=2), "cpu") == [{"CPU": 2.0}]
    assert placement_bundles(PoolConfig(num_cpus=0), "cpu") == [{"CPU": 0.001}]


def test_an_added_engine_takes_an_even_share_of_the_least_used_cores() -> None:
    cores = list(range(8))
    assert least_used_cores(cores, []) == cores
    assert least_used_cores(cores, [[0, 1, 2, 3, 4, 5, 6, 7]]) == [0, 1, 2, 3]
    assert least_used_cores(cores, [[0, 1, 2, 3], [4, 5, 6, 7]]) == [0, 1]
    assert least_used_cores(cores, [[0, 1, 2, 3]]) == [4, 5, 6, 7]  # a removed engine's cores are reused
    assert least_used_cores([0, 1], [[0], [1]]) == [0]  # more engines than cores: shared


def test_engines_sharing_a_host_take_consecutive_ports_of_each_kind() -> None:
    """Two Ray nodes on one host (as ray.cluster_utils.Cluster starts them) count as one host."""
    facts = {"a": NodeFacts("a", "10.0.0.1", [0, 1], "/m"), "b": NodeFacts("b", "10.0.0.1", [0, 1], "/m"),
             "c": NodeFacts("c", "10.0.0.2", [0, 1], "/m")}
    slots = assign_slots(["a", "b", "c", "a"], ["prefill", "decode", "decode", "decode"], [1, 1, 1, 1], PortBases(5600, 7000), False, facts)
    assert [(s.node_ip, s.side_channel_port, s.stream_port) for s in slots] == [
        ("10.0.0.1", 5600, 7000), ("10.0.0.1", 5601, 7001), ("10.0.0.2", 5600, 7000), ("10.0.0.1", 5602, 7002)]
    assert {s.stream_port for s in assign_slots(["a", "c"], ["prefill", "decode"], [1, 1], PortBases(5600), False, facts)} == {None}


def test_a_decode_engine_with_no_core_to_spare_runs_its_other_threads_on_the_prefill_engines_cores() -> None:
    """On a 2-core host 1P1D gives each engine one core: the decode engine's forward pass
    keeps its core to itself (docs/performance.md, "Where a decode engine's other threads
    run"); engines with a core to spare keep everything on their own cores."""
    two = {"n": NodeFacts("n", "10.0.0.1", [0, 1], "/m")}
    prefill, decode = assign_slots(["n", "n"], ["prefill", "decode"], [1, 1], PortBases(5600), True, two)
    assert (prefill.cores, prefill.cpu_binding, prefill.pinned_to) == ([0], "0", [0])
    assert (decode.cores, decode.cpu_binding, decode.pinned_to) == ([1], "1", [0])
    eight = {"n": NodeFacts("n", "10.0.0.1", list(range(8)), "/m")}
    prefill, decode = assign_slots(["n", "n"], ["prefill", "decode"], [1, 1], PortBases(5600), True, eight)
    assert (decode.cores, decode.cpu_binding, decode.pinned_to) == ([4, 5, 6, 7], "4,5,6", [4, 5, 6, 7])
    # TP ranks taking every core, and several prefill engines: all the prefill engines' cores.
    six = {"n": NodeFacts("n", "10.0.0.1", list(range(6)), "/m")}
    slots = assign_slots(["n", "n", "n"], ["prefill", "decode", "prefill"], [1, 2, 1], PortBases(5600), True, six)
    assert [(s.cpu_binding, s.pinned_to) for s in slots] == [("0", [0, 1]), ("2|3", [0, 1, 4, 5]), ("4", [4, 5])]
    # No prefill engine on the node (or colocated engines): nowhere else to go.
    four = {"n": NodeFacts("n", "10.0.0.1", [0, 1, 2, 3], "/m")}
    (decode,) = assign_slots(["n"], ["decode"], [4], PortBases(5600), True, four)
    assert decode.pinned_to == [0, 1, 2, 3] and decode.process_cores is None
    both = assign_slots(["n", "n"], ["both", "both"], [1, 1], PortBases(5600), True, two)
    assert [s.pinned_to for s in both] == [[0], [1]]
    # Unbound engines stay unbound.
    assert assign_slots(["n", "n"], ["prefill", "decode"], [1, 1], PortBases(5600), False, two)[1].pinned_to is None
    # 2P1D on two cores, whatever the disaggregation mode: the replicas spread over both
    # cores, the decode engine computing beside the first and running the rest on the other.
    slots = assign_slots(["n"] * 3, ["prefill", "prefill", "decode"], [1] * 3, PortBases(5600), True, two)
    assert [(s.cores, s.pinned_to) for s in slots] == [([0], [0]), ([1], [1]), ([0], [1])]


def test_rays_own_processes_go_where_no_engine_computes_else_beside_the_prefill_engines() -> None:
    """Ray's daemons, Serve and the tier run off every engine's compute cores where the
    engines leave some free; else on the prefill engines' cores, never on a decode step's."""
    # 1P1D on 2 cores: everything computes, the prefill engine's core takes the rest.
    assert control_cores([0, 1], [("prefill", "0"), ("decode", "1")]) == [0]
    # With cores to spare (the ones omp_binding leaves out), those.
    assert control_cores(list(range(8)), [("prefill", "0,1,2"), ("decode", "4,5,6")]) == [3, 7]
    assert control_cores([0, 1], [("colocated", "0")]) == [1]
    # TP ranks name their cores with "|"; two prefill engines and a decode engine on 3 cores.
    assert control_cores([0, 1, 2, 3], [("prefill", "0|1"), ("decode", "2|3")]) == [0, 1]
    assert control_cores([0, 1, 2], [("prefill", "0"), ("prefill", "1"), ("decode", "2")]) == [0, 1]
    # Every core streams tokens, an engine is unbound, or there are no engines: anywhere.
    assert control_cores([0, 1], [("decode", "0"), ("decode", "1")]) is None
    assert control_cores([0, 1], [("prefill", "0"), ("decode", None)]) is None
    assert control_cores([0, 1], []) is None


def test_the_nodes_cores_come_from_tandem_node_cores_where_ray_was_started_narrower(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_cores("0-3,8, 10-11") == [0, 1, 2, 3, 8, 10, 11]
    for bad in ("0-x", "one", " , "):
        with pytest.raises(ValueError, match=NODE_CORES_ENV):
            parse_cores(bad)
    monkeypatch.setenv(NODE_CORES_ENV, "2-3")
    assert node_cores() == [2, 3]
    monkeypatch.delenv(NODE_CORES_ENV)
    assert node_cores() == sorted(os.sched_getaffinity(0))


def test_engine_workers_are_known_by_rays_process_titles_even_while_a_named_one_starts() -> None:
    """Confinement leaves engines by the class in Ray's title: a restarting engine's process
    is listed nowhere yet, and a named actor's title names it first while it starts."""

    class Proc:
        def __init__(self, *args: str) -> None:
            self.args = list(args)

        def cmdline(self) -> list[str]:
            return self.args

    engine = ["EngineActor"]
    for title in (("ray::EngineActor",), ("ray::EngineActor.watch", "", ""), ("ray::tandem:decode-0:EngineActor.__init__", "", "")):
        assert serves_actor(Proc(*title), engine), title  # type: ignore[arg-type]
    for title in (("ray::IDLE",), ("ray::ServeReplica:tandem:openai",), ("ray::EngineActorPool",), ("ray::KVStoreActor.put",),
                  ("/usr/bin/python", "ray::EngineActor"), ()):
        assert not serves_actor(Proc(*title), engine), title  # type: ignore[arg-type]


def test_a_decode_engine_added_later_also_leaves_its_core_to_its_forward_pass() -> None:
    async def place() -> tuple[EngineSlot, EngineSlot]:
        allocator = SlotAllocator(PortBases(5600), True, "/m")
        allocator._facts = {"n": NodeFacts("n", "10.0.0.1", [0, 1, 2, 3], "/m")}  # probed already
        prefill, decode = await allocator.place_all(["n", "n"], ["prefill", "decode"], [1, 1])
        assert (prefill.cpu_binding, decode.cpu_binding, decode.process_cores) == ("0", "2", None)
        more = await allocator.place_one("n", "decode", 1)  # a third engine: one core, the least used
        allocator.release(more)
        return more, await allocator.place_one("n", "prefill", 1)

    more, instead = asyncio.run(place())
    assert (more.cores, more.cpu_binding, more.pinned_to) == ([0], "0", [1])
    assert instead == msgspec.structs.replace(more, process_cores=None)  # a prefill engine keeps to its core


def test_engine_port_ranges_may_not_overlap() -> None:
    with pytest.raises(ConfigError, match=r"`serve.token_path_base_port` \(5601..5602, one port per engine\) overlaps "
                                          r"`kv_transfer.side_channel_base_port`"):
        parse_config({"serve": {"token_path_base_port": 5601}})
    with pytest.raises(ConfigError, match=r"`kv_transfer.side_channel_base_port` .* overlaps `serve.port` \(5603\)"):
        parse_config({"serve": {"port": 5603}, "decode": {"replicas": 3}, "prefill": {}})
    with pytest.raises(ConfigError, match="leaves no room below 65536"):
        parse_config({"serve": {"token_path_base_port": 65535}})
    cfg = parse_config({"serve": {"token_path_base_port": 5602}})  # 5600-5601 and 5602-5603
    assert cfg.serve.token_path_base_port == 5602
    with pytest.raises(ConfigError, match=r"`cpu_tier.index_port` \(8000\) overlaps `serve.port` \(8000\)"):
        parse_config({"cpu_tier": {"index_port": 8000}})
    assert parse_config({"cpu_tier": {"index_port": 5700}}).cpu_tier.index_port == 5700



def test_the_tier_index_port_is_free_and_outside_the_range_for_outgoing_connections() -> None:
    """A port the kernel may hand to an outgoing connection could be held while the index
    restarts; the deploy picks one above that range where the host leaves room."""
    import socket

    from orchestrator.tier import free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        last_outgoing = int(f.read().split()[1])
    port = free_port()
    if last_outgoing < 65535:  # room above the range (Linux's default ends at 60999)
        assert last_outgoing < port <= 65535
    with socket.socket() as sock:
        sock.bind(("", port))  # still free: nothing here kept it

# ---- the operator's view -----------------------------------------------------------------


STATUS = DeploymentStatus(
    "tandem",
    [
        PoolStatus("prefill", 1, 1, [ReplicaStatus("prefill-0", "healthy", "10.0.0.1", 41, 2, 0, "ab12")]),
        PoolStatus("decode", 1, 2, [
            ReplicaStatus("decode-0", "restarting", "10.0.0.1", None, 0, 1, None, "its process died"),
            ReplicaStatus("decode-1", "healthy", "10.0.0.2", 77, 5, 0, "cd34"),
        ]),
    ],
    TierStatus(blocks=12, capacity=48, pinned=1, open_grants=0, stores={"node-a": (12, 48)}, lookups=9, hit_blocks=7,
               saved_blocks=20, evicted_blocks=8, expired_grants=1),
)


def test_health_is_degraded_while_every_pool_has_a_healthy_replica_and_down_when_one_has_none() -> None:
    assert STATUS.health == "degraded"
    down = msgspec.structs.replace(STATUS, pools=[STATUS.pools[1], PoolStatus("prefill", 1, 1, [])])
    assert down.health == "down"


def test_status_json_has_the_documented_shape() -> None:
    data = json.loads(to_json(STATUS))
    replica = data["pools"][1]["replicas"][0]
    assert {"id", "state", "node", "pid", "outstanding", "restarts"} <= replica.keys()
    assert [p["role"] for p in data["pools"]] == ["prefill", "decode"]
    assert data["cpu_tier"]["blocks"] == 12 and data["cpu_tier"]["capacity"] == 48


def test_the_status_table_names_each_replica_its_state_and_its_last_error() -> None:
    text = render(STATUS)
    assert "deployment tandem: degraded" in text
    assert "decode pool: 1/2 healthy (min 1, max 2)" in text
    line = next(line for line in text.splitlines() if "decode-0" in line)
    assert "restarting" in line and "its process died" in line
    assert "CPU tier: 12/48 blocks (25%), 1 pinned, 0 slots being written" in text
    assert "since the index started: 9 lookups found 7 blocks, 20 saved, 8 evicted, 0 lost with a store, 1 leases expired" in text


def test_metrics_show_a_down_engine_as_down_with_its_restarts() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from orchestrator.metrics import TandemMetrics

    page = TandemMetrics("t").render([], {}, STATUS).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(page) for s in f.samples}
    down = (("app", "t"), ("engine", "decode-0"), ("pool", "decode"))
    assert samples[("tandem_engine_up", down)] == 0
    assert samples[("tandem_engine_restarts_total", down)] == 1
    assert samples[("tandem_engine_state", tuple(sorted((*down, ("state", "restarting")))))] == 1
    assert samples[("tandem_engine_up", (("app", "t"), ("engine", "decode-1"), ("pool", "decode")))] == 1
    assert samples[("tandem_pool_healthy_replicas", (("app", "t"), ("pool", "decode")))] == 1
    app = (("app", "t"),)
    assert samples[("tandem_cpu_tier_blocks", app)] == 12 and samples[("tandem_cpu_tier_capacity_blocks", app)] == 48
    assert samples[("tandem_cpu_tier_lookups_total", app)] == 9 and samples[("tandem_cpu_tier_hit_blocks_total", app)] == 7
    assert samples[("tandem_cpu_tier_evicted_blocks_total", app)] == 8 and samples[("tandem_cpu_tier_expired_grants_total", app)] == 1
    no_tier = TandemMetrics("t").render([], {}, msgspec.structs.replace(STATUS, cpu_tier=None)).decode()
    assert "tandem_cpu_tier" not in no_tier  # the tier off (or its index silent): no series rather than zeros


# ---- health checks ----------------------------------------------------------------------


class _Health:
    """A replica's handle whose health calls answer after the delays given, in order."""

    def __init__(self, *delays: float) -> None:
        self.delays = list(delays)
        self.health = self

    def remote(self) -> asyncio.Future:
        return asyncio.ensure_future(asyncio.sleep(self.delays.pop(0), result=None))


def _check(peers: int, *delays: float) -> tuple[bool, list[str], int]:
    """Run the pool manager's confirmed health check (its real method, on a stand-in for the
    actor's state) of one replica with `peers` healthy others in its pool; returns the
    verdict, the states the replica went through and the checks it missed."""
    from types import SimpleNamespace

    from orchestrator.config import HealthConfig
    from orchestrator.pools import PoolManager, Replica

    states: list[str] = []
    r = Replica("decode-0", "decode", None, None, handle=_Health(*delays), state="healthy")  # type: ignore[arg-type]
    others = {f"decode-{i + 1}": Replica(f"decode-{i + 1}", "decode", None, None, state="healthy") for i in range(peers)}  # type: ignore[arg-type]

    def set_state(replica: Replica, state: str) -> None:
        replica.state = state  # type: ignore[assignment]
        states.append(state)

    manager = SimpleNamespace(replicas={"decode-0": r, **others}, health=HealthConfig(timeout_s=0.2), _set_state=set_state)
    answers = PoolManager.__ray_metadata__.modified_class._answers
    return asyncio.run(answers(manager, r)), states, r.missed_checks


def test_a_missed_health_check_is_confirmed_before_the_engine_is_condemned() -> None:
    # Answers in time: nothing happens.
    assert _check(1, 0.0) == (True, [], 0)
    # One miss: out of routing while it is asked again; answers the second time.
    assert _check(1, 1.0, 0.0) == (True, ["unhealthy"], 1)
    # Two misses: condemned (the caller restarts it).
    assert _check(1, 1.0, 1.0) == (False, ["unhealthy"], 2)
    # The pool's last replica in routing stays there while it is checked again.
    assert _check(0, 1.0, 0.0) == (True, [], 1)
    assert _check(0, 1.0, 1.0) == (False, [], 2)


def test_a_shrinking_pool_gives_up_a_replica_still_starting_before_draining_a_serving_one() -> None:
    """A burst asks for a second replica and ends before it is up: stopping the new one keeps
    a replica serving; draining the serving one would leave the pool with none until the new
    one starts."""
    from actors.protocol import EngineLoad
    from orchestrator.pools import Replica, shrink_victim

    def replica(engine_id: str, state: str, requests: int = 0) -> Replica:
        r = Replica(engine_id, "decode", None, None, state=state)  # type: ignore[arg-type]
        r.load = EngineLoad(requests, 0, float(requests), 0.0, 0.0) if state == "healthy" else None
        return r

    serving, starting = replica("decode-0", "healthy", 0), replica("decode-1", "starting")
    assert shrink_victim([serving, starting]) is starting
    busy, idle = replica("decode-0", "healthy", 3), replica("decode-1", "healthy", 1)
    assert shrink_victim([busy, idle]) is idle  # none starting: the least loaded healthy one
    assert shrink_victim([replica("decode-0", "healthy", 1), replica("decode-1", "healthy", 1)]).engine_id == "decode-1"


def test_joining_by_an_address_that_is_not_host_port_names_it_before_ray_tries() -> None:
    with pytest.raises(ConnectionError, match="'headnode' is not a Ray cluster address: give HOST:PORT"):
        join_ray("headnode")


def closed_port() -> int:
    """A port that was free a moment ago and has nothing listening now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_joining_an_address_where_nothing_listens_fails_at_once_naming_it() -> None:
    port = closed_port()
    with pytest.raises(ConnectionError, match=rf"nothing accepts connections at '127.0.0.1:{port}'.*no Ray cluster's GCS"):
        join_ray(f"127.0.0.1:{port}")


def test_auto_naming_a_cluster_that_is_gone_fails_at_once_saying_where_auto_looked(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ray's "auto" takes RAY_ADDRESS first, then the address the last `ray start` left in
    # /tmp/ray/ray_current_cluster; either may name a cluster that has since stopped.
    port = closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(ConnectionError, match=rf"nothing accepts connections at 'auto' \([^)]*:{port}: RAY_ADDRESS"):
        join_ray("auto")


def test_auto_with_no_cluster_to_find_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray._private.services as services

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: [])  # no GCS on this host
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)  # no `ray start` recorded
    with pytest.raises(ConnectionError, match="no Ray cluster found for 'auto': Could not find any running Ray instance"):
        join_ray("auto")
