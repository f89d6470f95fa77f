"""`tandem bench`'s fault scenarios: detection and recovery from status samples, TTFT around
the kill, the summary table, and one real SIGKILL of a decode engine under load."""

from __future__ import annotations

import argparse
import os

import msgspec
import pytest

from benchmarks.bench import add_arguments, checked_scenarios, options_from_args
from benchmarks.protocol import BenchOptions, BenchReport
from benchmarks.report import fault_table, write_bench_report
from benchmarks.faults import FaultPlan, FaultReport, StatusSample, changes, detection, fault_windows, first_replica, max_gap, window_of
from benchmarks.loadgen import RunConfig, RunResult, environment
from benchmarks.scenarios import parse_scenario, scenario_config
from benchmarks.stats import RequestResult, summarize
from orchestrator.config import parse_config
from orchestrator.protocol import DeploymentStatus, PoolStatus, ReplicaStatus

KILL_S = 10.0


def sample(t: float, state: str, restarts: int = 0, pid: int | None = 100) -> StatusSample:
    return StatusSample(t, state, restarts, pid)  # type: ignore[arg-type]


# A kill at 10 s: the manager notices 0.3 s later, the engine restarts and is back at 40 s.
SAMPLES = [
    sample(9.95, "healthy"),
    sample(10.05, "healthy"),  # the answer left the manager before it noticed
    sample(10.30, "restarting", 1, None),
    sample(10.35, "restarting", 1, None),
    sample(39.90, "restarting", 1, None),
    sample(40.00, "healthy", 1, 200),
    sample(40.05, "healthy", 1, 200),
]


def test_detection_is_the_first_sample_out_of_routing_and_recovery_the_first_healthy_one_with_the_restart_counted() -> None:
    assert detection(SAMPLES, KILL_S, restarts_before=0) == (pytest.approx(0.30), pytest.approx(30.0))


def test_a_healthy_sample_with_the_old_restart_count_is_no_recovery() -> None:
    stale = [sample(10.1, "healthy"), sample(10.2, "unhealthy"), sample(11.0, "healthy", 0)]
    assert detection(stale, KILL_S, restarts_before=0) == (pytest.approx(0.2), None)


def test_samples_before_the_kill_do_not_count() -> None:
    assert detection([sample(5.0, "starting"), sample(9.0, "healthy", 1)], KILL_S, restarts_before=0) == (None, None)


def test_the_timeline_keeps_the_first_sample_and_each_change() -> None:
    assert changes(SAMPLES) == [SAMPLES[0], SAMPLES[2], SAMPLES[5]]
    assert max_gap(SAMPLES) == pytest.approx(29.55)
    assert max_gap(SAMPLES[:1]) == 0.0


def request(start: float, ttft: float | None, error: str | None = None, latency: float | None = None) -> RequestResult:
    times = [] if ttft is None else [ttft, ttft + 0.01]
    return RequestResult(index=0, start=start, latency=latency or (ttft or 0.0) + 0.01, token_times=times, output_tokens=len(times), error=error)


def test_a_request_is_before_the_kill_only_if_its_first_token_came_before_it() -> None:
    assert window_of(request(9.5, 0.2), KILL_S, 40.0) == "before"
    assert window_of(request(9.9, 0.2), KILL_S, 40.0) == "during"  # sent before, answered after the kill
    assert window_of(request(9.9, None, "HTTP 500", latency=0.5), KILL_S, 40.0) == "during"  # failed after the kill
    assert window_of(request(9.9, None, "HTTP 500", latency=0.05), KILL_S, 40.0) == "before"
    assert window_of(request(39.9, 0.1), KILL_S, 40.0) == "during"
    assert window_of(request(40.0, 0.1), KILL_S, 40.0) == "after"


def test_each_window_counts_its_requests_and_failures_and_gives_the_ttft_of_the_others() -> None:
    requests = [request(1.0, 0.1), request(9.5, 0.2), request(9.9, 2.0), request(20.0, None, "HTTP 500"), request(40.0, 0.3), request(45.0, 0.1)]
    before, during, after = fault_windows(requests, KILL_S, recovered_s=40.0)
    assert (before.name, before.num_requests, before.num_failed) == ("before", 2, 0)
    assert before.ttft_ms.p50 == pytest.approx(150.0) and before.ttft_ms.p99 == pytest.approx(199.0)
    assert (during.name, during.num_requests, during.num_failed, during.ttft_ms.p50) == ("during", 2, 1, pytest.approx(2000.0))
    assert (after.name, after.num_requests, after.ttft_ms.p50) == ("after", 2, pytest.approx(200.0))


def test_without_recovery_the_fault_lasts_to_the_end_of_the_run() -> None:
    before, during, after = fault_windows([request(1.0, 0.1), request(12.0, 0.5), request(90.0, 0.4)], KILL_S, recovered_s=None)
    assert (before.num_requests, during.num_requests, after.num_requests) == (1, 2, 0)
    assert after.ttft_ms.p50 is None


def test_the_load_is_sized_to_outlast_the_window() -> None:
    # 2 req/s over 10 + 150 s: 320 expected, 3 standard deviations (53.7) more, plus one.
    assert FaultPlan(10.0, 150.0, 10.0).num_requests(2.0) == 375
    assert FaultPlan(1.0, 1.0, 1.0).num_requests(0.5) == 5


# ---- scenarios and options -----------------------------------------------------------


def test_a_fault_scenario_deploys_the_same_pools_as_1p1d() -> None:
    base = parse_config({"prefill": {"replicas": 3, "num_cpus": 2}, "decode": {"replicas": 2}})
    for role in ("prefill", "decode"):
        scenario = parse_scenario(f"fault:{role}")
        assert scenario.fault == role and scenario.kind == "disaggregated"
        assert scenario_config(base, scenario, 9100, 7100) == scenario_config(base, parse_scenario("1p1d"), 9100, 7100)


def test_fault_options_come_from_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--scenarios", "fault:prefill", "--fault-after", "3", "--fault-window", "60", "--fault-tail", "2"])
    assert options_from_args(args) == BenchOptions(scenarios="fault:prefill", fault_after_s=3.0, fault_window_s=60.0, fault_tail_s=2.0)


def test_fault_scenarios_are_refused_on_a_cluster() -> None:
    with pytest.raises(ValueError, match="fault:decode: fault scenarios SIGKILL engine processes on this host"):
        checked_scenarios(BenchOptions(scenarios="1p1d,fault:decode", address="10.0.0.1:6379"))
    assert [s.name for s in checked_scenarios(BenchOptions(scenarios="1p1d,fault:decode"))] == ["1p1d", "fault:decode"]


def test_the_victim_is_the_roles_first_replica_and_must_be_healthy() -> None:
    def status(state: str, pid: int | None) -> DeploymentStatus:
        prefill = [ReplicaStatus("prefill-0", state, "127.0.0.1", pid, 0, 0), ReplicaStatus("prefill-1", "healthy", "127.0.0.1", 1, 0, 0)]  # type: ignore[arg-type]
        return DeploymentStatus("bench", [PoolStatus("prefill", 2, 2, prefill), PoolStatus("decode", 1, 1, [])])

    victim, pid = first_replica(status("healthy", os.getpid()), "prefill")
    assert (victim.id, pid) == ("prefill-0", os.getpid())
    with pytest.raises(RuntimeError, match="prefill-0 is restarting"):
        first_replica(status("restarting", None), "prefill")
    with pytest.raises(RuntimeError, match="no decode replica"):
        first_replica(status("healthy", os.getpid()), "decode")


# ---- report --------------------------------------------------------------------------


def fault_report(recover_s: float | None = 30.0, errors: int = 0) -> FaultReport:
    requests = [request(1.0, 0.1), request(9.5, 0.2), request(12.0, 1.5), request(45.0, 0.12)]
    requests += [request(11.0, None, "stream error: engine died") for _ in range(errors)]
    config = RunConfig("http://x", "m", "fault:prefill", 2.0, None, "poisson", 0, 0, 160.0, None, True, 60.0)
    counters = {"tandem_fallbacks_total": 3.0, "tandem_engine_restarts_total": 1.0}
    run = RunResult(config, environment(), summarize(requests, 50.0, server_metrics=counters), requests, started=1000.0)
    detect_s, _ = detection(SAMPLES, KILL_S, 0)
    return FaultReport(
        scenario=parse_scenario("fault:prefill"), plan=FaultPlan(10.0, 150.0, 10.0), startup_s=42.0, victim="prefill-0", pid=100,
        kill_s=KILL_S, detect_s=detect_s, recover_s=recover_s,
        windows=fault_windows(requests, KILL_S, None if recover_s is None else KILL_S + recover_s),
        timeline=changes(SAMPLES), num_samples=len(SAMPLES), max_gap_s=max_gap(SAMPLES), run=run,
    )


def test_the_fault_table_sets_each_figure_beside_its_goal() -> None:
    table = fault_table([fault_report()])
    assert "| | Goal | fault:prefill |" in table
    assert "| time to detect (s): kill to out of routing | < 2 | 0.30 ✓ |" in table
    assert "| time to recover (s): kill to healthy again, restart counted | < 90 | 30.00 ✓ |" in table
    assert "| requests lost | 0 | 0 of 4 ✓ |" in table
    assert "| TTFT p50 / p99 (ms), requests answered before the kill |  | 150.0 / 199.0 (n=2) |" in table
    assert "| TTFT p50 / p99 (ms), requests during the fault (answered after the kill, sent before recovery) |  | 1,500.0 / 1,500.0 (n=1) |" in table
    assert "| tandem_fallbacks_total over the run |  | 3 |" in table
    assert "| tandem_migrations_total over the run |  | — (not on /metrics) |" in table
    assert "| victim's state (s from the kill) |  | healthy (pid 100) -0.05, restarting +0.30, healthy (pid 200) +30.00 |" in table
    assert "Requests lost" not in table and fault_table([]) == ""


def test_the_fault_table_marks_missed_goals_and_lists_the_lost_requests_errors() -> None:
    table = fault_table([fault_report(recover_s=None, errors=2)])
    assert "| < 90 | not seen ✗ |" in table
    assert "| requests lost | 0 | 2 of 6 ✗ |" in table
    assert "- fault:prefill: 2 × `stream error: engine died`" in table


def test_a_bench_of_fault_scenarios_only_writes_their_json_plot_and_summary(tmp_path) -> None:
    report = BenchReport(BenchOptions(scenarios="fault:prefill"), "tandem bench --scenarios fault:prefill", [], faults=[fault_report(errors=1)])
    summary = write_bench_report(report, tmp_path).read_text()
    assert "## Faults: one engine SIGKILLed 10 s into a load at 2 req/s" in summary and "Serving over HTTP" not in summary
    saved = msgspec.json.decode((tmp_path / "fault-prefill.json").read_bytes(), type=FaultReport)
    assert saved == report.faults[0] and saved.recovered_at == pytest.approx(40.0)
    assert msgspec.json.decode((tmp_path / "bench.json").read_bytes(), type=BenchReport).faults == report.faults
    assert (tmp_path / "fault-prefill.png").stat().st_size > 0
    assert not (tmp_path / "latency.png").exists()


# ---- one real fault ------------------------------------------------------------------


@pytest.mark.engines
def test_a_decode_engine_sigkilled_under_load_is_detected_recovers_and_loses_no_request(ray_local, tiny_model, tmp_path) -> None:
    from benchmarks.bench import run_bench

    # A few seconds of load before the kill; sending stops 2 s after recovery (the window only bounds it).
    opts = BenchOptions(scenarios="fault:decode", rates=(2.0,), warmup=1, input_len=64, output_len=16, request_timeout_s=120.0,
                        overhead=False, nixl_micro=False, fault_after_s=3.0, fault_window_s=300.0, fault_tail_s=2.0)
    report = run_bench(opts, tmp_path)
    summary = write_bench_report(report, tmp_path).read_text()
    (f,) = report.faults
    assert f.victim == "decode-0" and report.scenarios == []
    assert f.detected_at is not None and f.recovered_at is not None
    assert 0 < f.kill_s < f.detected_at < f.recovered_at
    assert f.num_lost == 0, f.run.summary.errors
    assert f.counter("tandem_engine_restarts_total") == 1
    last = f.timeline[-1]
    assert (last.state, last.restarts) == ("healthy", 1) and last.pid not in (None, f.pid)
    before, during, after = f.windows
    assert before.num_requests > 0 and before.num_requests + during.num_requests + after.num_requests == f.run.summary.num_requests
    # Sending stopped once the tail after recovery was over, long before the window's end.
    assert max(r.start for r in f.run.requests) <= f.recovered_at + opts.fault_tail_s + f.max_gap_s + 1.0
    assert "## Faults" in summary and "| requests lost | 0 | 0 of" in summary
    for name in ("fault-decode.json", "fault-decode.png", "bench.json", "summary.md"):
        assert (tmp_path / name).is_file(), name
