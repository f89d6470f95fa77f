"""Where a request's time to first token, and each interval between its tokens after that,
goes, from /metrics deltas and router traces (`ttft_phases`, `tpot_phases`).

Pure arithmetic, so every figure can be checked by hand. Inputs are the growth of Tandem's
/metrics samples over a run (see `metric_names`) and, for direct-path runs, the router's
own `RequestTrace`s. Phases are means per request in seconds (a request that skipped a phase, such as
a local prefill's remote one, counts 0), in the order they happen, and add up to the mean
TTFT the client saw:

- HTTP: client TTFT minus the ingress's and the router's (the client, the network, uvicorn);
- ingress: the request's way through vLLM's serving layer in the ingress (parsing, rendering,
  tokenizing) to the router, as the ingress timed it (a server that does not time it, or
  traces from before it did, show the two as one: HTTP + ingress);
- per engine leg (the prefill engine's, then the decode engine's; one leg when colocated),
  from vLLM's engine-core timestamps (`tandem_engine_phase_seconds_total`):
  - engine queue: arrival at the engine core to first scheduled (on a decode engine this
    includes waiting for the KV, shown apart: KV transfer is the NIXL READ itself, and
    "waiting for the KV" the rest: the READ's posting and the steps until its end is seen);
  - engine compute: first scheduled to first token (the prefill; on a decode engine the one
    step that computes the prompt's last token, or a local prefill);
  - relay: the rest of the router's time for that leg: the token path to the engine actor,
    vLLM's front end there (input processing, the engine core's socket, output processing)
    and the first output's way back.

A request whose first token was the prefill's (`routing.first_token: prefill`) has no decode
leg before it: its decode engine's time goes to the second token. Those engine sums count
for the other requests only, in proportion (`decode_share_*`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from benchmarks.loadgen import RunResult
from orchestrator.router import RequestTrace

# The router's phases to the first token (adding up to its TTFT), and those after it.
TTFT_PHASES = ("prefill", "route", "first_token")
LATER_PHASES = ("second_token", "decode")
# Every phase the ingress times (RequestTrace.phases), "ingress" before the router's.
ROUTER_PHASES = ("ingress", *TTFT_PHASES, *LATER_PHASES)

KV_BYTES = "tandem_kv_transfer_bytes_total"
KV_TRANSFERS = "tandem_kv_transfers_total"
KV_SECONDS = "tandem_kv_transfer_seconds_sum"
KV_FAILURES = "tandem_kv_transfer_failures_total"
KV_SLOW = "tandem_kv_transfer_slow_total"  # slower than kv_transfer.slow_transfer_s
KV_MAX = "tandem_kv_transfer_max_seconds"  # a gauge: the slowest transfer since the engine started
FALLBACKS = "tandem_fallbacks_total"
EXTERNAL_TOKENS = 'tandem_prompt_tokens_total{source="external_kv_transfer"}'
# vLLM's own per-request TPOT (engine-core timestamps, so no relay to the client in it),
# as Tandem's engines and a plain vLLM server expose it; a server has one pair or the other.
ENGINE_TPOT_SUMS = ("tandem_engine_tpot_seconds_total", "vllm:request_time_per_output_token_seconds_sum")
ENGINE_TPOT_COUNTS = ("tandem_engine_decoded_requests_total", "vllm:request_time_per_output_token_seconds_count")
# vLLM's own queue + prefill time per request (engine-core timestamps: arrival at the engine
# core to its first token), of a colocated engine or a plain vLLM server; one count per server.
ENGINE_FIRST_TOKEN_SUMS = (
    'tandem_engine_phase_seconds_total{phase="queue",pool="both"}', 'tandem_engine_phase_seconds_total{phase="prefill",pool="both"}',
    "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
)
ENGINE_FIRST_TOKEN_COUNTS = ('tandem_engine_timed_requests_total{pool="both"}', "vllm:request_prefill_time_seconds_count")
# What a plain vLLM server is scraped for (it has none of Tandem's samples).
VLLM_SERVER_METRICS = (*ENGINE_TPOT_SUMS, *ENGINE_TPOT_COUNTS, *ENGINE_FIRST_TOKEN_SUMS, *ENGINE_FIRST_TOKEN_COUNTS)
TTFT_SUM = "tandem_time_to_first_token_seconds_sum"
TTFT_COUNT = "tandem_time_to_first_token_seconds_count"

# Routing: prompt tokens found in an engine's own prefix cache and computed (every engine,
# so a remote prefill's tokens count on its prefill engine), loaded from the CPU tier, and
# requests a conditional router prefilled on their decode engine.
CACHE_HIT_TOKENS = 'tandem_prompt_tokens_total{source="local_cache_hit"}'
COMPUTED_TOKENS = 'tandem_prompt_tokens_total{source="local_compute"}'
TIER_TOKENS = 'tandem_connector_events_total{connector="TandemCpuTierConnector",event="tokens_loaded"}'
LOCAL_PREFILLS = 'tandem_disaggregation_decisions_total{decision="local"}'
ROUTING_METRICS = (CACHE_HIT_TOKENS, COMPUTED_TOKENS, TIER_TOKENS, LOCAL_PREFILLS)

# Shown in the results table; the rest only feed the phase arithmetic (and the JSON).
HEADLINE_METRICS = (KV_BYTES, KV_TRANSFERS, KV_SECONDS, KV_FAILURES, FALLBACKS, EXTERNAL_TOKENS)
# Divided by completed requests in the table.
PER_REQUEST_METRICS = (KV_BYTES, KV_SECONDS, EXTERNAL_TOKENS)


def router_phase(name: str, stat: str) -> str:
    return f'tandem_request_phase_seconds_{stat}{{phase="{name}"}}'


def engine_queue(pool: str) -> tuple[str, str]:
    """(queue seconds, timed requests) sample names of the engines of `pool`."""
    return f'tandem_engine_phase_seconds_total{{phase="queue",pool="{pool}"}}', f'tandem_engine_timed_requests_total{{pool="{pool}"}}'


def engine_compute(pool: str) -> str:
    """Sample name of the engine core's first-scheduled-to-first-token seconds of `pool`."""
    return f'tandem_engine_phase_seconds_total{{phase="prefill",pool="{pool}"}}'


def metric_names() -> list[str]:
    """Every /metrics sample a Tandem run scrapes before and after."""
    names = [*HEADLINE_METRICS, KV_SLOW, TTFT_SUM, TTFT_COUNT, *ENGINE_TPOT_SUMS, *ENGINE_TPOT_COUNTS]
    names += [n for n in (*ENGINE_FIRST_TOKEN_SUMS, *ENGINE_FIRST_TOKEN_COUNTS) if n.startswith("tandem_")]
    names += [router_phase(p, s) for p in ROUTER_PHASES for s in ("sum", "count")]
    names += [n for pool in ("prefill", "decode", "both") for n in (*engine_queue(pool), engine_compute(pool))]
    names += ROUTING_METRICS
    return list(dict.fromkeys(names))


def _mean(total: float | None, count: float | None) -> float | None:
    return total / count if total is not None and count else None


def engine_tpot_ms(deltas: Mapping[str, float]) -> float | None:
    """Mean per-request TPOT as the engines timed it, ms; None if the server does not expose it.

    A plain vLLM server counts one-token requests as 0 in its histogram; the benchmark's
    requests all decode many tokens, so that does not arise here.
    """
    return _engine_mean_ms(deltas, ENGINE_TPOT_SUMS, ENGINE_TPOT_COUNTS)


def engine_first_token_ms(deltas: Mapping[str, float]) -> float | None:
    """Mean time from a request reaching the engine core to its first token (queue + prefill),
    as the engine core timed it, ms; None if the server does not expose it. Client TTFT minus
    this is what everything outside vLLM's engine core (HTTP, front end, relay) added."""
    return _engine_mean_ms(deltas, ENGINE_FIRST_TOKEN_SUMS, ENGINE_FIRST_TOKEN_COUNTS)


def _engine_mean_ms(deltas: Mapping[str, float], sums: Sequence[str], counts: Sequence[str]) -> float | None:
    mean = _mean(sum(deltas.get(n, 0.0) for n in sums), sum(deltas.get(n, 0.0) for n in counts))
    return None if mean is None else 1000 * mean


def router_phases_from_metrics(deltas: Mapping[str, float]) -> dict[str, float]:
    """Mean router phases per request served over HTTP during a run (`_per_request`)."""
    sums = {p: deltas.get(router_phase(p, "sum")) for p in ROUTER_PHASES}
    counts = {p: deltas.get(router_phase(p, "count")) for p in ROUTER_PHASES}
    return _per_request(sums, counts)


def router_phases_from_traces(traces: Sequence[RequestTrace]) -> dict[str, float]:
    """Mean router phases per request of the direct path's traces (`_per_request`)."""
    sums: dict[str, float | None] = dict.fromkeys(ROUTER_PHASES)
    counts: dict[str, float | None] = dict.fromkeys(ROUTER_PHASES)
    for trace in traces:
        for phase, seconds in trace.phases().items():
            sums[phase] = (sums[phase] or 0.0) + seconds
            counts[phase] = (counts[phase] or 0) + 1
    return _per_request(sums, counts)


def _per_request(sums: Mapping[str, float | None], counts: Mapping[str, float | None]) -> dict[str, float]:
    """The ingress's phase and the router's up to the first token are averaged over every
    request that got one, a phase a request skipped counting 0 for it (a conditional router's
    local prefills have no prefill phase), so they add up to the mean TTFT; second_token and
    decode over the requests that had them."""
    n = counts.get("first_token")
    out = {p: sums[p] / n for p in ("ingress", *TTFT_PHASES) if sums.get(p) is not None and n}
    after = {p: _mean(sums.get(p), counts.get(p)) for p in LATER_PHASES}
    return out | {p: mean for p, mean in after.items() if mean is not None}


def decode_share_from_metrics(deltas: Mapping[str, float]) -> float:
    """The share of requests whose first token came from their output leg (the decode or
    colocated engine), not streamed from a prefill: those the router timed a route for."""
    first = deltas.get(router_phase("first_token", "count"))
    return min(1.0, (deltas.get(router_phase("route", "count")) or 0.0) / first) if first else 1.0


def handed_on_share_from_metrics(deltas: Mapping[str, float]) -> float:
    """The share of requests whose first token the prefill engine streamed and whose decode
    engine then answered: those the router timed a second token for."""
    first = deltas.get(router_phase("first_token", "count"))
    return min(1.0, (deltas.get(router_phase("second_token", "count")) or 0.0) / first) if first else 0.0


def decode_share_from_traces(traces: Sequence[RequestTrace]) -> float:
    """`decode_share_from_metrics` over the direct path's traces."""
    served = [t for t in traces if t.t_first_token is not None]
    return sum(not t.first_from_prefill for t in served) / len(served) if served else 1.0


def requests_with_first_token(deltas: Mapping[str, float]) -> float | None:
    """Requests the router saw reach their first token during a run (HTTP path)."""
    return deltas.get(router_phase("first_token", "count"))


def kv_transfer_mean(deltas: Mapping[str, float]) -> float | None:
    """Seconds per KV transfer, as the decode engines timed them; None without transfers."""
    return _mean(deltas.get(KV_SECONDS), deltas.get(KV_TRANSFERS))


def kv_rate_gib_s(deltas: Mapping[str, float]) -> float | None:
    """Bytes moved per second of transfer time, GiB/s; None without transfers."""
    seconds = deltas.get(KV_SECONDS)
    return deltas.get(KV_BYTES, 0.0) / seconds / 2**30 if seconds else None


def ttft_phases(
    router: Mapping[str, float],
    deltas: Mapping[str, float],
    disaggregated: bool,
    client_ttft_s: float | None = None,
    num_requests: float | None = None,
    decode_share: float = 1.0,
) -> dict[str, float]:
    """Split the mean TTFT into phases (module docstring); without `client_ttft_s`, no HTTP phase.

    `router`: per-request means (`router_phases_from_*`); `num_requests`: the requests they
    average over, so that phases only some requests have (a remote prefill and its KV
    transfer, under a conditional router) are spread over every request as well (None:
    every request had them). `decode_share` (`decode_share_*`): the share of requests whose
    first token was their decode engine's; 0 leaves out the decode leg, the prefill's relay
    then includes handing its token on. Missing inputs count as 0, so a scenario without
    transfers has no KV phase.
    """
    def engine(pool: str) -> tuple[float, float]:
        """Mean engine-core (queue, compute) seconds per request on `pool`'s engines."""
        queue_sum, timed = (deltas.get(n) for n in engine_queue(pool))
        n = num_requests or timed
        return _mean(queue_sum, n) or 0.0, _mean(deltas.get(engine_compute(pool)), n) or 0.0

    out: dict[str, float] = {}
    if client_ttft_s is not None:
        outside = client_ttft_s - sum(router.get(p, 0.0) for p in TTFT_PHASES)
        if "ingress" in router:
            out |= {"HTTP": outside - router["ingress"], "ingress": router["ingress"]}
        else:
            out["HTTP + ingress"] = outside
    output_leg = router.get("route", 0.0) + router.get("first_token", 0.0)
    if not disaggregated:
        queue, compute = engine("both")
        return out | {"engine queue": queue, "engine compute": compute, "relay": output_leg - queue - compute}
    queue, compute = engine("prefill")
    out |= {"prefill: engine queue": queue, "prefill: engine compute": compute,
            "prefill: relay": router.get("prefill", 0.0) - queue - compute}
    if not decode_share:
        out["prefill: relay"] += output_leg
        return out
    kv = decode_share * ((_mean(deltas.get(KV_SECONDS), num_requests) if num_requests else kv_transfer_mean(deltas)) or 0.0)
    queue, compute = (decode_share * t for t in engine("decode"))
    return out | {"decode: waiting for the KV": queue - kv, "KV transfer": kv, "decode: engine compute": compute,
                  "decode: relay": output_leg - queue - compute}


def tpot_phases(router: Mapping[str, float], deltas: Mapping[str, float], client_tpot_s: float, output_tokens: float) -> dict[str, float]:
    """Split the client's mean TPOT (seconds per interval between a request's tokens) into
    where each interval's time goes; empty when the server exposes no engine TPOT.

    - decode leg, to the second token: a request whose first token the prefill engine
      streamed waits for the decode engine's first one (the decode request's way in, the KV
      pull, that engine's first step, the way back), one of its `output_tokens - 1`
      intervals; spread over every interval of every request;
    - engine steps: vLLM's engine-core TPOT of the engine that decodes, over the intervals it
      timed (all but that first one on a decode engine);
    - relay: the rest, what the token path, the ingress and HTTP add per interval; negative
      when the client saw a request's first token later, relative to its last, than the
      engine produced it (a plain vLLM server's first chunk).
    """
    engine_ms = engine_tpot_ms(deltas)
    intervals = output_tokens - 1
    if engine_ms is None or intervals < 1:
        return {}
    share = handed_on_share_from_metrics(deltas)
    second = share * router.get("second_token", 0.0) / intervals
    steps = engine_ms / 1000 * (1 - share / intervals)
    return {"decode leg, to the second token": second, "engine steps": steps, "relay": client_tpot_s - second - steps}


class PathFigures(msgspec.Struct, frozen=True):
    """One path's latency figures at one rate (means and medians, milliseconds)."""

    ttft_mean_ms: float | None
    ttft_p50_ms: float | None
    tpot_p50_ms: float | None
    e2e_p50_ms: float | None
    phases_ms: dict[str, float]

    @classmethod
    def of(cls, run: RunResult, phases_s: Mapping[str, float]) -> PathFigures:
        s = run.summary
        return cls(s.ttft_ms.mean, s.ttft_ms.p50, s.tpot_ms.p50, s.e2e_ms.p50, {k: 1000 * v for k, v in phases_s.items()})


class Overhead(msgspec.Struct, frozen=True):
    """The same load through Tandem's HTTP endpoint and straight to the engines."""

    rate: float | None
    http: PathFigures
    direct: PathFigures

    def added_ms(self, field: str) -> float | None:
        """HTTP minus direct for one PathFigures field; None when either is unknown."""
        a, b = getattr(self.http, field), getattr(self.direct, field)
        return None if a is None or b is None else a - b

    def phase_rows(self) -> list[tuple[str, float, float, float]]:
        """(phase, HTTP ms, direct ms, HTTP - direct ms) for every phase of either path."""
        names = list(dict.fromkeys([*self.http.phases_ms, *self.direct.phases_ms]))
        return [(n, self.http.phases_ms.get(n, 0.0), self.direct.phases_ms.get(n, 0.0), self.http.phases_ms.get(n, 0.0) - self.direct.phases_ms.get(n, 0.0)) for n in names]
