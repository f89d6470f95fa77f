"""Worker role of the CPU tier connector: moves KV blocks between this engine's KV cache and
the stores' host pools with one-sided NIXL transfers.

Saves are synchronous, at the start of the step after the one that computed the blocks
(``handle_preemptions``, before anything can overwrite them), so neither the index's slot
grant (a round trip on the index's channel) nor the NIXL WRITE delays the tokens of the step
that computed them; both are paid in the next step. Loads are
asynchronous: posted in ``start_load_kv`` and polled in ``get_finished``. Any failure (a
dead store, a location outside its pool, a transfer error) marks the request's blocks as
load errors, which vLLM recomputes.

Rules that keep the tier safe under faults:
- The engine step never waits on the index for long: at most GRANT_WAIT_S for a slot grant (a
  grant arriving later is given back), never for a store's endpoint: a grant carries the
  endpoint of a store incarnation the worker does not know yet, and one needed by a load is
  fetched in the background (until it arrives, loads from that store fail and vLLM
  recomputes).
- A transfer's memory is never handed on while the transfer may still touch it: a load is
  reported finished, and a grant committed or given back, only once NIXL says every
  transfer of it has ended. Releasing a NIXL handle does not stop a UCX transfer (nixl
  1.5.1 "cancels" with ``ucp_request_cancel``, a no-op for RMA; a released READ or WRITE was
  seen to land in full afterwards), so an in-flight handle is never released: it is polled
  every step until it ends. A dead store ends its transfers with an error within about
  0.1 s; a live but stalled one can keep a request waiting, and while it does, new loads
  from that store fail and new saves to it are skipped.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.kv_index import Allocate, BlockLocation, Commit, Endpoint, Grant, SetSlotBytes, StoreEndpoint
from actors.nixl_agent import make_nixl_agent
from connectors.index_client import IndexCallError, IndexClient, IndexRefused

logger = logging.getLogger("tandem.cpu_tier")

# How long a save waits for its slot grant (a round trip to the index on its channel; over
# Ray it was 0.3-4 ms, mostly 1-2, on a busy 2-core host, docs/bench-results.md); a slower
# index costs one save and this much of one step, not a stalled engine, and the grant is
# given back when it arrives.
GRANT_WAIT_S = 0.02
# How long a save waits for its WRITE (a healthy one of a step's blocks takes 1-2 ms).
# Past it the WRITE is left running and later saves to that store are skipped until it ends,
# so a stalled store costs one step this long, once.
WRITE_TIMEOUT_S = 1.0
# A load still in flight after this long is logged as stuck (it keeps its blocks until NIXL
# ends it), and its store takes no new loads or saves meanwhile.
STUCK_TRANSFER_S = 10.0
# How long engine start waits for the index to take this engine's slot size. Saves send it
# again, so an index that is down or restarting only delays the tier, not the engine.
SLOT_BYTES_WAIT_S = 10.0
# The same warning is logged at most once per this many seconds (a slow index or a stalled
# store would otherwise log every step).
WARN_EVERY_S = 10.0


@dataclass
class LayerRegion:
    """Where one layer's block b lives: base + b * stride, `page` contiguous bytes."""

    base: int
    stride: int
    page: int


@dataclass
class _Xfer:
    """A posted NIXL transfer; `state` is NIXL's last answer ("PROC" until it ends)."""

    handle: Any
    store_id: str
    agent: str  # remote agent name
    state: str = "PROC"


@dataclass
class _Load:
    req_id: str
    block_ids: list[int]
    xfers: list[_Xfer]
    started: float
    nbytes: int
    # Blocks past the valid prefix of the plan (failed before any transfer).
    failed: list[int] = field(default_factory=list)
    stuck: bool = False


@dataclass
class _StuckSave:
    """A WRITE that outlived its step: its grant is given back once the WRITE ends."""

    xfer: _Xfer
    grant: Grant


class CpuTierWorker:
    """Per-engine-worker half of the tier: one NIXL agent, KV regions, store endpoints."""

    def __init__(
        self,
        index: IndexClient,
        store_id: str | None,
        owner: str,
        agent: Any | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`index` is this process's channel to the index; `owner` names
        this engine incarnation in the index (grants are reclaimed by it when it dies);
        `agent` is a NIXL agent (built here when None); `clock` is injectable for tests."""
        self._index = index
        self.store_id = store_id
        self.owner = owner
        if agent is None:
            agent = make_nixl_agent(f"tandem-kv-engine-{owner}-{uuid.uuid4().hex[:6]}", progress_thread=False)
        self.agent = agent
        self._clock = clock
        self.layers: list[LayerRegion] = []
        self.slot_bytes = 0
        # store id -> (endpoint, remote agent name) of the incarnation we know
        self._stores: dict[str, tuple[StoreEndpoint, str]] = {}
        # store id -> pending Endpoint call
        self._fetches: dict[str, int] = {}
        # Remote agents of replaced store incarnations, removed once no transfer uses them.
        self._retired_agents: set[str] = set()
        self._loads: list[_Load] = []
        self._stuck_saves: list[_StuckSave] = []
        # Slot grants that missed their step, given back when they arrive.
        self._late_grants: list[int] = []
        self._error_blocks: set[int] = set()
        self._last_warned: dict[str, float] = {}
        self.bytes_loaded = 0
        self.bytes_saved = 0
        self.tokens_saved = 0

    def register_kv_caches(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        """Called once at engine start: learn each layer's block layout, register the
        memory with NIXL, and tell the index how big one block of every layer is (an index
        that is down or restarting does not stop the engine: saves carry the size too)."""
        from vllm.v1.kv_cache_interface import group_kernel_blocks

        registered: set[tuple[int, int]] = set()
        for name, cache in kv_caches.items():
            ref = group_kernel_blocks(cache, num_blocks)
            if not ref[0].is_contiguous():
                raise RuntimeError(
                    f"CPU tier: layer {name}'s KV block is not contiguous (shape {tuple(cache.shape)}, "
                    f"stride {cache.stride()}); this KV cache layout is not supported by the CPU tier"
                )
            elem = ref.element_size()
            self.layers.append(LayerRegion(ref.data_ptr(), ref.stride(0) * elem, ref[0].numel() * elem))
            storage = cache.untyped_storage()
            registered.add((storage.data_ptr(), storage.nbytes()))
        self.agent.register_memory([(ptr, size, 0, "") for ptr, size in sorted(registered)], "DRAM")
        self.slot_bytes = sum(layer.page for layer in self.layers)
        self._index.wait_connected(SLOT_BYTES_WAIT_S)
        call = self._index.call(SetSlotBytes(self.slot_bytes))
        if not self._index.wait([call], SLOT_BYTES_WAIT_S):
            self._index.forget(call)
            logger.warning("CPU tier index did not take this engine's slot size within %.0f s; saves will send it",
                           SLOT_BYTES_WAIT_S)
            return
        try:
            self._index.result(call)
        except IndexRefused:  # another model's blocks: this engine must not share the tier
            raise
        except IndexCallError as err:
            logger.warning("CPU tier index did not take this engine's slot size (%s); saves will send it", err)

    # ---- the step's housekeeping ----

    def poll(self) -> set[str]:
        """Called once per step (get_finished): collect background answers, end transfers
        that have ended, and return the requests whose loads ended since the last poll."""
        self._poll_fetches()
        self._poll_late_grants()
        self._poll_stuck_saves()
        done = self._poll_loads()
        self._remove_retired_agents()
        return done

    def _warn(self, key: str, msg: str, *args: Any) -> None:
        now = self._clock()
        if now - self._last_warned.get(key, float("-inf")) >= WARN_EVERY_S:
            self._last_warned[key] = now
            logger.warning(msg, *args)

    def _give_back(self, grant: Grant) -> None:
        """Return a grant's slots to the index; only once nothing can write them any more."""
        self._index.send(Commit(grant, False))

    # ---- store endpoints ----

    def _known_store(self, store_id: str, incarnation: str) -> tuple[StoreEndpoint, str] | None:
        """The endpoint of that store incarnation if known; otherwise None, and its fetch is
        started (the answer is taken on a later step, never waited for)."""
        known = self._stores.get(store_id)
        if known is not None and known[0].incarnation == incarnation:
            return known
        self._fetch_endpoint(store_id)
        return None

    def _fetch_endpoint(self, store_id: str) -> None:
        if store_id not in self._fetches:
            self._fetches[store_id] = self._index.call(Endpoint(store_id))

    def _poll_fetches(self) -> None:
        if not self._fetches:
            return
        ready = self._index.wait(self._fetches.values(), 0)
        for store_id in [s for s, call in self._fetches.items() if call in ready]:
            try:
                ep: StoreEndpoint | None = self._index.result(self._fetches.pop(store_id))
            except IndexCallError as err:
                self._warn("endpoint", "CPU tier could not fetch the endpoint of store %s: %s", store_id, err)
                continue
            if ep is not None:
                self._adopt_endpoint(ep)

    def _adopt_endpoint(self, ep: StoreEndpoint) -> None:
        """Reach `ep` from now on (its remote agent loaded); an older incarnation's agent is
        retired."""
        known = self._stores.get(ep.store_id)
        if known is not None and known[0].incarnation == ep.incarnation:
            return
        if known is not None:
            self._retired_agents.add(known[1])
        self._stores[ep.store_id] = (ep, self.agent.add_remote_agent(ep.agent_metadata))

    def _remove_retired_agents(self) -> None:
        if not self._retired_agents:
            return
        in_use = {x.agent for x in self._live_xfers()}
        for name in self._retired_agents - in_use:
            self._retired_agents.discard(name)
            try:
                self.agent.remove_remote_agent(name)
            except Exception as err:
                logger.warning("CPU tier could not remove the NIXL agent of an old store incarnation: %s", err)

    # ---- transfers ----

    def _local_descs(self, block_ids: list[int]) -> Any:
        rows = [(l.base + b * l.stride, l.page, 0) for b in block_ids for l in self.layers]
        return self.agent.get_xfer_descs(np.array(rows, dtype=np.uint64), "DRAM")

    def _remote_descs(self, base: int, slots: list[int]) -> Any:
        rows = []
        for s in slots:
            offset = base + s * self.slot_bytes
            for l in self.layers:
                rows.append((offset, l.page, 0))
                offset += l.page
        return self.agent.get_xfer_descs(np.array(rows, dtype=np.uint64), "DRAM")

    def _post(self, op: str, block_ids: list[int], ep: StoreEndpoint, agent: str, slots: list[int]) -> _Xfer:
        local, remote = self._local_descs(block_ids), self._remote_descs(ep.base_addr, slots)
        handle = self.agent.initialize_xfer(op, local, remote, agent)
        try:
            state = self.agent.transfer(handle)
        except Exception:
            self._release(handle)
            raise
        if state == "ERR":
            self._release(handle)
            raise RuntimeError(f"NIXL {op} to store {ep.store_id} failed to post")
        return _Xfer(handle, ep.store_id, agent, state)

    def _check(self, xfer: _Xfer) -> str:
        """NIXL's state of a transfer ("PROC", "DONE" or "ERR"). NIXL raises when the remote
        disconnected (a dead store): that transfer has ended, in error."""
        if xfer.state == "PROC":
            try:
                xfer.state = self.agent.check_xfer_state(xfer.handle)
            except Exception as err:
                logger.warning("CPU tier transfer with store %s failed: %s", xfer.store_id, err)
                xfer.state = "ERR"
        return xfer.state

    def _release(self, handle: Any) -> None:
        """Free an ended transfer's handle (never one in flight: that would not stop it)."""
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as err:
            logger.warning("CPU tier could not release a NIXL transfer handle (leaked): %s", err)

    def _live_xfers(self) -> list[_Xfer]:
        return [x for load in self._loads for x in load.xfers] + [s.xfer for s in self._stuck_saves]

    def _stalled(self, store_id: str) -> bool:
        """Whether a transfer with this store outlived its bound and has not ended: new loads
        from it fail and new saves to it are skipped until it does."""
        if any(s.xfer.store_id == store_id for s in self._stuck_saves):
            return True
        return any(
            load.stuck and any(x.store_id == store_id and x.state == "PROC" for x in load.xfers) for load in self._loads
        )

    # ---- saves ----

    def request_slots(self, hashes: list[bytes]) -> int | None:
        """Ask the index for store slots for these hashes without waiting; the call goes to
        `save`. None: nothing to save."""
        if self.store_id is None or not hashes or not self.slot_bytes:
            return None
        known = self._stores.get(self.store_id)
        known_incarnation = known[0].incarnation if known is not None else None
        return self._index.call(Allocate(self.store_id, hashes, self.owner, self.slot_bytes, known_incarnation))

    def save(self, jobs: list[tuple[list[int], list[bytes], int | None]], block_size: int) -> None:
        """Write this step's computed blocks, (block ids, hashes, `request_slots` answer) per
        job, to their granted slots; called at the start of the next step, before anything
        can overwrite the blocks. Waits at most GRANT_WAIT_S for the grants together; a failed or skipped save
        is logged and dropped (a miss later)."""
        calls = [call for _, _, call in jobs if call is not None]
        if not calls:
            return
        ready = self._index.wait(calls, GRANT_WAIT_S)
        late = [call for call in calls if call not in ready]
        if late:
            self._warn("late-grant", "CPU tier index did not grant slots within %.0f ms; %d saves skipped",
                       GRANT_WAIT_S * 1000, len(late))
            self._late_grants += late
        for block_ids, hashes, call in jobs:
            if call is not None and call in ready:
                self._save(dict(zip(hashes, block_ids)), call, block_size)

    def _save(self, block_of: dict[bytes, int], call: int, block_size: int) -> None:
        try:
            grant: Grant | None = self._index.result(call)
        except IndexCallError as err:  # the index is gone or restarting: the tier is a cache
            self._warn("allocate", "CPU tier save skipped: the index did not grant slots (%s)", err)
            return
        if grant is None or not grant.hashes:
            return
        if grant.endpoint is not None:
            self._adopt_endpoint(grant.endpoint)
        store = self._known_store(grant.store_id, grant.incarnation)
        if store is None or self._stalled(grant.store_id):
            why = "its endpoint is being fetched" if store is None else "an earlier transfer with it has not ended"
            self._warn(f"skip-{grant.store_id}", "CPU tier saves to store %s skipped: %s", grant.store_id, why)
            self._give_back(grant)
            return
        try:
            xfer = self._post("WRITE", [block_of[h] for h in grant.hashes], store[0], store[1], grant.slots)
        except Exception as err:
            self._warn(f"write-{grant.store_id}", "CPU tier save to store %s failed: %s", grant.store_id, err)
            self._give_back(grant)
            return
        deadline = self._clock() + WRITE_TIMEOUT_S
        while self._check(xfer) == "PROC" and self._clock() < deadline:
            pass
        if xfer.state == "PROC":
            logger.warning("CPU tier WRITE to store %s did not end within %.1f s; saves to it are skipped until "
                           "it does", grant.store_id, WRITE_TIMEOUT_S)
            self._stuck_saves.append(_StuckSave(xfer, grant))
            return
        self._release(xfer.handle)
        if xfer.state != "DONE":
            self._give_back(grant)
            return
        self._index.send(Commit(grant, True))  # lost with an unreachable index: its lease reclaims the slots
        self.bytes_saved += len(grant.hashes) * self.slot_bytes
        self.tokens_saved += len(grant.hashes) * block_size

    def _poll_late_grants(self) -> None:
        if not self._late_grants:
            return
        ready = self._index.wait(self._late_grants, 0)
        self._late_grants = [call for call in self._late_grants if call not in ready]
        for call in ready:
            try:
                grant: Grant | None = self._index.result(call)
            except IndexCallError:  # nothing was granted
                continue
            if grant is not None and grant.hashes:
                self._give_back(grant)

    def _poll_stuck_saves(self) -> None:
        still: list[_StuckSave] = []
        for stuck in self._stuck_saves:
            if self._check(stuck.xfer) == "PROC":
                still.append(stuck)
                continue
            # Ended, but after its step: the blocks it read may have been reused meanwhile.
            self._release(stuck.xfer.handle)
            self._give_back(stuck.grant)
        self._stuck_saves = still

    # ---- loads ----

    def start_load(self, req_id: str, block_ids: list[int], locations: list[BlockLocation]) -> None:
        """Post the reads of one request's planned blocks (grouped by store). Blocks from the
        first one that cannot be read now (unknown or stalled store, slot outside the pool)
        are load errors; nothing here waits."""
        failed: list[int] = []
        xfers: list[_Xfer] = []
        nbytes = 0
        by_store: dict[str, tuple[StoreEndpoint, str, list[int], list[int]]] = {}
        for i, (b, loc) in enumerate(zip(block_ids, locations)):
            store = self._known_store(loc.store_id, loc.incarnation)
            if store is None or self._stalled(loc.store_id) or (loc.slot + 1) * self.slot_bytes > store[0].pool_bytes:
                failed = block_ids[i:]
                break
            _, _, blocks, slots = by_store.setdefault(loc.store_id, (*store, [], []))
            blocks.append(b)
            slots.append(loc.slot)
        for ep, agent, blocks, slots in by_store.values():
            try:
                xfers.append(self._post("READ", blocks, ep, agent, slots))
            except Exception as err:  # READs already posted stay in the load until they end
                logger.warning("CPU tier load of request %s failed to start: %s", req_id, err)
                failed = list(block_ids)
                break
            nbytes += len(blocks) * self.slot_bytes
        if failed:
            logger.warning("CPU tier load of request %s: %d of %d blocks unavailable, recomputing them",
                           req_id, len(failed), len(block_ids))
        self._loads.append(_Load(req_id, block_ids, xfers, self._clock(), nbytes, failed))

    def _poll_loads(self) -> set[str]:
        """Requests whose loads ended (successfully or not) since the last poll. A load ends
        only when every transfer of it has ended, so nothing writes its blocks afterwards."""
        done: set[str] = set()
        still: list[_Load] = []
        for load in self._loads:
            states = [self._check(x) for x in load.xfers]
            if "PROC" in states:
                if not load.stuck and self._clock() - load.started > STUCK_TRANSFER_S:
                    load.stuck = True
                    logger.warning("CPU tier load of request %s still in flight after %.0f s; the request waits "
                                   "for it (a stalled store: restarting it ends the transfer)",
                                   load.req_id, STUCK_TRANSFER_S)
                still.append(load)
                continue
            for x in load.xfers:
                self._release(x.handle)
            if all(s == "DONE" for s in states):
                self._error_blocks.update(load.failed)
                self.bytes_loaded += load.nbytes
            else:
                logger.warning("CPU tier load of request %s failed (transfer error); recomputing its blocks",
                               load.req_id)
                self._error_blocks.update(load.block_ids)
            done.add(load.req_id)
        self._loads = still
        return done

    def take_error_blocks(self) -> set[int]:
        errors, self._error_blocks = self._error_blocks, set()
        return errors

    def take_counters(self) -> dict[str, int]:
        counters = {"bytes_loaded": self.bytes_loaded, "bytes_saved": self.bytes_saved,
                    "tokens_saved": self.tokens_saved}
        self.bytes_loaded = self.bytes_saved = self.tokens_saved = 0
        return counters
