"""Benchmark statistics against values computed by hand."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from benchmarks.stats import (
    SLO,
    RequestResult,
    bisect_goodput,
    goodput_from_sweep,
    meets_slo,
    percentile,
    percentiles_ms,
    ratio_interval,
    slo_attainment,
    summarize,
)


def _request(
    token_times: list[float],
    latency: float,
    output_tokens: int,
    error: str | None = None,
    prompt_tokens: int | None = None,
) -> RequestResult:
    return RequestResult(
        index=0,
        start=0.0,
        latency=latency,
        token_times=token_times,
        output_tokens=output_tokens,
        prompt_tokens=prompt_tokens,
        error=error,
    )


def test_percentile_interpolates_linearly_between_ranks() -> None:
    values = [float(v) for v in range(1, 11)]
    # rank = q/100 * (n - 1): p50 -> 4.5 -> 5.5; p90 -> 8.1 -> 9.1; p99 -> 8.91 -> 9.91
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)


def test_percentile_of_one_value_is_that_value() -> None:
    assert percentile([7.0], 99) == 7.0


def test_percentile_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)


def test_percentiles_are_reported_in_milliseconds() -> None:
    stats = percentiles_ms([0.001, 0.002, 0.003, 0.004])
    # ms [1, 2, 3, 4]: mean 2.5; p50 rank 1.5 -> 2.5; p90 rank 2.7 -> 3.7; p99 rank 2.97 -> 3.97
    assert stats.mean == pytest.approx(2.5)
    assert stats.p50 == pytest.approx(2.5)
    assert stats.p90 == pytest.approx(3.7)
    assert stats.p99 == pytest.approx(3.97)


def test_percentiles_of_nothing_are_none() -> None:
    stats = percentiles_ms([])
    assert (stats.mean, stats.p50, stats.p90, stats.p99) == (None, None, None, None)


def test_ttft_is_the_first_token_time_and_itls_every_gap() -> None:
    r = _request([0.1, 0.15, 0.3, 0.35], latency=0.4, output_tokens=4)
    assert r.ttft == pytest.approx(0.1)
    assert r.itls == pytest.approx([0.05, 0.15, 0.05])


def test_tpot_divides_decode_time_by_tokens_after_the_first() -> None:
    r = _request([0.1, 0.15, 0.3, 0.35], latency=0.4, output_tokens=4)
    assert r.tpot == pytest.approx((0.4 - 0.1) / 3)


def test_tpot_counts_tokens_not_chunks() -> None:
    # Two chunks carrying 7 tokens: (0.8 - 0.2) / 6 = 0.1, one ITL of 0.3.
    r = _request([0.2, 0.5], latency=0.8, output_tokens=7)
    assert r.tpot == pytest.approx(0.1)
    assert r.itls == pytest.approx([0.3])


def test_tpot_is_undefined_for_one_token() -> None:
    assert _request([0.2], latency=0.2, output_tokens=1).tpot is None


def test_a_request_with_an_error_is_not_ok() -> None:
    assert not _request([], latency=0.1, output_tokens=0, error="HTTP 500: boom").ok


SLO_200_50 = SLO(ttft_ms=200.0, tpot_ms=50.0)


def test_a_request_within_both_slos_meets_them() -> None:
    # ttft 100 ms, tpot (0.5 - 0.1) / 10 = 40 ms
    assert meets_slo(_request([0.1], latency=0.5, output_tokens=11), SLO_200_50)


def test_a_slow_first_token_misses_the_slo() -> None:
    # ttft 250 ms > 200 ms although tpot is 40 ms
    assert not meets_slo(_request([0.25], latency=0.65, output_tokens=11), SLO_200_50)


def test_slow_decoding_misses_the_slo() -> None:
    # ttft 100 ms but tpot (0.7 - 0.1) / 10 = 60 ms > 50 ms
    assert not meets_slo(_request([0.1], latency=0.7, output_tokens=11), SLO_200_50)


def test_slo_bounds_are_inclusive() -> None:
    slo = SLO(ttft_ms=250.0, tpot_ms=50.0)
    # ttft exactly 250 ms, tpot (0.75 - 0.25) / 10 = 50 ms
    assert meets_slo(_request([0.25], latency=0.75, output_tokens=11), slo)


def test_a_one_token_answer_is_judged_on_ttft_alone() -> None:
    assert meets_slo(_request([0.1], latency=0.1, output_tokens=1), SLO_200_50)


def test_attainment_counts_failures_as_misses() -> None:
    results = [
        _request([0.1], latency=0.5, output_tokens=11),  # meets
        _request([0.1], latency=0.5, output_tokens=11),  # meets
        _request([0.3], latency=0.7, output_tokens=11),  # ttft miss
        _request([], latency=0.1, output_tokens=0, error="HTTP 503: busy"),  # failure
    ]
    assert slo_attainment(results, SLO_200_50) == pytest.approx(0.5)


def test_summary_figures_match_hand_computation() -> None:
    results = [
        # ttft 0.1, itls [0.1, 0.1], tpot (0.3 - 0.1) / 2 = 0.1, e2e 0.3, meets the SLO? no
        _request([0.1, 0.2, 0.3], latency=0.3, output_tokens=3, prompt_tokens=10),
        # ttft 0.2, itls [0.02], tpot (0.24 - 0.2) / 2 = 0.02, e2e 0.24, meets
        _request([0.2, 0.22], latency=0.24, output_tokens=3, prompt_tokens=20),
        # ttft 0.3, one token, e2e 0.3, ttft over 200 ms: misses
        _request([0.3], latency=0.3, output_tokens=1, prompt_tokens=30),
        _request([], latency=1.0, output_tokens=0, error="HTTP 500: boom"),
    ]
    s = summarize(results, duration_s=2.0, slo=SLO_200_50)
    assert (s.num_requests, s.num_completed, s.num_failed) == (4, 3, 1)
    assert s.errors == {"HTTP 500: boom": 1}
    assert s.request_throughput == pytest.approx(1.5)  # 3 completed / 2 s
    assert s.output_throughput == pytest.approx(3.5)  # 7 tokens / 2 s
    assert (s.total_input_tokens, s.total_output_tokens) == (60, 7)
    assert s.ttft_ms.mean == pytest.approx(200.0)  # (100 + 200 + 300) / 3
    assert s.ttft_ms.p50 == pytest.approx(200.0)
    assert s.ttft_ms.p90 == pytest.approx(280.0)  # rank 1.8 between 200 and 300
    assert s.tpot_ms.mean == pytest.approx(60.0)  # (100 + 20) / 2
    assert s.tpot_ms.p99 == pytest.approx(99.2)  # rank 0.99 between 20 and 100
    assert s.itl_ms.mean == pytest.approx(220.0 / 3)  # (100 + 100 + 20) / 3
    assert s.itl_ms.p50 == pytest.approx(100.0)
    assert s.e2e_ms.mean == pytest.approx(280.0)  # (300 + 240 + 300) / 3
    assert s.slo_attainment == pytest.approx(0.25)  # 1 of 4 sent
    assert s.goodput == pytest.approx(0.5)  # 1 request met both SLOs in 2 s


def test_summary_without_slo_has_no_attainment_or_goodput() -> None:
    s = summarize([_request([0.1], latency=0.1, output_tokens=1)], duration_s=1.0)
    assert s.slo_attainment is None and s.goodput is None


def test_goodput_is_the_highest_swept_rate_reaching_ninety_percent() -> None:
    points = [(4.0, 0.5), (1.0, 1.0), (3.0, 0.9), (2.0, 0.95)]
    assert goodput_from_sweep(points) == 3.0


def test_goodput_is_none_when_no_rate_reaches_the_target() -> None:
    assert goodput_from_sweep([(1.0, 0.89), (2.0, 0.5)]) is None


def test_goodput_target_is_configurable() -> None:
    assert goodput_from_sweep([(1.0, 1.0), (2.0, 0.95), (3.0, 0.9)], target=0.99) == 1.0


def test_bisection_narrows_to_the_boundary_within_tolerance() -> None:
    probed: list[float] = []

    def measure(rate: float) -> float:
        probed.append(rate)
        return 1.0 if rate <= 3.3 else 0.0

    # 1 ok, 5 fails; 3 ok, 4 no, 3.5 no, 3.25 ok, 3.375 no, 3.3125 no -> gap 0.0625 <= 0.1
    assert bisect_goodput(measure, 1.0, 5.0, tolerance=0.1) == 3.25
    assert probed == [1.0, 5.0, 3.0, 4.0, 3.5, 3.25, 3.375, 3.3125]


def test_bisection_returns_high_when_it_already_passes() -> None:
    assert bisect_goodput(lambda rate: 0.95, 1.0, 8.0) == 8.0


def test_bisection_returns_none_when_low_already_fails() -> None:
    assert bisect_goodput(lambda rate: 0.5, 1.0, 8.0) is None


def test_bisection_rejects_an_empty_interval() -> None:
    with pytest.raises(ValueError):
        bisect_goodput(lambda rate: 1.0, 4.0, 2.0)


# Reports: the table shows these figures, the files hold them.


def _run(label: str, rate: float, results: list[RequestResult], metrics: dict[str, float]):
    from benchmarks.loadgen import Environment, RunConfig, RunResult

    config = RunConfig(
        base_url="http://127.0.0.1:1",
        model="m",
        label=label,
        rate=rate,
        concurrency=None,
        arrival="poisson",
        seed=0,
        warmup=0,
        duration_s=None,
        max_requests=None,
        ignore_eos=True,
        request_timeout_s=60.0,
    )
    env = Environment("host", "linux", 2, "3.11", {}, "2025-01-01T00:00:00+00:00")
    summary = summarize(results, duration_s=2.0, slo=SLO_200_50, server_metrics=metrics)
    return RunResult(config, env, summary, results)


def _two_requests() -> list[RequestResult]:
    return [
        _request([0.1, 0.2, 0.3], latency=0.3, output_tokens=3),
        _request([0.1, 0.12], latency=0.14, output_tokens=3),
    ]


def test_markdown_table_shows_the_run_figures() -> None:
    from benchmarks.report import markdown_table

    metrics = {"tandem_kv_bytes_total": 4096.0, "tandem_fallbacks_total": 1.0}
    run = _run("1P1D", 2.0, _two_requests(), metrics)
    header, _, row = markdown_table([run], per_request=["tandem_kv_bytes_total"]).splitlines()
    cells = dict(zip(header.strip("| ").split(" | "), row.strip("| ").split(" | ")))
    assert cells["Scenario"] == "1P1D" and cells["Rate (req/s)"] == "2.00"
    assert cells["OK / failed"] == "2 / 0"
    assert cells["TTFT p50 / p99 (ms)"] == "100.0 / 100.0"
    assert cells["SLO attainment"] == "50.0%"  # tpot 100 ms misses, tpot 20 ms meets
    assert cells["Goodput (req/s)"] == "0.50"
    assert cells["tandem_kv_bytes_total / request"] == "2,048"  # 4096 bytes over 2 requests
    assert cells["tandem_fallbacks_total"] == "1"
    assert cells["Host CPU busy / stolen"] == "—"  # not measured


def test_markdown_table_shows_how_busy_the_host_was() -> None:
    from benchmarks.loadgen import HostCpu
    from benchmarks.report import markdown_table

    run = msgspec.structs.replace(_run("colocated:1", 1.0, _two_requests(), {}), host_cpu=HostCpu(busy=0.5, steal=0.1))
    header, _, row = markdown_table([run]).splitlines()
    cells = dict(zip(header.strip("| ").split(" | "), row.strip("| ").split(" | ")))
    assert cells["Host CPU busy / stolen"] == "50% / 10.0%"


def test_runs_round_trip_through_json_and_plot_to_png(tmp_path) -> None:
    from benchmarks.report import load_json, markdown_table, plot_goodput, plot_latency_vs_load, plot_phase_breakdown, save_json

    runs = {
        "colocated": [_run("colocated", r, _two_requests(), {}) for r in (1.0, 2.0)],
        "1P1D": [_run("1P1D", r, _two_requests(), {}) for r in (1.0, 2.0)],
    }
    save_json(runs["1P1D"][1], tmp_path / "1P1D.json")
    assert load_json(tmp_path / "1P1D.json") == runs["1P1D"][1]
    assert len(markdown_table([r for sweep in runs.values() for r in sweep]).splitlines()) == 2 + 4
    phases = {
        "colocated": {"prefill": 0.2, "decode": 1.0},
        "1P1D": {"prefill": 0.1, "transfer": 0.01, "decode": 0.9},
    }
    written = [
        plot_latency_vs_load(runs, tmp_path / "latency.png"),
        plot_goodput(runs, tmp_path / "goodput.png"),
        plot_phase_breakdown(phases, tmp_path / "phases.png"),
    ]
    for path in written:
        assert path.read_bytes().startswith(b"\x89PNG")


def test_the_ratio_interval_holds_one_where_two_sides_are_alike_and_not_where_one_is_slower() -> None:
    rng = np.random.default_rng(1)
    # Two rounds of 200 requests, each request's own cost shared by both sides (a first
    # request of a prefix is slow on both), the host slower in round 2.
    cost = [rng.lognormal(4.0, 0.5, 200), 1.5 * rng.lognormal(4.0, 0.5, 200)]
    alike = [(c * rng.normal(1.0, 0.05, 200), c * rng.normal(1.0, 0.05, 200)) for c in cost]
    for figure, (low, high) in ratio_interval(alike, ("p50", "mean", "p90", "p99")).items():
        assert low < 1.0 < high, figure
    slower = [(1.3 * c * rng.normal(1.0, 0.05, 200), c * rng.normal(1.0, 0.05, 200)) for c in cost]
    intervals = ratio_interval(slower)
    assert list(intervals) == ["p50", "mean", "p99"]
    for low, high in intervals.values():
        assert 1.0 < low < 1.3 < high < 1.6
    # Seeded: a report reads the same each time; a wider level gives a wider interval.
    assert ratio_interval(slower) == intervals
    wide = ratio_interval(slower, level=0.99)
    assert wide["p50"][0] <= intervals["p50"][0] and wide["p50"][1] >= intervals["p50"][1]


def test_the_ratio_interval_needs_pairs_and_a_known_figure() -> None:
    with pytest.raises(ValueError, match="same number of values"):
        ratio_interval([([1.0, 2.0], [1.0])])
    with pytest.raises(ValueError, match="same number of values"):
        ratio_interval([])
    with pytest.raises(ValueError, match="unknown figure 'p101'"):
        ratio_interval([([1.0], [2.0])], ("p101",))
    with pytest.raises(ValueError, match="unknown figure 'median'"):
        ratio_interval([([1.0], [2.0])], ("median",))
