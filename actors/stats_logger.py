"""A vLLM stat logger that folds each engine step's stats into an EngineStats struct.

vLLM calls `record` in the engine actor's event loop after every batch of outputs; the
actor answers `get_stats` from the same struct, so /metrics needs no extra engine work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

from actors.protocol import EngineStats


class TandemStatLogger(StatLoggerBase):
    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_index: int = 0,
        *,
        sink: EngineStats,
        observe_connector: Callable[[EngineStats, dict[str, Any]], None],
    ) -> None:
        self.sink = sink
        self.observe_connector = observe_connector

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        s = self.sink
        if scheduler_stats is not None:
            s.num_running = scheduler_stats.num_running_reqs
            s.num_waiting = scheduler_stats.num_waiting_reqs
            s.kv_cache_usage = scheduler_stats.kv_cache_usage
            if scheduler_stats.kv_connector_stats:
                self.observe_connector(s, scheduler_stats.kv_connector_stats)
        if iteration_stats is not None:
            s.num_generation_tokens += iteration_stats.num_generation_tokens
            p = iteration_stats.prompt_token_stats
            by_source = s.prompt_tokens_by_source
            for source, n in (
                ("local_compute", p.computed),
                ("local_cache_hit", p.local_cache_hit),
                ("external_kv_transfer", p.external_kv_transfer),
            ):
                by_source[source] = by_source.get(source, 0) + n
            for finished in iteration_stats.finished_requests:
                s.num_timed_requests += 1
                for phase, seconds in (("queue", finished.queued_time), ("prefill", finished.prefill_time)):
                    s.phase_seconds[phase] = s.phase_seconds.get(phase, 0.0) + seconds
                if finished.num_generation_tokens > 1:
                    s.num_decoded_requests += 1
                    s.tpot_seconds += finished.mean_time_per_output_token

    def log_engine_initialized(self) -> None:
        pass
