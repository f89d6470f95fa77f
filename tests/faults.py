"""Fault injection for tests, loaded by engines through the config seam, never by production code.

A deployment under test names the connector of its CPU tier child, or its P/D connector:

    cpu_tier: {connector: CorruptingCpuTierConnector, module_path: tests.faults}
    kv_transfer: {connector: FailingLoadNixlConnector, module_path: tests.faults}

Engine processes import this module by that path (Ray puts the driver's working directory on
their ``sys.path``, so run the tests from the repository root).
"""

from __future__ import annotations

import time
from typing import Any

from actors.kv_index import BlockLocation
from connectors.nixl import TandemNixlConnector, TandemNixlWorker
from connectors.offload import TandemCpuTierConnector

# Requests whose id contains this are the ones whose tier loads fail.
FAIL_MARK = "tierfail"
# Blocks of a corrupted lookup before this one stay valid; from it on they point past the pool.
CORRUPT_FROM_BLOCK = 2
# A slot no pool has, so the worker refuses the location before any transfer.
BAD_SLOT = 2**40


def corrupted(locations: list[BlockLocation]) -> list[BlockLocation]:
    """`locations` with every slot from CORRUPT_FROM_BLOCK on moved past any pool."""
    return locations[:CORRUPT_FROM_BLOCK] + [
        BlockLocation(loc.store_id, loc.incarnation, BAD_SLOT) for loc in locations[CORRUPT_FROM_BLOCK:]
    ]


class CorruptingCpuTierConnector(TandemCpuTierConnector):
    """The CPU tier connector, except that lookups of requests marked FAIL_MARK answer slots
    past the pool from CORRUPT_FROM_BLOCK on: their loads fail midway and vLLM must recompute
    the rest, while every other request is served as usual."""

    def _answer(self, req_id: str, pending: Any) -> bool:
        answered = super()._answer(req_id, pending)
        if answered and FAIL_MARK in req_id and pending.locations:
            pending.locations = corrupted(pending.locations)
        return answered


# Requests whose id contains this (a client's X-Request-Id becomes part of the engines'
# request ids) have their decode engine's KV pull fail.
KV_LOAD_FAILURE_MARK = "kvfail"


class FailingLoadNixlWorker(TandemNixlWorker):
    """Fails the KV pull of marked requests the way vLLM handles a read that cannot be posted
    (the transfer is counted failed and the request reported in failed_recving), so the
    decode engine's kv_load_failure_policy decides what the client gets."""

    def _read_blocks(self, *, request_id: str, **kwargs: Any) -> bool:  # type: ignore[override]
        if KV_LOAD_FAILURE_MARK in request_id:
            self._handle_failed_transfer(request_id, None, self._recv_failures)
            return False
        return super()._read_blocks(request_id=request_id, **kwargs)


# Requests whose id contains this wait HOLD_S in their engine's queue before it schedules them:
# a phase that lasts as long as a test needs, whatever the host's speed.
HOLD_MARK = "hold"
HOLD_S = 1.5


class FailingLoadNixlConnector(TandemNixlConnector):
    """TandemNixlConnector whose pulls of requests marked KV_LOAD_FAILURE_MARK fail, and whose
    engine holds requests marked HOLD_MARK waiting for HOLD_S (the way vLLM's scheduler waits
    on a connector that cannot yet say how many tokens it will load; the engine steps on)."""

    worker_cls = FailingLoadNixlWorker

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held_since: dict[str, float] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if HOLD_MARK in request.request_id:
            since = self._held_since.setdefault(request.request_id, time.monotonic())
            if time.monotonic() - since < HOLD_S:
                return None, False
            del self._held_since[request.request_id]
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    # A request aborted while held ends here: vLLM calls one of the two, as its connector
    # supports hybrid KV groups or not.
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._held_since.pop(request.request_id, None)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        self._held_since.pop(request.request_id, None)
        return super().request_finished_all_groups(request, block_ids)
