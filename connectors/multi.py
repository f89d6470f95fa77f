"""Tandem's MultiConnector: vLLM's MultiConnector plus load fallback and per-child counters.

Engines load it with ``kv_connector="TandemMultiConnector"`` and
``kv_connector_module_path="connectors.multi"``; the children are listed, in priority
order, in ``kv_connector_extra_config["connectors"]`` and resolved through
``connectors.registry`` (vLLM names, Tandem names and out-of-tree module paths alike).

Inherited from vLLM's MultiConnector, unchanged: load from the first child reporting
matched tokens in config order, "not yet" while any child is still looking up, save to
every child, a request finishes sending only when every async-saving child has, load-error
block ids and transfer results aggregated, shutdown of every child with the last error
re-raised.

Added here:

Load fallback. vLLM's scheduler asks a connector for matched tokens only while a request
has ``num_computed_tokens == 0`` (a fresh admission or a re-admission after preemption).
When a load fails under ``kv_load_failure_policy="recompute"``, the scheduler truncates the
request's ``num_computed_tokens`` to the valid prefix before the first failed block
(``_update_requests_with_invalid_blocks``) or to 0 for a whole-request failure
(``_handle_failed_recving``). For an *async* load that leaves 0 valid tokens, the request
goes back to WAITING with its blocks freed and the next ``schedule()`` asks
``get_num_new_matched_tokens`` again: that is the re-query this class turns into a
fallback, by skipping every child whose load already failed for the request and taking
the next child that reports tokens, else 0 (recompute). Where the scheduler does not
re-query (a sync load, or a failure that leaves a valid prefix) vLLM itself recomputes the
rest locally; the failure is still counted. Output is correct either way: a failed child is
never asked to load the same request again.

The failure reaches the scheduler-side connector in ``update_connector_output``:
``failed_recving`` names requests, and ``invalid_block_ids`` are mapped back to the
requests whose load was given those blocks in ``update_state_after_alloc``. vLLM calls
``update_connector_output`` after it has handled the failure and before the next
``schedule()``, so the skip is in place when the re-query comes.

Per-child counters, exposed through vLLM's KVConnectorStats (see TandemMultiStats).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.v1.outputs import KVConnectorOutput

from actors.protocol import ChildCounters, StatsPayload, parse_stats
from connectors.registry import (
    ConnectorError,
    child_configs,
    register_in_vllm,
    resolve_connector,
    supports_hma_config,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        PromMetric,
        PromMetricT,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# vLLM's HMA check and its own MultiConnector resolve children by name through
# KVConnectorFactory; this makes Tandem's names resolvable there in every engine process.
register_in_vllm()


def _extend_transfers(into: dict[str, dict[str, list[Any]]], name: str, data: Mapping[str, Any]) -> None:
    mine = into.setdefault(name, {})
    for key, values in data.items():
        if isinstance(values, list):
            mine.setdefault(key, []).extend(values)


def _has_transfers(data: Mapping[str, Any]) -> bool:
    return any(isinstance(v, list) and v for v in data.values())


@dataclass
class TandemMultiStats(KVConnectorStats):
    """Per-child counters; ``data`` is plain builtins (``msgspec.to_builtins(StatsPayload)``)
    so it survives the worker -> engine core -> stat logger hops unchanged."""

    def __post_init__(self) -> None:
        if "children" not in self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"children": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Sum counters child by child (workers of one engine, then scheduler + workers)."""
        totals = parse_stats(self.data)
        theirs = parse_stats(other.data)
        for name, counters in theirs.children.items():
            totals.children.setdefault(name, ChildCounters()).add(counters)
        for name, data in theirs.transfers.items():
            _extend_transfers(totals.transfers, name, data)
        self.data = msgspec.to_builtins(totals)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Flat ``{"<child>.<counter>": value}`` of the non-zero counters, children sorted by
        name so log lines are stable."""
        return {
            f"{name}.{field}": value
            for name, counters in sorted(parse_stats(self.data).children.items())
            for field, value in msgspec.structs.asdict(counters).items()
            if value
        }

    def is_empty(self) -> bool:
        payload = parse_stats(self.data)
        return all(c.is_zero() for c in payload.children.values()) and not any(
            _has_transfers(d) for d in payload.transfers.values()
        )


def child_names(children: list[Mapping[str, Any]]) -> list[str]:
    """Stats names of the children: ``kv_connector``, plus ``#i`` where a name repeats."""
    names = [str(child["kv_connector"]) for child in children]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


def _child_transfer_counts(stats: KVConnectorStats) -> ChildCounters:
    """Bytes/tokens moved, read from a child's own stats in the formats Tandem knows:
    Tandem's int keys bytes_loaded/bytes_saved/tokens_saved, NixlConnector's
    bytes_transferred list (recorded by the reading side, so loaded), and
    OffloadingConnector's load/store byte counters."""
    data = stats.to_dict()
    counts = ChildCounters(
        bytes_loaded=int(data.get("bytes_loaded", 0)),
        bytes_saved=int(data.get("bytes_saved", 0)),
        tokens_saved=int(data.get("tokens_saved", 0)),
    )
    transferred = data.get("bytes_transferred")
    if isinstance(transferred, list):
        counts.bytes_loaded += int(sum(transferred))
    offload = data.get("data")
    if isinstance(offload, Mapping):
        counts.bytes_loaded += int(sum(offload.get("vllm:kv_offload_load_bytes", {}).values()))
        counts.bytes_saved += int(sum(offload.get("vllm:kv_offload_store_bytes", {}).values()))
    return counts


def _as_mapping(ktc: KVTransferConfig) -> dict[str, Any]:
    return {
        "kv_connector": ktc.kv_connector,
        "kv_connector_module_path": ktc.kv_connector_module_path,
        "kv_connector_extra_config": ktc.kv_connector_extra_config,
    }


class TandemMultiConnector(MultiConnector):
    """vLLM's MultiConnector with children from Tandem's registry, load fallback and
    per-child counters. Scheduler-side state is keyed by request id and dropped in
    ``request_finished``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        ktc = vllm_config.kv_transfer_config
        if ktc is None:
            raise ConnectorError("TandemMultiConnector needs vllm_config.kv_transfer_config")
        if not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager and not (
            supports_hma_config(_as_mapping(ktc))
        ):
            raise ConnectorError(
                "TandemMultiConnector: a child connector does not support vLLM's hybrid "
                "KV cache manager, which is enabled; set disable_hybrid_kv_cache_manager"
                "=True (--disable-hybrid-kv-cache-manager), see "
                "connectors.registry.supports_hma_config"
            )
        super().__init__(vllm_config, role, kv_cache_config)
        self._names = child_names(child_configs(_as_mapping(ktc)))
        self._counters = {name: ChildCounters() for name in self._names}
        # child name -> its NIXL-shaped transfer records since the last stats report.
        self._transfers: dict[str, dict[str, list[Any]]] = {}
        # req id -> children whose load failed for it; skipped on every later lookup.
        self._failed_children: dict[str, set[int]] = {}
        # req id -> the child whose failure awaits a re-query (counted as fallback/recompute).
        self._awaiting_requery: dict[str, int] = {}
        # req id -> child chosen by the latest lookup (None: no child), consumed at alloc.
        self._lookups: dict[str, int | None] = {}
        # req id -> (loading child, block ids it loads into), to attribute invalid blocks.
        self._loads: dict[str, tuple[int, frozenset[int]]] = {}

    @classmethod
    def _get_connector_classes_and_configs(
        cls, vllm_config: VllmConfig
    ) -> list[tuple[type[KVConnectorBase_V1], VllmConfig]]:
        """Children resolved through Tandem's registry, each with its own VllmConfig copy
        (vLLM's recipe); errors name the child's position."""
        ktc = vllm_config.kv_transfer_config
        if ktc is None:
            raise ConnectorError("TandemMultiConnector needs vllm_config.kv_transfer_config")
        ret: list[tuple[type[KVConnectorBase_V1], VllmConfig]] = []
        for i, child in enumerate(child_configs(_as_mapping(ktc))):
            where = f"kv_transfer.connectors[{i}]"
            try:
                connector_cls = resolve_connector(
                    child.get("kv_connector", ""), child.get("kv_connector_module_path")
                )
            except ConnectorError as e:
                raise ConnectorError(f"{where}: {e}") from e
            child_config = copy.copy(vllm_config)
            child_config.kv_transfer_config = KVTransferConfig(
                **{**child, "engine_id": child.get("engine_id", ktc.engine_id)}
            )
            ret.append((connector_cls, child_config))
        return ret

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Called once by the engine before allocating KV caches. Returns the one layout
        the children require (None: no preference); children that disagree raise."""
        wanted: dict[str, str] = {}
        configs = cls._get_connector_classes_and_configs(vllm_config)
        names = child_names([_as_mapping(c.kv_transfer_config) for _, c in configs])
        for name, (connector_cls, child_config) in zip(names, configs):
            layout = connector_cls.get_required_kvcache_layout(child_config)
            if layout is not None:
                wanted[name] = layout
        if len(set(wanted.values())) > 1:
            raise ConnectorError(
                f"TandemMultiConnector: children require different KV cache layouts "
                f"{wanted}; all children share one KV cache, so use children that agree"
            )
        return next(iter(wanted.values()), None)

    # ---- scheduler side ----

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Called by the scheduler while admitting a request with no computed tokens, maybe
        several times before it is admitted. Returns (tokens the first child in order with
        a hit can load, whether async); (None, False) while any asked child is still
        looking up; (0, False) when none has tokens. Children whose load already failed
        for this request are not asked."""
        req_id = request.request_id
        skip = self._failed_children.get(req_id, set())
        self._requests_to_connector.pop(req_id, None)
        chosen: int | None = None
        result: tuple[int | None, bool] = (0, False)
        for i, c in enumerate(self._connectors):
            if i in skip:
                continue
            num_tokens, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if num_tokens is None:
                return None, False
            if chosen is None and num_tokens > 0:
                chosen, result = i, (num_tokens, load_async)
        if chosen is not None:
            self._requests_to_connector[req_id] = chosen
        self._lookups[req_id] = chosen
        return result

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Called by the scheduler after allocating blocks for an admitted request (twice
        for an async load). Forwards to the children, then counts the admission once."""
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        req_id = request.request_id
        if req_id not in self._lookups:
            return
        chosen = self._lookups.pop(req_id)
        loading = chosen is not None and num_external_tokens > 0
        if chosen is not None and loading:
            counters = self._counters[self._names[chosen]]
            counters.hits += 1
            counters.tokens_loaded += num_external_tokens
            block_ids = frozenset(b for group in blocks.get_block_ids() for b in group)
            self._loads[req_id] = (chosen, block_ids)
        failed = self._awaiting_requery.pop(req_id, None)
        if failed is not None:
            counters = self._counters[self._names[failed]]
            if loading:
                counters.fallbacks += 1
            else:
                counters.recomputes += 1

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Called by the scheduler once per step with the workers' aggregated output, after
        vLLM has handled load failures and before the next schedule(). Records which
        child failed which request, so the re-query skips it."""
        failed = set(connector_output.failed_recving)
        if connector_output.invalid_block_ids:
            failed |= {
                req_id
                for req_id, (_, block_ids) in self._loads.items()
                if block_ids & connector_output.invalid_block_ids
            }
        for req_id in failed:
            load = self._loads.pop(req_id, None)
            if load is None:
                continue
            child = load[0]
            self._failed_children.setdefault(req_id, set()).add(child)
            self._awaiting_requery[req_id] = child
            self._counters[self._names[child]].load_failures += 1
        for req_id in connector_output.finished_recving or ():
            self._loads.pop(req_id, None)
        super().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, blocks: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request finishes, before its blocks are freed. Returns
        (whether any child saves asynchronously, merged kv_transfer_params)."""
        result = super().request_finished(request, blocks)
        self._forget(request.request_id)
        return result

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """HMA variant of request_finished, same contract."""
        result = super().request_finished_all_groups(request, block_ids)
        self._forget(request.request_id)
        return result

    def _forget(self, req_id: str) -> None:
        for state in (self._failed_children, self._awaiting_requery, self._lookups, self._loads):
            state.pop(req_id, None)

    # ---- worker side ----

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Called by the worker once per step. Returns the union of the children's failed
        block ids, counting each child's share."""
        failed: set[int] = set()
        for name, c in zip(self._names, self._connectors):
            child_failed = c.get_block_ids_with_load_errors()
            self._counters[name].load_error_blocks += len(child_failed)
            failed |= child_failed
        return failed

    # ---- stats (both roles) ----

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Called once per step by the worker and by the scheduler. Returns the counters
        of the children that changed since the last call (then resets them), or None. The children's
        own stats are read here (which resets them) and folded into byte/token counts."""
        for name, c in zip(self._names, self._connectors):
            child_stats = c.get_kv_connector_stats()
            if child_stats is not None and not child_stats.is_empty():
                self._counters[name].add(_child_transfer_counts(child_stats))
                data = child_stats.to_dict()
                if isinstance(data.get("transfer_duration"), list):
                    _extend_transfers(self._transfers, name, data)
        changed = {name: c for name, c in self._counters.items() if not c.is_zero()}
        transfers = {name: d for name, d in self._transfers.items() if _has_transfers(d)}
        if not changed and not transfers:
            return None
        stats = TandemMultiStats(
            data=msgspec.to_builtins(StatsPayload(children=changed, transfers=transfers))
        )
        self._counters = {name: ChildCounters() for name in self._names}
        self._transfers = {}
        return stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """Called by vLLM's stat loggers to rebuild stats from the serialised dict."""
        return TandemMultiStats(data=copy.deepcopy(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """None: vLLM's per-child Prometheus metrics expect vLLM's stats shape, not
        TandemMultiStats; Tandem's engine actor exports the per-child counters itself."""
        return None
