"""How fast each prefill replica computes a prompt token, learned from the prefills it answered.

kv_aware's `work` prices a prefill replica by the prompt tokens it has to compute before a
request's first token (scoring.queue_tokens). Replicas of one pool do not compute at one
rate where they share cores: with decode engines (priced by fixed factors,
scoring.BESIDE_*), but also with Ray's processes, Serve's and the ingress, which no factor
named. On the 2-core host, the two replicas on core 0 (the control plane's core) drew 73% of
the long chats' turns, and pricing them 1.17x a prompt token took kv_aware from about 0.58x
round robin's TTFT p50 to 0.52x (docs/bench-results.md, runs 161-162). So a router can
learn every replica's rate from its own prefills (routing.prefill_speed_samples, off by
default: on those long chats it routed and scored as the fixed factors did, runs 164-165): the seconds from sending one to its answer
against the tokens it expected ahead of it (the replica's queue plus the request's own part),
fitted as one intercept for the pool (the hops and the scheduling every replica pays alike)
plus a slope per replica (its time per prompt token). Once two candidates have answered
enough, the slopes over the fastest one's price the candidates instead of the fixed factors.
A replica's sums decay by half every HALF_LIFE of its answers, so a replica whose neighbours
change is repriced within a few dozen requests. Nothing is learned across routers: each fits
the prefills it timed, which is as many as it routes.
"""

from __future__ import annotations

from collections.abc import Collection

# Answers after which an old one weighs half as much as a new one.
HALF_LIFE = 64
# The slowest a replica is priced against the fastest: a bound on what a few odd answers
# (a replica restarting, a stall on the host) can do to the routing.
MAX_SLOWDOWN = 4.0
# Rates within this share of the fastest count as the fastest's: the fit moves by about as
# much between answers (a replica's 0.250 ms a token was 0.240 two seconds later, run 164),
# and replicas alike (GPUs, no core shared) keep the exact ties that send fresh prompts
# round the pool.
TOLERANCE = 0.05


class _Sums:
    """One replica's decayed sums of (tokens ahead, seconds) pairs, for a least-squares fit."""

    __slots__ = ("count", "w", "x", "y", "xx", "xy")

    def __init__(self) -> None:
        self.count = 0
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float, keep: float) -> None:
        self.count += 1
        self.w = self.w * keep + 1.0
        self.x = self.x * keep + x
        self.y = self.y * keep + y
        self.xx = self.xx * keep + x * x
        self.xy = self.xy * keep + x * y


class PrefillSpeed:
    """Each prefill replica's seconds per prompt token, as one router timed its prefills."""

    def __init__(self, min_samples: int, half_life: float = HALF_LIFE) -> None:
        """`min_samples`: prefills a replica must have answered before it has a rate (0: none
        ever has, and the fixed factors price every replica)."""
        self.min_samples = min_samples
        self._keep = 0.5 ** (1.0 / half_life)
        self._sums: dict[str, _Sums] = {}
        self._rates: dict[str, float] = {}

    def observe(self, engine_id: str, tokens: float, seconds: float) -> None:
        """A prefill on `engine_id` answered `seconds` after it was sent, with `tokens` prompt
        tokens expected ahead of its first (the replica's queue and its own)."""
        if not self.min_samples or tokens <= 0 or seconds <= 0:
            return
        self._sums.setdefault(engine_id, _Sums()).add(tokens, seconds, self._keep)
        self._rates = self._fit()

    def keep(self, engine_ids: Collection[str]) -> None:
        """Forget the replicas no longer in the routing table."""
        if set(self._sums) - set(engine_ids):
            self._sums = {e: s for e, s in self._sums.items() if e in engine_ids}
            self._rates = self._fit()

    @property
    def rates(self) -> dict[str, float]:
        """Seconds per prompt token of each replica that has answered enough prefills."""
        return dict(self._rates)

    def slowdowns(self, engine_ids: Collection[str]) -> dict[str, float] | None:
        """Each replica's time per prompt token over the fastest one's among `engine_ids`
        (at most MAX_SLOWDOWN; 1 within TOLERANCE of it), or None while fewer than two of
        them have a rate. A replica not timed yet counts as the fastest, so that it draws
        requests until it is: kv_aware sends few to a replica it prices high, and waiting for
        every replica's rate would leave the learned ones unused while it waits."""
        rates = {e: r for e in engine_ids if (r := self._rates.get(e)) is not None}
        if len(rates) < 2:
            return None
        fastest = min(rates.values())
        slower = {e: min(MAX_SLOWDOWN, r / fastest) for e, r in rates.items()}
        return {e: s if (s := slower.get(e, 1.0)) > 1.0 + TOLERANCE else 1.0 for e in engine_ids}

    def _fit(self) -> dict[str, float]:
        """Least squares of seconds = intercept + slope[replica] * tokens over the replicas
        with enough answers, the intercept shared (at least 0; none when no replica's tokens
        vary); {} when a slope comes out not above 0: the answers do not pin them down."""
        ready = {e: s for e, s in self._sums.items() if s.count >= self.min_samples}
        if not ready:
            return {}
        # For a given intercept c, each slope is (xy - c x) / xx; the c that minimises the
        # summed squares then solves a linear equation of the sums.
        spread = sum(s.w - s.x * s.x / s.xx for s in ready.values())
        intercept = sum(s.y - s.x * s.xy / s.xx for s in ready.values()) / spread if spread > 1e-9 else 0.0
        intercept = max(0.0, intercept)
        rates = {e: (s.xy - intercept * s.x) / s.xx for e, s in ready.items()}
        return rates if all(r > 0 for r in rates.values()) else {}
