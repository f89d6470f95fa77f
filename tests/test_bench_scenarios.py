"""`tandem bench`: scenario names, per-scenario configs, phase arithmetic, and one real run."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import msgspec
import psutil
import pytest

from benchmarks.bench import add_arguments, options_from_args, scenario_names
from benchmarks.protocol import BenchOptions, BenchReport, CpuMatched, ScenarioReport
from benchmarks.report import overhead_table, phase_table, routing_table, transfer_table, vllm_comparison
from benchmarks.loadgen import HostCpu, RunConfig, RunResult, environment
from actors.nixl_agent import GPU_UCX_ENV
from benchmarks.nixl_micro import KVGeometry, Memory, markdown, parse_paths, run_micro, standard_sizes
from benchmarks.nixl_micro import main as micro_main
from benchmarks.phases import (
    CACHE_HIT_TOKENS,
    COMPUTED_TOKENS,
    ENGINE_FIRST_TOKEN_COUNTS,
    ENGINE_FIRST_TOKEN_SUMS,
    KV_BYTES,
    KV_SECONDS,
    KV_SLOW,
    KV_TRANSFERS,
    LOCAL_PREFILLS,
    TTFT_COUNT,
    VLLM_SERVER_METRICS,
    Overhead,
    PathFigures,
    decode_share_from_metrics,
    decode_share_from_traces,
    engine_first_token_ms,
    engine_compute,
    engine_queue,
    engine_tpot_ms,
    handed_on_share_from_metrics,
    metric_names,
    kv_rate_gib_s,
    router_phase,
    requests_with_first_token,
    router_phases_from_metrics,
    router_phases_from_traces,
    tpot_phases,
    ttft_phases,
)
from benchmarks.scenarios import PORT_BAND, Scenario, free_ports, parse_scenario, parse_scenarios, round_order, scenario_config, vllm_server_command
from benchmarks.server_cpu import CpuMeter, CpuReading, ServerCpu, cpu_between
from benchmarks.stats import RequestResult, summarize
from orchestrator.config import PoolConfig, parse_config
from orchestrator.router import RequestTrace

BASE = parse_config({
    "engine_args": {"max_model_len": 512, "dtype": "bfloat16"},
    "prefill": {"replicas": 3, "num_cpus": 2},
    "decode": {"replicas": 2, "num_cpus": 1, "engine_args": {"max_num_seqs": 8}},
})


# ---- scenario names ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("colocated", Scenario("colocated:1", "colocated", num_decode=1)),
        ("colocated:3", Scenario("colocated:3", "colocated", num_decode=3)),
        ("1p1d", Scenario("1p1d", "disaggregated", num_prefill=1, num_decode=1)),
        (" 2P1D ", Scenario("2p1d", "disaggregated", num_prefill=2, num_decode=1)),
        ("vllm-server", Scenario("vllm-server", "vllm-server", num_decode=1)),
        ("Ray-Serve-LLM", Scenario("ray-serve-llm", "ray-serve-llm", num_prefill=1, num_decode=1)),
        ("fault:prefill", Scenario("fault:prefill", "disaggregated", num_prefill=1, num_decode=1, fault="prefill")),
        ("Fault:Decode", Scenario("fault:decode", "disaggregated", num_prefill=1, num_decode=1, fault="decode")),
    ],
)
def test_scenario_names_parse_to_pools(text: str, expected: Scenario) -> None:
    assert parse_scenario(text) == expected


@pytest.mark.parametrize("text", ["colocated:0", "0p1d", "1p0d", "p1d", "monolithic", "colocated:x", "fault", "fault:both", "fault:colocated"])
def test_a_bad_scenario_name_says_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match=r"scenario|engine"):
        parse_scenario(text)


def test_a_scenario_sets_routing_fields_in_brackets_as_the_config_file_would() -> None:
    """Routing options compared in the same rounds: the brackets' fields reach the deployed
    config, typed as YAML reads them, and the comma inside them does not split the list."""
    both = parse_scenarios("3p1d@kv_aware, 3p1d@kv_aware[prefill_speed_samples=16, evict_cost=2.5]")
    assert [s.name for s in both] == ["3p1d@kv_aware", "3p1d@kv_aware[prefill_speed_samples=16, evict_cost=2.5]"]
    assert both[1].routing == (("prefill_speed_samples", 16), ("evict_cost", 2.5))
    cfg = scenario_config(BASE, both[1], port=9100, side_channel_base_port=7100)
    assert (cfg.routing.policy, cfg.routing.disaggregation) == ("kv_aware", "always")
    assert (cfg.routing.prefill_speed_samples, cfg.routing.evict_cost) == (16, 2.5)
    assert scenario_config(BASE, both[0], 9100, 7100).routing.prefill_speed_samples == BASE.routing.prefill_speed_samples
    conditional = parse_scenario("2p1d@kv_aware+conditional[first_token=decode]")
    assert scenario_config(BASE, conditional, 9100, 7100).routing.disaggregation == "conditional"
    assert scenario_config(BASE, conditional, 9100, 7100).routing.first_token == "decode"


@pytest.mark.parametrize(("text", "says"), [
    ("3p1d@kv_aware[evict_cost=-1]", r"routing\.evict_cost"),  # the config's own bound
    ("3p1d@kv_aware[evict_costs=2]", "evict_costs"),  # no such field
    ("3p1d@kv_aware[first_token=both]", r"routing\.first_token"),
    ("3p1d@kv_aware[evict_cost]", "not <routing field>=<value>"),
    ("3p1d@kv_aware[evict_cost=1,evict_cost=2]", "more than once"),
    ("3p1d@kv_aware[policy=round_robin]", r"set by the name"),
    ("3p1d@kv_aware[disaggregation=never]", r"set by the name"),
    ("3p1d@kv_aware[evict_cost=1", "unknown scenario"),
])
def test_a_bad_routing_field_in_a_scenario_names_the_field_and_the_scenario(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as err:
        parse_scenarios(f"3p1d@round_robin,{text}")
    assert "scenario" in str(err.value)


def test_a_list_keeps_its_order_and_refuses_duplicates() -> None:
    assert [s.name for s in parse_scenarios("1p1d, colocated:1,vllm-server")] == ["1p1d", "colocated:1", "vllm-server"]
    with pytest.raises(ValueError, match="more than once"):
        parse_scenarios("colocated,colocated:1")
    with pytest.raises(ValueError, match="no scenario"):
        parse_scenarios(" , ")


# ---- configs per scenario ------------------------------------------------------------


def test_a_colocated_scenario_replaces_the_pools_and_keeps_the_rest() -> None:
    cfg = scenario_config(BASE, parse_scenario("colocated:2"), port=9100, side_channel_base_port=7100)
    assert cfg.pools == {"both": PoolConfig(replicas=2, num_cpus=1, engine_args={"max_num_seqs": 8})}
    assert (cfg.serve.port, cfg.serve.app_name, cfg.kv_transfer.side_channel_base_port) == (9100, "bench", 7100)
    assert cfg.engine_args == BASE.engine_args and cfg.model == BASE.model
    assert not cfg.disaggregated


def test_a_disaggregated_scenario_keeps_each_pools_per_replica_settings() -> None:
    cfg = scenario_config(BASE, parse_scenario("2p1d"), port=9100, side_channel_base_port=7100)
    assert cfg.prefill == PoolConfig(replicas=2, num_cpus=2)
    assert cfg.decode == PoolConfig(replicas=1, num_cpus=1, engine_args={"max_num_seqs": 8})
    assert cfg.colocated is None and cfg.disaggregated


def test_disaggregated_pools_from_a_colocated_base_copy_its_settings() -> None:
    base = parse_config({"colocated": {"replicas": 4, "num_cpus": 3}})
    cfg = scenario_config(base, parse_scenario("1p1d"), 9100, 7100)
    assert cfg.prefill == cfg.decode == PoolConfig(replicas=1, num_cpus=3)


def test_the_vllm_server_command_carries_the_same_engine_args() -> None:
    cfg = scenario_config(BASE, parse_scenario("vllm-server"), port=9100, side_channel_base_port=7100)
    cmd = vllm_server_command(msgspec.structs.replace(cfg, engine_args={**cfg.engine_args, "enable_prefix_caching": False}), "/models/tiny")
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for part in ("--model /models/tiny", "--served-model-name tandem-tiny", "--host 127.0.0.1", "--port 9100",
                 "--enforce-eager", "--max-model-len 512", "--dtype bfloat16", "--max-num-seqs 8", "--no-enable-prefix-caching"):
        assert part in joined


def test_the_vllm_server_serves_the_dtype_tandems_engines_would_on_this_host(monkeypatch) -> None:
    """Where the config names no dtype, a CPU without AVX-512 gets float32 on both sides
    (orchestrator.specs.local_engine_args), so neither is compared computing emulated half precision."""
    import platform

    from actors import affinity

    unnamed = scenario_config(parse_config({"engine_args": {"max_model_len": 512}}), parse_scenario("vllm-server"),
                              port=9100, side_channel_base_port=7100)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(affinity, "cpu_flags", lambda: {"avx2", "fma"})
    assert "--dtype float32" in " ".join(vllm_server_command(unnamed, "/models/tiny"))
    assert "--dtype bfloat16" in " ".join(vllm_server_command(
        scenario_config(BASE, parse_scenario("vllm-server"), port=9100, side_channel_base_port=7100), "/models/tiny"))
    monkeypatch.setattr(affinity, "cpu_flags", lambda: {"avx2", *affinity.AVX512_FLAGS})
    assert "--dtype" not in " ".join(vllm_server_command(unnamed, "/models/tiny"))


def test_an_embedded_ray_offers_the_cpus_of_the_largest_scenario() -> None:
    from benchmarks.scenarios import cpus_needed

    base = parse_config(None)
    assert cpus_needed(base, parse_scenarios("colocated:1,2p2d,vllm-server")) == 5  # 4 engines of 1 CPU, plus one


def test_free_ports_are_consecutive_bindable_outside_the_ephemeral_range_and_never_repeated() -> None:
    first = free_ports(3)
    for port in range(first, first + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    # Below the range outgoing connections take their local ports from.
    assert PORT_BAND[0] <= first and first + 3 <= PORT_BAND[1]
    handed = [free_ports(2) for _ in range(50)]
    ports = [p for f in [first, *handed] for p in range(f, f + (3 if f == first else 2))]
    assert len(ports) == len(set(ports))


def test_cli_options_become_bench_options() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    opts = options_from_args(parser.parse_args(["--rates", "0.5,2", "--scenarios", "1p1d", "--no-nixl-micro", "--duration", "30"]))
    assert opts == BenchOptions(rates=(0.5, 2.0), scenarios="1p1d", nixl_micro=False, duration_s=30.0)


def test_rounds_are_checked_and_run_every_scenario_once_per_round_every_other_round_reversed() -> None:
    from benchmarks.bench import checked_scenarios

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    opts = options_from_args(parser.parse_args(["--client", "vllm", "--rounds", "3", "--scenarios", "colocated:1,vllm-server"]))
    assert (opts.client, opts.rounds) == ("vllm", 3)
    scenarios = checked_scenarios(opts)
    assert [(r, s.name) for r, s in round_order(scenarios, 3)] == [
        (0, "colocated:1"), (0, "vllm-server"), (1, "vllm-server"), (1, "colocated:1"), (2, "colocated:1"), (2, "vllm-server")]
    with pytest.raises(ValueError, match="at least 1, not 0"):
        checked_scenarios(msgspec.structs.replace(opts, rounds=0))
    assert checked_scenarios(msgspec.structs.replace(opts, client="tandem")) == scenarios  # Tandem's load generator too
    with pytest.raises(ValueError, match="fault:decode: fault scenarios run once"):
        checked_scenarios(msgspec.structs.replace(opts, client="tandem", scenarios="1p1d,fault:decode"))
    with pytest.raises(ValueError, match="--target-url server is measured once"):
        checked_scenarios(msgspec.structs.replace(opts, client="tandem", target_url="http://127.0.0.1:8000"))


def test_the_rounds_table_sets_each_scenario_against_the_first_of_its_round_and_pools_the_rounds() -> None:
    from benchmarks.report import rounds_table

    always, conditional = parse_scenario("3p1d@kv_aware"), parse_scenario("3p1d@kv_aware+conditional")
    # Round 1: 100 ms against 80 (0.80x); round 2, the host slower: 200 against 100 (0.50x).
    reports = [ScenarioReport(always, 1.0, [_run("a", 1.0, 0.100, 0.002)], round=0),
               ScenarioReport(conditional, 1.0, [_run("c", 1.0, 0.080, 0.002)], round=0),
               ScenarioReport(conditional, 1.0, [_run("c", 1.0, 0.100, 0.002)], round=1),
               ScenarioReport(always, 1.0, [_run("a", 1.0, 0.200, 0.002)], round=1)]
    table = rounds_table(reports)
    assert "| 3p1d@kv_aware | 1 | 150.0 / 150.0 / 200.0 | 2.0 | 1.00x / 1.00x | 1.00x / 1.00x | 1.00x / 1.00x | 1.00x / 1.00x / 1.00x |  |" in table
    # Pooled: 90 ms p50 (three requests at 80, three at 100) against 150; p99 100 against 200.
    # Every round's requests are alike, so each resample pools the same figures: the interval
    # is the point.
    assert ("| 3p1d@kv_aware+conditional | 1 | 90.0 / 90.0 / 100.0 | 2.0 | 0.80x / 0.80x | 0.50x / 0.50x | 0.65x / 0.65x "
            "| 0.60x / 0.60x / 0.50x | 0.60-0.60x / 0.60-0.60x / 0.50-0.50x |") in table
    assert "Ratios are to 3p1d@kv_aware (the first scenario listed) in the same round" in table
    assert "Each conditional scenario" not in table  # its twin is the first listed: the table above
    assert rounds_table([msgspec.structs.replace(r, round=None) for r in reports[:2]]) == ""  # one round: nothing to set apart


def test_the_rounds_table_also_sets_each_conditional_scenario_against_its_always_twin() -> None:
    """Round robin listed first, then kv_aware and kv_aware + conditional: issue 17's
    "conditional never worse than always" is read from a second table, same pairing."""
    from benchmarks.report import rounds_table

    rr, always, conditional = (parse_scenario(f"3p1d@{p}") for p in ("round_robin", "kv_aware", "kv_aware+conditional"))
    other_pools = parse_scenario("2p1d@kv_aware+conditional")  # no always twin of its own pools ran
    ttfts = {rr: (0.200, 0.200), always: (0.100, 0.100), conditional: (0.080, 0.090), other_pools: (0.050, 0.050)}
    reports = [ScenarioReport(s, 1.0, [_run(s.name, 1.0, ttfts[s][r], 0.002)], round=r) for r in (0, 1) for s in ttfts]
    main, twins = rounds_table(reports).split("Each conditional scenario against its twin that disaggregates every request")
    assert "| 3p1d@kv_aware+conditional | 1 | 85.0 / 85.0 / 90.0 | 2.0 | 0.40x / 0.40x | 0.45x / 0.45x |" in main
    assert "| 3p1d@kv_aware | 1 | 100.0 / 100.0 / 100.0 | 2.0 | 1.00x / 1.00x | 1.00x / 1.00x | 1.00x / 1.00x | 1.00x / 1.00x / 1.00x |  |" in twins
    # Round 1: 80 ms against 100, round 2: 90 against 100; pooled 85 (p50 and mean) and 90 (p99).
    assert ("| 3p1d@kv_aware+conditional | 1 | 85.0 / 85.0 / 90.0 | 2.0 | 0.80x / 0.80x | 0.90x / 0.90x | 0.85x / 0.85x "
            "| 0.85x / 0.85x / 0.90x | 0.85-0.85x / 0.85-0.85x / 0.90-0.90x |") in twins
    assert "2p1d@kv_aware+conditional" not in twins


def test_server_replies_are_for_conversations_over_http_without_fault_scenarios() -> None:
    from benchmarks.bench import checked_scenarios, workload_of

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    opts = options_from_args(parser.parse_args(["--workload", "conversation", "--replies", "server", "--no-overhead",
                                                "--scenarios", "1p1d"]))
    assert [s.name for s in checked_scenarios(opts)] == ["1p1d"]
    assert workload_of(opts).replies == "server"
    for bad in ({"overhead": True}, {"workload": "random"}, {"client": "vllm"}, {"scenarios": "1p1d,fault:decode"}):
        with pytest.raises(ValueError, match="--replies server applies to --workload conversation"):
            checked_scenarios(msgspec.structs.replace(opts, **bad))
    staggered = options_from_args(parser.parse_args(["--workload", "conversation", "--chat-order", "staggered"]))
    assert workload_of(staggered).order == "staggered"
    with pytest.raises(ValueError, match="--chat-order orders the turns of chats"):
        checked_scenarios(msgspec.structs.replace(staggered, workload="random"))


def test_the_default_scenarios_add_a_plain_vllm_server_and_ray_serve_llm_on_one_machine_only() -> None:
    assert scenario_names(BenchOptions()) == "colocated:1,1p1d,vllm-server,ray-serve-llm"
    assert scenario_names(BenchOptions(address="10.0.0.1:6379")) == "colocated:1,1p1d"
    assert scenario_names(BenchOptions(scenarios="2p2d", address="10.0.0.1:6379")) == "2p2d"


def test_kv_geometry_counts_block_bytes_from_the_model_shape() -> None:
    g = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype_bytes=2, block_size=128)
    assert g.chunk_bytes == 128 * 2 * 32 * 2
    assert g.block_bytes == 2 * 2 * g.chunk_bytes == 65536
    assert [n for _, n in standard_sizes(g, 257)] == [1, 3, 256]
    assert standard_sizes(g, 257, batch_bytes=2**30)[-1] == ("1024 MiB", 2**30 // 65536)


def test_micro_paths_name_reader_and_target_memory() -> None:
    assert parse_paths("DRAM:DRAM") == [(Memory(), Memory())]
    assert parse_paths("VRAM0:VRAM1, VRAM:DRAM") == [(Memory("VRAM", 0), Memory("VRAM", 1)), (Memory("VRAM", 0), Memory())]
    assert str(Memory("VRAM", 3)) == "VRAM3" and str(Memory()) == "DRAM"
    for bad, named in (("VRAM0", "reader:target"), ("GPU:DRAM", "'GPU'"), ("DRAM:VRAMx", "'VRAMx'")):
        with pytest.raises(ValueError, match=named):
            parse_paths(bad)


def test_micro_reads_real_blocks_between_two_nixl_agents() -> None:
    """Real NIXL agents over UCX in host memory, as `tandem bench` runs it after the scenarios."""
    g = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype_bytes=2, block_size=16)
    results = run_micro(g, [("1 block", 1), ("4 blocks", 4)], iterations=3, warmup=1)
    assert [(r.num_blocks, r.num_descs, r.num_bytes, r.path) for r in results] == [
        (1, 4, g.block_bytes, "DRAM <- DRAM"), (4, 16, 4 * g.block_bytes, "DRAM <- DRAM")]
    assert all(0 < r.median_s <= r.p90_s and r.gib_per_s > 0 for r in results)
    assert "| raw NIXL READ, 4 blocks | DRAM <- DRAM | 4 | 32,768 | 16 |" in markdown(results)


def test_micro_reads_from_a_target_agent_in_a_process_of_its_own() -> None:
    """As a decode engine pulls from a prefill engine: the target agent in a spawned process."""
    g = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype_bytes=2, block_size=16)
    (result,) = run_micro(g, [("4 blocks", 4)], iterations=3, warmup=1, processes=2)
    assert (result.num_descs, result.num_bytes, result.path) == (16, 4 * g.block_bytes, "DRAM <- DRAM, two processes")
    assert 0 < result.median_s <= result.p90_s
    with pytest.raises(ValueError, match="processes=3"):
        run_micro(g, [("1 block", 1)], processes=3)


def test_micro_agents_run_the_ucx_worker_threads_they_are_given() -> None:
    """As a GPU engine's agent has them (GPU_NUM_THREADS); the path names them."""
    g = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype_bytes=2, block_size=16)
    (result,) = run_micro(g, [("4 blocks", 4)], iterations=3, warmup=1, processes=2, threads=2)
    assert result.path == "DRAM <- DRAM, two processes, 2 UCX threads" and 0 < result.median_s <= result.p90_s


def test_micro_on_a_gpu_path_without_a_gpu_says_what_to_do() -> None:
    g = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=32, dtype_bytes=2, block_size=16)
    with pytest.raises(SystemExit, match="VRAM0: this host's torch sees 0 GPU"):
        run_micro(g, [("1 block", 1)], iterations=1, reader_memory=Memory("VRAM", 0))


def test_micro_measures_gpu_paths_with_the_ucx_settings_serving_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU run asks UCX for cuda_ipc reads, as disaggregated GPU engines do (else it times a
    TCP fallback serving never takes); a value already in the environment stays; a host-memory
    run sets nothing."""
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64}))
    (name, value), = GPU_UCX_ENV.items()
    monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match="VRAM0: this host's torch sees 0 GPU"):
        micro_main(["--model", str(tmp_path), "--paths", "VRAM0:DRAM", "--iterations", "1"])
    assert os.environ[name] == value
    monkeypatch.setenv(name, "n")
    with pytest.raises(SystemExit):
        micro_main(["--model", str(tmp_path), "--paths", "DRAM:VRAM0", "--iterations", "1"])
    assert os.environ[name] == "n"
    monkeypatch.delenv(name)
    micro_main(["--model", str(tmp_path), "--paths", "DRAM:DRAM", "--iterations", "1", "--batch-mib", "0.01"])
    assert name not in os.environ
    with pytest.raises(SystemExit):
        micro_main(["--model", str(tmp_path), "--num-threads", "-1"])


# ---- phase arithmetic ----------------------------------------------------------------


def test_a_trace_splits_into_consecutive_phases() -> None:
    t = RequestTrace(t_arrival=10.0, t_prefill_done=10.5, t_decode_sent=10.502, t_first_token=10.7, t_done=11.0)
    assert t.phases() == pytest.approx({"prefill": 0.5, "route": 0.002, "first_token": 0.198, "decode": 0.3})
    colocated = RequestTrace(t_arrival=1.0, t_decode_sent=1.001, t_first_token=1.1, t_done=1.5)
    assert list(colocated.phases()) == ["route", "first_token", "decode"]
    # Over HTTP the ingress times the request's way through vLLM's serving layer first.
    served = RequestTrace(t_received=0.992, t_arrival=1.0, t_decode_sent=1.001, t_first_token=1.1, t_done=1.5)
    assert served.phases() == pytest.approx({"ingress": 0.008, "route": 0.001, "first_token": 0.099, "decode": 0.4})


def _deltas(router: dict[str, float], count: int, **extra: float) -> dict[str, float]:
    out = {router_phase(p, "sum"): s * count for p, s in router.items()} | {router_phase(p, "count"): count for p in router}
    return out | extra


def test_disaggregated_phases_add_up_to_the_client_ttft() -> None:
    """Each engine leg splits into the engine core's queue and compute (vLLM's timestamps) and
    the relay around them; the decode engine's queue holds the KV transfer."""
    (pq, pt), (dq, dt) = engine_queue("prefill"), engine_queue("decode")
    deltas = _deltas({"ingress": 0.012, "prefill": 0.300, "route": 0.001, "first_token": 0.099, "decode": 1.0}, 4,
                     **{pq: 0.2, pt: 4, engine_compute("prefill"): 0.8, dq: 0.24, dt: 4, engine_compute("decode"): 0.08,
                        KV_SECONDS: 0.12, KV_TRANSFERS: 4, KV_BYTES: 4 * 131072})
    phases = ttft_phases(router_phases_from_metrics(deltas), deltas, disaggregated=True, client_ttft_s=0.450)
    assert phases == pytest.approx({
        "HTTP": 0.038, "ingress": 0.012, "prefill: engine queue": 0.050, "prefill: engine compute": 0.200, "prefill: relay": 0.050,
        "decode: waiting for the KV": 0.030, "KV transfer": 0.030, "decode: engine compute": 0.020, "decode: relay": 0.020,
    })
    assert sum(phases.values()) == pytest.approx(0.450)
    # A server whose ingress does not time its own phase: the two stay one row.
    untimed = {k: v for k, v in deltas.items() if '"ingress"' not in k}
    assert ttft_phases(router_phases_from_metrics(untimed), untimed, True, 0.450)["HTTP + ingress"] == pytest.approx(0.050)


def test_a_streamed_prefill_token_leaves_the_decode_leg_out_of_the_ttft() -> None:
    """routing.first_token: prefill: the client's first token is the prefill's; the decode
    engine's queue, KV transfer and first step come after it and are not TTFT phases."""
    forwarded = RequestTrace(t_arrival=10.0, t_prefill_done=10.3, t_first_token=10.301, t_decode_sent=10.3012,
                             t_done=11.0, first_from_prefill=True)
    assert forwarded.phases() == pytest.approx({"prefill": 0.3, "first_token": 0.001, "decode": 0.699})
    assert decode_share_from_traces([forwarded, forwarded]) == 0.0
    (pq, pt), (dq, dt) = engine_queue("prefill"), engine_queue("decode")
    deltas = _deltas({"prefill": 0.300, "first_token": 0.001, "decode": 1.0}, 4,
                     **{pq: 0.2, pt: 4, engine_compute("prefill"): 0.8, dq: 0.24, dt: 4, engine_compute("decode"): 0.08,
                        KV_SECONDS: 0.12, KV_TRANSFERS: 4})
    assert decode_share_from_metrics(deltas) == 0.0
    phases = ttft_phases(router_phases_from_metrics(deltas), deltas, True, 0.350, requests_with_first_token(deltas),
                         decode_share_from_metrics(deltas))
    assert phases == pytest.approx({"HTTP + ingress": 0.049, "prefill: engine queue": 0.050,
                                    "prefill: engine compute": 0.200, "prefill: relay": 0.051})
    # Half the requests forwarded: the decode engine's sums count for the other half.
    mixed = deltas | {router_phase("route", "sum"): 2 * 0.001, router_phase("route", "count"): 2}
    assert decode_share_from_metrics(mixed) == 0.5
    half = ttft_phases(router_phases_from_metrics(mixed), mixed, True, 0.400, requests_with_first_token(mixed), 0.5)
    assert half["decode: engine compute"] == pytest.approx(0.010) and half["KV transfer"] == pytest.approx(0.015)
    assert sum(half.values()) == pytest.approx(0.400)


def test_the_tpot_budget_adds_up_to_the_clients_mean_tpot() -> None:
    """A handed-on request spends one of its intervals on the decode leg (to the second
    token); the decode engine timed the others; the rest is relay. A plain vLLM server
    has engine steps and relay only (negative: its first chunk came late)."""
    forwarded = RequestTrace(t_arrival=10.0, t_prefill_done=10.3, t_first_token=10.301, t_decode_sent=10.3012,
                             t_second_token=10.313, t_done=11.0, first_from_prefill=True)
    assert forwarded.phases() == pytest.approx({"prefill": 0.3, "first_token": 0.001, "second_token": 0.012, "decode": 0.687})
    deltas = _deltas({"prefill": 0.300, "first_token": 0.001, "second_token": 0.0124, "decode": 0.1}, 4,
                     tandem_engine_tpot_seconds_total=4 * 0.003, tandem_engine_decoded_requests_total=4)
    assert handed_on_share_from_metrics(deltas) == 1.0
    budget = tpot_phases(router_phases_from_metrics(deltas), deltas, client_tpot_s=0.0045, output_tokens=32)
    assert budget == pytest.approx({"decode leg, to the second token": 0.0004, "engine steps": 0.003 * 30 / 31,
                                    "relay": 0.0045 - 0.0004 - 0.003 * 30 / 31})
    # Half handed on: the other half's engine timed all 31 intervals.
    half = deltas | {router_phase("second_token", "count"): 2, router_phase("second_token", "sum"): 2 * 0.0124}
    assert tpot_phases(router_phases_from_metrics(half), half, 0.0045, 32)["decode leg, to the second token"] == pytest.approx(0.0002)
    plain = {"vllm:request_time_per_output_token_seconds_sum": 40 * 0.0032, "vllm:request_time_per_output_token_seconds_count": 40}
    assert tpot_phases({}, plain, 0.0028, 32) == pytest.approx(
        {"decode leg, to the second token": 0.0, "engine steps": 0.0032, "relay": -0.0004})
    assert tpot_phases({}, {}, 0.0028, 32) == {} and tpot_phases({}, plain, 0.0028, 1) == {}


def test_the_vllm_client_tpot_budget_has_a_column_per_scenario_the_plain_server_too() -> None:
    from benchmarks.protocol import ClientResult
    from benchmarks.report import vllm_client_tpot_budget

    handed = _deltas({"first_token": 0.001, "second_token": 0.0124}, 4,
                     tandem_engine_tpot_seconds_total=4 * 0.003, tandem_engine_decoded_requests_total=4)
    plain = {"vllm:request_time_per_output_token_seconds_sum": 40 * 0.0032, "vllm:request_time_per_output_token_seconds_count": 40}
    figures = {"completed": 40, "total_output_tokens": 40 * 32}
    text = vllm_client_tpot_budget([ClientResult("vllm-server", "1 req/s", figures | {"mean_tpot_ms": 2.8}, plain),
                                    ClientResult("1p1d", "1 req/s", figures | {"mean_tpot_ms": 4.5}, handed),
                                    ClientResult("colocated:1", "1 req/s", {"completed": 0}, handed)])
    assert text.splitlines()[0] == "| Phase (mean ms) | vllm-server, 1 req/s | 1p1d, 1 req/s |"
    assert "| decode leg, to the second token | 0.00 | 0.40 |" in text and "| relay | -0.40 | 1.20 |" in text
    assert "| engine steps | 3.20 | 2.90 |" in text and text.splitlines()[-1] == "| **= client's mean TPOT** | 2.80 | 4.50 |"


def test_phases_add_up_when_some_requests_were_prefilled_locally() -> None:
    """A conditional router prefilled 2 of 4 requests on the decode engine: those have no
    prefill phase, no prefill-engine queue and no KV transfer, and count 0 for them."""
    (pq, pt), (dq, dt) = engine_queue("prefill"), engine_queue("decode")
    deltas = {
        router_phase("prefill", "sum"): 2 * 0.300, router_phase("prefill", "count"): 2,
        router_phase("route", "sum"): 4 * 0.001, router_phase("route", "count"): 4,
        router_phase("first_token", "sum"): 2 * 0.099 + 2 * 0.200, router_phase("first_token", "count"): 4,
        pq: 2 * 0.1, pt: 2, engine_compute("prefill"): 2 * 0.15, KV_SECONDS: 2 * 0.030, KV_TRANSFERS: 2,
        dq: 2 * 0.04 + 2 * 0.01, dt: 4, engine_compute("decode"): 2 * 0.02 + 2 * 0.15,
    }
    client_ttft = (2 * 0.450 + 2 * 0.250) / 4
    phases = ttft_phases(router_phases_from_metrics(deltas), deltas, True, client_ttft, requests_with_first_token(deltas))
    assert phases == pytest.approx({
        "HTTP + ingress": 0.0495, "prefill: engine queue": 0.050, "prefill: engine compute": 0.075, "prefill: relay": 0.025,
        "decode: waiting for the KV": 0.010, "KV transfer": 0.015, "decode: engine compute": 0.085, "decode: relay": 0.0405,
    })
    assert sum(phases.values()) == pytest.approx(client_ttft) and min(phases.values()) >= 0


def test_colocated_phases_split_the_engine_core_from_the_relay() -> None:
    queue, timed = engine_queue("both")
    deltas = _deltas({"route": 0.001, "first_token": 0.019}, 2, **{queue: 0.004, timed: 2, engine_compute("both"): 0.024})
    phases = ttft_phases(router_phases_from_metrics(deltas), deltas, disaggregated=False)
    assert phases == pytest.approx({"engine queue": 0.002, "engine compute": 0.012, "relay": 0.006})


def test_router_phases_from_traces_average_each_phase_over_the_traces_that_reached_it() -> None:
    traces = [RequestTrace(t_arrival=0.0, t_decode_sent=0.0, t_first_token=0.1, t_done=0.5),
              RequestTrace(t_arrival=0.0, t_decode_sent=0.0, t_first_token=0.3)]
    assert router_phases_from_traces(traces) == pytest.approx({"route": 0.0, "first_token": 0.2, "decode": 0.4})


def test_the_kv_rate_is_bytes_per_transfer_second() -> None:
    assert kv_rate_gib_s({KV_BYTES: 2**30, KV_SECONDS: 0.5}) == 2.0
    assert kv_rate_gib_s({KV_BYTES: 0.0, TTFT_COUNT: 3}) is None


def test_overhead_is_http_minus_direct_field_by_field() -> None:
    http = PathFigures(40.0, 35.0, 2.0, 100.0, {"HTTP + ingress": 12.0, "prefill": 28.0})
    direct = PathFigures(27.0, 25.0, 1.8, None, {"prefill": 27.0})
    o = Overhead(1.0, http, direct)
    assert o.added_ms("ttft_mean_ms") == 13.0 and o.added_ms("e2e_p50_ms") is None
    assert o.phase_rows() == [("HTTP + ingress", 12.0, 0.0, 12.0), ("prefill", 28.0, 27.0, 1.0)]


# ---- report pieces -------------------------------------------------------------------


def _run(label: str, rate: float, ttft: float, tpot: float, server_metrics: dict[str, float] | None = None) -> RunResult:
    results = [RequestResult(index=i, start=0.0, latency=ttft + 9 * tpot, token_times=[ttft + k * tpot for k in range(10)], output_tokens=10) for i in range(3)]
    config = RunConfig("http://x", "m", label, rate, None, "poisson", 0, 0, None, None, True, 60.0)
    return RunResult(config, environment(), summarize(results, 1.0, server_metrics=server_metrics), results)


def test_the_transfer_table_sums_counters_over_runs_and_shows_the_slowest_transfer() -> None:
    runs = [_run("1p1d", r, 0.05, 0.002, {KV_TRANSFERS: n, KV_BYTES: n * 2**20, KV_SECONDS: n * 0.004, KV_SLOW: slow}) for r, n, slow in ((1.0, 3, 0), (2.0, 5, 1))]
    disagg = ScenarioReport(parse_scenario("1p1d"), 60.0, runs, kv_max_s=1.2345)
    colocated = ScenarioReport(parse_scenario("colocated:1"), 60.0, [_run("colocated:1", 1.0, 0.03, 0.002)])
    table = transfer_table(BenchReport(BenchOptions(), "tandem bench", [colocated, disagg]))
    # 8 transfers of 1 MiB in 32 ms in all: 4 ms each, 0.244 GiB/s; one was slow, the slowest took 1.2 s.
    assert "| 1p1d | 8 | 1,048,576 | 4.00 | 0.244 | — | 1,234.5 | 1 |" in table
    assert "colocated:1" not in table


def test_the_routing_table_gives_token_shares_per_policy_and_says_how_to_read_them() -> None:
    # 100 prompt tokens in all: 150 hits (prefill and decode engines both count theirs), 25 computed.
    metrics = {CACHE_HIT_TOKENS: 150.0, COMPUTED_TOKENS: 25.0, LOCAL_PREFILLS: 2.0}
    run = _run("2p1d@kv_aware+conditional", 1.0, 0.05, 0.002, metrics)
    run = msgspec.structs.replace(run, summary=msgspec.structs.replace(run.summary, total_input_tokens=100))
    table = routing_table([ScenarioReport(parse_scenario("2p1d@kv_aware+conditional"), 60.0, [run]),
                           ScenarioReport(parse_scenario("1p1d"), 60.0, [_run("1p1d", 1.0, 0.05, 0.002)])])
    assert "| 2p1d@kv_aware+conditional | 50.0 | 50.0 | 2.0 | 150% | n/a | 25% | 2 |" in table
    assert "1p1d |" not in table  # no policy given: not a routing comparison
    assert table.rstrip().endswith("and the decode engine's own hit may both count).")


def test_the_route_table_pools_rounds_and_splits_requests_by_the_engines_that_served_them() -> None:
    from benchmarks.report import route_table

    def routed(run: RunResult, *routes: tuple[str | None, str | None, str | None]) -> RunResult:
        requests = [msgspec.structs.replace(q, engine=e, prefill_engine=p, disaggregation=d) for q, (e, p, d) in zip(run.requests, routes)]
        return msgspec.structs.replace(run, requests=requests)

    local = ("decode-0", None, "decision=local;reason=short_uncached")
    remote = ("decode-0", "prefill-1", "decision=remote;reason=long_uncached")
    scenario = parse_scenario("2p1d@kv_aware+conditional")
    rounds = [ScenarioReport(scenario, 60.0, [routed(_run("c", 1.0, ttft, 0.002), local, remote, local)], round=r)
              for r, ttft in ((0, 0.05), (1, 0.07))]
    one_route = ScenarioReport(parse_scenario("1p1d"), 60.0, [routed(_run("1p1d", 1.0, 0.05, 0.002), *[remote] * 3)])
    table = route_table([*rounds, one_route])
    assert "| 2p1d@kv_aware+conditional | decode-0 (local) | 4 | 60.0 / 60.0 / 70.0 | 2.0 |" in table, table
    assert "| 2p1d@kv_aware+conditional | prefill-1 → decode-0 | 2 | 60.0 / 60.0 / 69.8 | 2.0 |" in table, table
    assert "1p1d |" not in table  # one route: nothing to split
    # Another server's responses name no engine: no table.
    assert route_table([ScenarioReport(scenario, 60.0, [_run("vllm-server", 1.0, 0.05, 0.002)])]) == ""


def test_vllm_comparison_says_within_20_percent_or_gives_the_measured_overhead() -> None:
    overhead = Overhead(1.0, PathFigures(30.0, 30.0, 2.0, 50.0, {}), PathFigures(12.0, 12.0, 2.0, 32.0, {}))
    tandem = ScenarioReport(parse_scenario("colocated:1"), 60.0, [_run("colocated:1", 1.0, 0.030, 0.0021)], overhead=[overhead])
    plain = ScenarioReport(parse_scenario("vllm-server"), 30.0, [_run("vllm-server", 1.0, 0.010, 0.0020)])
    table = vllm_comparison([tandem, plain])
    # TPOT p50: vLLM 2.0, Tandem 2.1 over HTTP, 2.0 direct; TTFT p50: vLLM 10, Tandem 30 over HTTP, 12 direct.
    assert "| 1 | TPOT | 2.0 | 2.1 | +0.1 | 2.0 | +0.1 | +0.0 | — | within 20% |" in table
    assert "| 1 | TTFT | 10.0 | 30.0 | +20.0 | 12.0 | +18.0 | +2.0 | — | +200%; without Tandem's HTTP path within 20% (+20%) |" in table
    assert vllm_comparison([tandem]) == ""


def test_vllm_comparison_names_the_engine_side_when_the_direct_path_differs_too() -> None:
    overhead = Overhead(1.0, PathFigures(30.0, 30.0, 2.0, 50.0, {}), PathFigures(20.0, 20.0, 2.0, 32.0, {}))
    tandem = ScenarioReport(parse_scenario("colocated:1"), 60.0, [_run("colocated:1", 1.0, 0.030, 0.002), _run("colocated:1", 2.0, 0.030, 0.002)], overhead=[overhead])
    plain = ScenarioReport(parse_scenario("vllm-server"), 30.0, [_run("vllm-server", 1.0, 0.010, 0.002), _run("vllm-server", 2.0, 0.010, 0.002)])
    table = vllm_comparison([tandem, plain])
    assert "| 1 | TTFT | 10.0 | 30.0 | +20.0 | 20.0 | +10.0 | +10.0 | — | +200%: HTTP path +10.0 ms, engine side +100% |" in table
    assert "| 2 | TTFT | 10.0 | 30.0 | +20.0 | — | — | — | — | +200% (no direct run at this rate) |" in table


def test_vllm_comparison_explains_the_engine_side_by_the_cpu_matched_run_within_20_percent_only() -> None:
    # vLLM TTFT 10 ms; Tandem 30 over HTTP, 20 direct (engine side +100%). Tandem's direct run took
    # 0.40 core outside vLLM's engine processes, the vLLM server 0.10: the ballast burned 0.30 core.
    overhead = Overhead(1.0, PathFigures(30.0, 30.0, 2.0, 50.0, {}), PathFigures(20.0, 20.0, 2.0, 32.0, {}))

    def with_cpu(run: RunResult, engine: float, other: float, steal: float = 0.01) -> RunResult:
        return msgspec.structs.replace(run, server_cpu=ServerCpu(engine, other), host_cpu=HostCpu(busy=0.5, steal=steal))

    tandem = ScenarioReport(
        parse_scenario("colocated:1"), 60.0, [with_cpu(_run("colocated:1", 1.0, 0.030, 0.002), 0.9, 0.5)],
        direct=[with_cpu(_run("colocated:1 direct", 1.0, 0.020, 0.002), 0.9, 0.4)], overhead=[overhead],
    )

    def plain_beside(matched_ttft: float) -> ScenarioReport:
        matched = CpuMatched(0.30, with_cpu(_run("vllm-server + 0.30 core", 1.0, matched_ttft, 0.002), 0.8, 0.41, steal=0.079))
        return ScenarioReport(parse_scenario("vllm-server"), 30.0, [with_cpu(_run("vllm-server", 1.0, 0.010, 0.002), 0.95, 0.10)], cpu_matched=[matched])

    # Beside the ballast vLLM takes 18.5 ms: 1.5 ms from Tandem direct, within 20% of 10 ms.
    table = vllm_comparison([tandem, plain_beside(0.0185)])
    assert ("| 1 | TTFT | 10.0 | 30.0 | +20.0 | 20.0 | +10.0 | +10.0 | 18.5 | +200%: HTTP path +10.0 ms, engine side +100%, "
            "as much as Tandem's extra 0.30 core costs vLLM's own server (+85%; Tandem direct within 20% of it) |") in table
    assert ("| 1 | CPU of the server's processes, cores: vLLM engine / rest | 0.95 / 0.10 | 0.90 / 0.50 | +0.40 rest | 0.90 / 0.40 | | | "
            "0.80 / 0.41 | ballast: Tandem direct's rest − vLLM server's rest |") in table
    assert "| 1 | host CPU time stolen by the hypervisor | 1.0% | 1.0% | | 1.0% | | | 7.9% |" in table
    # At 17.5 ms it is 2.5 ms (25%) away: not explained, but the figure is given.
    table = vllm_comparison([tandem, plain_beside(0.0175)])
    assert "| 17.5 | +200%: HTTP path +10.0 ms, engine side +100%; Tandem's extra 0.30 core costs vLLM's own server +75% |" in table


def test_cpu_between_sums_each_group_per_second_of_the_window() -> None:
    # Over 2 s: the engine used 1.8 CPU-s; the rest 0.3 (pid 2) + 0.1 (pid 4, started in the
    # window, counted from zero); pid 3 ended in the window and is lost.
    before = CpuReading(10.0, {1: 5.0}, {2: 1.0, 3: 7.0})
    after = CpuReading(12.0, {1: 6.8}, {2: 1.3, 4: 0.1})
    assert cpu_between(before, after) == ServerCpu(engine=pytest.approx(0.9), other=pytest.approx(0.2))
    with pytest.raises(ValueError, match="later"):
        cpu_between(after, before)


def test_vllm_engine_processes_are_told_apart_by_the_title_vllm_gives_them() -> None:
    from benchmarks.server_cpu import is_engine

    titles = ("VLLM::EngineCore", "VLLM::Worker_TP1", "VLLM::APIServer_0", "python")
    procs = [subprocess.Popen(["bash", "-c", f"exec -a {title} sleep 30"]) for title in titles]
    try:
        deadline = time.monotonic() + 30
        # Until each has exec'd: before that its command line is bash's, or (between fork and
        # exec, on a loaded host) this very Python's.
        while any(psutil.Process(p.pid).cmdline()[:1] != [t] for p, t in zip(procs, titles)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [is_engine(psutil.Process(p.pid)) for p in procs] == [True, True, False, False]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_ballast_burns_in_its_own_processes_and_leaves_none_behind() -> None:
    from benchmarks.ballast import ballast, ballast_procs

    assert ballast_procs(0.3) == 4 and ballast_procs(6.5) == 7
    with pytest.raises(ValueError, match="positive"):
        with ballast(0.0, seconds=5):
            pass
    with ballast(0.2, seconds=60) as pid:
        meter = CpuMeter([pid])
        burners = [p for p in meter.processes() if p.pid != pid]
        assert len(burners) == 4 and all(p.is_running() for p in burners)
        first = meter.read()
        time.sleep(1.0)
        cpu = cpu_between(first, meter.read())
        assert cpu.engine == 0.0 and cpu.other > 0.0
    assert not psutil.pid_exists(pid) and not any(p.is_running() for p in burners)


def test_engine_tpot_is_the_mean_per_request_tpot_whichever_server_reported_it() -> None:
    # Tandem: 3 decoded requests with TPOTs summing to 30 ms; vLLM: 4 requests summing to 24 ms.
    assert engine_tpot_ms({"tandem_engine_tpot_seconds_total": 0.030, "tandem_engine_decoded_requests_total": 3}) == pytest.approx(10.0)
    assert engine_tpot_ms({"vllm:request_time_per_output_token_seconds_sum": 0.024, "vllm:request_time_per_output_token_seconds_count": 4}) == pytest.approx(6.0)
    assert engine_tpot_ms({KV_BYTES: 1.0}) is None


def test_engine_first_token_is_queue_plus_prefill_per_request_whichever_server_reported_it() -> None:
    # Tandem: 4 colocated requests, 8 ms queued and 200 ms prefilling in all: 52 ms each. The
    # prefill pool's samples of a disaggregated run are not the colocated engine's and are ignored.
    tandem = {
        'tandem_engine_phase_seconds_total{phase="queue",pool="both"}': 0.008,
        'tandem_engine_phase_seconds_total{phase="prefill",pool="both"}': 0.200,
        'tandem_engine_timed_requests_total{pool="both"}': 4,
        'tandem_engine_phase_seconds_total{phase="prefill",pool="prefill"}': 9.0,
    }
    assert engine_first_token_ms(tandem) == pytest.approx(52.0)
    # vLLM: 5 requests, 5 ms queued and 195 ms prefilling in all: 40 ms each.
    plain = {"vllm:request_queue_time_seconds_sum": 0.005, "vllm:request_prefill_time_seconds_sum": 0.195, "vllm:request_prefill_time_seconds_count": 5}
    assert engine_first_token_ms(plain) == pytest.approx(40.0)
    assert engine_first_token_ms({KV_BYTES: 1.0}) is None


def test_a_vllm_server_is_scraped_for_its_engine_timings_and_tandem_for_its_own() -> None:
    assert {"vllm:request_prefill_time_seconds_sum", "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_count"} <= set(VLLM_SERVER_METRICS)
    names = metric_names()
    assert len(names) == len(set(names))
    assert {n for n in (*ENGINE_FIRST_TOKEN_SUMS, *ENGINE_FIRST_TOKEN_COUNTS) if n.startswith("tandem_")} <= set(names)


def test_vllm_comparison_adds_the_engines_own_tpot_when_both_servers_report_it() -> None:
    overhead = Overhead(1.0, PathFigures(30.0, 30.0, 2.0, 50.0, {}), PathFigures(12.0, 12.0, 2.0, 32.0, {}))
    tandem_engine = {"tandem_engine_tpot_seconds_total": 0.0066, "tandem_engine_decoded_requests_total": 3}
    tandem = ScenarioReport(
        parse_scenario("colocated:1"), 60.0, [_run("colocated:1", 1.0, 0.030, 0.0021, tandem_engine)],
        direct=[_run("colocated:1 direct", 1.0, 0.012, 0.002, {"tandem_engine_tpot_seconds_total": 0.0063, "tandem_engine_decoded_requests_total": 3})],
        overhead=[overhead],
    )
    plain = ScenarioReport(parse_scenario("vllm-server"), 30.0, [_run("vllm-server", 1.0, 0.010, 0.0020, {
        "vllm:request_time_per_output_token_seconds_sum": 0.006, "vllm:request_time_per_output_token_seconds_count": 3})])
    # Engine TPOT: vLLM 2.0 ms, Tandem 2.2 ms over HTTP (+10%), 2.1 ms on the direct run.
    table = vllm_comparison([tandem, plain])
    assert "| 1 | engine TPOT (mean; vLLM's engine-core timing, no relay) | 2.0 | 2.2 | +0.2 | 2.1 | | | — | +10% in the engine itself |" in table
    # Neither server reported queue and prefill times here: no first-token row.
    assert "engine time to first token" not in table


def test_vllm_comparison_adds_the_engines_own_time_to_first_token_before_its_tpot() -> None:
    overhead = Overhead(1.0, PathFigures(30.0, 30.0, 2.0, 50.0, {}), PathFigures(12.0, 12.0, 2.0, 32.0, {}))
    q, p, n = 'tandem_engine_phase_seconds_total{phase="queue",pool="both"}', 'tandem_engine_phase_seconds_total{phase="prefill",pool="both"}', 'tandem_engine_timed_requests_total{pool="both"}'
    tandem = ScenarioReport(
        parse_scenario("colocated:1"), 60.0, [_run("colocated:1", 1.0, 0.030, 0.002, {q: 0.001, p: 0.029, n: 2})],  # 15 ms each
        direct=[_run("colocated:1 direct", 1.0, 0.012, 0.002, {q: 0.0, p: 0.026, n: 2})],  # 13 ms
        overhead=[overhead],
    )
    plain = ScenarioReport(parse_scenario("vllm-server"), 30.0, [_run("vllm-server", 1.0, 0.010, 0.002, {
        "vllm:request_queue_time_seconds_sum": 0.0, "vllm:request_prefill_time_seconds_sum": 0.024, "vllm:request_prefill_time_seconds_count": 2})])  # 12 ms
    table = vllm_comparison([tandem, plain])
    row = "| 1 | engine time to first token (mean; vLLM's engine-core timing: queue + prefill) | 12.0 | 15.0 | +3.0 | 13.0 | | | — | +25% in the engine itself |"
    assert row in table
    assert table.index("| 1 | TTFT |") < table.index(row)


def test_the_overhead_table_has_a_row_per_rate_and_splits_each_by_phase() -> None:
    def at(rate: float, http_ttft: float) -> Overhead:
        http = PathFigures(http_ttft, http_ttft, 2.0, 50.0, {"HTTP + ingress": http_ttft - 10.0, "prefill": 10.0})
        return Overhead(rate, http, PathFigures(10.0, 10.0, 1.5, 40.0, {"prefill": 10.0}))

    report = ScenarioReport(parse_scenario("colocated:1"), 1.0, [], overhead=[at(1.0, 30.0), at(2.0, 45.0)])
    table = overhead_table([report])
    assert "| colocated:1 | 1 | 30.0 / 10.0 | 20.0 | 30.0 / 10.0 | 20.0 | 2.0 / 1.5 | 0.5 | 50.0 / 40.0 | 10.0 |" in table
    assert "| colocated:1 | 2 | 45.0 / 10.0 | 35.0 |" in table
    assert "| colocated:1 | 2 | HTTP + ingress | 35.0 | 0.0 | 35.0 |" in table
    assert report.overhead_at(2.0) is report.overhead[1] and report.overhead_at(4.0) is None


def test_the_phase_table_has_one_column_per_scenario_and_path_and_a_total() -> None:
    report = ScenarioReport(parse_scenario("1p1d"), 1.0, [], phases_ms={"1p1d HTTP": {"prefill": 10.0, "KV transfer": 2.0}, "1p1d direct": {"prefill": 9.0}})
    table = phase_table([report])
    assert "| Phase (mean ms) | 1p1d HTTP | 1p1d direct |" in table
    assert "| KV transfer | 2.0 | — |" in table
    assert "| **= mean TTFT** | 12.0 | 9.0 |" in table


# ---- one real run --------------------------------------------------------------------


@pytest.mark.engines
def test_a_short_bench_of_tandem_and_a_plain_vllm_server_writes_every_file_and_consistent_figures(ray_local, tiny_model, tmp_path) -> None:
    from benchmarks.bench import MIN_BALLAST_CORES, run_bench
    from benchmarks.report import write_bench_report

    # Two rounds: colocated:1, vllm-server, then the other way round, each a fresh deployment.
    opts = BenchOptions(scenarios="colocated:1,vllm-server", rounds=2, rates=(4.0,), num_requests=4, warmup=1, input_len=64, output_len=8,
                        duration_s=30.0, request_timeout_s=60.0)
    report = run_bench(opts, tmp_path)
    summary = write_bench_report(report, tmp_path).read_text()
    assert [s.label for s in report.scenarios] == ["colocated:1, round 1", "vllm-server, round 1", "vllm-server, round 2", "colocated:1, round 2"]
    scenario, plain, plain_again, again = report.scenarios
    (run,) = scenario.runs
    assert plain.scenario.name == "vllm-server" and plain.runs[0].summary.num_completed == 4
    assert "## Tandem colocated vs a plain vLLM server" in summary and "| 4, round 1 | TPOT |" in summary and "| 4, round 2 | TPOT |" in summary
    # Every round sends the same requests to its fresh deployment; the rounds' table pools them.
    assert again.runs[0].config.seed == run.config.seed and again.runs[0].summary.num_completed == 4
    assert plain_again.cpu_matched == []  # colocated:1 had not run yet in its round: nothing to match
    assert "## 2 rounds, each scenario against the first of its round" in summary
    assert "| colocated:1 | 4 | " in summary and "1.00x / 1.00x | 1.00x / 1.00x | 1.00x / 1.00x / 1.00x |" in summary
    assert (tmp_path / "colocated-1-round-2-00-rate-4.json").is_file()
    (direct,) = scenario.direct
    assert run.summary.num_failed == 0 and direct.summary.num_failed == 0 and direct.config.rate == run.config.rate
    http = scenario.phases_ms["colocated:1, round 1 HTTP"]
    assert sum(http.values()) == pytest.approx(run.summary.ttft_ms.mean, rel=1e-6)
    assert http["engine queue"] >= 0 and http["engine compute"] > 0 and http["relay"] > 0  # relay: the leg around the engine core
    assert [o.rate for o in scenario.overhead] == [4.0] and report.micro and report.geometry is not None
    assert "| 4, round 1 | TTFT |" in summary and "(no direct run at this rate)" not in summary
    # Each server's processes were read over its runs; the vLLM server ran once more beside a
    # ballast of what Tandem's stack took beyond its own, on the direct run's prompts.
    assert run.server_cpu and direct.server_cpu and plain.runs[0].server_cpu
    assert run.server_cpu.engine > 0 and plain.runs[0].server_cpu.engine > 0
    # A run this short on a fast host can leave Tandem's stack no measurable extra CPU; then
    # there is nothing to burn and the report must say so instead of a matched column.
    extra = direct.server_cpu.other - plain.runs[0].server_cpu.other
    assert "| 4, round 1 | CPU of the server's processes, cores: vLLM engine / rest |" in summary
    if extra < MIN_BALLAST_CORES:
        assert plain.cpu_matched == [] and "no CPU-matched run |" in summary
    else:
        (matched,) = plain.cpu_matched
        assert matched.ballast_cores == pytest.approx(extra)
        assert matched.run.summary.num_completed == 4 and matched.run.config.rate == 4.0 and matched.run.server_cpu
        assert matched.run.config.seed == direct.config.seed  # the same arrival schedule
        assert (tmp_path / "vllm-server-round-1-cpu-matched-00-rate-4.json").is_file()
    for name in ("summary.md", "results.md", "bench.json", "latency.png", "goodput.png", "phases.png"):
        assert (tmp_path / name).is_file(), name


def test_routing_scenarios_set_the_policy_and_the_bench_can_drop_the_tier() -> None:
    from benchmarks.bench import base_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    opts = options_from_args(parser.parse_args(["--workload", "conversation", "--turns", "4", "--no-cpu-tier",
                                                "--scenarios", "2p1d@kv_aware+conditional"]))
    assert (opts.workload, opts.turns, opts.cpu_tier) == ("conversation", 4, False)
    base = base_config(opts)
    assert not base.cpu_tier.enabled
    scenario = parse_scenario("2P1D@kv_aware+conditional")
    cfg = scenario_config(base, scenario, 8000, 5600)
    assert (cfg.routing.policy, cfg.routing.disaggregation) == ("kv_aware", "conditional")
    assert cfg.prefill is not None and cfg.prefill.replicas == 2
    plain = scenario_config(base, parse_scenario("2p1d@round_robin"), 8000, 5600)
    assert (plain.routing.policy, plain.routing.disaggregation) == ("round_robin", "always")
    with pytest.raises(ValueError, match="unknown routing policy"):
        parse_scenario("2p1d@fastest")


def test_the_vllm_client_runs_the_bench_workload_with_arguments_vllm_accepts() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from benchmarks.vllm_bench import workload_runs

    runs = workload_runs(BenchOptions(rates=(1.0, 2.5), num_requests=40, input_len=256, output_len=32, warmup=2, seed=7))
    assert [r.label for r in runs] == ["1 req/s", "2.5 req/s"]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--model", "m", *runs[1].args])  # vLLM's own parser: it rejects what it does not know
    assert (args.dataset_name, args.random_input_len, args.random_output_len, args.num_prompts) == ("random", 256, 32, 40)
    assert (args.request_rate, args.num_warmups, args.ignore_eos, float(args.random_range_ratio)) == (2.5, 2, True, 0.0)
    assert args.seed == 8  # each rate its own prompts: the next rate would hit the prefix cache
    with pytest.raises(ValueError, match="random workload"):
        workload_runs(BenchOptions(workload="conversation"))


def test_the_vllm_client_table_sets_each_scenario_against_the_plain_server() -> None:
    from benchmarks.phases import LOCAL_PREFILLS
    from benchmarks.protocol import ClientResult
    from benchmarks.report import TOKEN_SOURCES, vllm_client_table

    def figures(ttft: float, tpot: float) -> dict[str, object]:
        return {"completed": 40, "failed": 0, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "median_tpot_ms": tpot,
                "mean_tpot_ms": tpot + 1, "median_itl_ms": tpot, "total_input_tokens": 1000}

    vllm_tpot = {"vllm:request_time_per_output_token_seconds_sum": 0.16, "vllm:request_time_per_output_token_seconds_count": 40}
    grown = {n: 500.0 for n in TOKEN_SOURCES.values()} | {LOCAL_PREFILLS: 3.0, "tandem_engine_tpot_seconds_total": 0.2,
                                                          "tandem_engine_decoded_requests_total": 40}
    text = vllm_client_table([ClientResult("vllm-server", "2 req/s", figures(50.0, 5.0), vllm_tpot),
                              ClientResult("1p1d", "2 req/s", figures(75.0, 6.0), grown)])
    assert "| vllm-server | 2 req/s | 40 / 0 | 50.0 / 100.0 | 5.0 | 5.0 | 6.0 / 4.0 |  |  |  |" in text
    assert "| 1p1d | 2 req/s | 40 / 0 | 75.0 / 150.0 | 6.0 | 6.0 | 7.0 / 5.0 | 1.50x / 1.20x | 50% / 50% / 50% | 3 |" in text


def test_with_rounds_each_scenario_is_set_against_the_plain_server_of_its_own_round() -> None:
    from benchmarks.protocol import ClientResult
    from benchmarks.report import peer_comparison, round_ratios, vllm_client_table

    def figures(ttft: float, tpot: float) -> dict[str, object]:
        return {"completed": 40, "failed": 0, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "median_tpot_ms": tpot,
                "mean_tpot_ms": tpot, "median_itl_ms": tpot, "total_input_tokens": 1000}

    # The host slows down in round 2: the plain server with it.
    results = [ClientResult("colocated:1", "2 req/s", figures(12.0, 2.2), {}, 0),
               ClientResult("vllm-server", "2 req/s", figures(10.0, 2.0), {}, 0),
               ClientResult("ray-serve-llm", "2 req/s", figures(100.0, 10.0), {}, 0),
               ClientResult("ray-serve-llm", "2 req/s", figures(150.0, 15.0), {}, 1),
               ClientResult("vllm-server", "2 req/s", figures(20.0, 4.0), {}, 1),
               ClientResult("colocated:1", "2 req/s", figures(26.0, 4.8), {}, 1),
               ClientResult("colocated:1", "2 req/s", figures(11.0, 2.0), {}, 2),
               ClientResult("vllm-server", "2 req/s", figures(10.0, 2.0), {}, 2)]
    table = vllm_client_table(results)
    assert "| colocated:1 | 2 req/s, round 2 | 40 / 0 | 26.0 / 52.0 | 4.8 | 4.8 | 4.8 / — | 1.30x / 1.20x |  |  |" in table
    lines = round_ratios(results).splitlines()
    assert lines[0] == "| scenario | load | round 1 | round 2 | round 3 | median |"
    assert lines[2] == "| colocated:1 | 2 req/s | 1.20x / 1.10x | 1.30x / 1.20x | 1.10x / 1.00x | 1.20x / 1.10x |"
    assert lines[3] == "| ray-serve-llm | 2 req/s | 10.00x / 5.00x | 7.50x / 3.75x |  | 8.75x / 4.38x |"  # no round 3 run
    assert round_ratios([r for r in results if r.round == 0]) == ""  # one round: the main table says it all
    assert "| colocated:1 | 2 req/s, round 2 | 5.8x | 5.8x | 3.1x |" in peer_comparison(results)


def test_without_the_plain_server_rounds_are_set_against_the_first_scenario_and_pooled() -> None:
    """The held-out routing check (`python -m benchmarks.vllm_bench --rounds N ... --save-detailed`):
    policies against the first listed, per round and over every round's requests pooled."""
    from benchmarks.protocol import ClientResult
    from benchmarks.report import pooled_ttft, reference_scenario, round_ratios

    def figures(ttfts_ms: list[float], tpot: float = 5.0, detailed: bool = True) -> dict[str, object]:
        out: dict[str, object] = {"completed": len(ttfts_ms), "failed": 0, "median_ttft_ms": sorted(ttfts_ms)[len(ttfts_ms) // 2],
                                  "p99_ttft_ms": max(ttfts_ms), "median_tpot_ms": tpot, "mean_tpot_ms": tpot}
        return out | ({"ttfts": [t / 1000 for t in ttfts_ms]} if detailed else {})

    # Round 2 runs the scenarios reversed; the first listed is still the reference. A failed
    # request's TTFT (0 in vLLM's file) is left out.
    results = [ClientResult("2p1d@round_robin", "as given", figures([20.0, 30.0, 40.0]), {}, 0),
               ClientResult("2p1d@kv_aware", "as given", figures([10.0, 15.0, 20.0]), {}, 0),
               ClientResult("2p1d@kv_aware", "as given", figures([10.0, 0.0, 30.0, 100.0]), {}, 1),
               ClientResult("2p1d@round_robin", "as given", figures([20.0, 60.0, 80.0]), {}, 1)]
    assert reference_scenario(results) == "2p1d@round_robin"
    lines = round_ratios(results).splitlines()
    assert lines[2] == "| 2p1d@kv_aware | as given | 0.50x / 1.00x | 0.50x / 1.00x | 0.50x / 1.00x |"
    table = pooled_ttft(results).splitlines()
    assert table[0] == "| scenario | load | requests | TTFT p50 / mean / p99 (ms) | over 2p1d@round_robin's | 95% interval |"
    assert table[2] == "| 2p1d@round_robin | as given | 6 | 35.0 / 41.7 / 79.0 |  |  |"
    # Round 2 sent kv_aware four prompts and round robin three: not one request list, no pairs.
    assert table[3] == "| 2p1d@kv_aware | as given | 6 | 17.5 / 30.8 / 96.5 | 0.50x / 0.74x / 1.22x | — |"
    # Paired round by round, the failed request's pair left out: every kv_aware TTFT is half
    # round robin's, so every resample's ratio is 0.50x.
    halves = [msgspec.structs.replace(results[2], vllm=figures([10.0, 0.0, 40.0])), results[3]]
    assert pooled_ttft([*results[:2], *halves]).splitlines()[3].endswith("| 0.50-0.50x / 0.50-0.50x / 0.50-0.50x |")
    assert pooled_ttft(results[:2]) == ""  # one round
    assert pooled_ttft([*results[:3], ClientResult("2p1d@round_robin", "as given", figures([20.0], detailed=False), {}, 1)]) == ""


def test_rounds_pool_into_one_budget_column_per_scenario_and_load() -> None:
    from benchmarks.protocol import ClientResult
    from benchmarks.report import pooled, vllm_client_tpot_budget

    def figures(completed: int, tpot: float) -> dict[str, object]:
        return {"completed": completed, "total_output_tokens": 32 * completed, "mean_tpot_ms": tpot, "mean_ttft_ms": 10.0}

    def engine(requests: int, tpot_s: float) -> dict[str, float]:
        return {"tandem_engine_tpot_seconds_total": requests * tpot_s, "tandem_engine_decoded_requests_total": requests}

    results = [ClientResult("colocated:1", "1 req/s", figures(30, 3.0), engine(30, 0.0028), 0),
               ClientResult("colocated:1", "1 req/s", figures(10, 5.0), engine(10, 0.0048), 1)]
    (merged,) = pooled(results)
    assert (merged.vllm["completed"], merged.vllm["total_output_tokens"]) == (40, 40 * 32)
    assert merged.vllm["mean_tpot_ms"] == pytest.approx(3.5) and merged.vllm["mean_ttft_ms"] == pytest.approx(10.0)
    assert merged.metrics["tandem_engine_decoded_requests_total"] == 40 and merged.engine_tpot_ms == pytest.approx(3.3)
    text = vllm_client_tpot_budget(results)
    assert text.splitlines()[0] == "| Phase (mean ms) | colocated:1, 1 req/s |"
    assert "| engine steps | 3.30 |" in text and text.splitlines()[-1] == "| **= client's mean TPOT** | 3.50 |"


def test_ray_serve_llms_figures_are_set_over_tandems_under_the_same_load() -> None:
    from benchmarks.protocol import ClientResult
    from benchmarks.report import peer_comparison

    def figures(ttft: float, p99: float, tpot: float) -> dict[str, object]:
        return {"median_ttft_ms": ttft, "p99_ttft_ms": p99, "median_tpot_ms": tpot}

    results = [ClientResult("1p1d", "1 req/s", figures(20.0, 40.0, 3.0), {}),
               ClientResult("1p1d", "2 req/s", figures(25.0, 50.0, 4.0), {}),
               ClientResult("vllm-server", "2 req/s", figures(10.0, 20.0, 2.0), {}),
               ClientResult("ray-serve-llm", "2 req/s", figures(125.0, 200.0, 11.0), {})]
    lines = peer_comparison(results).splitlines()
    assert lines[0] == "| scenario | load | ray-serve-llm's TTFT p50 over this | TTFT p99 | TPOT p50 |"
    assert lines[2:] == ["| 1p1d | 2 req/s | 5.0x | 4.0x | 2.8x |"]  # no peer run at 1 req/s; no row for the plain server
    assert peer_comparison(results[:3]) == ""


def test_ray_serve_llm_gets_the_bench_models_engines_each_on_half_the_cores() -> None:
    from benchmarks.ray_serve_llm import engine_cores, pd_serving_args

    cfg = scenario_config(parse_config({"model": {"source": "builtin:tiny", "served_name": "tiny"}, "engine_args": {"max_model_len": 512}}),
                          parse_scenario("ray-serve-llm"), port=9100, side_channel_base_port=7100)
    args = pd_serving_args(cfg, "/models/tiny", [0, 1, 2, 3])
    prefill, decode = args["prefill_config"], args["decode_config"]
    assert prefill["model_loading_config"] == {"model_id": "tiny", "model_source": "/models/tiny"}
    assert prefill["engine_kwargs"] == {"enforce_eager": True, "max_model_len": 512,
                                        "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"}}
    assert prefill["runtime_env"]["env_vars"]["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert decode["runtime_env"]["env_vars"]["VLLM_CPU_OMP_THREADS_BIND"] == "2,3"
    assert decode["runtime_env"]["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == str(cfg.cpu.kvcache_space_gib)
    assert decode["placement_group_config"] == {"bundles": [{"CPU": 1}]}
    msgspec.json.encode(args)  # plain data: it travels to the subprocess as JSON
    assert engine_cores([4, 5, 6]) == ("4", "5,6")
    with pytest.raises(ValueError, match="needs two cores"):
        engine_cores([0])


def test_stopping_a_servers_session_leaves_none_of_its_processes() -> None:
    from benchmarks.scenarios import stop_group

    # The leader goes at SIGTERM; its child ignores SIGTERM, as a server's worker that
    # outlives its parent for a while would.
    proc = subprocess.Popen(["sh", "-c", "(trap '' TERM; exec sleep 120) & wait"], start_new_session=True)
    deadline = time.monotonic() + 10
    while len([p for p in psutil.process_iter() if _sid(p) == proc.pid]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    child = next(p for p in psutil.process_iter() if _sid(p) == proc.pid and p.pid != proc.pid)
    stop_group(proc, linger_s=1.0)
    assert proc.poll() is not None
    deadline = time.monotonic() + 10  # SIGKILLed by stop_group: gone, or a zombie nobody reaps yet
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_stopping_a_servers_session_removes_the_shared_memory_its_vllm_processes_left() -> None:
    """A server process maps a segment in /dev/shm as vLLM's executor queue does (psm_*, not
    unlinked by Python's resource tracker) and dies at SIGTERM without cleaning up, as a
    plain vLLM server killed by the bench did: its segment goes with its session."""
    from benchmarks.scenarios import stop_group
    from tests.shm import start_segment_maker

    proc, segment = start_segment_maker(start_new_session=True)
    stop_group(proc, linger_s=1.0)  # type: ignore[arg-type]
    assert proc.poll() is not None and not segment.exists()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _sid(p: psutil.Process) -> int | None:
    import os

    try:
        return os.getsid(p.pid)
    except OSError:
        return None


def test_the_vllm_client_ttft_budget_adds_up_to_the_clients_mean_ttft() -> None:
    from benchmarks.protocol import ClientResult
    from benchmarks.report import vllm_client_budget

    (pq, pt), (dq, dt) = engine_queue("prefill"), engine_queue("decode")
    grown = {router_phase("prefill", "sum"): 4 * 0.030, router_phase("route", "sum"): 4 * 0.001, router_phase("route", "count"): 4,
             router_phase("first_token", "sum"): 4 * 0.019, router_phase("first_token", "count"): 4,
             pq: 0.004, pt: 4, engine_compute("prefill"): 0.08, dq: 0.04, dt: 4, engine_compute("decode"): 0.02,
             KV_SECONDS: 0.012, KV_TRANSFERS: 4}
    results = [ClientResult("vllm-server", "1 req/s", {"mean_ttft_ms": 12.0}, {}),
               ClientResult("1p1d", "1 req/s", {"mean_ttft_ms": 55.0}, grown)]
    text = vllm_client_budget(results, parse_scenarios("1p1d,vllm-server"))
    assert text.splitlines()[0] == "| Phase (mean ms) | 1p1d, 1 req/s |"  # no column for the plain server
    assert "| HTTP + ingress | 5.0 |" in text and "| prefill: relay | 9.0 |" in text and "| KV transfer | 3.0 |" in text
    assert "| decode: waiting for the KV | 7.0 |" in text and "| decode: relay | 5.0 |" in text
    assert text.splitlines()[-1] == "| **= client's mean TTFT** | 55.0 |"


@pytest.mark.engines
def test_tandem_bench_with_vllms_client_measures_1p1d_and_a_plain_server(ray_local, tiny_model, tmp_path) -> None:
    import json

    from ray import serve

    from benchmarks.bench import run_vllm_client

    # Serve keeps the HTTP port it was first started with (by the bench before, in this
    # module's Ray); this bench picks its own, as on a fresh machine.
    serve.shutdown()
    opts = BenchOptions(client="vllm", scenarios="1p1d,vllm-server", rates=(4.0,), num_requests=4, warmup=1,
                        input_len=64, output_len=8)
    assert run_vllm_client(opts, tmp_path) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(r["scenario"], r["load"]) for r in results] == [("1p1d", "4 req/s"), ("vllm-server", "4 req/s")]
    for r in results:  # vLLM's client saw every request complete, 8 tokens each
        assert (r["vllm"]["completed"], r["vllm"]["failed"], r["vllm"]["total_output_tokens"]) == (4, 0, 32)
    from benchmarks.phases import COMPUTED_TOKENS, LOCAL_PREFILLS

    pd = results[0]["metrics"]  # Tandem's /metrics: the prompts were computed, all on the prefill pool
    assert pd[COMPUTED_TOKENS] >= 4 * 50 and pd.get(LOCAL_PREFILLS, 0.0) == 0.0
    assert set(results[1]["metrics"]) == {"vllm:request_time_per_output_token_seconds_sum",
                                          "vllm:request_time_per_output_token_seconds_count"}  # all a vLLM server has
    summary = (tmp_path / "summary.md").read_text()
    assert "| 1p1d | 4 req/s | 4 / 0 |" in summary and "x / " in summary
    # The TTFT budget: the first token is the prefill's (routing.first_token), so no decode leg in it.
    assert "| prefill: relay |" in summary and "| **= client's mean TTFT** |" in summary
    assert "| decode: relay |" not in summary
