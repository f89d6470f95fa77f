"""Per-request measurements and the figures computed from them.

Everything here is pure (no I/O, no clocks), so every figure can be checked against values
computed by hand. Times inside a `RequestResult` are seconds; figures in a `RunSummary` are
milliseconds for latencies and per-second for throughputs, the units serving papers report.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

#: DistServe's attainment target: goodput is the highest rate at which this fraction of
#: requests meets both the TTFT and the TPOT SLO.
DEFAULT_ATTAINMENT_TARGET = 0.9


class RequestResult(msgspec.Struct, frozen=True):
    """One measured request: what was sent, when each token arrived, how it ended."""

    index: int  # position in the request list handed to the load generator
    start: float  # seconds from the run's start to sending the request
    latency: float  # seconds from sending to the end of the response (or to the failure)
    # Seconds from sending to each chunk carrying a token, its text shown or held back (as
    # vLLM's client times them: a byte of a UTF-8 character streams with no text).
    token_times: list[float]
    output_tokens: int  # usage.completion_tokens, else the number of token-carrying chunks
    prompt_tokens: int | None = None  # usage.prompt_tokens when the server reported it
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    error: str | None = None  # why the request failed; None when it succeeded
    # Where Tandem ran it (its x-tandem-* response headers; None from other servers): the
    # engine that streamed the output, the one that prefilled it remotely, and the
    # disaggregation decision (e.g. "decision=local;reason=short_uncached").
    engine: str | None = None
    prefill_engine: str | None = None
    disaggregation: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        """Time to the first token-carrying chunk, seconds."""
        return self.token_times[0] if self.token_times else None

    @property
    def itls(self) -> list[float]:
        """Every gap between consecutive token-carrying chunks, seconds."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1): the mean decode step, seconds.

        Uses the token count rather than the chunk count, so chunks that carry several tokens
        do not inflate it. Undefined with fewer than two tokens.
        """
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


class SLO(msgspec.Struct, frozen=True):
    """Latency objectives a request must meet, both at once, to count towards goodput."""

    ttft_ms: float  # time to first token, milliseconds
    tpot_ms: float  # time per output token after the first, milliseconds


class Percentiles(msgspec.Struct, frozen=True):
    """Mean and tail of one latency, milliseconds; all None when nothing was measured."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


class RunSummary(msgspec.Struct, frozen=True):
    """The figures of one run, over the measured (non-warm-up) requests only."""

    num_requests: int  # measured requests sent
    num_completed: int
    num_failed: int
    errors: dict[str, int]  # error text -> how many requests failed with it
    duration_s: float  # from the first send to the last response
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second, completed requests only
    total_input_tokens: int  # as reported by the server's usage
    total_output_tokens: int
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    slo: SLO | None = None
    slo_attainment: float | None = None  # fraction of sent requests meeting both SLOs
    goodput: float | None = None  # requests per second that met both SLOs
    server_metrics: dict[str, float] = {}  # deltas of scraped /metrics samples over the run


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=float), q))


def percentiles_ms(values_s: Sequence[float]) -> Percentiles:
    """Mean, p50, p90 and p99 of values given in seconds, in milliseconds."""
    if not values_s:
        return Percentiles()
    ms = [v * 1000.0 for v in values_s]
    return Percentiles(
        mean=float(np.mean(ms)),
        p50=percentile(ms, 50),
        p90=percentile(ms, 90),
        p99=percentile(ms, 99),
    )


def meets_slo(result: RequestResult, slo: SLO) -> bool:
    """True when the request succeeded within both objectives.

    A one-token answer has no TPOT; it is judged on TTFT alone.
    """
    if not result.ok or result.ttft is None:
        return False
    if result.ttft * 1000.0 > slo.ttft_ms:
        return False
    return result.tpot is None or result.tpot * 1000.0 <= slo.tpot_ms


def num_meeting_slo(results: Sequence[RequestResult], slo: SLO) -> int:
    """How many requests met both SLOs."""
    return sum(meets_slo(r, slo) for r in results)


def slo_attainment(results: Sequence[RequestResult], slo: SLO) -> float:
    """Fraction of requests meeting both SLOs; failed requests count as misses."""
    return num_meeting_slo(results, slo) / len(results) if results else 0.0


def _per_second(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    slo: SLO | None = None,
    server_metrics: dict[str, float] | None = None,
) -> RunSummary:
    """Reduce measured requests to a run's figures."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    num_met = num_meeting_slo(results, slo) if slo else 0
    return RunSummary(
        num_requests=len(results),
        num_completed=len(done),
        num_failed=len(failed),
        errors=dict(Counter(r.error for r in failed if r.error)),
        duration_s=duration_s,
        request_throughput=_per_second(len(done), duration_s),
        output_throughput=_per_second(output_tokens, duration_s),
        total_input_tokens=sum(r.prompt_tokens or 0 for r in done),
        total_output_tokens=output_tokens,
        ttft_ms=percentiles_ms([r.ttft for r in done if r.ttft is not None]),
        tpot_ms=percentiles_ms([r.tpot for r in done if r.tpot is not None]),
        itl_ms=percentiles_ms([gap for r in done for gap in r.itls]),
        e2e_ms=percentiles_ms([r.latency for r in done]),
        slo=slo,
        slo_attainment=num_met / len(results) if slo and results else None,
        goodput=_per_second(num_met, duration_s) if slo else None,
        server_metrics=server_metrics or {},
    )


def goodput_from_sweep(
    points: Sequence[tuple[float, float]], target: float = DEFAULT_ATTAINMENT_TARGET
) -> float | None:
    """DistServe goodput over a rate sweep: the highest swept rate whose attainment >= target.

    `points` are (rate, attainment) pairs in any order. None when no rate reaches the target.
    """
    passing = [rate for rate, attainment in points if attainment >= target]
    return max(passing) if passing else None


def bisect_goodput(
    measure: Callable[[float], float],
    low: float,
    high: float,
    target: float = DEFAULT_ATTAINMENT_TARGET,
    tolerance: float = 0.1,
) -> float | None:
    """Narrow the goodput rate down between `low` and `high` req/s by bisection.

    `measure(rate)` runs a load at that rate and returns its SLO attainment; attainment is
    assumed to fall as the rate rises. Returns the highest rate known to reach `target`
    (within `tolerance` req/s of the true boundary), `high` if even it passes, and None if
    `low` already fails. Each probe is a full run, so the tolerance sets the cost.
    """
    if not 0 < low < high:
        raise ValueError(f"need 0 < low < high, got low={low}, high={high}")
    if measure(low) < target:
        return None
    if measure(high) >= target:
        return high
    while high - low > tolerance:
        mid = (low + high) / 2
        if measure(mid) >= target:
            low = mid
        else:
            high = mid
    return low


def _figure(values: np.ndarray, figure: str) -> np.ndarray:
    """`figure` ("mean", or a percentile such as "p99") of each row of `values`."""
    if figure == "mean":
        return values.mean(axis=1)
    if figure.startswith("p") and figure[1:].replace(".", "", 1).isdigit() and float(figure[1:]) <= 100:
        return np.percentile(values, float(figure[1:]), axis=1)
    raise ValueError(f"unknown figure {figure!r}: give 'mean' or a percentile such as 'p99'")


def ratio_interval(
    rounds: Sequence[tuple[Sequence[float], Sequence[float]]],
    figures: Sequence[str] = ("p50", "mean", "p99"),
    *,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> dict[str, tuple[float, float]]:
    """A bootstrap interval for each figure of scenario A's pooled requests over B's.

    `rounds` holds each round's paired values, A's and B's for the same requests in the same
    order (both sides of a round were sent one request list; a request's own cost, such as
    the first of a new prefix, weighs on both). Each resample draws every round's requests
    with replacement within that round, so a round stays one pair of deployments on one
    stretch of the host's time, and keeps their pairing. A pooled p99 over a few hundred
    requests rests on its three or four slowest: an interval holding 1.0 says these rounds
    cannot tell the two apart there, one wholly above says A is slower. Percentile method,
    seeded so that a report reads the same each time."""
    if not rounds or any(len(a) != len(b) or len(a) == 0 for a, b in rounds):
        raise ValueError("every round needs the same number of values, at least one, for A and B")
    rng = np.random.default_rng(seed)
    picks = [(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rng.integers(0, len(a), (resamples, len(a))))
             for a, b in rounds]
    drawn_a = np.concatenate([a[idx] for a, _, idx in picks], axis=1)
    drawn_b = np.concatenate([b[idx] for _, b, idx in picks], axis=1)
    tail = (1.0 - level) / 2 * 100
    out = {}
    for figure in figures:
        ratios = _figure(drawn_a, figure) / _figure(drawn_b, figure)
        out[figure] = (float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail)))
    return out
