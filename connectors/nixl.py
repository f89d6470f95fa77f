"""TandemNixlConnector: vLLM's NixlConnector with a NIXL agent built on purpose.

Why it exists: vLLM builds each worker's NIXL agent as
``nixl_agent_config(num_threads=<extra_config num_threads, 4>, capture_telemetry=True)``
and NIXL's Python API then hard-codes ``pthrDelay = 0``. Every engine so keeps a UCX
progress thread that polls without sleeping (about one core per engine, idle or not) and
four dedicated UCX threads that busy-poll while a large transfer is in flight. On a CPU
host those threads take the cores the engines' forward passes run on: with two engines on
two cores, decode slowed ~10x and some KV pulls stalled for seconds. Neither setting can be
reached from vLLM's config, so this connector builds the agent itself
(``actors.nixl_agent.make_nixl_agent``, which also gives a progress thread a sleep) from
``kv_connector_extra_config["tandem_nixl"]`` (Tandem's ``kv_transfer.nixl``, see
:class:`connectors.config.NixlConfig`). By default: no progress thread (vLLM's engine
loop polls NIXL every step while a request sends or receives KV and sleeps when idle, so
transfers still progress on both sides), no dedicated threads on CPU hosts (vLLM's four on
GPUs, which have the cores and read large prompts 2-3x faster with them), and a strict agent
lock because vLLM's handshake thread calls the agent concurrently with the engine thread.

On CPU hosts it also undoes vLLM's move of the worker's compute thread onto the host's
last core (see ``TandemNixlWorker.__init__``), which put every engine's forward passes on
one core.

It also tags every completed transfer with its request id, so the engine actor can name
the request of a slow transfer (``TandemNixlStats``), and lets a decode request's prompt go on
past what the prefill computed (``TandemNixlScheduler``): the router streams the prefill's
first token to the client and the decode engine continues from prompt + that token. On a
CPU engine it posts a step's KV READs before the step's forward pass, not after it as vLLM
does for GPUs (``TandemNixlConnector.bind_connector_metadata``).

Everything else is vLLM's pull-mode (READ) NixlConnector, unchanged. Engines load it with
``kv_connector="TandemNixlConnector"``, ``kv_connector_module_path="connectors.nixl"``.
"""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed import nixl_utils
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
from vllm.logger import init_logger
from vllm.platforms import current_platform

from actors.nixl_agent import make_nixl_agent
from connectors.config import PREFILLED_TOKENS, NixlConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

# The kv_connector_extra_config key that carries a NixlConfig as plain data.
EXTRA_CONFIG_KEY = "tandem_nixl"


def settings_from_extra_config(extra: dict[str, Any] | None) -> NixlConfig:
    """The NixlConfig an engine was given (defaults when the key is absent)."""
    return msgspec.convert((extra or {}).get(EXTRA_CONFIG_KEY, {}), NixlConfig)


class TandemNixlStats(NixlKVConnectorStats):
    """NixlKVConnectorStats plus ``request_ids``: the request of each entry of
    ``transfer_duration`` / ``bytes_transferred``, in the same order."""

    # The request whose transfers the worker is polling; set around each request's poll.
    polling_request: str | None = None

    def reset(self) -> None:
        super().reset()
        self.data["request_ids"] = []

    def record_transfer(self, res: Any) -> None:
        if res is not None:
            self.data.setdefault("request_ids", []).append(self.polling_request or "")
        super().record_transfer(res)

    def aggregate(self, other: Any) -> TandemNixlStats:
        # A plain NixlKVConnectorStats (no request ids) keeps the lists aligned with blanks.
        if not other.is_empty() and "request_ids" not in other.data:
            other.data["request_ids"] = [""] * len(other.data["transfer_duration"])
        super().aggregate(other)
        return self


class TandemNixlWorker(NixlPullConnectorWorker):
    """vLLM's pull worker with a Tandem-built agent and per-request transfer records."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig) -> None:
        # On CPU, vLLM's worker moves the calling thread to the host's last core of each
        # NUMA node, "reserved for KV transfer" (base_worker.py). That thread is the worker's
        # main thread, OpenMP's master: the forward pass itself. Under Tandem's placement
        # that core belongs to another engine, so every engine would compute there. Keep
        # the thread on the cores the engine's binding gave it.
        affinity = os.sched_getaffinity(0)
        super().__init__(vllm_config, engine_id, kv_cache_config)
        os.sched_setaffinity(0, affinity)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        settings = settings_from_extra_config(extra)
        # vLLM's agent has no memory registered and no peers yet (both happen later), so
        # replacing it here is safe; dropping it stops its busy progress thread.
        if nixl_utils.NixlWrapper is None:
            raise RuntimeError("NIXL is not available in this process; install nixl on every engine node")
        threads = settings.worker_threads(on_gpu=not current_platform.is_cpu())
        self.nixl_wrapper = make_nixl_agent(
            str(uuid.uuid4()), settings.progress_thread, list(self.nixl_backends), threads,
            settings.sync_mode, capture_telemetry=True, api_module=nixl_utils.NixlWrapper.__module__,
        )
        self.xfer_stats = TandemNixlStats()
        logger.info(
            "Tandem NIXL agent for engine %s: progress_thread=%s num_threads=%d sync_mode=%s",
            engine_id, settings.progress_thread, threads, settings.sync_mode,
        )

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        """vLLM's poll, one request at a time, so each recorded transfer knows its request."""
        done: set[str] = set()
        failed: set[str] = set()
        stats = self.xfer_stats
        for req_id in list(transfers):
            one = {req_id: transfers[req_id]}
            stats.polling_request = req_id
            try:
                d, f = super()._pop_done_transfers(one)
            finally:
                stats.polling_request = None
            done |= d
            failed |= f
            if req_id in one:
                transfers[req_id] = one[req_id]
            else:
                del transfers[req_id]
        return done, failed


class TandemNixlScheduler(NixlPullConnectorScheduler):
    """vLLM's pull scheduler, for decode requests whose prompt extends the prefilled one.

    vLLM's decode side claims its whole prompt from the prefill engine. A prompt that goes on
    past the prefill's tokens (kv_transfer_params[PREFILLED_TOKENS]) claims only those: the
    blocks it allocates for the pull then match the prefill's one for one (vLLM refuses a
    pull into more blocks than the prefill sent, as at a block boundary), and the scheduler
    computes the tokens after them, the first sampling the next token.
    """

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        prefilled = params.get(PREFILLED_TOKENS) if params else None
        if prefilled is None or not params.get("do_remote_prefill"):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        count = self._get_remote_prefill_token_count(prefilled) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)


class TandemNixlConnector(NixlConnector):
    """NixlConnector (pull mode) whose worker role is a TandemNixlWorker (or `worker_cls`, for
    a subclass that changes the worker side), posting a CPU engine's READs before its forward."""

    worker_cls: type[TandemNixlWorker] = TandemNixlWorker
    # Whether this step's READs were posted when its metadata was bound (CPU engines).
    _loads_started = False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        # NixlConnector's own __init__ would build vLLM's worker (and its agent) first;
        # this is its role dispatch with Tandem's worker in place of vLLM's.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = TandemNixlScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = self.worker_cls(vllm_config, self.engine_id, kv_cache_config)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Post this step's KV READs before the forward pass. vLLM's model runner posts them
        after it, which on a GPU overlaps the host's posting with the device's work; on a
        CPU engine the forward is synchronous, so a READ posted after it starts a whole
        step late. Posted first, it runs while this step computes (the prefill engine
        serves it) and its request can be scheduled a step sooner."""
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None and current_platform.is_cpu():
            self.connector_worker.start_load_kv(connector_metadata)
            self._loads_started = True

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._loads_started:  # already posted at bind
            self._loads_started = False
            return
        super().start_load_kv(forward_context, **kwargs)
