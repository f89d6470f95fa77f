"""How fast each prefill replica computes a prompt token, learned from the prefills it answered.

kv_aware's `work` prices a prefill replica by the prompt tokens it has to compute before a
request's first token (scoring.queue_tokens). Replicas of one pool do not compute at one
rate where they share cores: with decode engines (priced by fixed factors,
scoring.BESIDE_*), but also with Ray's processes, Serve's and the ingress, which no factor
named. On the 2-core host, the two replicas on core 0 (the control plane's core) drew 73% of
the long chats' turns, and pricing them 1.17x a prompt token took kv_aware from about 0.58x
round robin's TTFT p50 to 0.52x (docs/bench-results.md, runs 161-162). So a router can
learn every replica's speed from its own prefills (routing.prefill_speed_samples, off by
default: docs/design.md, "A learned line in place of the fixed factors", says why): the
seconds from sending one to its answer against the tokens it expected ahead of it (the
replica's queue plus the request's own part),
fitted as a line per replica: a fixed part (the hops, and what else its cores do for every
request: on the 2-core host Ray's, Serve's and the ingress's processes share core 0, and
they work in bursts with each request) plus a time per prompt token. Once two candidates
have answered enough, each is priced by its line against the fastest's: its time per token
as a factor, its extra fixed time as tokens of the fastest. One intercept shared by the
pool, the first fit, put core 0's per-request delay into the slopes of whichever replica
got the short prompts, and priced core 0's two replicas slowest and fastest (run 164).
A replica's sums decay by half every HALF_LIFE of its answers, so a replica whose neighbours
change is repriced within a few dozen requests. Nothing is learned across routers: each fits
the prefills it timed, which is as many as it routes.
"""

from __future__ import annotations

from collections.abc import Collection

import msgspec

# Answers after which an old one weighs half as much as a new one.
HALF_LIFE = 64
# The slowest a replica is priced against the fastest: a bound on what a few odd answers
# (a replica restarting, a stall on the host) can do to the routing.
MAX_SLOWDOWN = 4.0
# Rates within this share of the fastest count as the fastest's, and fixed times within this
# share of the best replica's time for a prefill of the mean size as the least one's: the fit
# moves by about as much between answers (a replica's 0.250 ms a token was 0.240 two seconds
# later, run 164), and replicas alike (GPUs, no core shared) keep the exact ties that send
# fresh prompts round the pool.
TOLERANCE = 0.05
# The least variance of a replica's tokens, as a share of their mean square, that separates
# its fixed time from its time per token (about a 0.23 coefficient of variation); below it,
# its whole time is priced per token.
MIN_SPREAD = 0.05


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


class Line(msgspec.Struct, frozen=True):
    """A replica's prefill time: `fixed` seconds plus `per_token` seconds a token ahead."""

    fixed: float
    per_token: float


class Price(msgspec.Struct, frozen=True):
    """A replica's tokens ahead, priced against the fastest candidate's line: times
    `slowdown`, plus `delay_tokens` (its extra fixed time, in the fastest's tokens)."""

    slowdown: float = 1.0
    delay_tokens: float = 0.0


class PrefillSpeed:
    """Each prefill replica's line of seconds against tokens ahead, as one router timed its prefills."""

    def __init__(self, min_samples: int, half_life: float = HALF_LIFE) -> None:
        """`min_samples`: prefills a replica must have answered before it has a line (0: none
        ever has, and the fixed factors price every replica)."""
        self.min_samples = min_samples
        self._keep = 0.5 ** (1.0 / half_life)
        self._sums: dict[str, _Sums] = {}
        self._lines: dict[str, Line] = {}

    def observe(self, engine_id: str, tokens: float, seconds: float) -> None:
        """A prefill on `engine_id` answered `seconds` after it was sent, with `tokens` prompt
        tokens expected ahead of its first (the replica's queue and its own)."""
        if not self.min_samples or tokens <= 0 or seconds <= 0:
            return
        self._sums.setdefault(engine_id, _Sums()).add(tokens, seconds, self._keep)
        self._lines = self._fit()

    def keep(self, engine_ids: Collection[str]) -> None:
        """Forget the replicas no longer in the routing table."""
        if set(self._sums) - set(engine_ids):
            self._sums = {e: s for e, s in self._sums.items() if e in engine_ids}
            self._lines = self._fit()

    @property
    def lines(self) -> dict[str, Line]:
        """The line of each replica that has answered enough prefills."""
        return dict(self._lines)

    def prices(self, engine_ids: Collection[str]) -> dict[str, Price] | None:
        """Each replica's price among `engine_ids` against the fastest per token: a slowdown
        of at most MAX_SLOWDOWN, and its fixed time beyond the least one's, of at most
        MAX_SLOWDOWN - 1 times the best prefill (the least fixed time plus the fastest rate
        over the candidates' mean tokens); or None while fewer than two have a line. A replica not timed
        yet counts as the fastest, so that it draws requests until it is: kv_aware sends few to
        a replica it prices high, and waiting for every replica's line would leave the learned
        ones unused while it waits."""
        lines = {e: line for e in engine_ids if (line := self._lines.get(e)) is not None}
        if len(lines) < 2:
            return None
        fastest = min(line.per_token for line in lines.values())
        least = min(line.fixed for line in lines.values())
        sums = [self._sums[e] for e in lines]
        best = least + fastest * sum(s.x for s in sums) / sum(s.w for s in sums)
        prices = {}
        for e, line in lines.items():
            slowdown = min(MAX_SLOWDOWN, line.per_token / fastest)
            delay = min((MAX_SLOWDOWN - 1) * best, line.fixed - least)
            prices[e] = Price(slowdown if slowdown > 1.0 + TOLERANCE else 1.0,
                              delay / fastest if delay > TOLERANCE * best else 0.0)
        return {e: prices.get(e, Price()) for e in engine_ids}

    def _fit(self) -> dict[str, Line]:
        """Weighted least squares of seconds = fixed + per_token * tokens, per replica with
        enough answers; a replica whose tokens vary too little (MIN_SPREAD) to tell the two
        apart, or whose fixed part comes out below 0, is fitted through 0. {} when a time per
        token comes out not above 0: the answers do not pin the lines down."""
        lines = {}
        for e, s in self._sums.items():
            if s.count < self.min_samples:
                continue
            spread = s.xx - s.x * s.x / s.w
            per_token = (s.xy - s.x * s.y / s.w) / spread if spread > MIN_SPREAD * s.xx else 0.0
            fixed = (s.y - per_token * s.x) / s.w
            if per_token <= 0 or fixed < 0:
                per_token, fixed = s.xy / s.xx, 0.0
            if per_token <= 0:
                return {}
            lines[e] = Line(fixed, per_token)
        return lines
