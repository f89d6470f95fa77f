"""When a pool should grow or shrink: the decision alone, fed with load samples (pure logic).

As Ray Serve's autoscaler: the pool wants ceil(total load / target per replica) replicas,
clamped to [min_replicas, max_replicas], and acts only once it has wanted more (fewer) for
upscale_delay_s (downscale_delay_s) without interruption, so a burst shorter than the delay
does not start a replica that takes a minute to come up, nor does a lull drain one.
"""

from __future__ import annotations

import math

from orchestrator.config import AutoscalingConfig


class ScaleDecider:
    """Target replica count for one pool."""

    def __init__(self, cfg: AutoscalingConfig, min_replicas: int, max_replicas: int) -> None:
        self.cfg = cfg
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        # When the current wish to grow (shrink) began; None while there is none.
        self._up_since: float | None = None
        self._down_since: float | None = None

    def wanted(self, total_load: float) -> int:
        """The replica count this load asks for, within the pool's bounds."""
        want = math.ceil(total_load / self.cfg.target_per_replica - 1e-9)
        return max(self.min_replicas, min(self.max_replicas, want))

    def decide(self, now: float, total_load: float, current: int) -> int:
        """The replica count to move to now (`current` when nothing should change yet).
        Moves one replica at a time: each change is re-judged on the load it leads to."""
        want = self.wanted(total_load)
        if want > current:
            self._down_since = None
            self._up_since = now if self._up_since is None else self._up_since
            if now - self._up_since >= self.cfg.upscale_delay_s:
                self._up_since = None
                return current + 1
        elif want < current:
            self._up_since = None
            self._down_since = now if self._down_since is None else self._down_since
            if now - self._down_since >= self.cfg.downscale_delay_s:
                self._down_since = None
                return current - 1
        else:
            self._up_since = self._down_since = None
        return current
