"""Settings the connectors take from Tandem's config (through kv_connector_extra_config).

At the bottom of the layers: orchestrator.config embeds them, the connectors read them, and
neither has to import the other's package for it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

# A decode request's kv_transfer_params key: how many leading tokens of its prompt the prefill
# computed, when the prompt goes on past them (the prefill's sampled first token, streamed to
# the client already, ends it). The decode engine pulls those and computes the rest itself.
PREFILLED_TOKENS = "tandem_prefilled_tokens"

# Tandem's own connectors: class name -> the module defining it. Engines load them by module
# path, which the pool manager writes into every engine's kv_transfer_config from this table
# without importing vLLM (connectors.registry, which does, registers the same names).
TANDEM_CONNECTORS: dict[str, str] = {
    "TandemMultiConnector": "connectors.multi",
    "TandemNixlConnector": "connectors.nixl",
}

# UCX worker threads of a GPU engine's NIXL agent unless `kv_transfer.nixl.num_threads` says
# otherwise: vLLM's own default.
GPU_NUM_THREADS = 4


class NixlConfig(Struct, forbid_unknown_fields=True, frozen=True):
    """How TandemNixlConnector builds each engine's NIXL agent (see docs/performance.md)."""

    # Run NIXL's UCX progress thread (Tandem's agents sleep it 200 us between polls; NIXL's
    # Python API would busy-poll a core per engine). Off: vLLM's engine loop drives
    # transfers (it steps while a request sends or receives KV, sleeps when idle).
    progress_thread: bool = False
    # Dedicated UCX worker threads per engine (vLLM's default: 4). Each busy-polls while a
    # transfer of >= 1024 descriptors is in flight; 0 runs transfers on the engine thread.
    # Unset: GPU_NUM_THREADS on GPU engines, whose hosts have cores to spare and whose reads
    # of 2k-token prompts took a half to a third of the time with four (docs/performance.md),
    # 0 on CPU hosts, where each would take a core the forward passes need.
    num_threads: Annotated[int, Meta(ge=0)] | None = None
    # How the agent serialises calls from vLLM's threads (its handshake thread adds peers
    # while the engine thread polls): "strict" one lock around every agent call, "rw" a
    # reader-writer lock plus a thread-safe UCX worker.
    sync_mode: Literal["strict", "rw"] = "strict"
    # Extra environment for engine processes, for UCX (UCX_TLS, UCX_NET_DEVICES, ...).
    # Empty lets UCX choose: shared memory / CMA within a host, TCP or RDMA across hosts.
    ucx_env: dict[str, str] = {}

    def worker_threads(self, on_gpu: bool) -> int:
        """The UCX worker threads of an engine's agent: `num_threads`, else the default for
        where its KV cache lives."""
        if self.num_threads is not None:
            return self.num_threads
        return GPU_NUM_THREADS if on_gpu else 0
