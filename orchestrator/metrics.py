"""Tandem's Prometheus metrics: the router's own, plus every engine's, on one /metrics page.

The router records per-request figures as they happen. Engine figures (KV bytes and
tokens moved, transfer times, prompt tokens by source) are pulled from the engine actors
at scrape time and exposed with `pool` and `engine` labels, so a "disaggregated"
deployment that silently recomputes shows up as zero external tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from actors.protocol import TRANSFER_BUCKETS, EngineStats
from orchestrator.protocol import REPLICA_STATES, DeploymentStatus
from orchestrator.router import RequestTrace, RouterStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _replica_families(app: str, status: DeploymentStatus | None) -> Iterable[Metric]:
    """Every replica the pool manager knows, down ones included: a dead engine shows as
    tandem_engine_up 0, never as a series that silently vanished. When the manager did not
    answer, tandem_pool_manager_up is 0 and the replicas' state is unknown (no series)."""
    labels = ["app", "pool", "engine"]
    manager = GaugeMetricFamily("tandem_pool_manager_up", "1 when the pool manager answered this scrape, else 0", labels=["app"])
    manager.add_metric([app], 0.0 if status is None else 1.0)
    up = GaugeMetricFamily("tandem_engine_up", "1 while the replica is healthy and in routing, else 0", labels=labels)
    state = GaugeMetricFamily("tandem_engine_state", "1 for the replica's current state", labels=labels + ["state"])
    restarts = CounterMetricFamily("tandem_engine_restarts", "Times the replica's engine was restarted after a failure", labels=labels)
    outstanding = GaugeMetricFamily("tandem_engine_outstanding_requests", "Requests in flight on the engine at its last health check", labels=labels)
    healthy = GaugeMetricFamily("tandem_pool_healthy_replicas", "Healthy replicas per pool", labels=["app", "pool"])
    if status is not None:
        for pool in status.pools:
            role = "both" if pool.role == "colocated" else pool.role
            healthy.add_metric([app, role], pool.num_healthy)
            for r in pool.replicas:
                lv = [app, role, r.id]
                up.add_metric(lv, 1.0 if r.state == "healthy" else 0.0)
                for name in REPLICA_STATES:
                    state.add_metric(lv + [name], 1.0 if r.state == name else 0.0)
                restarts.add_metric(lv, r.restarts)
                outstanding.add_metric(lv, r.outstanding)
    return [manager, up, state, restarts, outstanding, healthy]


# TierStatus field -> (metric, help) of the CPU tier's families; gauges first, then counters.
_TIER_GAUGES = {
    "blocks": ("tandem_cpu_tier_blocks", "Blocks the CPU tier holds"),
    "capacity": ("tandem_cpu_tier_capacity_blocks", "Blocks the CPU tier's stores have room for"),
    "pinned": ("tandem_cpu_tier_pinned_blocks", "Held blocks pinned by a lookup whose load has not ended"),
    "open_grants": ("tandem_cpu_tier_open_grants", "Slot grants for saves not yet written"),
}
_TIER_COUNTERS = {
    "lookups": ("tandem_cpu_tier_lookups", "Prefix lookups the CPU tier's index answered"),
    "hit_blocks": ("tandem_cpu_tier_hit_blocks", "Blocks the index's lookups found"),
    "saved_blocks": ("tandem_cpu_tier_saved_blocks", "Blocks saved into the CPU tier"),
    "evicted_blocks": ("tandem_cpu_tier_evicted_blocks", "Blocks evicted from a full store (least recently used first)"),
    "forgotten_blocks": ("tandem_cpu_tier_forgotten_blocks", "Blocks lost with a store that died or restarted"),
    "expired_pins": ("tandem_cpu_tier_expired_pins", "Lookup pins reclaimed by their lease: nobody released them"),
    "expired_grants": ("tandem_cpu_tier_expired_grants", "Slot grants reclaimed by their lease: the save never committed"),
}


def _tier_families(app: str, status: DeploymentStatus | None) -> Iterable[Metric]:
    """The CPU tier's fill and its index's counts (they restart from 0 with the index);
    nothing when the tier is off or its index did not answer this scrape."""
    tier = status.cpu_tier if status is not None else None
    if tier is None:
        return []
    families: list[Metric] = []
    for kind, fields in ((GaugeMetricFamily, _TIER_GAUGES), (CounterMetricFamily, _TIER_COUNTERS)):
        for field, (name, doc) in fields.items():
            family = kind(name, doc, labels=["app"])
            family.add_metric([app], getattr(tier, field))
            families.append(family)
    return families


def _by_label(name: str, doc: str, app: str, label: str, values: Mapping[str, float],
              kind: type[CounterMetricFamily | GaugeMetricFamily] = CounterMetricFamily) -> Metric:
    """One family of counts (or gauges, `kind`) of this ingress replica, a sample per `label` value."""
    family = kind(name, doc, labels=["app", label])
    for value, n in values.items():
        family.add_metric([app, value], n)
    return family


def _router_families(app: str, stats: RouterStats) -> Iterable[Metric]:
    """This ingress replica's router: failover and cancellation counts, requests in flight."""
    migrations = CounterMetricFamily("tandem_migrations", "Requests moved to another engine mid-stream after the engine serving them failed", labels=["app"])
    migrations.add_metric([app], stats.migrations)
    in_flight = GaugeMetricFamily("tandem_requests_in_flight", "Requests this ingress replica is serving", labels=["app"])
    in_flight.add_metric([app], stats.in_flight)
    decisions = CounterMetricFamily(
        "tandem_disaggregation_decisions",
        "Disaggregated requests prefilled on the prefill pool (remote) or on their decode engine (local), by reason",
        labels=["app", "decision", "reason"],
    )
    for key, n in stats.decisions.items():
        decisions.add_metric([app, *key.split(":")], n)
    continuation = GaugeMetricFamily(
        "tandem_continuation_rate",
        "Of the prompts seen lately that extended no earlier one (a chat's first turn, a one-off question) and were "
        "either extended by a later prompt or waited for longer than the longest pause seen before one was, the share "
        "extended, over every first block; 1 while none is either (conditional disaggregation prices a first turn's "
        "stranded history at the share among those with its own first block)",
        labels=["app"],
    )
    if stats.continuation_rate is not None:
        continuation.add_metric([app], stats.continuation_rate)
    return [
        _by_label("tandem_prefill_retries", "Prefill attempts retried on another prefill replica, by why the attempt ended", app, "reason", stats.retries),
        _by_label("tandem_fallbacks", "Requests that left the disaggregated path, by reason", app, "reason", stats.fallbacks),
        migrations,
        _by_label("tandem_requests_failed", "Requests that could not be served: no engine left, or past routing.max_migrations", app, "reason", stats.failed),
        _by_label("tandem_requests_aborted", "Requests whose client left, by the phase they were in (aborted on every engine involved)", app, "phase", stats.aborts),
        in_flight,
        decisions,
        continuation,
        _by_label("tandem_prefill_seconds_per_token",
                  "A prefill replica's time per prompt token, as this ingress replica's kv_aware router learned it from the prefills it timed there",
                  app, "engine", stats.prefill_seconds_per_token, GaugeMetricFamily),
        _by_label("tandem_prefill_fixed_seconds",
                  "A prefill replica's time per prefill beyond its prompt tokens' (hops, its cores' other work), as this ingress replica's kv_aware router learned it",
                  app, "engine", stats.prefill_fixed_seconds, GaugeMetricFamily),
    ]


def _engine_families(app: str, stats: Sequence[EngineStats], outstanding: dict[str, int]) -> Iterable[Metric]:
    labels = ["app", "pool", "engine"]

    def fam(cls: type, name: str, doc: str, extra: list[str] | None = None) -> Metric:
        return cls(name, doc, labels=labels + (extra or []))

    kv_bytes = fam(CounterMetricFamily, "tandem_kv_transfer_bytes", "KV cache bytes this engine loaded through its KV connector")
    kv_num = fam(CounterMetricFamily, "tandem_kv_transfers", "KV transfers this engine completed")
    kv_failed = fam(CounterMetricFamily, "tandem_kv_transfer_failures", "KV transfers or handshakes that failed")
    kv_slow = fam(CounterMetricFamily, "tandem_kv_transfer_slow", "KV transfers slower than kv_transfer.slow_transfer_s")
    kv_max = fam(GaugeMetricFamily, "tandem_kv_transfer_max_seconds", "Slowest KV transfer seen by this engine")
    kv_time = fam(HistogramMetricFamily, "tandem_kv_transfer_seconds", "Time per KV transfer")
    prompt = fam(CounterMetricFamily, "tandem_prompt_tokens", "Prompt tokens by where their KV came from", ["source"])
    gen = fam(CounterMetricFamily, "tandem_generation_tokens", "Tokens generated")
    finished = fam(CounterMetricFamily, "tandem_engine_requests_finished", "Requests the engine finished")
    aborted = fam(CounterMetricFamily, "tandem_engine_requests_aborted", "Requests aborted before finishing")
    running = fam(GaugeMetricFamily, "tandem_engine_running_requests", "Requests the engine is running")
    waiting = fam(GaugeMetricFamily, "tandem_engine_waiting_requests", "Requests waiting in the engine's queue")
    usage = fam(GaugeMetricFamily, "tandem_engine_kv_cache_usage", "Fraction of the engine's KV cache in use")
    inflight = fam(GaugeMetricFamily, "tandem_router_outstanding_requests", "Requests the router has in flight on the engine")
    conn = fam(CounterMetricFamily, "tandem_connector_events", "Counters reported by Tandem's KV connectors", ["connector", "event"])
    timed = fam(CounterMetricFamily, "tandem_engine_timed_requests", "Finished requests whose engine-side phases are summed in tandem_engine_phase_seconds")
    phase = fam(CounterMetricFamily, "tandem_engine_phase_seconds", "Engine-side time by phase: queue (to first scheduled), prefill (to first token)", ["phase"])
    tpot = fam(CounterMetricFamily, "tandem_engine_tpot_seconds", "vLLM's per-request mean time per output token after the first (engine-core timestamps), summed over tandem_engine_decoded_requests")
    decoded = fam(CounterMetricFamily, "tandem_engine_decoded_requests", "Finished requests that generated two tokens or more")
    for s in stats:
        lv = [app, s.role, s.engine_id]
        t = s.transfers
        kv_bytes.add_metric(lv, t.bytes)
        kv_num.add_metric(lv, t.num_transfers)
        kv_failed.add_metric(lv, t.num_failed)
        kv_slow.add_metric(lv, t.num_slow)
        kv_max.add_metric(lv, t.max_seconds)
        cumulative, running_total = [], 0
        for bound, n in zip([*map(str, TRANSFER_BUCKETS), "+Inf"], t.bucket_counts):
            running_total += n
            cumulative.append((bound, running_total))
        kv_time.add_metric(lv, cumulative, sum_value=t.seconds)
        for source, n in s.prompt_tokens_by_source.items():
            prompt.add_metric(lv + [source], n)
        gen.add_metric(lv, s.num_generation_tokens)
        finished.add_metric(lv, s.num_requests_finished)
        aborted.add_metric(lv, s.num_requests_aborted)
        running.add_metric(lv, s.num_running)
        waiting.add_metric(lv, s.num_waiting)
        usage.add_metric(lv, s.kv_cache_usage)
        inflight.add_metric(lv, outstanding.get(s.engine_id, 0))
        for name, counters in s.connector_counters.items():
            for event, value in counters.items():
                conn.add_metric(lv + [name, event], value)
        timed.add_metric(lv, s.num_timed_requests)
        for name, seconds in s.phase_seconds.items():
            phase.add_metric(lv + [name], seconds)
        tpot.add_metric(lv, s.tpot_seconds)
        decoded.add_metric(lv, s.num_decoded_requests)
    return [kv_bytes, kv_num, kv_failed, kv_slow, kv_max, kv_time, prompt, gen, finished, aborted, running, waiting, usage, inflight, conn, timed, phase, tpot, decoded]


class _ScrapeCollector:
    """Serves what was fetched for the scrape in progress: engine stats, the pool manager's
    view of every replica, and the router's counters."""

    def __init__(self, app: str) -> None:
        self.app = app
        self.stats: Sequence[EngineStats] = ()
        self.outstanding: dict[str, int] = {}
        self.status: DeploymentStatus | None = None
        self.router = RouterStats()

    def collect(self) -> Iterable[Metric]:
        yield from _engine_families(self.app, self.stats, self.outstanding)
        yield from _replica_families(self.app, self.status)
        yield from _tier_families(self.app, self.status)
        yield from _router_families(self.app, self.router)


class TandemMetrics:
    """One registry per ingress replica: router-side metrics plus an engine collector."""

    def __init__(self, app: str) -> None:
        self.app = app
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tandem_requests", "HTTP requests by endpoint and status", ["app", "endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("tandem_request_prompt_tokens", "Prompt tokens of served requests", ["app"], registry=r)
        self.completion_tokens = Counter("tandem_request_completion_tokens", "Completion tokens of served requests", ["app"], registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Arrival to first output token, at the router", ["app"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tandem_request_latency_seconds", "Arrival to last output token, at the router", ["app"], buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("tandem_prefill_phase_seconds", "Arrival to the prefill engine's answer (disaggregated only)", ["app"], buckets=LATENCY_BUCKETS, registry=r)
        self.phases = Histogram("tandem_request_phase_seconds", "Router-timed phases of a request (see RequestTrace.phases)", ["app", "phase"], buckets=LATENCY_BUCKETS, registry=r)
        self._scrape = _ScrapeCollector(app)
        r.register(self._scrape)

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(self.app, endpoint, str(status)).inc()

    def observe_trace(self, trace: RequestTrace, prompt_tokens: int, completion_tokens: int) -> None:
        """Record a finished request's phases as the router timed them."""
        self.prompt_tokens.labels(self.app).inc(prompt_tokens)
        self.completion_tokens.labels(self.app).inc(completion_tokens)
        if trace.t_first_token is not None:
            self.ttft.labels(self.app).observe(trace.t_first_token - trace.t_arrival)
        if trace.t_done is not None:
            self.e2e.labels(self.app).observe(trace.t_done - trace.t_arrival)
        if trace.t_prefill_done is not None:
            self.prefill.labels(self.app).observe(trace.t_prefill_done - trace.t_arrival)
        for name, seconds in trace.phases().items():
            self.phases.labels(self.app, name).observe(seconds)

    def render(
        self,
        engine_stats: Sequence[EngineStats],
        outstanding: dict[str, int],
        status: DeploymentStatus | None = None,
        router: RouterStats | None = None,
    ) -> bytes:
        """The Prometheus text page, with what was fetched for this scrape."""
        c = self._scrape
        c.stats, c.outstanding, c.status, c.router = engine_stats, outstanding, status, router or RouterStats()
        return generate_latest(self.registry)
