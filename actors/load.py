"""How busy an engine is: requests and tokens in flight, now and averaged over time.

The engine actor counts what passes through it, so the figure is the same whichever ingress
replica sent the requests; the pool manager reads it with every health check and scales
pools on the time average, which a single sample at check time would miss for requests
shorter than the period (a prefill takes milliseconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from actors.protocol import EngineLoad


class LoadMeter:
    """Integrates requests and tokens in flight over time; `report` returns the averages
    since the previous report and starts a new window."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.num_requests = 0
        self.num_tokens = 0
        self._request_seconds = 0.0
        self._token_seconds = 0.0
        self._window_start = self._last = clock()

    def _advance(self) -> float:
        now = self._clock()
        elapsed = now - self._last
        self._request_seconds += self.num_requests * elapsed
        self._token_seconds += self.num_tokens * elapsed
        self._last = now
        return now

    def add(self, requests: int, tokens: int) -> None:
        """Count requests arriving (positive) or leaving (negative), and tokens still to compute."""
        self._advance()
        self.num_requests += requests
        self.num_tokens += tokens

    def report(self, kv_cache_usage: float) -> EngineLoad:
        now = self._advance()
        window = now - self._window_start
        if window > 0:
            mean_requests, mean_tokens = self._request_seconds / window, self._token_seconds / window
        else:
            mean_requests, mean_tokens = float(self.num_requests), float(self.num_tokens)
        self._request_seconds = self._token_seconds = 0.0
        self._window_start = now
        return EngineLoad(self.num_requests, self.num_tokens, mean_requests, mean_tokens, kv_cache_usage)
