"""Worker role of the CPU tier connector: moves KV blocks between this engine's KV cache and
the stores' host pools with one-sided NIXL transfers.

Saves are synchronous, in ``wait_for_save`` right after the forward pass that computed the
blocks (the blocks may be freed and reused the step after); their slots are requested from
the index when the step's metadata is bound, before the forward pass, so the index round
trip hides behind it and only the local NIXL WRITE is paid in the step. Loads are
asynchronous: posted in ``start_load_kv`` and polled in ``get_finished``. Any failure (a
dead store, a location outside its pool, a transfer error or timeout) marks the request's
not-yet-loaded blocks as load errors, which vLLM recomputes.
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from actors.kv_index import BlockLocation, Grant, StoreEndpoint

logger = logging.getLogger("tandem.cpu_tier")

# Seconds a load may stay in flight before it counts as failed.
LOAD_TIMEOUT_S = 10.0
# Seconds a control call to the index may take on the save path before the save is skipped.
CONTROL_TIMEOUT_S = 5.0


def make_nixl_agent(name: str, progress_thread: bool, progress_delay_us: int = 200) -> Any:
    """A NIXL agent whose UCX progress thread (if any) sleeps `progress_delay_us` between
    polls. The nixl Python API hard-codes ``pthrDelay = 0``, a busy loop that costs a whole
    core per agent (see PLATFORM.md); the delay is applied by wrapping the binding's agent
    constructor for the duration of this call."""
    from nixl._api import nixl_agent, nixl_agent_config

    bind = sys.modules[nixl_agent.__module__].nixlBind
    real = bind.nixlAgent

    def with_delay(agent_name: str, cfg: Any) -> Any:
        cfg.pthrDelay = progress_delay_us
        return real(agent_name, cfg)

    bind.nixlAgent = with_delay
    try:
        return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))
    finally:
        bind.nixlAgent = real


@dataclass
class LayerRegion:
    """Where one layer's block b lives: base + b * stride, `page` contiguous bytes."""

    base: int
    stride: int
    page: int


@dataclass
class _Load:
    req_id: str
    block_ids: list[int]
    handles: list[Any]
    started: float
    nbytes: int
    # Blocks past the valid prefix of the plan (failed before any transfer).
    failed: list[int] = field(default_factory=list)


class CpuTierWorker:
    """Per-engine-worker half of the tier: one NIXL agent, KV regions, store endpoints."""

    def __init__(self, index: Any, store_id: str | None, engine_id: str) -> None:
        self.index = index
        self.store_id = store_id
        self.agent = make_nixl_agent(f"tandem-kv-engine-{engine_id}-{uuid.uuid4().hex[:6]}", progress_thread=False)
        self.layers: list[LayerRegion] = []
        self.slot_bytes = 0
        # store id -> (endpoint, remote agent name) of the incarnation we know
        self._stores: dict[str, tuple[StoreEndpoint, str]] = {}
        self._loads: list[_Load] = []
        self._error_blocks: set[int] = set()
        self.bytes_loaded = 0
        self.bytes_saved = 0
        self.tokens_saved = 0

    def register_kv_caches(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        """Called once at engine start: learn each layer's block layout, register the
        memory with NIXL, and tell the index how big one block of every layer is."""
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
        ray.get(self.index.set_slot_bytes.remote(self.slot_bytes), timeout=CONTROL_TIMEOUT_S * 6)

    # ---- descriptors ----

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

    def _store(self, store_id: str, incarnation: str) -> tuple[StoreEndpoint, str] | None:
        """The known endpoint of that store incarnation, fetched from the index on a change."""
        known = self._stores.get(store_id)
        if known is not None and known[0].incarnation == incarnation:
            return known
        if known is not None:
            self.agent.remove_remote_agent(known[1])
            del self._stores[store_id]
        ep: StoreEndpoint | None = ray.get(self.index.endpoint.remote(store_id), timeout=CONTROL_TIMEOUT_S)
        if ep is None or ep.incarnation != incarnation:
            return None
        self._stores[store_id] = (ep, self.agent.add_remote_agent(ep.agent_metadata))
        return self._stores[store_id]

    def _transfer(self, op: str, block_ids: list[int], ep: StoreEndpoint, agent: str, slots: list[int]) -> Any:
        handle = self.agent.initialize_xfer(
            op, self._local_descs(block_ids), self._remote_descs(ep.base_addr, slots), agent
        )
        state = self.agent.transfer(handle)
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError(f"NIXL {op} to store {ep.store_id} failed to post")
        return handle

    # ---- saves ----

    def request_slots(self, hashes: list[bytes]) -> Any | None:
        """Ask the index for store slots for these hashes without waiting (called before the
        forward pass that computes the blocks); the answer goes to `save`. None: nothing to save."""
        if self.store_id is None or not hashes:
            return None
        return self.index.allocate.remote(self.store_id, hashes)

    def save(self, block_ids: list[int], hashes: list[bytes], block_size: int, slots_ref: Any | None) -> None:
        """Write these computed blocks to the slots `request_slots` asked for; called in
        wait_for_save, so the blocks are valid until it returns. A failed save is logged and
        dropped (a miss later)."""
        if slots_ref is None:
            return
        grant: Grant | None = None
        try:
            grant = ray.get(slots_ref, timeout=CONTROL_TIMEOUT_S)
            if grant is None or not grant.hashes:
                return
            store = self._store(grant.store_id, grant.incarnation)
            if store is None:
                raise RuntimeError(f"store {grant.store_id} restarted during the save")
            by_hash = dict(zip(hashes, block_ids))
            handle = self._transfer("WRITE", [by_hash[h] for h in grant.hashes], store[0], store[1], grant.slots)
            deadline = time.monotonic() + CONTROL_TIMEOUT_S
            state = "PROC"
            while state == "PROC" and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(handle)
            if state != "PROC":
                self.agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL WRITE ended in state {state}")
        except Exception as err:  # the tier is a cache: never fail the engine step for it
            logger.warning("CPU tier save of %d blocks skipped: %s", len(hashes), err)
            if grant is not None and grant.hashes:
                self.index.commit.remote(grant, False)
            return
        self.index.commit.remote(grant, True)
        self.bytes_saved += len(grant.hashes) * self.slot_bytes
        self.tokens_saved += len(grant.hashes) * block_size

    # ---- loads ----

    def start_load(self, req_id: str, block_ids: list[int], locations: list[BlockLocation]) -> None:
        """Post the reads of one request's planned blocks (grouped by store)."""
        failed: list[int] = []
        handles: list[Any] = []
        nbytes = 0
        try:
            by_store: dict[tuple[str, str], tuple[list[int], list[int]]] = {}
            for i, (b, loc) in enumerate(zip(block_ids, locations)):
                ep = self._store(loc.store_id, loc.incarnation)
                if ep is None or (loc.slot + 1) * self.slot_bytes > ep[0].pool_bytes:
                    failed = block_ids[i:]
                    break
                blocks, slots = by_store.setdefault((loc.store_id, loc.incarnation), ([], []))
                blocks.append(b)
                slots.append(loc.slot)
            for (store_id, incarnation), (blocks, slots) in by_store.items():
                ep, agent = self._stores[store_id]
                handles.append(self._transfer("READ", blocks, ep, agent, slots))
                nbytes += len(blocks) * self.slot_bytes
        except Exception as err:
            logger.warning("CPU tier load of request %s failed to start: %s", req_id, err)
            for h in handles:
                self.agent.release_xfer_handle(h)
            handles, failed = [], list(block_ids)
        if failed:
            logger.warning("CPU tier load of request %s: %d of %d blocks unavailable, recomputing them",
                           req_id, len(failed), len(block_ids))
        self._loads.append(_Load(req_id, block_ids, handles, time.monotonic(), nbytes, failed))

    def poll_loads(self) -> set[str]:
        """Requests whose loads ended (successfully or not) since the last poll."""
        done: set[str] = set()
        still: list[_Load] = []
        for load in self._loads:
            states = [self.agent.check_xfer_state(h) for h in load.handles]
            timed_out = time.monotonic() - load.started > LOAD_TIMEOUT_S
            if "PROC" in states and not timed_out and "ERR" not in states:
                still.append(load)
                continue
            if all(s == "DONE" for s in states):
                self._error_blocks.update(load.failed)
                self.bytes_loaded += load.nbytes
            else:
                logger.warning("CPU tier load of request %s failed (%s); recomputing its blocks",
                               load.req_id, "timeout" if timed_out else "transfer error")
                self._error_blocks.update(load.block_ids)
            for h in load.handles:
                if self.agent.check_xfer_state(h) != "PROC":
                    self.agent.release_xfer_handle(h)
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
