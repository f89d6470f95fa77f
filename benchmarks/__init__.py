"""Benchmarks for any OpenAI-compatible server: load generation, figures, reports.

The pieces, one concern per module:

- `workloads`: what to send. Frozen msgspec Structs that `sample(num_requests, seed,
  tokenizer=None) -> list[BenchRequest]`:
  `RandomWorkload(input_len, output_len)`,
  `ConversationWorkload(turns, system_len, user_len, reply_len)` (shared system prompt plus a
  growing history), `DatasetWorkload(path=<bundled prompts>, output_len=None)`. Lengths are
  `Fixed(value)`, `Uniform(low, high)` or `Normal(mean, std, low=1, high=None)`. A tokenizer
  from `load_tokenizer(folder_or_hub_id)` makes random prompts exactly `input_len` tokens long.
  `WorkloadSpec` / `LengthDist` decode from config: `{"type": "random", "input_len":
  {"type": "fixed", "value": 512}, ...}`.
- `loadgen`: how to send it. `await run_load(base_url, model, requests, *, rate=None,
  concurrency=None, arrival="poisson", seed=0, warmup=0, duration_s=None, max_requests=None,
  slo=None, ignore_eos=True, extra_body=None, metric_names=(), request_timeout_s=600.0,
  label="", progress=True) -> RunResult` streams `/v1/completions` with usage. `await
  run_sweep(base_url, model, workload, num_requests, *, rates=... | concurrencies=...,
  tokenizer=None, seed=0, warmup=0, **run_load_kwargs) -> list[RunResult]` runs one point per
  value with fresh prompts. `await scrape_metrics(base_url, names)` and `metric_deltas(before,
  after)` read Prometheus samples (run_load does it itself when given `metric_names`).
- `stats`: the figures, pure functions. `RequestResult` (token timestamps; ttft, itls, tpot),
  `summarize(results, duration_s, slo=None) -> RunSummary` (mean/p50/p90/p99 of TTFT, TPOT,
  ITL, e2e in ms; throughputs; SLO attainment; goodput in req/s), `SLO(ttft_ms, tpot_ms)`,
  `slo_attainment(results, slo)`, `goodput_from_sweep([(rate, attainment), ...], target=0.9)`
  (DistServe: highest rate with >= 90% of requests meeting both SLOs) and
  `bisect_goodput(measure, low, high, target=0.9, tolerance=0.1)` where `measure(rate)` returns
  the attainment of a run at that rate.
- `report` (imports matplotlib, so not re-exported here): `save_json` / `load_json` of a
  `RunResult`, `markdown_table(results, per_request=())`, `plot_latency_vs_load(runs, path,
  x="rate")`, `plot_goodput(runs, path)`, `plot_phase_breakdown({scenario: {phase: seconds}},
  path)`, where `runs` maps a scenario's name to the `RunResult`s of its sweep; and
  `write_bench_report(report, out_dir)`, every file `tandem bench` leaves.

Typical use from a scenario script::

    requests = RandomWorkload(Fixed(512), Fixed(128)).sample(220, seed=0, tokenizer=tok)
    result = await run_load("http://127.0.0.1:8000", "tiny", requests, rate=4.0, warmup=20,
                            slo=SLO(ttft_ms=500, tpot_ms=100), label="1P1D",
                            metric_names=["tandem_kv_transfer_bytes_total"])
    result.summary.ttft_ms.p99, result.summary.slo_attainment, result.summary.server_metrics
"""

from benchmarks.loadgen import RunConfig, RunResult, run_load, run_sweep, scrape_metrics
from benchmarks.stats import SLO, RequestResult, RunSummary, goodput_from_sweep, summarize
from benchmarks.workloads import (
    BenchRequest,
    ConversationWorkload,
    DatasetWorkload,
    Fixed,
    Normal,
    RandomWorkload,
    Uniform,
    Workload,
    WorkloadSpec,
    load_tokenizer,
)

__all__ = [
    "SLO",
    "BenchRequest",
    "ConversationWorkload",
    "DatasetWorkload",
    "Fixed",
    "Normal",
    "RandomWorkload",
    "RequestResult",
    "RunConfig",
    "RunResult",
    "RunSummary",
    "Uniform",
    "Workload",
    "WorkloadSpec",
    "goodput_from_sweep",
    "load_tokenizer",
    "run_load",
    "run_sweep",
    "scrape_metrics",
    "summarize",
]
