"""The CPU KV tier connector: engines save prompt KV blocks to a store actor's host pool and
load shared prefixes back, across engines and nodes.

Loaded with ``kv_connector="TandemCpuTierConnector"``,
``kv_connector_module_path="connectors.offload"`` (usually as a child of
TandemMultiConnector). ``kv_connector_extra_config`` is a ``TierSettings`` (written by
``orchestrator.deploy``): where the Ray cluster and the tier's actors are, and whether this
engine saves and/or loads.

Scheduler role (engine core): asks the index actor, as soon as a request arrives, how long
a prefix of the request's block hashes is held (when first scheduling the request it waits
a few ms for the answer, then says "not yet" until it arrives), pins it for the load, plans
loads into the blocks vLLM allocates, and plans saves of newly computed full blocks: the
prompt's and, with ``TierSettings.save_outputs``, those of the generated tokens, which a
chat's next turn resends as its prompt.
Worker role (next to the KV cache): moves the bytes through NIXL, see
``connectors.offload_worker``. Both reach the index on its channel
(``connectors.index_client``: hashes and slot numbers, never KV bytes); the engine's
processes never join the Ray cluster.

The engine's ``kv_transfer_config.engine_id`` names it in the index: pin keys are
``<engine_id>/<request id>`` and grants are owned by ``<engine_id>``, so the control plane
can release whatever a dead engine held with ``KVIndexActor.release_owner(engine_id)``.
The index may be unreachable or restarting at any time: lookups then miss and saves are
skipped, and the engine serves by computing.

Why not vLLM's OffloadingConnector with an out-of-tree OffloadingSpec: see docs/cpu-tier.md
(it asserts that no transfer fails, so a dead store would crash the engine instead of
recomputing).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from actors.kv_index import TIER_HINT, TIER_SAVED, TIER_SKIP, BlockLocation, Lookup, Unpin
from actors.kv_store import TierSettings
from connectors.index_client import IndexCallError, IndexClient
from connectors.offload_worker import CpuTierWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("tandem.cpu_tier")

# How long the scheduler waits for the index's answer when it first considers a request.
# The lookup starts when the request arrives, so this is usually a wait of a few ms at most;
# past it the request waits a step ("not yet"), which under load costs a whole forward pass.
LOOKUP_WAIT_S = 0.01
# A lookup unanswered after this long counts as a miss (the request is admitted cold).
LOOKUP_TIMEOUT_S = 2.0
# An answer older than this is looked up again before a load is planned from it: its pins may
# have lapsed (actors.kv_index.PIN_LEASE_S) or the index may have restarted since, and only
# fresh answers are covered by a restarted index's quarantine (RESTART_QUARANTINE_S).
LOOKUP_FRESH_S = 5.0


class LoadJob(msgspec.Struct, frozen=True):
    req_id: str
    block_ids: list[int]
    locations: list[BlockLocation]


class SaveJob(msgspec.Struct, frozen=True):
    block_ids: list[int]
    hashes: list[bytes]


@dataclass
class TierMetadata(KVConnectorMetadata):
    """One step's plan, scheduler -> worker."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


@dataclass
class TierStats(KVConnectorStats):
    """{"bytes_loaded", "bytes_saved", "tokens_saved"}: read by TandemMultiConnector."""

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _skips_tier(request: Request) -> bool:
    """Whether the tier has nothing to offer the request, so a lookup would only hold it for
    the index's answer: the router that sent it knows the tier holds none of its prompt's
    blocks (TIER_HINT), the request keeps the tier out of it (TIER_SKIP), or its prompt's KV
    is pulled from the engine that prefilled it (vLLM's P/D `do_remote_prefill`, which the
    P/D connector clears once it plans the pull, so a pull that fails asks the tier again).
    Under conditional disaggregation a decode engine loads from the tier, and MultiConnector
    admits a request only once every child has answered: a lookup per remote prefill held
    each one a step behind the index, and stalled the engine's running decodes while the
    scheduler waited for it (docs/bench-results.md, runs 85-88)."""
    params = request.kv_transfer_params or {}
    return params.get(TIER_HINT) == 0 or bool(params.get("do_remote_prefill")) or _kept_out(request)


def _kept_out(request: Request) -> bool:
    """Whether the request keeps the tier out of it altogether (TIER_SKIP): no lookup, no save."""
    return bool((request.kv_transfer_params or {}).get(TIER_SKIP))


class _Pending:
    """An in-flight or answered lookup of one request (`call`: its call on the index's channel)."""

    __slots__ = ("call", "started", "first_block", "locations")

    def __init__(self, call: int, first_block: int) -> None:
        self.call = call
        self.started = time.monotonic()
        self.first_block = first_block
        self.locations: list[BlockLocation] | None = None

    @property
    def stale(self) -> bool:
        return self.locations is not None and time.monotonic() - self.started > LOOKUP_FRESH_S


class TandemCpuTierConnector(KVConnectorBase_V1):
    """Facade: picks the scheduler-side or worker-side half once, by role."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None  # checked by the base class
        self.settings = msgspec.convert(ktc.kv_connector_extra_config, TierSettings)
        self.engine_id = str(ktc.engine_id)
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks
        self.index = IndexClient(self.settings.index_address)
        is_worker = role == KVConnectorRole.WORKER
        self.worker = CpuTierWorker(self.index, self.settings.store_id, self.engine_id) if is_worker else None
        # Scheduler state, keyed by request id and dropped in request_finished.
        self._requests: dict[str, Request] = {}
        self._lookups: dict[str, _Pending] = {}
        self._saved_blocks: dict[str, int] = {}
        # Requests whose planned load has not ended: they hold pins until it does.
        self._loading: set[str] = set()
        self._meta = TierMetadata()
        # Worker state: this step's saves (block ids, hashes, the slot call asked of the index),
        # bound before the forward pass; and the last step's, written at the start of this one.
        self._step_saves: list[tuple[list[int], list[bytes], int | None]] = []
        self._deferred_saves: list[tuple[list[int], list[bytes], int | None]] = []

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped save is a later miss, never a wrong answer."""
        return False

    # ---- scheduler side ----

    def on_new_request(self, request: Request) -> None:
        """Called when a request reaches the scheduler: start its lookup now, so the answer is
        usually in by the time the scheduler first considers the request."""
        if self.settings.load and self._loadable_blocks(request) > 0 and not _skips_tier(request):
            self._start_lookup(request, 0)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Called while admitting a request, maybe several times. Waits up to LOOKUP_WAIT_S
        for the index's answer, then returns (None, False) while it is still in flight; once
        answered, (tokens of the held prefix beyond num_computed_tokens, True: loaded
        asynchronously), or (0, False) on a miss."""
        if not self.settings.load or _skips_tier(request):
            return 0, False
        req_id = request.request_id
        first = num_computed_tokens // self.block_size
        if first >= self._loadable_blocks(request):
            return 0, False
        pending = self._lookups.get(req_id)
        if pending is None or pending.first_block > first or pending.stale:
            pending = self._start_lookup(request, first)
        if pending.locations is None and not self._answer(req_id, pending):
            return None, False
        if pending.first_block < first:
            # Looked up from an earlier block (at arrival); vLLM's own cache covers up to
            # `first`. A tier run shorter than that is of no use (a rare miss, not an error).
            pending.locations = pending.locations[first - pending.first_block :]
            pending.first_block = first
        num_blocks = len(pending.locations)
        if num_blocks == 0:
            return 0, False
        return (first + num_blocks) * self.block_size - num_computed_tokens, True

    def _loadable_blocks(self, request: Request) -> int:
        """Full prompt blocks the tier may provide (at least one prompt token must be computed
        to produce logits)."""
        return min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)

    def _start_lookup(self, request: Request, first: int) -> _Pending:
        req_id = request.request_id
        hashes = [bytes(h) for h in request.block_hashes[first : self._loadable_blocks(request)]]
        replaced = self._lookups.get(req_id)
        if replaced is not None:
            self.index.forget(replaced.call)
        pending = self._lookups[req_id] = _Pending(self.index.call(Lookup(self._pin_key(req_id), hashes)), first)
        return pending

    def _answer(self, req_id: str, pending: _Pending) -> bool:
        """Fill `pending.locations` if the index has answered (waiting up to LOOKUP_WAIT_S
        from the lookup's start), or if it failed or timed out (a miss); False: still open."""
        waited = time.monotonic() - pending.started
        if not self.index.wait([pending.call], max(0.0, LOOKUP_WAIT_S - waited)):
            if waited < LOOKUP_TIMEOUT_S:
                return False
            logger.warning("CPU tier lookup of request %s timed out; computing it", req_id)
            self.index.forget(pending.call)
            pending.locations = []
            return True
        try:
            pending.locations = self.index.result(pending.call).locations
        except IndexCallError as err:  # index unreachable or restarting: serve without the tier
            logger.warning("CPU tier lookup of request %s failed (%s); computing it", req_id, err)
            pending.locations = []
        return True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Called after vLLM allocates blocks for an admitted request (twice for an async
        load). Plans the load of the looked-up locations into the new blocks."""
        req_id = request.request_id
        if not _kept_out(request):  # only the requests held here have their blocks saved
            self._requests[req_id] = request
            # Blocks pulled from a prefill engine that saves them: that engine writes them.
            saved = (request.kv_transfer_params or {}).get(TIER_SAVED, 0)
            if saved and req_id not in self._saved_blocks:
                self._saved_blocks[req_id] = min(saved, request.num_prompt_tokens) // self.block_size
        pending = self._lookups.pop(req_id, None)
        if num_external_tokens == 0 or pending is None or not pending.locations:
            if pending is not None:
                self.index.forget(pending.call)  # its answer may not have come
                self._unpin(req_id)
            return
        # `blocks` are all the request's blocks; the load fills those after the local hit.
        first, num_blocks = pending.first_block, num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0][first : first + num_blocks]
        self._meta.loads.append(LoadJob(req_id, block_ids, pending.locations[:num_blocks]))
        self._loading.add(req_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Called once per step: the loads planned since the last step, and saves of the full
        blocks this step computes (of the prompt, and of the output with save_outputs)."""
        if self.settings.store_id is not None:
            steps = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
            cached = scheduler_output.scheduled_cached_reqs
            steps += list(zip(cached.req_ids, cached.num_computed_tokens))
            for req_id, computed in steps:
                self._plan_save(req_id, computed + scheduler_output.num_scheduled_tokens.get(req_id, 0))
        meta, self._meta = self._meta, TierMetadata()
        return meta

    def _plan_save(self, req_id: str, computed_after: int) -> None:
        request = self._requests.get(req_id)
        if request is None or self._kv_cache_manager is None:
            return
        # A block is full once its last token's KV is computed; vLLM hashes the blocks of
        # generated tokens too, as they fill (Request.block_hashes).
        saveable = computed_after if self.settings.save_outputs else min(computed_after, request.num_prompt_tokens)
        full = min(saveable // self.block_size, len(request.block_hashes))
        done = self._saved_blocks.get(req_id, 0)
        if full <= done:
            return
        block_ids = self._kv_cache_manager.get_block_ids(req_id)[0][done:full]
        hashes = [bytes(h) for h in request.block_hashes[done:full]]
        self._meta.saves.append(SaveJob(block_ids, hashes))
        self._saved_blocks[req_id] = full

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Called once per step with the workers' results: a finished load releases its pins."""
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)
            self._unpin(req_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request ends. Its blocks may be freed now: a save of them not yet
        written is written before any plan that can reuse them runs (handle_preemptions)."""
        req_id = request.request_id
        # Pins are held by a lookup not yet used and by a load not yet ended; a request that
        # had neither (told the tier holds none of it, a miss, a load that ended) holds none,
        # and costs the index no call.
        pending = self._lookups.pop(req_id, None)
        if pending is not None:
            self.index.forget(pending.call)
        if pending is not None or req_id in self._loading:
            self._unpin(req_id)
        self._loading.discard(req_id)
        self._requests.pop(req_id, None)
        self._saved_blocks.pop(req_id, None)
        return False, None

    def _pin_key(self, req_id: str) -> str:
        return f"{self.engine_id}/{req_id}"

    def _unpin(self, req_id: str) -> None:
        """Release a request's pins; lost if the index is unreachable (its lease reclaims them)."""
        self.index.send(Unpin(self._pin_key(req_id)))

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches, self.num_blocks)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Called before each forward pass: note this step's saves and ask the index for their
        slots now, so that the answer comes during the forward pass instead of in the next
        step's start (`handle_preemptions`), which used to wait the round trip. The ask is one
        ZMQ message sent without waiting; asked this early as a Ray call, it slowed the
        forward pass beside it (docs/cpu-tier.md)."""
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, TierMetadata) and self.worker is not None
        worker = self.worker
        self._step_saves = [(job.block_ids, job.hashes, worker.request_slots(job.hashes)) for job in connector_metadata.saves]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Called once per step: post this step's planned loads."""
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierMetadata)
        for job in meta.loads:
            self.worker.start_load(job.req_id, job.block_ids, job.locations)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        """Called after each forward pass, before its tokens are sampled: the blocks it
        completed are written at the start of the next step instead (`handle_preemptions`),
        so the write does not delay this step's tokens, a new request's first one above all."""
        self._deferred_saves += self._step_saves
        self._step_saves = []

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Called at the start of every step, forward pass or not, before anything can write
        the KV cache (the forward pass, loads into newly allocated blocks): write the last
        step's blocks now, while they still hold what it computed. No block needs holding for
        this: a block freed (a request finished, aborted or preempted) is handed out again at
        the earliest in a plan made after the free, and that plan's step starts here. vLLM
        runs one more step after any request finishes, so the last saves are written too."""
        assert self.worker is not None
        saves, self._deferred_saves = self._deferred_saves, []
        self.worker.save(saves, self.block_size)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Called once per step: requests whose loads ended (errors reported separately), after
        the step's housekeeping (answers from the index, transfers that outlived their step)."""
        assert self.worker is not None
        return None, self.worker.poll() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_error_blocks() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is None:
            return None
        stats = TierStats(data=self.worker.take_counters())
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        self.index.close()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TierStats(data=dict(data or {}))
